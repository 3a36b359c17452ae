"""Issue 25 (security round 3), items 1, 4, 6, 7, 13 and 16: regression tests, each failing on
the code before the fix (7abd054).

1   `cluster up` chooses token auth when the head's Ray token is given in the inventory's `env:`
    (RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH), says which source decided it (never the value), and
    every on-head client finds the token the running Ray was started with.
4   the dashboard proxy answers only its own loopback Host names with its own port (DNS
    rebinding).
6   the proxy's own per-run credential (?token= in the printed URL, then an HttpOnly
    SameSite=Strict cookie); requests without it get 403.
7   state-changing requests need the proxy's own Origin (or Referer).
13  `cluster bench`: bounded decompression, bounded streaming statistics.
16  inventory numbers: no base 60, no underscores, no non-ASCII digits; colliding ports; an
    IPv4 address in brackets.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from cluster.nodes import inventory
from cluster.ray import ray_cluster, rollout
from cluster.node_programs import _common
from cluster.ray.ray_cluster import REFUSE, START, plan_up
from cluster.nodes.shell import SECRET_ENV_FROM_STDIN
from fakes import FakeRunner
from fakes import cluster_cli
from fakes import RAY_INVENTORY as INV, node_facts as facts

TOKEN = "5f1e0c9a" * 8


# ---------------------------------------------------------------- 1: the auth mode `up` picks


def _with_env(text: str, node: str, env: str) -> str:
    """INV with `env` (a YAML flow mapping) given to `node`."""
    return text.replace(f"  - name: {node}\n", f"  - name: {node}\n    env: {env}\n", 1)


def _auth_mode(command: str) -> str | None:
    found = re.findall(r"\bRAY_AUTH_MODE=(\w+)", command)
    return found[-1] if found else None


@pytest.mark.parametrize("var,value", [("RAY_AUTH_TOKEN", TOKEN),
                                       ("RAY_AUTH_TOKEN_PATH", "/etc/ray/token")])
def test_a_token_in_the_heads_inventory_env_gives_token_mode_and_says_so(var, value):
    inv = inventory.loads(_with_env(INV, "gpu01", f"{{{var}: {value}}}"))
    f = {n: facts(n, auth_token=(n != "gpu01")) for n in ("gpu01", "gpu02", "gpu03")}
    plan = plan_up(inv, f, None)
    head = plan.action("gpu01")
    assert head.kind == START and _auth_mode(head.commands[0]) == "token"
    assert _auth_mode(plan.action("gpu02").commands[0]) == "token"
    assert plan.auth.mode == "token" and var in plan.auth.source and "gpu01" in plan.auth.source
    assert value not in plan.auth.source and value not in head.commands[0]
    assert plan.to_dict()["auth"] == {"mode": "token", "source": plan.auth.source}


def test_the_source_of_each_choice_is_named():
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}
    off = plan_up(inventory.loads(INV), f, None).auth
    assert off.mode == "disabled" and "no Ray token" in off.source
    found = plan_up(inventory.loads(INV), dict(f, gpu01=facts("gpu01", auth_token=True)),
                    None).auth
    assert found.mode == "token" and "~/.ray/auth_token" in found.source
    explicit = plan_up(inventory.loads(_with_env(INV, "gpu01", "{RAY_AUTH_MODE: disabled, "
                                                 f"RAY_AUTH_TOKEN: {TOKEN}}}")), f, None).auth
    assert explicit.mode == "disabled" and "RAY_AUTH_MODE" in explicit.source


def test_a_worker_whose_token_is_in_its_inventory_env_is_not_refused():
    text = _with_env(_with_env(INV, "gpu01", f"{{RAY_AUTH_TOKEN: {TOKEN}}}"), "gpu03",
                     f"{{RAY_AUTH_TOKEN: {TOKEN}}}")
    f = {n: facts(n) for n in ("gpu01", "gpu02", "gpu03")}   # the probe never sees the env
    plan = plan_up(inventory.loads(text), f, None)
    assert plan.action("gpu03").kind == START
    assert _auth_mode(plan.action("gpu03").commands[0]) == "token"
    assert plan.action("gpu02").kind == REFUSE and "token" in plan.action("gpu02").reason


def test_the_drain_client_gets_the_inventory_token_on_stdin_never_argv():
    inv = inventory.loads(_with_env(INV, "gpu01", f"{{RAY_AUTH_TOKEN: {TOKEN}}}"))
    cmd = rollout.drain_command(inv, "ab" * 28, "msg", auth_mode="token")
    assert cmd.startswith(SECRET_ENV_FROM_STDIN) and TOKEN not in cmd
    nodes = FakeRunner()
    ray_cluster.run_node_command(nodes.session(inv), inv.head, cmd, 10)
    assert TOKEN in nodes.sent[-1].stdin


def _proc(root: Path, procs: dict[int, tuple[str, dict[str, str], str]],
          own_ns: str = "pid:[4026531836]") -> str:
    """A fake /proc: pid -> (comm, environ, PID namespace link); `self` in `own_ns`."""
    for pid, (comm, env, ns) in procs.items():
        d = root / str(pid)
        (d / "ns").mkdir(parents=True)
        (d / "comm").write_text(comm + "\n")
        (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()))
        os.symlink(ns, d / "ns" / "pid")
    (root / "self" / "ns").mkdir(parents=True)
    os.symlink(own_ns, root / "self" / "ns" / "pid")
    return str(root)


def test_on_the_head_the_running_rays_token_wins_over_a_default_file_it_did_not_read(tmp_path):
    """`ray start` got RAY_AUTH_TOKEN from the inventory (on its stdin): a client on the head
    (status, deploy, health job, nccl-check) must use that token, not ~/.ray/auth_token."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("stale-default-file\n")
    proc = _proc(tmp_path / "proc", {
        20: ("gcs_server", {"RAY_AUTH_TOKEN": "started-with"}, "pid:[4026531836]")})
    env = {"HOME": str(home)}
    assert _common.auth_token(env, scan_ray=True, proc=proc) == "started-with"
    assert _common.find_token(env, scan_ray=True, proc=proc)[1] == "ray process 20 RAY_AUTH_TOKEN"
    assert _common.auth_token(env, proc=proc) == "stale-default-file"       # no scan: the file
    assert _common.auth_token(dict(env, RAY_AUTH_TOKEN="mine"), scan_ray=True, proc=proc) == "mine"


