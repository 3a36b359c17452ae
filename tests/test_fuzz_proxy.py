"""Fuzz (Hypothesis): the dashboard proxy's request heads (issue 25 items 4, 6, 7). Random Host,
Origin, Referer, Cookie and credential values: the Gate lets a request through only with the
proxy's own Host and port, its own credential cookie and (state-changing) its own Origin or
Referer; parse_head gives a RequestHead or BadRequest, nothing else; what is forwarded never
carries the proxy's credential; and random heads sent to a live proxy reach the dashboard only
when the Gate says so."""

from __future__ import annotations

import socket

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cluster.nodes import inventory
from cluster.ray.dashboard_proxy import (BadRequest, DashboardProxy, Gate, parse_head, rewrite_head,
                                     without_own_cookie)
from cluster.nodes.head_tunnel import HeadTunnel
from cluster.nodes.remote import Session
from fakes import DASHBOARD_TOKEN as RAY_TOKEN, FakeDashboard, read_all as _read_all

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
PORT = 8265
CRED = "Zq3" * 14 + "x"          # the shape of secrets.token_urlsafe(32): 43 characters
GATE = Gate("127.0.0.1", PORT, CRED)
OWN_HOSTS = [f"{h}:{PORT}" for h in ("127.0.0.1", "localhost", "[::1]")]
COOKIE = f"{GATE.cookie}={CRED}"

# Printable header-value text, the way a hostile page or client can write one.
VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=60)
# Near misses of the proxy's own Host: the right name with junk around it, another port...
NEAR_HOST = st.builds(lambda h, pre, post: pre + h + post, st.sampled_from(OWN_HOSTS),
                      st.sampled_from(["", "x", ".", "evil.", " ", "0"]),
                      st.sampled_from(["", "0", "1", ".evil", "@evil", "/", ".", ":80", "x"]))
HOST = st.one_of(VALUE, NEAR_HOST, st.sampled_from(OWN_HOSTS))
NEAR_CRED = st.one_of(VALUE, st.builds(lambda pre, post: pre + CRED + post,
                                       st.sampled_from(["", " ", "x"]),
                                       st.sampled_from(["", " ", "x", ";"])),
                      st.just(CRED[:-1]), st.just(CRED.upper()))
METHOD = st.sampled_from(["GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE", "PATCH", "TRACE"])


