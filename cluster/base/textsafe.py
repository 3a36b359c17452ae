"""Make text that came from a node, a server or a file safe to show on a terminal.

Anything a remote side sends (command output, an HTTP error body, a parsed value) may carry
escape sequences that retitle the window, clear the screen or move the cursor, or bidi controls
that reorder what is shown. `terminal_safe` replaces every control character but newline and tab
(C0, DEL, C1, Unicode bidi overrides) with a visible `\\xNN` / `\\uNNNN` escape, in linear time.
JSON output needs none of this: json.dumps escapes control characters itself.
"""

from __future__ import annotations

_BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


_TABLE = {code: _escape(code) for code in (*range(0x00, 0x20), *range(0x7F, 0xA0), *_BIDI)
          if code not in (0x09, 0x0A)}
_TABLE_ONE_LINE = {**_TABLE, 0x0A: "\\n", 0x09: "\\t"}


def terminal_safe(text: str) -> str:
    """`text` with every control character except newline and tab shown as an escape."""
    return text.translate(_TABLE)


def terminal_safe_line(text: str) -> str:
    """`text` as one safe line: newlines and tabs escaped too (for one-line messages)."""
    return text.translate(_TABLE_ONE_LINE)


def safe_line(value: object, limit: int | None = None) -> str:
    """terminal_safe_line(str(value)), cut to `limit` characters (for messages and reports)."""
    text = terminal_safe_line(value if isinstance(value, str) else str(value))
    return text if limit is None else text[:limit]