def test_another_pid_namespaces_ray_is_not_this_nodes(tmp_path):
    """A simulated node's (or a container's) Ray is another cluster's: its token is not used."""
    proc = _proc(tmp_path / "proc", {
        30: ("raylet", {"RAY_AUTH_TOKEN": "other-cluster"}, "pid:[4026532999]")})
    assert _common.auth_token({"HOME": str(tmp_path / "nobody")}, scan_ray=True, proc=proc) \
        is None


def test_every_on_head_client_scans_for_the_running_rays_token():
    """The programs that talk to the head's Ray with its token (status, nccl-check, the
    health job; deploy's dashboard program already did) read it as _common.find_token does."""
    from cluster.node_programs import source
    for name in ("head_state", "nccl_job", "health_submit", "dashboard"):
        text = source(name)
        assert re.search(r"auth_token\([^)]*scan_ray=True", text.split("def find_token")[-1]), \
            name


# ---------------------------------------------------------------- 4, 6, 7: the proxy's gate

from cluster.ray.dashboard_proxy import DashboardProxy, parse_head  # noqa: E402
from cluster.nodes.head_tunnel import HeadTunnel  # noqa: E402
from cluster.nodes.remote import Session  # noqa: E402
from fakes import DASHBOARD_TOKEN as RAY_TOKEN, FakeDashboard, LoopbackServer, read_all as _read_all  # noqa: E402