def _head(method: str, host: str | None, cookies: list[str], extra: list[str],
          target: str = "/api/jobs/") -> bytes:
    lines = [f"{method} {target} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    lines += [f"Cookie: {c}" for c in cookies] + extra
    return "\r\n".join(lines).encode()


def _parsed(raw: bytes):
    try:
        return parse_head(raw)
    except BadRequest:
        return None


def _own_origin(headers: list[str]) -> bool:
    origins = [h.split(":", 1)[1].strip().lower() for h in headers
               if h.lower().startswith("origin:")]
    return len(origins) == 1 and origins[0] in {f"http://{h}".lower() for h in OWN_HOSTS}


@SETTINGS
@given(host=HOST, method=METHOD)
def test_only_the_proxys_own_host_passes(host, method):
    head = _parsed(_head(method, host, [COOKIE], [f"Origin: http://127.0.0.1:{PORT}"]))
    if head is None:
        return
    verdict = GATE.check(head)
    if host.strip().lower() in {h.lower() for h in OWN_HOSTS}:
        assert verdict is None
    else:
        assert verdict is not None and verdict.status in (400, 403)


@SETTINGS
@given(values=st.lists(NEAR_CRED, max_size=3), names=st.lists(
    st.sampled_from([GATE.cookie, "cluster-dashboard-8266", "ray-authentication-token", "x",
                     GATE.cookie.upper()]), min_size=0, max_size=3))
def test_only_the_exact_credential_in_the_proxys_cookie_passes(values, names):
    cookies = [f"{n}={v}" for n, v in zip(names, values)]
    head = _parsed(_head("GET", OWN_HOSTS[0], cookies, []))
    if head is None:
        return
    assert (GATE.check(head) is None) == _has_credential(cookies), cookies


def _has_credential(cookies: list[str]) -> bool:
    """The model: some `name=value` pair of some Cookie header is exactly the proxy's."""
    for header in cookies:
        for part in header.split(";"):
            name, _, value = part.strip().partition("=")
            if name.strip() == GATE.cookie and value.strip() == CRED:
                return True
    return False


@SETTINGS
@given(method=METHOD, origin=st.one_of(st.none(), VALUE, st.sampled_from(
    ["null", f"http://127.0.0.1:{PORT}", f"http://localhost:{PORT}", "http://evil.example",
     f"https://127.0.0.1:{PORT}", f"http://127.0.0.1:{PORT + 1}"])),
       referer=st.one_of(st.none(), VALUE, st.sampled_from(
           [f"http://127.0.0.1:{PORT}/", f"http://127.0.0.1:{PORT}.evil/", "http://evil/"])))
def test_state_changing_requests_pass_only_from_the_proxys_own_origin(method, origin, referer):
    extra = ([f"Origin: {origin}"] if origin is not None else []) + \
        ([f"Referer: {referer}"] if referer is not None else [])
    head = _parsed(_head(method, OWN_HOSTS[0], [COOKIE], extra))
    if head is None:
        return
    verdict = GATE.check(head)
    if origin is not None and not _own_origin(extra):
        assert verdict is not None and verdict.status == 403
    elif origin is None and method not in ("GET", "HEAD", "OPTIONS"):
        ref_ok = referer is not None and referer.strip().lower().startswith(
            tuple(f"http://{h}".lower() + end for h in OWN_HOSTS for end in ("/", "?", "#"))) \
            or (referer is not None and referer.strip().lower()
                in {f"http://{h}".lower() for h in OWN_HOSTS})
        assert (verdict is None) == ref_ok, (extra, verdict)
    else:
        assert verdict is None


@SETTINGS
@given(raw=st.binary(max_size=400))
def test_parse_head_gives_a_head_or_bad_request(raw):
    try:
        head = parse_head(raw)
    except BadRequest as exc:
        assert exc.status in (400, 431)
        return
    verdict = GATE.check(head)
    assert verdict is None or verdict.status in (302, 400, 403)


@SETTINGS
@given(before=st.lists(st.sampled_from(["a=1", "theme=dark", "x", "ray-authentication-token=t"]),
                       max_size=3),
       after=st.lists(st.sampled_from(["b=2", "lang=en", ""]), max_size=3),
       spaces=st.sampled_from(["", " ", "  "]))
def test_the_proxys_cookie_is_never_forwarded(before, after, spaces):
    value = "; ".join(before + [spaces + COOKIE + spaces] + after)
    raw = _head("GET", OWN_HOSTS[0], [value, "z=9; " + COOKIE], [])
    head = parse_head(raw)
    assert GATE.check(head) is None
    for out in (rewrite_head(head, "Bearer " + RAY_TOKEN, GATE.cookie),
                without_own_cookie(raw, GATE.cookie)):
        assert CRED.encode() not in out and GATE.cookie.encode() not in out
        assert b"z=9" in out


# ---------------------------------------------------------------- the live proxy


@pytest.fixture(scope="module")
def live():
    fake = FakeDashboard(RAY_TOKEN)
    inv = inventory.loads("nodes: [{name: localhost, local: true}]\n")
    with Session(inv) as session:
        tunnel = HeadTunnel(session)
        proxy = DashboardProxy(lambda: tunnel.open("127.0.0.1", fake.port),
                               "Bearer " + RAY_TOKEN).start()
        try:
            yield proxy, fake
        finally:
            proxy.stop()
            fake.close()


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(host=st.one_of(HOST, st.none()), cookie=st.booleans(), method=METHOD,
       origin=st.one_of(st.none(), st.sampled_from(["null", "http://evil.example", "own"])))
@example(host=f"127.0.0.1:{PORT}", cookie=True, method="POST", origin="own")   # passes
@example(host=f"localhost:{PORT}", cookie=True, method="GET", origin=None)     # passes
@example(host=f"evil.example:{PORT}", cookie=True, method="GET", origin=None)  # rebinding
def test_a_live_request_reaches_the_dashboard_only_through_the_gate(live, host, cookie, method,
                                                                     origin):
    proxy, fake = live
    own = f"127.0.0.1:{proxy.port}"
    host = None if host is None else host.replace(str(PORT), str(proxy.port))
    extra = [] if origin is None else \
        [f"Origin: http://{own}" if origin == "own" else f"Origin: {origin}"]
    cookies = [f"{proxy.gate.cookie}={proxy.gate.credential}"] if cookie else []
    raw = _head(method, host, cookies, extra + ["Content-Length: 0"]) + b"\r\n\r\n"
    head = _parsed(raw[:-4])
    expect_pass = head is not None and proxy.gate.check(head) is None
    before = len(fake.heads)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(raw)
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 ")
    assert (len(fake.heads) > before) == expect_pass, (raw, reply[:200])
    assert RAY_TOKEN.encode() not in reply and proxy.gate.credential.encode() not in reply
    for forwarded in fake.heads[before:]:
        assert proxy.gate.credential.encode() not in forwarded
