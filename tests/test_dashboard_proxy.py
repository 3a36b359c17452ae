"""`cluster dashboard`'s proxy and the head tunnel, without SSH: a local head (the tunnel's
streams are loopback sockets) and a fake dashboard, a real socket server on loopback that records
every request head it gets and answers like Ray 2.60's token middleware (401 without the
token). Covers: the token added to every request, a browser's Authorization / cookie replaced,
the bounded request head, loopback-only --bind, the --json line, the token never printed, the
on-head token reader's order (run locally), and the httpx transport over the tunnel."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cluster.nodes import inventory
from cluster.ray.dashboard_proxy import (MAX_HEAD_BYTES, BadRequest, DashboardProxy, loopback_bind,
                                     parse_head, rewrite_head)
from cluster.base.errors import UsageError
from cluster.nodes.head_tunnel import HeadTransport, HeadTunnel
from cluster.ray.head_token import AuthToken, read_auth_token, token_from_reply, valid_token
from cluster.nodes.remote import Session
from fakes import DASHBOARD_TOKEN as TOKEN, FakeDashboard, cluster_process, read_all as _read_all

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def local_session():
    inv = inventory.loads("nodes: [{name: localhost, local: true}]\n")
    with Session(inv) as session:
        yield session


@pytest.fixture
def dashboard():
    fake = FakeDashboard(TOKEN)
    yield fake
    fake.close()


def _proxy(session, fake: FakeDashboard, header: str | None) -> DashboardProxy:
    tunnel = HeadTunnel(session)
    return DashboardProxy(lambda: tunnel.open("127.0.0.1", fake.port), header).start()


def _client(proxy: DashboardProxy, **kw) -> httpx.Client:
    """An httpx client holding the proxy's cookie (what a browser has after the login URL)."""
    return httpx.Client(base_url=proxy.url, timeout=10, trust_env=False,
                        cookies={proxy.gate.cookie: proxy.gate.credential}, **kw)


def _cookie(proxy: DashboardProxy) -> bytes:
    """The Cookie header line a logged-in browser sends."""
    return f"Cookie: {proxy.gate.cookie}={proxy.gate.credential}\r\n".encode()


def _host(proxy: DashboardProxy) -> bytes:
    return f"Host: 127.0.0.1:{proxy.port}\r\n".encode()


def _header(head: bytes, name: str) -> list[str]:
    return [line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")[1:]
            if line.split(b":", 1)[0].strip().lower() == name.encode()]


# ---------------------------------------------------------------- the proxy


def test_the_token_is_added_to_every_request_and_each_gets_its_own_connection(
        local_session, dashboard):
    proxy = _proxy(local_session, dashboard, "Bearer " + TOKEN)
    try:
        with _client(proxy) as http:
            replies = [http.get(f"/api/v0/nodes?n={i}") for i in range(3)]
        assert [r.status_code for r in replies] == [200, 200, 200]
        assert [r.text for r in replies] == [f"ok /api/v0/nodes?n={i}" for i in range(3)]
        assert len(dashboard.heads) == 3
        for head in dashboard.heads:
            assert _header(head, "authorization") == ["Bearer " + TOKEN]
            assert _header(head, "connection") == ["close"]
    finally:
        proxy.stop()


def test_without_the_proxy_the_fake_dashboard_refuses(dashboard):
    """The fake upstream really checks the token: the proxy tests above can fail."""
    r = httpx.get(f"http://127.0.0.1:{dashboard.port}/api/v0/nodes", timeout=10,
                  trust_env=False)
    assert r.status_code == 401


def test_a_browser_sent_authorization_and_token_cookie_are_replaced(local_session, dashboard):
    proxy = _proxy(local_session, dashboard, "Bearer " + TOKEN)
    try:
        r = httpx.get(f"{proxy.url}/api/jobs/", timeout=10, trust_env=False, headers={
            "Authorization": "Bearer wrong", "X-Ray-Authorization": "Bearer wrong2",
            "Cookie": f"theme=dark; ray-authentication-token=stale; lang=en; "
                      f"{proxy.gate.cookie}={proxy.gate.credential}"})
        assert r.status_code == 200
        head = dashboard.heads[-1]
        assert _header(head, "authorization") == ["Bearer " + TOKEN]
        assert _header(head, "x-ray-authorization") == []
        assert _header(head, "cookie") == ["theme=dark; lang=en"]
        assert b"wrong" not in head and b"stale" not in head
        assert proxy.gate.credential.encode() not in head   # the proxy's cookie stays here
    finally:
        proxy.stop()


