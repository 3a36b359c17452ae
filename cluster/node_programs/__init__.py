"""Programs that run ON the nodes: each a real file (stdlib only, Python 3.8+) that prints one
JSON document, shipped on stdin (`python3 - ARGS`) so nothing is installed on a node.

A program that reads input of its own (a secret, a file list) cannot be `python3 -`'s script:
that reads stdin to its end. It is shipped as `python3 -c BOOT ARGS` with stdin = the program
as one JSON line, then its input (`with_input`)."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Reads the program from stdin's first line and runs it as __main__; the rest of stdin is its.
BOOT = 'import sys,json;exec(compile(json.loads(sys.stdin.readline()),"node_program","exec"))'


def source(name: str) -> str:
    """The text of the on-node program `name` (e.g. "reach")."""
    return (HERE / f"{name}.py").read_text()


def with_input(name: str, data: str) -> str:
    """stdin for `python3 -c BOOT ARGS`: the program `name` on one line, then `data`."""
    return json.dumps(source(name)) + "\n" + data
