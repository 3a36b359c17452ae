"""argparse value types of the text flags (-i, --nodes, --undo, --model, --run-root, names...):
an empty value is a usage error (an unset variable in a script must not mean "all nodes" or
"./cluster.yaml"), and a path is refused before any file call when the system could not take it
(longer than PATH_MAX, a component longer than NAME_MAX, a NUL byte)."""

from __future__ import annotations

import argparse


def bound(section: str, key: str) -> int:
    """cluster.base.bounds.bound, imported when a flag is read (`cluster --help` loads no YAML)."""
    from cluster.base.bounds import bound as limit
    return limit(section, key)


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def text_value(text: str) -> str:
    """A non-empty flag value (not only blanks), at most flags.text_bytes long. Control
    characters pass (they are escaped wherever a value is shown)."""
    if not isinstance(text, str) or not text.strip():
        raise argparse.ArgumentTypeError("an empty value is not allowed")
    limit = bound("flags", "text_bytes")
    if len(text.encode("utf-8", "surrogateescape")) > limit:
        raise argparse.ArgumentTypeError(f"longer than {limit} bytes: {_shown(text)}")
    return text


def path_value(text: str) -> str:
    """A path flag: text_value, at most flags.path_bytes long, each component at most
    flags.name_bytes (else the system's "File name too long" would surface later)."""
    limit, name = bound("flags", "path_bytes"), bound("flags", "name_bytes")
    if isinstance(text, str) and (len(text) > limit
                                  or len(text.encode("utf-8", "surrogateescape")) > limit):
        raise argparse.ArgumentTypeError(f"a path longer than {limit} bytes: {_shown(text)}")
    text = text_value(text)
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"a path cannot hold a NUL byte: {_shown(text)}")
    long = next((c for c in text.split("/") if len(c.encode("utf-8", "surrogateescape")) > name),
                None)
    if long is not None:
        raise argparse.ArgumentTypeError(f"a path component longer than {name} bytes: "
                                         f"{_shown(long)}")
    return text