def test_a_cookie_holding_only_the_token_is_dropped():
    head = parse_head(b"GET / HTTP/1.1\r\nHost: x\r\nCookie: ray-authentication-token=old")
    out = rewrite_head(head, "Bearer " + TOKEN)
    assert b"Cookie" not in out and b"old" not in out
    assert out.endswith(b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")


def test_without_a_token_the_request_head_is_forwarded_byte_for_byte(local_session):
    """... less the proxy's own cookie."""
    fake = FakeDashboard(None)
    proxy = _proxy(local_session, fake, None)
    try:
        raw = (b"GET /api/version HTTP/1.1\r\n" + _host(proxy) + b"Authorization: Bearer mine\r\n"
               b"Connection: keep-alive\r\nX-Odd:   spaced  \r\n")
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(raw + _cookie(proxy) + b"\r\n")
            reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok /api/version")
        assert fake.heads == [raw[:-2]]
    finally:
        proxy.stop()
        fake.close()


def test_chunked_replies_and_a_websocket_upgrade_pass(local_session, dashboard):
    proxy = _proxy(local_session, dashboard, "Bearer " + TOKEN)
    try:
        with _client(proxy) as http:
            r = http.get("/chunked")
        assert r.status_code == 200 and r.text == "alphabetagamma"
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(b"GET /logs/stream HTTP/1.1\r\n" + _host(proxy) + _cookie(proxy)
                      + b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
                      b"Sec-WebSocket-Version: 13\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(4096)
            assert head.startswith(b"HTTP/1.1 101")
            s.sendall(b"frame-1")
            assert s.recv(4096) == b"echo:frame-1"
        upgrade = dashboard.heads[-1]
        assert _header(upgrade, "connection") == ["Upgrade"]
        assert _header(upgrade, "authorization") == ["Bearer " + TOKEN]
    finally:
        proxy.stop()


def test_a_request_head_over_the_bound_is_refused_before_the_dashboard_is_asked(
        local_session, dashboard):
    proxy = _proxy(local_session, dashboard, "Bearer " + TOKEN)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 10))
            reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 431 ")
        assert dashboard.heads == []
    finally:
        proxy.stop()


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nHost: x\r\n folded",             # obsolete line folding
    b"GET / HTTP/1.1\r\nNo colon here",
    b"GET / HTTP/1.1\r\nX: a\nInjected: b",               # a bare LF inside a line
    b"GET /a b HTTP/1.1",                                  # a space in the target
    b"GET / HTTP/2.0",
    b"",
])
def test_malformed_request_heads_are_refused(raw):
    with pytest.raises(BadRequest) as info:
        parse_head(raw)
    assert info.value.status == 400


def test_too_many_header_lines_are_refused():
    raw = b"GET / HTTP/1.1" + b"\r\nX: y" * 300
    with pytest.raises(BadRequest) as info:
        parse_head(raw)
    assert info.value.status == 431


def test_an_unreachable_dashboard_is_a_502_not_a_hang(local_session):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    tunnel = HeadTunnel(local_session)
    proxy = DashboardProxy(lambda: tunnel.open("127.0.0.1", closed), "Bearer " + TOKEN).start()
    try:
        with _client(proxy) as http:
            r = http.get("/")
        assert r.status_code == 502 and TOKEN not in r.text
    finally:
        proxy.stop()


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", "10.0.0.1", "192.168.1.5", "localhost",
                                  "::ffff:127.0.0.1", "fe80::1", "127.0.0.1 "])
def test_bind_refuses_anything_but_loopback(addr):
    with pytest.raises(UsageError):
        loopback_bind(addr)


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.3.4.5", "::1", "[::1]"])
def test_bind_accepts_loopback(addr):
    assert loopback_bind(addr) in ("127.0.0.1", "127.3.4.5", "::1")


def test_the_proxy_repr_never_shows_the_token(local_session, dashboard):
    proxy = _proxy(local_session, dashboard, "Bearer " + TOKEN)
    try:
        assert TOKEN not in repr(proxy) and TOKEN not in str(vars(proxy).keys())
        assert TOKEN not in repr(AuthToken(TOKEN, "x")) and TOKEN not in str(AuthToken(TOKEN, "x"))
    finally:
        proxy.stop()