@pytest.fixture
def proxy():
    """A proxy in token mode in front of a fake dashboard that records what reaches it."""
    fake = FakeDashboard(RAY_TOKEN)
    inv = inventory.loads("nodes: [{name: localhost, local: true}]\n")
    with Session(inv) as session:
        tunnel = HeadTunnel(session)
        p = DashboardProxy(lambda: tunnel.open("127.0.0.1", fake.port),
                           "Bearer " + RAY_TOKEN).start()
        p.fake = fake
        try:
            yield p
        finally:
            p.stop()
            fake.close()


def _send(p: DashboardProxy, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request over a raw socket: (status, headers lower-cased, body)."""
    import socket
    with socket.create_connection(("127.0.0.1", p.port), timeout=10) as s:
        s.sendall(raw)
        reply = _read_all(s)
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers, body


def _req(p: DashboardProxy, *lines: str, method: str = "GET", target: str = "/api/jobs/",
         host: str | None = "own", cookie: bool = True) -> bytes:
    out = [f"{method} {target} HTTP/1.1"]
    if host == "own":
        out.append(f"Host: 127.0.0.1:{p.port}")
    elif host is not None:
        out.append(f"Host: {host}")
    if cookie and getattr(p, "gate", None) is not None:   # (the code before the fix had none)
        out.append(f"Cookie: {p.gate.cookie}={p.gate.credential}")
    out += list(lines)
    return ("\r\n".join(out) + "\r\n\r\n").encode()


def _refused(p: DashboardProxy, raw: bytes, status: int = 403) -> None:
    got, _, body = _send(p, raw)
    assert got == status, body
    assert p.fake.heads == [], "a refused request reached the dashboard"
    assert RAY_TOKEN.encode() not in body and _credential(p) not in body


def _credential(p: DashboardProxy) -> bytes:
    return p.gate.credential.encode() if getattr(p, "gate", None) is not None else b"\0"


def test_the_logged_in_request_reaches_the_dashboard_with_the_token(proxy):
    """The control: the refusals below are the gate's, not a broken proxy."""
    status, _, body = _send(proxy, _req(proxy))
    assert status == 200 and body == b"ok /api/jobs/"
    assert len(proxy.fake.heads) == 1 and proxy.gate.credential.encode() not in proxy.fake.heads[0]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1",
                                  "127.0.0.1:{other}", "localhost:{other}", "127.0.0.2:{port}",
                                  "127.0.0.1:{port}.evil.example", "127.0.0.1:{port}@evil",
                                  "localhost.:{port}", "0.0.0.0:{port}",
                                  "[::ffff:127.0.0.1]:{port}",
                                  "127.1:{port}", "2130706433:{port}", "127.0.0.1:0{port}",
                                  ""])
def test_a_foreign_host_header_is_refused_dns_rebinding(proxy, host):
    value = host.format(port=proxy.port, other=proxy.port + 1 if proxy.port < 65535 else 1)
    _refused(proxy, _req(proxy, host=value))


def test_no_host_and_two_host_headers_are_refused(proxy):
    _refused(proxy, _req(proxy, host=None), 400)
    _refused(proxy, _req(proxy, f"Host: evil.example:{proxy.port}"), 400)
    _refused(proxy, _req(proxy, f"Host: 127.0.0.1:{proxy.port}"), 400)   # even twice our own
    _refused(proxy, _req(proxy, host=None).replace(b"HTTP/1.1", b"HTTP/1.0"), 400)


def test_an_absolute_form_target_cannot_name_another_host(proxy):
    _refused(proxy, _req(proxy, target="http://evil.example/api/jobs/"), 400)
    _refused(proxy, _req(proxy, method="CONNECT", target=f"127.0.0.1:{proxy.port}"), 400)


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LocalHost:{port}",
                                  "[::1]:{port}"])
def test_the_proxys_own_host_names_are_accepted(proxy, host):
    status, _, _ = _send(proxy, _req(proxy, host=host.format(port=proxy.port)))
    assert status == 200


