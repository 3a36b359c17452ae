"""Pure parsers: text -> typed data, one module per tool."""
