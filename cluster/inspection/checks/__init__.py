"""Checks: command + parser + verdict against expectations; an explicit registry."""