@pytest.mark.parametrize("cookie", [None, "{name}=wrong", "{name}=", "{name}",
                                    "other={cred}", "cluster-dashboard-1={cred}",
                                    "{name}={cred}x", "{name}= {cred}x",
                                    "ray-authentication-token={cred}"])
def test_a_request_without_the_proxys_credential_is_refused(proxy, cookie):
    """Any other local account (or a page without the cookie) reaches nothing (item 6)."""
    lines = [] if cookie is None else \
        ["Cookie: " + cookie.format(name=proxy.gate.cookie, cred=proxy.gate.credential)]
    _refused(proxy, _req(proxy, *lines, cookie=False))


def test_the_credential_is_taken_only_from_the_proxys_cookie(proxy):
    cred = proxy.gate.credential
    for line in (f"Authorization: Bearer {cred}", f"X-Ray-Authorization: Bearer {cred}",
                 f"Authorization: token {cred}"):
        _refused(proxy, _req(proxy, line, cookie=False))
    _refused(proxy, _req(proxy, cookie=False, target=f"/api/jobs/?x={cred}"))


def test_the_credential_in_a_second_cookie_header_counts_and_is_never_forwarded(proxy):
    raw = _req(proxy, "Cookie: theme=dark", cookie=False) \
        .replace(b"\r\n\r\n", f"\r\nCookie: a=1; {proxy.gate.cookie}={proxy.gate.credential}"
                 .encode() + b"\r\n\r\n")
    status, _, _ = _send(proxy, raw)
    assert status == 200
    head = proxy.fake.heads[-1]
    assert proxy.gate.credential.encode() not in head and proxy.gate.cookie.encode() not in head
    assert b"theme=dark" in head and b"a=1" in head


def test_the_login_url_sets_an_httponly_strict_cookie_and_strips_itself(proxy):
    assert proxy.login_url == f"{proxy.url}/?token={proxy.gate.credential}"
    target = f"/api/x?a=1&token={proxy.gate.credential}&b=2"
    status, headers, _ = _send(proxy, _req(proxy, cookie=False, target=target))
    assert status == 302 and headers["location"] == "/api/x?a=1&b=2"
    cookie = headers["set-cookie"]
    assert cookie.startswith(f"{proxy.gate.cookie}={proxy.gate.credential};")
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= {a.strip() for a in cookie.split(";")}
    assert proxy.fake.heads == []
    status, headers, _ = _send(proxy, _req(proxy, cookie=False,
                                           target=f"/?token={proxy.gate.credential}"))
    assert status == 302 and headers["location"] == "/"


@pytest.mark.parametrize("target,method", [
    ("/?token=wrong", "GET"), ("/?token=", "GET"), ("/?token={cred}&token={cred}", "GET"),
    ("/?token={cred}", "POST"), ("/?token={cred}x", "GET"), ("/?token={cred}", "DELETE")])
def test_a_wrong_or_misplaced_url_credential_is_refused(proxy, target, method):
    _refused(proxy, _req(proxy, "Origin: http://127.0.0.1:%d" % proxy.port, method=method,
                         cookie=False, target=target.format(cred=proxy.gate.credential)))


def test_the_login_redirect_never_leaves_the_proxy(proxy):
    for path in ("//evil.example/", "/\\evil.example/"):
        status, headers, _ = _send(proxy, _req(proxy, cookie=False,
                                               target=f"{path}?token={proxy.gate.credential}"))
        assert status == 302 and headers["location"] == "/"


