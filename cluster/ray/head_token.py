"""The head's Ray token (token authentication, Ray 2.60), read on the head the way Ray itself
finds it, through the node program cluster/node_programs/ray_auth_token.py; the token is
returned in memory only (never in argv, logs or files). `cluster dashboard`'s proxy adds it
(cluster/ray/dashboard_proxy.py)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.base.errors import ProgramError, RemoteError
from cluster.node_programs import read_document, run_raw
from cluster.nodes.inventory import Inventory
from cluster.nodes.remote import Session

TOKEN_PROGRAM = "ray_auth_token"   # cluster/node_programs/ray_auth_token.py, run on the head

MAX_TOKEN_CHARS = 4096
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


@dataclass(frozen=True)
class AuthToken:
    """The head's Ray token (repr never shows it) and where it was found."""

    value: str
    source: str

    def __repr__(self) -> str:
        return f"AuthToken(value=***, source={self.source!r})"

    __str__ = __repr__

    @property
    def header(self) -> str:
        """The Authorization header value the dashboard accepts."""
        return "Bearer " + self.value


def valid_token(text: object) -> str | None:
    """The token stripped, or None when it is unusable in a header (empty, too long, or with
    characters outside printable ASCII: a CR/LF would split the HTTP request)."""
    if not isinstance(text, str):
        return None
    token = text.strip()
    if not token or len(token) > MAX_TOKEN_CHARS:
        return None
    if any(not 0x21 <= ord(c) <= 0x7e for c in token):
        return None
    return token


def read_auth_token(session: Session, inventory: Inventory) -> AuthToken | None:
    """The head's Ray token, found as Ray finds it, or None when the head has none.

    Order: RAY_AUTH_TOKEN in the head's inventory `env:` (what `ray start` got), then on the
    head (cluster/node_programs/ray_auth_token.py): $RAY_AUTH_TOKEN, the file named by
    RAY_AUTH_TOKEN_PATH (the inventory's, else the login environment's), ~/.ray/auth_token,
    then the environment of the running gcs_server / raylet. The program gets the path as an
    argument and prints the token on its stdout, read here into memory: the token is never on
    a command line. Raises ConnectError when the head cannot be reached, RemoteError when its
    answer is unreadable or the token found is unusable, CommandTimeout when it hangs.
    """
    head = inventory.head
    env = dict(head.env)
    if env.get(TOKEN_ENV):
        token = valid_token(env[TOKEN_ENV])
        if token is None:
            raise RemoteError(head.name, f"{TOKEN_ENV} in the inventory is not a usable token")
        return AuthToken(token, "inventory env")
    args = ["--path", env[TOKEN_PATH_ENV]] if env.get(TOKEN_PATH_ENV) else []
    # Past the session's hooks (record=False): they record results (run directories), and this
    # one's stdout is the token. Raises ConnectError / CommandTimeout.
    result = run_raw(session, head, TOKEN_PROGRAM, args, timeout=inventory.ssh.connect_timeout + 30,
                     python=inventory.ray.python, record=False)
    return token_from_reply(head.name, result)


def token_from_reply(node: str, result) -> AuthToken | None:
    """ray_auth_token.py's document (the one reader) -> the token, None, or RemoteError. The
    error never quotes the output (it may hold the token)."""
    try:
        doc = read_document(result, TOKEN_PROGRAM)
    except ProgramError as exc:
        raise RemoteError(node, f"reading the Ray token gave no answer ({exc.kind}, exit "
                                f"{result.exit_code})") from None
    if doc.get("error"):
        raise RemoteError(node, f"reading the Ray token: {str(doc['error'])[:300]}")
    if doc.get("token") is None:
        return None
    token = valid_token(doc["token"])
    if token is None:
        raise RemoteError(node, f"the Ray token in {doc.get('source')} is not a usable token")
    return AuthToken(token, str(doc.get("source")))
