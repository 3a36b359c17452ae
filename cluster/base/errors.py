"""One typed error tree for the library; the CLI turns each into one line and exit code 2."""

from __future__ import annotations


class ClusterError(Exception):
    """Base of every error the library raises on purpose."""


class UsageError(ClusterError):
    """The caller asked for something that cannot be done as asked (bad flag combination...)."""


class InventoryError(ClusterError):
    """A cluster.yaml that cannot be used; the message names file:line and key."""

    def __init__(self, message: str, *, path: str = "<inventory>", line: int | None = None,
                 key: str | None = None):
        self.path = path
        self.line = line
        self.key = key
        self.reason = message
        where = f"{path}:{line}" if line is not None else path
        what = f"{key}: " if key else ""
        super().__init__(f"{where}: {what}{message}")


class ParseError(ClusterError):
    """Text a parser cannot read. Parsers raise this instead of returning None or a guess."""

    def __init__(self, kind: str, message: str, *, line: int | None = None):
        self.kind = kind
        self.line = line
        at = f" (line {line})" if line is not None else ""
        super().__init__(f"cannot parse {kind} output{at}: {message}")


class RemoteError(ClusterError):
    """A node could not be reached or did not answer in time (a failed command is NOT an error)."""

    def __init__(self, node: str, message: str):
        self.node = node
        super().__init__(f"{node}: {message}")


class ConnectError(RemoteError):
    """Unreachable: connect timeout, refused, auth failure, host-key mismatch, lost connection."""


class CommandTimeout(RemoteError):
    """The command (or the SSH session) did not finish within its timeout."""

    def __init__(self, node: str, timeout: float, command: str = ""):
        self.timeout = timeout
        self.command = command
        super().__init__(node, f"no answer within {timeout:g} s")


class TunnelError(RemoteError):
    """The head was reached but would not connect a forwarded channel to the service there
    (nothing listens on that port, or the head's sshd refuses TCP forwarding)."""


class PlanError(ClusterError):
    """A plan that cannot be made (the model does not fit, impossible request)."""


class RayError(ClusterError):
    """Ray bring-up or state queries failed."""


class DeployError(ClusterError):
    """A Serve deployment failed or did not become RUNNING."""


class ProgramError(RemoteError):
    """An on-node program (cluster/node_programs/) did not give its one JSON document: the node
    was not reached or did not answer in time, the program exited non-zero, printed no JSON,
    more than one document, or more output than allowed, or its document was unusable. The one
    error of the node-program protocol (cluster/node_programs/__init__.py).

    `kind`: unreachable | timeout | exit | no-json | several | oversized | not-an-object |
    not-finite (NaN/Infinity) | packed (an embedded document unreadable or too large) |
    bad-answer (the program's typed parse refused its document).
    `result`: the CommandResult; `doc`: the document when one was read despite a non-zero exit.
    `reason`: the message without the node name; `detail`: the output's last line (<= 300)."""

    def __init__(self, node: str, program: str, kind: str, reason: str, *, result=None,
                 doc: dict | None = None, detail: str = ""):
        self.program = program
        self.kind = kind
        self.reason = reason
        self.result = result
        self.doc = doc
        self.detail = detail
        super().__init__(node, f"{program}: {reason}")

    @property
    def reached(self) -> bool:
        """The program ran on the node (whatever it printed); False: unreachable or timed out."""
        return self.kind not in ("unreachable", "timeout")
