"""Shell command text for the nodes: quoting, env prefixes, secrets on stdin, sudo, here-docs.

The one place that writes the shell around a remote command (pure functions on strings):

    env_prefix({"A": "1 2"})       -> "env 'A=1 2' "          ('' for no env)
    SECRET_ENV_FROM_STDIN + " && " + command
                                   a command that exports the K=V lines it reads on stdin
    export_lines({"K": "v"})       -> "export K=v\\n"          (that stdin; never on argv)
    as_root_command(cmd)           -> "sudo -n bash -c 'cmd'"  (never asks for a password)
    heredoc(command, body)         -> "command <<'EOF_x'\\nbody\\nEOF_x" (a marker not in body)
    without_heredocs(command)      -> the command with each here-document's body left out (for
                                      reports: a shipped program's text is not evidence)

Values are quoted with shlex, so an inventory value holding `; $() '` spaces or globs is one
literal word to the remote shell. Secret values go on stdin (export_lines), never into argv,
where `ps` and the run logs would show them.
"""

from __future__ import annotations

import functools
import hashlib
import shlex
from typing import Mapping

# A command with this in front reads `export K='v'` lines from its standard input (what
# export_lines writes) before it runs; Session.run sends that stdin and no log records it.
SECRET_ENV_FROM_STDIN = "{ set -a; . /dev/stdin; set +a; }"


def env_prefix(env: Mapping[str, str]) -> str:
    """`env K=V ... ` with every pair shlex-quoted ('' when empty)."""
    if not env:
        return ""
    return "env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " "


def export_lines(env: Mapping[str, str]) -> str:
    """The `export K='v'` lines (one per pair) a SECRET_ENV_FROM_STDIN command reads."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def bash_command(command: str) -> str:
    """`bash -c 'command'`: the command as one word for a shell that runs it."""
    return f"bash -c {shlex.quote(command)}"


def as_root_command(command: str) -> str:
    """The command through `sudo -n` (fails at once instead of asking for a password)."""
    return f"sudo -n {bash_command(command)}"


def heredoc(command: str, body: str, prefix: str = "CLUSTER_EOF_") -> str:
    """`command <<'MARKER'` then body on the lines after it; MARKER is derived from body's hash
    (the same text gives the same command: dry runs and records stay comparable) and is not in
    body. Quoted, so the shell expands nothing in body."""
    marker = _marker(body, prefix)
    return f"{command} <<'{marker}'\n{body}\n{marker}"


@functools.lru_cache(maxsize=64)
def _marker(body: str, prefix: str) -> str:
    """heredoc's MARKER for body, kept per body: every node gets the same program texts (10
    hashes of them a node in a preflight)."""
    digest = hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()
    n = 0
    marker = prefix + digest[:16]
    while marker in body:
        n += 1
        marker = f"{prefix}{digest[:16]}_{n}"
    return marker


_HEREDOC_PREFIXES = ("CLUSTER_EOF_", "CLUSTER_PROGRAM_")


def without_heredocs(command: str) -> str:
    """`command` with the body of each here-document that heredoc() wrote replaced by a note of
    its size (a report names the command, not the program text it carried; the run's
    nodes/<node>.log keeps the whole command). Linear in the command's length."""
    out, pos = [], 0
    while True:
        start = command.find("<<'", pos)
        if start < 0:
            break
        close = command.find("'\n", start + 3)
        marker = command[start + 3:close] if close > 0 else ""
        end = command.find(f"\n{marker}", close + 2) if marker.startswith(_HEREDOC_PREFIXES) \
            else -1
        if end < 0:
            out.append(command[pos:start + 3])
            pos = start + 3
            continue
        body = command[close + 2:end]
        out.append(f"{command[pos:close + 1]} [here-document of {body.count(chr(10)) + 1} lines, "
                   f"{len(body)} characters, not shown]")
        pos = end + 1 + len(marker)
    out.append(command[pos:])
    return "".join(out)
