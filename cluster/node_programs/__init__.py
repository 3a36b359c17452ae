"""Programs that run ON the nodes: each a real file (stdlib only, Python 3.8+) that prints one
JSON document, shipped on stdin (`python3 - ARGS`) so nothing is installed on a node."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def source(name: str) -> str:
    """The text of the on-node program `name` (e.g. "reach")."""
    return (HERE / f"{name}.py").read_text()
