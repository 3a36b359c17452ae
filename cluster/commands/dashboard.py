"""`cluster dashboard`: the head's Ray dashboard on this machine's loopback, with the Ray token added.

A local HTTP proxy (cluster/ray/dashboard_proxy.py) listens on 127.0.0.1 (`--bind` takes only
loopback addresses) and sends every request over its own SSH channel (cluster/nodes/head_tunnel.py:
the inventory's SSH route, bastion included, strict host-key checks) to the dashboard on the
head's loopback. When the cluster uses Ray token authentication, the token is read on the head
over SSH, held in this process's memory only and added to every request, so a browser never
sees "Authentication Token Required". The proxy answers only its own Host and Origin and only
requests that carry its per-run credential: the URL it prints has `?token=CREDENTIAL` (the
proxy's own, made at start; not the Ray token), which the proxy turns into an HttpOnly,
SameSite=Strict cookie. Runs until Ctrl-C / SIGTERM (exit 0).

`tunnel_argv` is the plain `ssh -N -L` tunnel (no token) for those who want one.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading

from cluster.commands._common import int_range, load_inventory, stderr
from cluster.base.errors import UsageError
from cluster.nodes.inventory import Inventory, SSHOptions
from cluster.nodes.endpoints import dashboard_target, head_dashboard_base

AUTH_TOKEN, AUTH_DISABLED = "token", "disabled"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard", help="serve the head's Ray dashboard on this machine's loopback, the Ray "
                          "token added, and print its local URL",
        description="A local HTTP proxy on 127.0.0.1 to the Ray dashboard on the head's "
                    "loopback, over SSH channels; with Ray token authentication it adds the "
                    "head's token (read over SSH, held in memory only) to every request. Runs "
                    "until interrupted (Ctrl-C or SIGTERM).")
    p.add_argument("--port", type=int_range(0, 65535), metavar="LOCAL",
                   help="local port (default: the inventory's ray.dashboard_port; 0: any free "
                        "port)")
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDR",
                   help="local loopback address to listen on (127.0.0.0/8 or ::1; default "
                        "127.0.0.1); anything else is refused")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--url-only", action="store_true",
                     help="print only the URL (with the proxy's own credential, ?token=) once "
                          "the proxy answers, then keep serving")
    out.add_argument("--json", action="store_true",
                     help='print one JSON line {"url", "head", "auth", "local_port", "bind"} '
                          "once the proxy answers, then keep serving (url carries the "
                          "proxy's credential)")
    p.set_defaults(handler=run)


def _ssh_options(ssh: SSHOptions, identity: str | None) -> list[str]:
    opts = ["-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=" + ("accept-new" if ssh.accept_unknown_host_keys
                                              else "yes"),
            "-o", f"ConnectTimeout={max(1, int(round(ssh.connect_timeout)))}"]
    if ssh.known_hosts:
        opts += ["-o", f"UserKnownHostsFile={os.path.expanduser(ssh.known_hosts)}"]
    if identity:
        opts += ["-i", os.path.expanduser(identity), "-o", "IdentitiesOnly=yes"]
    return opts


def tunnel_argv(inventory: Inventory, local_port: int) -> list[str]:
    """The ssh command line of the tunnel (pure)."""
    head = inventory.head
    identity = head.identity_file or inventory.ssh.identity_file
    opts = _ssh_options(inventory.ssh, identity)
    argv = ["ssh", "-N", "-o", "ExitOnForwardFailure=yes", "-o", "ServerAliveInterval=15",
            "-L", f"127.0.0.1:{local_port}:{dashboard_target(inventory)}:"
                  f"{inventory.ray.dashboard_port}",
            "-p", str(head.port)] + opts
    if head.jump_host:
        # A ProxyCommand (not -J) so the jump hop gets the same key and known_hosts checks.
        user, _, hostport = head.jump_host.rpartition("@")
        host, _, port = hostport.partition(":")
        jump = ["ssh", "-W", "%h:%p", "-p", port or "22"] + opts \
            + [f"{user}@{host}" if user else host]
        argv += ["-o", "ProxyCommand=" + shlex.join(jump)]
    argv.append(f"{head.user}@{head.address}" if head.user else head.address)
    return argv


def _auth_mode(http, base: str) -> str | None:
    """The dashboard's authentication mode (a public endpoint): token, disabled, or None when
    the dashboard does not answer (Ray not running, an old Ray)."""
    import httpx

    try:
        reply = http.get(f"{base}/api/authentication_mode")
        mode = reply.json().get("authentication_mode") if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return mode if mode in (AUTH_TOKEN, AUTH_DISABLED) else None


def _answers(url: str) -> bool:
    """The proxy answers an HTTP request (any status: the dashboard may still be starting)."""
    import httpx

    try:
        httpx.get(f"{url}/api/authentication_mode", timeout=30, trust_env=False)
        return True
    except httpx.HTTPError:
        return False


def _token_header(session, inv: Inventory, mode: str | None) -> str | None:
    """The Authorization value to add: required in token mode, used when found in an unknown
    mode, never read when the dashboard says token auth is disabled."""
    from cluster.base.errors import RemoteError
    from cluster.ray.head_token import read_auth_token

    if mode == AUTH_DISABLED:
        return None
    try:
        token = read_auth_token(session, inv)
    except RemoteError as exc:
        if mode == AUTH_TOKEN:
            raise UsageError(f"the cluster uses Ray token authentication but the head's token "
                             f"could not be read: {exc}") from None
        return None
    if token is None and mode == AUTH_TOKEN:
        raise UsageError(f"the cluster uses Ray token authentication but {inv.head.name} has no "
                         "token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)")
    return token.header if token else None


def _stop_on_sigterm(stop: threading.Event) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())


def _announce(args: argparse.Namespace, inv: Inventory, proxy, mode: str | None) -> None:
    if args.json:
        sys.stdout.write(json.dumps({"url": proxy.login_url, "head": inv.head.name,
                                     "auth": mode, "local_port": proxy.port,
                                     "bind": proxy.bind}) + "\n")
        sys.stdout.flush()
        return
    sys.stdout.write(proxy.login_url + "\n")
    sys.stdout.flush()
    if args.url_only:
        return
    if mode == AUTH_TOKEN:
        stderr.print("the cluster uses Ray token authentication: the proxy adds the head's token "
                     "to every request (held in memory only)", soft_wrap=True)
    elif mode is None:
        stderr.print(f"the dashboard on {inv.head.name} does not answer yet (is Ray up? "
                     "`cluster status`): serving anyway", soft_wrap=True)
    stderr.print(f"proxy to the Ray dashboard on {inv.head.name} open on {proxy.bind} only; "
                 "the URL above carries this run's own credential (not the Ray token): keep "
                 "it to yourself. Ctrl-C closes it.", soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    import httpx

    from cluster.ray.dashboard_proxy import DashboardProxy, loopback_bind
    from cluster.nodes.head_tunnel import HeadTransport, HeadTunnel
    from cluster.nodes.remote import Session

    bind = loopback_bind(args.bind)
    inv = load_inventory(args)
    local = inv.ray.dashboard_port if args.port is None else args.port
    stop = threading.Event()
    with Session(inv) as session:
        tunnel = HeadTunnel(session)
        base = head_dashboard_base(inv)
        with httpx.Client(transport=HeadTransport(tunnel), timeout=30) as http:
            if not inv.head.local:  # an unreachable head is an error, not an unknown mode
                session.runner_for(inv.head).transport(inv.head)
            mode = _auth_mode(http, base)
        header = _token_header(session, inv, mode)
        target = (dashboard_target(inv), inv.ray.dashboard_port)
        proxy = DashboardProxy(lambda: tunnel.open(*target), header, bind, local).start()
        try:
            _stop_on_sigterm(stop)
            if not _answers(proxy.url):
                raise UsageError(f"the proxy on {proxy.url} does not answer")
            _announce(args, inv, proxy, mode)
            stop.wait()
        except KeyboardInterrupt:
            pass
        finally:
            proxy.stop()
    return 0