# ---------------------------------------------------------------- the token


@pytest.mark.parametrize("text,ok", [(TOKEN, True), (f"  {TOKEN}\n", True), ("", False),
                                     ("a\r\nX-Evil: 1", False), ("a b", False), ("x" * 5000, False),
                                     (None, False), ("tök", False)])
def test_only_header_safe_tokens_are_used(text, ok):
    assert (valid_token(text) is not None) is ok


def test_the_token_reply_is_parsed_strictly():
    from cluster.base.errors import RemoteError
    from cluster.nodes.remote import CommandResult

    def reply(stdout, code=0):
        return CommandResult("h", "cmd", code, stdout, "", 0.1, "ok" if code == 0 else "failed")

    assert token_from_reply("h", reply(json.dumps({"token": None, "source": None}))) is None
    tok = token_from_reply("h", reply(json.dumps({"token": TOKEN, "source": "s"})))
    assert tok.value == TOKEN and tok.header == "Bearer " + TOKEN
    for bad, code in (("", 0), ("not json", 0), (json.dumps({"error": "PermissionError: denied"}), 0),
                      (json.dumps({"token": "a\r\nb", "source": "f"}), 0),
                      ("noise\n" + json.dumps({"token": TOKEN, "source": "s"}), 0),
                      (json.dumps({"token": TOKEN, "source": "s"}) + "\n" + TOKEN, 0),
                      (json.dumps({"token": TOKEN, "source": "s"}), 1)):
        with pytest.raises(RemoteError) as err:
            token_from_reply("h", reply(bad, code))
        assert TOKEN not in str(err.value)


