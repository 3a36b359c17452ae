"""`cluster dashboard [--port LOCAL]`: an SSH tunnel from this machine to the head's dashboard.

The Ray dashboard has no authentication: it stays bound to the head's loopback and is reached
only through this tunnel (`ssh -N -L LOCAL:127.0.0.1:<dashboard_port>`), with the inventory's
SSH settings and strict host-key checking. Never expose it on a public address.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import time

from cluster.commands._common import int_range, load_inventory, stderr, stdout
from cluster.errors import ClusterError, UsageError
from cluster.inventory import Inventory, SSHOptions
from cluster.ray_state import dashboard_target


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard", help="open an SSH tunnel to the head's Ray dashboard and print its local URL",
        description="Forward a local port to the Ray dashboard on the head over SSH (the "
                    "dashboard has no authentication and stays on the head's loopback). Runs "
                    "until interrupted (Ctrl-C).")
    p.add_argument("--port", type=int_range(1, 65535), metavar="LOCAL",
                   help="local port (default: the inventory's ray.dashboard_port)")
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


def _auth_mode(port: int) -> str | None:
    """The dashboard's authentication mode (a public endpoint), or None when it does not say."""
    import httpx

    try:
        reply = httpx.get(f"http://127.0.0.1:{port}/api/authentication_mode", timeout=10)
        return reply.json().get("authentication_mode")
    except Exception:  # an old Ray, a dashboard still starting: nothing to add
        return None


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def run(args: argparse.Namespace) -> int:
    inv = load_inventory(args)
    local = args.port or inv.ray.dashboard_port
    if not 1 <= local <= 65535:
        raise UsageError("--port must be between 1 and 65535")
    if inv.head.local:
        stdout.print(f"the head runs on this machine: http://{dashboard_target(inv)}:"
                     f"{inv.ray.dashboard_port}")
        return 0
    if _port_open(local):
        raise UsageError(f"local port {local} is already in use: pick another with --port")
    argv = tunnel_argv(inv, local)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + inv.ssh.connect_timeout + 10
        while not _port_open(local):
            if proc.poll() is not None:
                raise ClusterError(f"ssh exited with {proc.returncode}: {shlex.join(argv)}")
            if time.monotonic() > deadline:
                raise ClusterError(f"the tunnel did not open within "
                                   f"{inv.ssh.connect_timeout + 10:g} s: {shlex.join(argv)}")
            time.sleep(0.2)
        stdout.print(f"http://127.0.0.1:{local}", soft_wrap=True)
        if _auth_mode(local) == "token":
            stderr.print("the cluster uses Ray token authentication: the dashboard asks for the "
                         "token (~/.ray/auth_token on the head)")
        stderr.print(f"tunnel to the Ray dashboard on {inv.head.name} open: keep it on this "
                     "machine, never expose the dashboard. Ctrl-C closes it.")
        return 0 if proc.wait() == 0 else 2
    except KeyboardInterrupt:
        return 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