@pytest.mark.parametrize("extra", [
    [], ["Origin: http://evil.example"], ["Origin: null"], ["Origin: http://127.0.0.1"],
    ["Origin: http://127.0.0.1:{other}"], ["Origin: https://127.0.0.1:{port}"],
    ["Origin: http://127.0.0.1:{port}.evil.example"],
    ["Origin: http://127.0.0.1:{port}", "Origin: http://evil.example"],
    ["Referer: http://evil.example/x"], ["Referer: http://127.0.0.1:{port}.evil.example/"],
    ["Referer: http://127.0.0.1:{port}@evil.example/"], ["Referer: /relative"],
    ["Origin: null", "Referer: http://127.0.0.1:{port}/"],
    ["Origin: http://evil.example", "Referer: http://127.0.0.1:{port}/"]])
@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_a_state_changing_request_needs_the_proxys_own_origin(proxy, extra, method):
    """The job API (POST /api/jobs/, text/plain from another site) is not reachable (item 7)."""
    other = proxy.port + 1 if proxy.port < 65535 else 1
    lines = [e.format(port=proxy.port, other=other) for e in extra]
    _refused(proxy, _req(proxy, *lines, "Content-Type: text/plain", "Content-Length: 0",
                         method=method))


@pytest.mark.parametrize("extra", [["Origin: http://127.0.0.1:{port}"],
                                   ["Origin: http://localhost:{port}"],
                                   ["Referer: http://127.0.0.1:{port}/#/jobs"],
                                   ["Referer: http://LOCALHOST:{port}"]])
def test_a_state_changing_request_from_the_proxys_own_page_passes(proxy, extra):
    lines = [e.format(port=proxy.port) for e in extra]
    status, _, _ = _send(proxy, _req(proxy, *lines, "Content-Length: 0", method="POST"))
    assert status == 200


def test_a_foreign_origin_is_refused_on_reads_and_websockets_too(proxy):
    _refused(proxy, _req(proxy, "Origin: http://evil.example"))
    _refused(proxy, _req(proxy, "Origin: null", "Upgrade: websocket", "Connection: Upgrade",
                         target="/logs/stream"))


def test_the_gate_is_pure_and_never_shows_its_credential():
    from cluster.ray.dashboard_proxy import Gate
    gate = Gate("::1", 8265, "c" * 43)
    assert "c" * 43 not in repr(gate)
    head = parse_head(b"GET / HTTP/1.1\r\nHost: [::1]:8265\r\nCookie: cluster-dashboard-8265="
                      + b"c" * 43)
    assert gate.check(head) is None
    assert gate.check(parse_head(b"GET / HTTP/1.1\r\nHost: [::1]:8266\r\nCookie: "
                                 b"cluster-dashboard-8265=" + b"c" * 43)).status == 403


# ---------------------------------------------------------------- 16: inventory numbers and ports


from cluster.base.errors import InventoryError  # noqa: E402

ONE = "nodes: [{name: a}]\n"
REPO = Path(__file__).resolve().parents[1]


def _refusal(text: str) -> InventoryError:
    with pytest.raises(InventoryError) as info:
        inventory.loads(ONE + text, path="c.yaml")
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize("text,key", [
    ("ssh: {connect_timeout: 1:30}", "ssh.connect_timeout"),          # was 90
    ("ssh: {command_timeout: 1:00:00}", "ssh.command_timeout"),        # was 3600
    ("ssh: {command_timeout: 1:30.5}", "ssh.command_timeout"),         # a base-60 float
    ("ssh: {port: 2_2}", "ssh.port"),                                  # was 22
    ("ssh: {connect_timeout: 2_0.5}", "ssh.connect_timeout"),
    ("ray: {object_store_memory: 10_737_418_240}", "ray.object_store_memory"),
    ("health: {period_s: 0x1e}", "health.period_s"),                   # was 30
    ("health: {period_s: 010}", "health.period_s"),                    # was 8
    ("expectations: {clock: {max_offset_ms: 1:40}}", "expectations.clock.max_offset_ms"),
])
def test_yaml_base_60_underscores_hex_and_octal_numbers_are_refused(text, key):
    err = _refusal(text)
    assert err.key == key, str(err)
    assert "decimal" in str(err) or "integer" in str(err), str(err)