def _read_locally(tmp_path, env: dict, inv_env: str = "{}"):
    """read_auth_token on a local head with a private HOME and environment."""
    inv = inventory.loads(f"nodes: [{{name: localhost, local: true, env: {inv_env}}}]\n"
                          f"ray: {{python: {sys.executable}}}\n")
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update({"PATH": old.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), **env})
    try:
        with Session(inv) as session:
            return read_auth_token(session, inv)
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_the_token_is_found_in_rays_order(tmp_path):
    """$RAY_AUTH_TOKEN, then the file RAY_AUTH_TOKEN_PATH names (the inventory's first), then
    ~/.ray/auth_token (a private HOME here), as Ray's AuthenticationTokenLoader reads them."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("default-file-token\n")
    (tmp_path / "named").write_text("named-file-token")
    assert _read_locally(tmp_path, {}).value == "default-file-token"
    assert _read_locally(tmp_path, {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "named")}).value \
        == "named-file-token"
    assert _read_locally(tmp_path, {"RAY_AUTH_TOKEN": "env-token",
                                    "RAY_AUTH_TOKEN_PATH": str(tmp_path / "named")}).value \
        == "env-token"
    got = _read_locally(tmp_path, {}, inv_env=f"{{RAY_AUTH_TOKEN_PATH: {tmp_path / 'named'}}}")
    assert got.value == "named-file-token"
    got = _read_locally(tmp_path, {}, inv_env="{RAY_AUTH_TOKEN: inventory-token}")
    assert got.value == "inventory-token" and got.source == "inventory env"


# ---------------------------------------------------------------- httpx over the tunnel


def test_httpx_over_the_head_tunnel(local_session, dashboard):
    with httpx.Client(transport=HeadTransport(HeadTunnel(local_session)), timeout=10) as http:
        r = http.get(f"http://127.0.0.1:{dashboard.port}/api/version",
                     headers={"Authorization": "Bearer " + TOKEN})
        assert r.status_code == 200 and r.text == "ok /api/version"
        assert http.get(f"http://127.0.0.1:{dashboard.port}/chunked",
                        headers={"Authorization": "Bearer " + TOKEN}).text == "alphabetagamma"
        assert http.get(f"http://127.0.0.1:{dashboard.port}/x").status_code == 401
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        with pytest.raises(httpx.ConnectError):
            http.get(f"http://127.0.0.1:{closed}/")


# ---------------------------------------------------------------- the command


def _inventory(tmp_path, port: int) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"nodes: [{{name: localhost, local: true}}]\nray: {{dashboard_port: {port}, python: "
                    f"{sys.executable}}}\nrun_dir: {tmp_path / 'runs'}\n")
    return path


def _start(tmp_path, *args: str, token: str | None = TOKEN) -> subprocess.Popen:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "PYTHONPATH": str(REPO), "CLUSTER_CRASH_DIR": str(tmp_path / "crash")}
    if token:
        env["RAY_AUTH_TOKEN"] = token
    return cluster_process(*args, env=env, cwd=tmp_path)


def _end(proc: subprocess.Popen, stop: bool = True,
         sig: int = signal.SIGTERM) -> tuple[int, str, str]:
    """Exit code, the rest of stdout, stderr; `stop`: send `sig` first (it keeps serving)."""
    if stop and proc.poll() is None:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def _fails(proc: subprocess.Popen) -> tuple[int, str, str]:
    return _end(proc, stop=False)


@pytest.mark.parametrize("addr", ["0.0.0.0", "192.168.1.5", "::"])
def test_the_command_refuses_a_non_loopback_bind(tmp_path, addr):
    code, out, err = _fails(_start(tmp_path, "dashboard", "--bind", addr))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "loopback" in err


def test_the_json_line_then_serving_with_the_token_never_printed(tmp_path, dashboard):
    proc = _start(tmp_path, "-i", str(_inventory(tmp_path, dashboard.port)), "dashboard",
                  "--port", "0", "--json")
    try:
        doc = json.loads(proc.stdout.readline())
        assert set(doc) == {"url", "head", "auth", "local_port", "bind"}
        assert doc["head"] == "localhost" and doc["auth"] == "token" and doc["bind"] == "127.0.0.1"
        assert isinstance(doc["local_port"], int) and 0 < doc["local_port"] < 65536
        base = f"http://127.0.0.1:{doc['local_port']}"
        assert re.fullmatch(re.escape(base) + r"/\?token=[A-Za-z0-9_-]{43}", doc["url"])
        assert TOKEN not in doc["url"]   # the proxy's own credential, not the Ray token
        with httpx.Client(timeout=10, trust_env=False, follow_redirects=True) as http:
            assert http.get(doc["url"]).status_code == 200      # the login sets the cookie
            r = http.get(base + "/api/serve/applications/")
        assert r.status_code == 200     # the fake dashboard got the token
        assert httpx.get(base + "/api/serve/applications/", timeout=10,
                         trust_env=False).status_code == 403   # no credential
    finally:
        code, out, err = _end(proc)
    assert code == 0, err
    assert out == "" and TOKEN not in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "crash").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_url_only_prints_just_the_url_and_a_signal_ends_it_with_0(tmp_path, dashboard, sig):
    proc = _start(tmp_path, "-i", str(_inventory(tmp_path, dashboard.port)), "dashboard",
                  "--port", "0", "--url-only")
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and "?token=" in url
        with httpx.Client(timeout=10, trust_env=False, follow_redirects=True) as http:
            http.get(url)
            assert http.get(url.split("?")[0] + "api/jobs/").status_code == 200
    finally:
        code, out, err = _end(proc, sig=sig)
    assert code == 0 and out == "" and err == ""


def test_token_mode_without_a_token_is_one_line_and_exit_2(tmp_path, dashboard):
    code, out, err = _fails(_start(tmp_path, "-i", str(_inventory(tmp_path, dashboard.port)),
                                   "dashboard", "--port", "0", token=None))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "no token" in err


def test_a_busy_port_is_one_line_and_exit_2(tmp_path, dashboard):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, out, err = _fails(_start(tmp_path, "-i", str(_inventory(tmp_path, dashboard.port)),
                                       "dashboard", "--port", str(port)))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and str(port) in err and TOKEN not in err


def test_an_unreachable_head_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    (tmp_path / "known_hosts").write_text("")
    inv = tmp_path / "cluster.yaml"
    inv.write_text(f"ssh: {{known_hosts: {tmp_path}/known_hosts, connect_timeout: 3}}\n"
                   f"nodes: [{{name: node1, address: 127.0.0.1, port: {closed}, local: false}}]\n")
    for extra in ([], ["--json"]):
        code, out, err = _fails(_start(tmp_path, "-i", str(inv), "dashboard", "--port", "0",
                                       *extra))
        assert code == 2 and len(err.strip().splitlines()) == 1 and "node1" in err
        assert "refused" in err and "Traceback" not in err
        if extra:   # --json: the error document, as every command gives
            assert json.loads(out)["status"] == "error"
        else:
            assert out == ""
