"""Layer 10, cli: one module per subcommand (registered in cluster/cli.py's COMMANDS); with
cluster/cli.py the only code that prints and exits. May import: every layer, playbooks/ included."""