def test_plain_decimal_numbers_still_load():
    inv = inventory.loads(ONE + "ssh: {connect_timeout: 2.5, command_timeout: 3600, port: 22}\n"
                          "ray: {object_store_memory: 10737418240}\n"
                          "health: {period_s: 1.5e+1}\n")
    assert (inv.ssh.connect_timeout, inv.ssh.command_timeout, inv.ssh.port) == (2.5, 3600.0, 22)
    assert inv.health.period_s == 15.0 and inv.ray.object_store_memory == 10737418240


@pytest.mark.parametrize("text,keys", [
    ("ray: {prometheus_port: 8265}", ("ray.dashboard_port", "ray.prometheus_port")),
    ("ray: {port: 9090}", ("ray.port", "ray.prometheus_port")),
    ("ray: {prometheus_port: 8100, dashboard_port: 8100}\n"
     "expectations: {fix: {model_copy_port: 8100}}", ("ray.dashboard_port", "ray.prometheus_port")),
    ("expectations: {model_relay: {ports: [6370, 6380]}}",
     ("ray.port", "expectations.model_relay.ports")),
    ("expectations: {model_relay: {ports: [7990, 8010]}}",
     ("ray.serve_port", "expectations.model_relay.ports")),
    ("ray: {vllm_port_min: 10500, vllm_port_max: 10600}",
     ("ray.min_worker_port", "ray.vllm_port_min")),
    ("ray: {vllm_port_min: 8260, vllm_port_max: 8270}",
     ("ray.dashboard_port", "ray.vllm_port_min")),
    ("ray: {serve_port: 8265}", ("ray.dashboard_port", "ray.serve_port")),
    ("ray: {metrics_export_port: 8076}", ("ray.node_manager_port", "ray.metrics_export_port")),
    ("ray: {dashboard_port: 10500}", ("ray.dashboard_port", "ray.min_worker_port")),
    ("ray: {min_worker_port: 30100, max_worker_port: 30500}",
     ("ray.min_worker_port", "expectations.reachability.serve_replica_ports")),
    ("expectations: {model_relay: {ports: [30500, 30510]}}",
     ("expectations.model_relay.ports", "serve_replica_ports")),
])
def test_colliding_ports_are_refused_naming_both_keys(text, keys):
    err = _refusal(text)
    for key in keys:
        assert key in str(err), str(err)
    assert str(err).startswith("c.yaml:")


def test_distinct_ports_still_load():
    inv = inventory.loads(ONE + "ray: {port: 6380, dashboard_port: 8266, prometheus_port: 9091}\n"
                          "expectations: {fix: {model_copy_port: 8091}}\n")
    assert inv.ray.prometheus_port == 9091


@pytest.mark.parametrize("url", ["http://[1.2.3.4]:3000", "http://[1.2.3.4]",
                                 "http://[10.0.0.1]:3000", "https://[127.0.0.1]/grafana"])
def test_an_ipv4_address_in_brackets_is_refused(url):
    err = _refusal(f"ray: {{grafana_url: '{url}'}}")
    assert err.key == "ray.grafana_url" and "IPv6" in str(err)


def test_an_ipv6_grafana_url_still_loads():
    inv = inventory.loads(ONE + "ray: {grafana_url: 'http://[::1]:3000'}\n")
    assert inv.ray.grafana_url == "http://[::1]:3000"


