"""CLI subcommands: each module registers one subcommand; with cluster/cli.py the only code that prints."""