@pytest.mark.parametrize("value", ["\u0665", "\u0661\u0660", "\uff15", "1_0", "\u0665.5"])
def test_status_window_refuses_non_ascii_digits_and_underscores(tmp_path, value):
    """float("٥") is 5.0 in Python: the flag takes ASCII decimal digits only."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "PYTHONPATH": str(REPO)}
    proc = cluster_cli("status", "--window", value, cwd=tmp_path, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "--window" in proc.stderr


# ---------------------------------------------------------------- 13: bench, bounded

import random  # noqa: E402
import socket  # noqa: E402
import tracemalloc  # noqa: E402
import zlib  # noqa: E402

from cluster.serving import bench  # noqa: E402
from cluster.serving.bench import BenchConfig, RequestOutcome, run_bench, summarize_level  # noqa: E402

BOMB_BYTES = 128 << 20     # twice bench.reply_bytes of zeros: ~130 KB once gzipped


def _compressed(chunks, wbits: int = 31) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return b"".join(z.compress(c) for c in chunks) + z.flush()


def _zeros(total: int = BOMB_BYTES):
    step = 1 << 20
    return (b"\0" * step for _ in range(total // step))


class OneReply(LoopbackServer):
    """A loopback HTTP server answering every request with the same status, headers and
    body (Content-Length), then closing the connection."""

    def __init__(self, status: str, headers: dict[str, str], body: bytes):
        head = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reply = (head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")\
            .encode() + body
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            try:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, body = buf.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                want = int(length.group(1)) if length else 0
                while len(body) < want:
                    data = conn.recv(65536)
                    if not data:
                        return
                    body += data
                conn.sendall(self.reply)
            except OSError:
                return


def _bench_once(server: OneReply):
    """One request against `server`: (its outcome's error kind, its detail, peak traced bytes)."""
    config = BenchConfig(url=server.url, model="m", concurrency=(1,), requests=1, prompt_len=4,
                         output_len=4, timeout_s=60)
    tracemalloc.start()
    try:
        result = run_bench(config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    level = result.levels[0]
    kind = next(iter(level.errors), None)
    return kind, level.error_examples.get(kind, ""), peak, level


SSE = ("".join("data: " + '{"choices": [{"index": 0, "text": "t%d "}]}' % i + "\n\n"
               for i in range(5)) + 'data: {"choices": [], "usage": {"prompt_tokens": 4, '
       '"completion_tokens": 5}}\n\ndata: [DONE]\n\n').encode()


@pytest.mark.parametrize("encoding,body", [
    ("gzip", _compressed([SSE])), ("x-gzip", _compressed([SSE])),
    ("deflate", _compressed([SSE], 15)), ("deflate", _compressed([SSE], -15)),
    ("identity", SSE), ("", SSE)])
def test_a_compressed_stream_is_still_read(encoding, body):
    """The control: an honest gzip/deflate stream is decoded and measured."""
    server = OneReply("200 OK", {"Content-Type": "text/event-stream",
                                 **({"Content-Encoding": encoding} if encoding else {})}, body)
    try:
        kind, detail, _, level = _bench_once(server)
    finally:
        server.close()
    assert kind is None and level.ok == 1, detail
    assert level.output_tokens == 5 and level.itl_ms.count == 4


@pytest.mark.parametrize("status", ["200 OK", "500 Internal Server Error"])
def test_a_gzip_bomb_is_refused_in_bounded_memory(status):
    """1 GiB of zeros in ~1 MB of gzip took ~850 MiB for 8 replies: now each reply stops at
    bench.reply_bytes, inflated 64 KiB at a time."""
    server = OneReply(status, {"Content-Type": "text/event-stream", "Content-Encoding": "gzip"},
                      _compressed(_zeros()))
    try:
        kind, detail, peak, _ = _bench_once(server)
    finally:
        server.close()
    assert kind == ("protocol_error" if status == "200 OK" else "http_500"), detail
    assert peak < 24 << 20, f"peak {peak:,} bytes"


def test_an_encoding_the_bench_cannot_bound_is_refused():
    server = OneReply("200 OK", {"Content-Type": "text/event-stream", "Content-Encoding": "br"},
                      b"\x0b\x02\x80data")
    try:
        kind, detail, _, _ = _bench_once(server)
    finally:
        server.close()
    assert kind == "protocol_error" and "Content-Encoding" in detail


def test_the_metrics_page_is_inflated_in_bounded_memory():
    server = OneReply("200 OK", {"Content-Type": "text/plain", "Content-Encoding": "gzip"},
                      _compressed(_zeros()))
    tracemalloc.start()
    try:
        with pytest.raises(bench.BenchError, match="larger than|inflates"):
            bench.scrape_metric(server.url, "vllm:generation_tokens_total")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        server.close()
    assert peak < 48 << 20, f"peak {peak:,} bytes"


def test_the_decoder_never_hands_out_more_than_a_step_and_stops_at_its_cap():
    decoder = bench.BoundedDecoder("gzip", 1 << 20)
    seen = 0
    with pytest.raises(bench.StreamFailure) as info:
        for piece in decoder.pieces(_compressed(_zeros(8 << 20))):
            assert len(piece) <= decoder.STEP
            seen += len(piece)
    assert info.value.kind == "protocol_error" and seen <= 1 << 20
    with pytest.raises(bench.StreamFailure):
        list(bench.BoundedDecoder("gzip", 1 << 20).pieces(b"not gzip at all"))
    with pytest.raises(bench.StreamFailure):
        bench.BoundedDecoder("gzip, gzip", 1 << 20)


def _exact(values, q):
    return bench.percentile(sorted(values), q)


def test_small_data_gives_the_exact_percentiles():
    rng = random.Random(25)
    values = [rng.lognormvariate(-4, 1.5) for _ in range(999)] + [0.0] * 10
    dist = Distribution.of(values)
    assert dist.exact
    for q in (50, 90, 95, 99, 0, 100):
        assert dist.percentile(q) == _exact(values, q)
    stats = bench.latency_stats(dist)
    assert stats.p99 == pytest.approx(_exact(values, 99) * 1000) and stats.count == 1009


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_past_the_exact_size_percentiles_stay_within_the_documented_error(seed):
    """RELATIVE_ERROR (1%) of the exact value, or ZERO_S absolute (chunks read together)."""
    rng = random.Random(seed)
    values = [rng.lognormvariate(-4, 2) for _ in range(5000)] + [0.0] * 300 \
        + [rng.uniform(1e-7, 1e-3) for _ in range(700)]
    rng.shuffle(values)
    parts = [Distribution(exact_max=64) for _ in range(7)]
    for i, v in enumerate(values):
        parts[i % 7].add(v)
    whole = Distribution(exact_max=64)
    for part in parts:
        whole.merge(part)
    assert not whole.exact and whole.count == len(values)
    assert whole.mean == pytest.approx(sum(values) / len(values))
    for q in (50, 90, 95, 99, 99.9):
        exact, got = _exact(values, q), whole.percentile(q)
        assert abs(got - exact) <= max(RELATIVE_ERROR * exact, ZERO_S) + 1e-12, (q, got, exact)


def test_inter_token_gaps_take_bounded_memory_however_long_the_stream():
    """12 requests of 2M chunks kept every gap (2 GB): now a request's gaps and the level's
    merge stay within a few thousand entries (300k gaps per request here)."""
    rng = random.Random(7)
    outcomes = []
    for _ in range(12):
        arrivals, now = bench._Arrivals(), 0.0
        for _ in range(300_000 // 100):
            now += rng.expovariate(200.0)
            arrivals.add(now, 100)       # 100 chunks in one read: 99 gaps of 0, then one
        assert arrivals.count == 300_000 and arrivals.gaps.count == 299_999
        assert arrivals.gaps.size < 5_000
        outcomes.append(RequestOutcome(True, ttft_s=0.1, e2e_s=now, itl=arrivals.gaps,
                                       prompt_tokens=4, output_tokens=300_000,
                                       content_chunks=300_000))
    level = summarize_level(12, outcomes, 10.0, 300_000)
    assert level.itl_ms.count == 12 * 299_999 and level.itl_ms.p50 == 0.0
    assert set(level.to_dict()["itl_ms"]) == {"p50", "p95", "p99", "mean"}


from cluster.serving.distribution import RELATIVE_ERROR, ZERO_S, Distribution  # noqa: E402
