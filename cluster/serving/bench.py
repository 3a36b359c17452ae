"""Load-test an OpenAI-compatible streaming endpoint: closed-loop concurrency levels -> latency and throughput.

The library behind `cluster bench` (and `cluster tune`, which calls `run_bench` at one fixed
concurrency). For each concurrency level C, C workers send streaming requests back to back
(closed loop) until the level's request count (or duration) is reached. Every request is
bounded by a total timeout and every level by a hard deadline derived from it, so a bench
never hangs. Returns frozen dataclasses; never prints. See docs/bench.md for the JSON keys.

Measured per request (streaming, `stream_options.include_usage`):
- TTFT: send -> first chunk carrying content (text / delta.content / reasoning);
- ITL: the gaps between consecutive content chunks (as vLLM's benchmark_serving does);
- E2E: send -> `[DONE]`;
- tokens: prompt/completion tokens from the final usage chunk; without usage, output tokens
  are the number of content chunks and input tokens the number of prompt words (estimates).

Errors are classified by kind: http_<status> (e.g. http_401, http_500), timeout,
connection_error (no response), dropped (connection lost mid-stream), protocol_error
(not SSE, bad JSON, a line or chunk count over its cap, JSON nested too deeply, a usage token
count that is not a whole number in range), stream_error (an error event inside the stream),
incomplete_stream (ended without [DONE] or without any content). `SseReader` is the pure
stream reader. Every number of the config is checked against cluster/data/limits.yaml, and
every text the server sends is made terminal-safe (cluster.base.textsafe) before it is kept.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence
from urllib.parse import SplitResult, urlsplit, urlunsplit

from cluster.base.bounds import bound, check_float, check_int
from cluster.serving.distribution import Distribution
from cluster.base.errors import ClusterError, ParseError, UsageError
from cluster.inspection.parsers import prometheus
from cluster.base.textsafe import safe_line

ENDPOINTS = ("completions", "chat")
ERROR_KINDS = ("timeout", "connection_error", "dropped", "protocol_error", "stream_error",
               "incomplete_stream")  # plus http_<status>
DEFAULT_TIMEOUT_S = 120.0
# Duration mode stops issuing requests at this count per level regardless (a dead endpoint
# that refuses instantly must not be hammered for minutes).
MAX_REQUESTS_PER_LEVEL = int(bound("bench", "requests"))
# A worker pauses this long after a connection-level failure before its next request.
ERROR_BACKOFF_S = 0.05
_ERROR_BODY_CHARS = 300
ACCEPT_ENCODING = "gzip, deflate"   # what BoundedDecoder undoes (never br or zstd)
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

# Common English words that most BPE vocabularies hold as one token each (with the leading
# space). A prompt of N words is therefore roughly N tokens; the server's usage is the truth.
PROMPT_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "people", "year",
    "way", "day", "man", "thing", "world", "life", "hand", "part", "child", "eye", "place",
    "work", "week",
)


class BenchError(ClusterError):
    """A bench that cannot run or a metrics endpoint that cannot be read."""


# ----------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class BenchConfig:
    """What to send, how hard, and for how long.

    url: the server's base (http://host:8000, .../v1 or a Serve route prefix .../app/v1).
    requests / duration_s: per level; at most one. Neither: max(4*C, 16) requests per level.
    api_key: sent as `Authorization: Bearer`; kept out of repr and of every result.
    vllm_extensions: send `ignore_eos` and `min_tokens` so outputs have exactly output_len
    tokens (vLLM accepts them; a strict OpenAI server may reject unknown fields).
    """

    url: str
    model: str
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    prompt_len: int = 128
    output_len: int = 128
    requests: int | None = None
    duration_s: float | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    endpoint: str = "completions"
    api_key: str | None = field(default=None, repr=False, compare=False)
    vllm_extensions: bool = True

    def __post_init__(self) -> None:
        levels = self.concurrency
        if isinstance(levels, (str, bytes)) or not hasattr(levels, "__len__") or not levels:
            raise UsageError("concurrency levels must be positive integers")
        if len(levels) > bound("bench", "concurrency_levels"):
            raise UsageError(f"at most {bound('bench', 'concurrency_levels')} concurrency levels "
                             f"(got {len(levels)})")
        object.__setattr__(self, "concurrency", tuple(
            check_int(c, "concurrency level", lo=1, hi=bound("bench", "concurrency")) for c in levels))
        check_int(self.prompt_len, "prompt length", lo=1, hi=bound("bench", "prompt_len"))
        check_int(self.output_len, "output length", lo=1, hi=bound("bench", "output_len"))
        if self.requests is not None and self.duration_s is not None:
            raise UsageError("give either a request count or a duration per level, not both")
        if self.requests is not None:
            check_int(self.requests, "requests per level", lo=1, hi=bound("bench", "requests"))
        if self.duration_s is not None:
            check_float(self.duration_s, "duration per level (s)", lo=0, lo_open=True,
                        hi=bound("bench", "duration_s"))
        check_float(self.timeout_s, "per-request timeout (s)", lo=0, lo_open=True,
                    hi=bound("bench", "timeout_s"))
        if self.endpoint not in ENDPOINTS:
            raise UsageError(f"endpoint must be one of {', '.join(ENDPOINTS)}")
        _client_url(endpoint_url(self.url, self.endpoint))  # validates the URL
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key
                                         or not self.api_key.isascii()
                                         or not self.api_key.isprintable() or " " in self.api_key):
            raise UsageError("the API key holds characters an HTTP header cannot carry "
                             "(printable ASCII without spaces only)")

    def requests_for(self, concurrency: int) -> int | None:
        """Requests to send at this level; None in duration mode."""
        if self.duration_s is not None:
            return None
        return self.requests if self.requests is not None else max(4 * concurrency, 16)

    def level_deadline_s(self, concurrency: int) -> float:
        """Hard cap on one level's wall time (every request is already bounded by timeout_s)."""
        grace = 5.0
        if self.duration_s is not None:
            return self.duration_s + self.timeout_s + ERROR_BACKOFF_S + grace
        n = self.requests_for(concurrency) or 1
        rounds = math.ceil(n / concurrency)
        return rounds * (self.timeout_s + ERROR_BACKOFF_S) + grace

    def deadline_s(self) -> float:
        """Worst-case wall time of the whole bench."""
        return sum(self.level_deadline_s(c) for c in self.concurrency)


# ----------------------------------------------------------------------------- results

@dataclass(frozen=True)
class LatencyStats:
    """Percentiles (linear interpolation between samples) and mean, in milliseconds; None without samples."""

    p50: float | None
    p95: float | None
    p99: float | None
    mean: float | None
    count: int = 0

    def to_dict(self) -> dict[str, float | None]:
        return {k: _round(getattr(self, k)) for k in ("p50", "p95", "p99", "mean")}


@dataclass(frozen=True)
class RequestOutcome:
    """One request: ok, or the kind of error; timings in seconds from the request's send."""

    ok: bool
    error_kind: str | None = None
    detail: str = ""
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl: Distribution = field(default_factory=Distribution)   # gaps between content chunks (s)
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    content_chunks: int = 0


@dataclass(frozen=True)
class LevelResult:
    """One concurrency level. Rates are per second of the level's wall time; tokens count successful requests."""

    concurrency: int
    requests: int
    ok: int
    errors: Mapping[str, int]
    error_examples: Mapping[str, str]
    duration_s: float
    input_tokens: int
    output_tokens: int
    ttft_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    tpot_ms: LatencyStats
    short_outputs: int
    usage_missing: int
    deadline_hit: bool = False

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    def _rate(self, value: float) -> float:
        return value / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self._rate(self.ok)

    @property
    def input_tokens_per_s(self) -> float:
        return self._rate(self.input_tokens)

    @property
    def output_tokens_per_s(self) -> float:
        return self._rate(self.output_tokens)

    @property
    def total_tokens_per_s(self) -> float:
        return self._rate(self.input_tokens + self.output_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "ok": self.ok,
            "errors": dict(self.errors),
            "error_examples": dict(self.error_examples),
            "duration_s": _round(self.duration_s),
            "requests_per_s": _round(self.requests_per_s),
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "input_tokens_per_s": _round(self.input_tokens_per_s),
            "output_tokens_per_s": _round(self.output_tokens_per_s),
            "total_tokens_per_s": _round(self.total_tokens_per_s),
            "ttft_ms": self.ttft_ms.to_dict(),
            "itl_ms": self.itl_ms.to_dict(),
            "e2e_ms": self.e2e_ms.to_dict(),
            "tpot_ms": self.tpot_ms.to_dict(),
            "short_outputs": self.short_outputs,
            "usage_missing": self.usage_missing,
            "deadline_hit": self.deadline_hit,
        }


@dataclass(frozen=True)
class BenchResult:
    """All levels of one bench; exit_code 0 clean, 1 warnings only, 2 any failed request."""

    config: BenchConfig
    levels: tuple[LevelResult, ...]

    @property
    def errors(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for level in self.levels:
            for kind, n in level.errors.items():
                total[kind] = total.get(kind, 0) + n
        return dict(sorted(total.items()))

    @property
    def output_tokens(self) -> int:
        return sum(level.output_tokens for level in self.levels)

    @property
    def input_tokens(self) -> int:
        return sum(level.input_tokens for level in self.levels)

    @property
    def warnings(self) -> tuple[str, ...]:
        out = []
        for level in self.levels:
            c = level.concurrency
            if level.requests == 0:
                out.append(f"c={c}: no request completed within the level's time")
            if level.short_outputs:
                out.append(f"c={c}: {level.short_outputs} response(s) shorter than "
                           f"{self.config.output_len} tokens (server ignored ignore_eos/min_tokens?)")
            if level.usage_missing:
                out.append(f"c={c}: {level.usage_missing} response(s) without usage: tokens "
                           f"estimated (output = content chunks, input = prompt words)")
        return tuple(out)

    @property
    def exit_code(self) -> int:
        if any(level.failed for level in self.levels):
            return 2
        return 1 if self.warnings else 0

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "url": redact_url(c.url),
            "endpoint_url": redact_url(endpoint_url(c.url, c.endpoint)),
            "model": c.model,
            "endpoint": c.endpoint,
            "prompt_len": c.prompt_len,
            "output_len": c.output_len,
            "requests_per_level": c.requests if c.duration_s is None else None,
            "duration_per_level_s": c.duration_s,
            "timeout_s": c.timeout_s,
            "vllm_extensions": c.vllm_extensions,
            "levels": [level.to_dict() for level in self.levels],
            "errors": self.errors,
            "warnings": list(self.warnings),
            "exit_code": self.exit_code,
        }


# ----------------------------------------------------------------------------- pure helpers

def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ascending values, linear between closest ranks (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    frac = rank - low
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * frac)


def latency_stats(values_s: Sequence[float] | Distribution) -> LatencyStats:
    """Seconds in, milliseconds out. A Distribution that is no longer exact (more values than
    it keeps: cluster/serving/distribution.py) gives percentiles within its RELATIVE_ERROR (1%)."""
    if isinstance(values_s, Distribution):
        if not values_s.count:
            return LatencyStats(None, None, None, None, 0)
        return LatencyStats(*(values_s.percentile(q) * 1000.0 for q in (50, 95, 99)),
                            values_s.mean * 1000.0, values_s.count)
    if not values_s:
        return LatencyStats(None, None, None, None, 0)
    ms = sorted(v * 1000.0 for v in values_s)
    return LatencyStats(percentile(ms, 50), percentile(ms, 95), percentile(ms, 99),
                        sum(ms) / len(ms), len(ms))


def build_prompt(words: int, index: int) -> str:
    """A deterministic prompt of `words` words; the start rotates with the request index so
    consecutive requests do not share a prefix (prefix caching would flatter TTFT)."""
    n = len(PROMPT_WORDS)
    start = (index * 7919) % n
    step = 1 + (index % (n - 1))
    picked = [PROMPT_WORDS[(start + i * step) % n] for i in range(words)]
    return " ".join(picked)


def _split(url: str) -> SplitResult:
    """urlsplit that refuses what is not a clean http(s) URL (UsageError, never ValueError)."""
    text = url.strip() if isinstance(url, str) else ""
    shown = redact_url(text)
    if not text or len(text) > 2048 or safe_line(text) != text or any(c.isspace() for c in text):
        raise UsageError(f"not an http(s) URL: {shown!r}")
    try:
        parts = urlsplit(text)
        port_text = parts.netloc.rpartition("@")[2].rpartition("]")[2].partition(":")[2]
        port = parts.port
    except ValueError as exc:
        raise UsageError(f"not an http(s) URL: {shown!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"not an http(s) URL: {shown!r}")
    if port_text and (not port_text.isascii() or not port_text.isdigit() or port is None
                      or not 1 <= port <= 65535):
        raise UsageError(f"not an http(s) URL: {shown!r} (port must be 1-65535)")
    return parts


def _client_url(url: str) -> str:
    """url, refused (UsageError) unless the HTTP client accepts it too (IDNA host, port...)."""
    import httpx

    try:
        httpx.URL(url)
    except (httpx.InvalidURL, ValueError, UnicodeError) as exc:
        raise UsageError(f"not an http(s) URL: {redact_url(url)!r} "
                         f"({safe_line(exc, limit=200)})") from None
    return url


def api_base(url: str) -> str:
    """The OpenAI API base (…/v1) for a server URL given with or without /v1 (or a full endpoint)."""
    parts = _split(url)
    path = parts.path.rstrip("/")
    for suffix in ("/chat/completions", "/completions", "/models"):
        if path.endswith("/v1" + suffix):
            path = path[: -len(suffix)]
            break
    if not path.endswith("/v1"):
        path += "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def endpoint_url(url: str, endpoint: str) -> str:
    return api_base(url) + ("/chat/completions" if endpoint == "chat" else "/completions")


def metrics_url(url: str) -> str:
    """The Prometheus /metrics URL beside an API base (…/v1 stripped); a …/metrics URL as is."""
    parts = _split(url)
    path = parts.path.rstrip("/")
    if not path.endswith("/metrics"):
        base = api_base(url)
        path = urlsplit(base).path[: -len("/v1")] + "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def redact_url(url: str) -> str:
    """The URL without user:password@ (credentials never reach output), control characters removed."""
    text = safe_line(url, limit=2048)
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:  # not parseable: cut any userinfo by hand
        scheme, sep, rest = text.partition("://")
        authority, slash, tail = rest.partition("/")
        if sep and "@" in authority:
            authority = authority.rpartition("@")[2]
        return scheme + sep + authority + slash + tail if sep else text
    if parts.username is None and parts.password is None:
        return text
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{port}" if port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _is_loopback(url: str) -> bool:
    return (_split(url).hostname or "") in _LOOPBACK_HOSTS


def request_body(config: BenchConfig, index: int) -> dict[str, Any]:
    prompt = build_prompt(config.prompt_len, index)
    body: dict[str, Any] = {"model": config.model, "max_tokens": config.output_len,
                            "stream": True, "stream_options": {"include_usage": True}}
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if config.vllm_extensions:
        body["ignore_eos"] = True
        body["min_tokens"] = config.output_len
    return body


def parse_metric_total(text: str, name: str) -> float | None:
    """Sum of the samples of metric `name` over all label sets in Prometheus text; None when absent.
    NaN / +Inf samples carry no count. ParseError when the text is not Prometheus exposition."""
    return prometheus.total(prometheus.parse(text).samples, name)


def scrape_metric(url: str, name: str, *, api_key: str | None = None,
                  timeout_s: float = 10.0, default: float | None = None) -> float:
    """Read /metrics beside `url` and sum metric `name` over its label sets.

    E.g. scrape_metric("http://127.0.0.1:8000", "vllm:generation_tokens_total"). Raises
    BenchError when the page cannot be read, or when the metric is absent and no default is given.
    """
    import httpx

    target = _client_url(metrics_url(url))
    headers = {"Accept-Encoding": ACCEPT_ENCODING}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    timeout_s = check_float(timeout_s, "metrics timeout (s)", lo=0, lo_open=True,
                            hi=bound("bench", "timeout_s"))
    cap = int(bound("files", "metrics_page"))
    try:
        with httpx.Client(timeout=timeout_s, trust_env=not _is_loopback(target)) as client:
            with client.stream("GET", target, headers=headers) as response:
                status = response.status_code
                raw = bytearray()
                decoder = BoundedDecoder(response.headers.get("content-encoding"), cap)
                for part in response.iter_raw():
                    for piece in decoder.pieces(part):
                        raw += piece
                    if len(raw) > cap:
                        raise BenchError(f"{redact_url(target)}: /metrics page larger than "
                                         f"{cap:,} bytes")
    except httpx.HTTPError as exc:
        raise BenchError(safe_line(f"cannot read {redact_url(target)}: {type(exc).__name__}: "
                                    f"{exc}", limit=500)) from None
    if status != 200:
        raise BenchError(f"{redact_url(target)} answered HTTP {status}")
    try:
        value = parse_metric_total(raw.decode("utf-8", "replace"), name)
    except ParseError as exc:
        raise BenchError(safe_line(f"{redact_url(target)}: {exc}", limit=500)) from None
    if value is None:
        if default is not None:
            return default
        raise BenchError(f"metric {name} not found at {redact_url(target)}")
    return value


# ----------------------------------------------------------------------------- one request

class StreamFailure(BenchError):
    """A reply that is not a valid OpenAI stream; `kind` is its error kind (protocol_error...)."""

    def __init__(self, kind: str, detail: str):
        detail = safe_line(detail, limit=_ERROR_BODY_CHARS)
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            err = doc.get("error", doc)
            if isinstance(err, dict):
                text = str(err.get("message") or err.get("detail") or json.dumps(err))
            else:
                text = str(err)
    except (ValueError, RecursionError):
        pass
    return safe_line(text, limit=_ERROR_BODY_CHARS)


def _chunk_content(chunk: Mapping[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not isinstance(choices, list):
        raise StreamFailure("protocol_error", "'choices' is not a list")
    text = ""
    for choice in choices:
        if not isinstance(choice, dict):
            raise StreamFailure("protocol_error", "a choice is not an object")
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise StreamFailure("protocol_error", "'delta' is not an object")
            for key in ("content", "reasoning_content", "reasoning"):
                if isinstance(delta.get(key), str):
                    text += delta[key]
        elif isinstance(choice.get("text"), str):
            text += choice["text"]
    return text


def usage_tokens(usage: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from a usage object; None when not both reported.

    A count that is there but not a whole number in 0..limits.yaml bench.token_count (a
    negative count, `true`, 1.5, NaN) is an invalid reply: StreamFailure protocol_error.
    """
    if usage is None:
        return None
    counts = []
    for key in ("prompt_tokens", "completion_tokens"):
        value = usage.get(key)
        if value is None:
            counts.append(None)
            continue
        if (isinstance(value, bool) or not isinstance(value, int)
                or not 0 <= value <= bound("bench", "token_count")):
            raise StreamFailure("protocol_error",
                                f"usage.{key} {safe_line(repr(value), limit=40)} is not a token count")
        counts.append(value)
    if counts[0] is None or counts[1] is None:
        return None
    return counts[0], counts[1]


class SseReader:
    """Incremental reader of one streamed completion (server-sent events over HTTP).

    feed(bytes) -> the number of content-carrying chunks it completed; finish() reads a last
    line without a line break. `done` once [DONE] arrived, `usage` the last usage object.
    Lines are capped (limits.yaml bench.sse_line_bytes), and so is the chunk count; anything
    that is not a valid stream raises StreamFailure (protocol_error / stream_error), never
    another exception. Pure: no clock, no I/O (the fuzz suite feeds it random bytes).
    """

    def __init__(self, endpoint: str = "completions") -> None:
        self.endpoint = endpoint
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.content_chunks = 0
        self._buf = bytearray()
        self._max_line = int(bound("bench", "sse_line_bytes"))
        self._max_chunks = int(bound("bench", "chunks_per_request"))

    def feed(self, data: bytes) -> int:
        if self.done:
            return 0
        scan = len(self._buf)  # the rest of the buffer holds no line break: not scanned again
        self._buf += data.replace(b"\r", b"\n")
        found = 0
        start = 0
        while not self.done:
            end = self._buf.find(b"\n", scan)
            if end < 0:
                break
            found += self._line(bytes(self._buf[start:end]))
            start = scan = end + 1
        del self._buf[:start]
        if self.done:
            self._buf.clear()
        elif len(self._buf) > self._max_line:
            raise StreamFailure("protocol_error", f"an SSE line longer than {self._max_line:,} bytes")
        return found

    def finish(self) -> int:
        """The last line when the body ended without a line break."""
        rest, self._buf = bytes(self._buf), bytearray()
        return 0 if self.done or not rest else self._line(rest)

    def _line(self, raw: bytes) -> int:
        if len(raw) > self._max_line:
            raise StreamFailure("protocol_error", f"an SSE line longer than {self._max_line:,} bytes")
        line = raw.decode("utf-8", "replace").strip()
        if not line or line.startswith(":"):
            return 0
        field_name, _, value = line.partition(":")
        if field_name in ("event", "id", "retry"):
            return 0
        if field_name != "data":
            raise StreamFailure("protocol_error", f"not an SSE line: {line[:80]!r}")
        payload = value.strip()
        if payload == "[DONE]":
            self.done = True
            return 0
        try:
            return self._chunk(payload)
        except RecursionError:
            raise StreamFailure("protocol_error", "a chunk nested too deeply") from None

    def _chunk(self, payload: str) -> int:
        try:
            chunk = json.loads(payload)
        except ValueError:
            raise StreamFailure("protocol_error", f"bad JSON in stream: {payload[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamFailure("protocol_error", f"chunk is not an object: {payload[:80]!r}")
        if "error" in chunk and not chunk.get("choices"):
            err = chunk["error"]
            msg = err.get("message", json.dumps(err)) if isinstance(err, dict) else str(err)
            raise StreamFailure("stream_error", str(msg))
        found = 1 if _chunk_content(chunk, self.endpoint) else 0
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
            usage_tokens(self.usage)  # an invalid count fails the request now
        self.content_chunks += found
        if self.content_chunks > self._max_chunks:
            raise StreamFailure("protocol_error", f"more than {self._max_chunks:,} chunks")
        return found


def _failure(kind: str, exc: BaseException) -> RequestOutcome:
    return RequestOutcome(False, kind, safe_line(f"{type(exc).__name__}: {exc}",
                                                  limit=_ERROR_BODY_CHARS))


class _Arrivals:
    """When content chunks arrived: the first, the count, and the gaps between consecutive
    ones (a Distribution: bounded however long the stream)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0
        self.gaps = Distribution()

    def add(self, now: float, chunks: int) -> None:
        """`chunks` content chunks completed at `now` (several in one read: gaps of 0)."""
        if self.last is None:
            self.first = now
        else:
            self.gaps.add(max(0.0, now - self.last))
        for _ in range(chunks - 1):
            self.gaps.add(0.0)
        self.last = now
        self.count += chunks


class BoundedDecoder:
    """A reply body's Content-Encoding undone in bounded steps: identity, gzip (x-gzip) or
    deflate (zlib-wrapped or raw). pieces(raw) yields the decoded bytes at most STEP at a
    time (the caller consumes each before the next is inflated: a gzip bomb never sits in
    memory) and raises StreamFailure(protocol_error) once a compressed reply inflates past
    `cap` bytes in all (limits.yaml bench.reply_bytes), on another encoding, or on corrupt
    data. Pure: no I/O."""

    STEP = 1 << 16

    def __init__(self, content_encoding: str | None, cap: int):
        names = [n.strip().lower() for n in (content_encoding or "").split(",") if n.strip()]
        names = [n for n in names if n != "identity"]
        if len(names) > 1 or (names and names[0] not in ("gzip", "x-gzip", "deflate")):
            raise StreamFailure("protocol_error", "unsupported Content-Encoding "
                                                  f"{(content_encoding or '')[:40]!r}")
        self.encoding = names[0] if names else "identity"
        self.cap = cap
        self.total = 0
        self._inflate = None

    def pieces(self, raw: bytes) -> Iterator[bytes]:
        import zlib

        if self.encoding == "identity":
            if raw:
                yield raw
            return
        if self._inflate is None:
            raw_deflate = self.encoding == "deflate" and bool(raw) and (raw[0] & 0x0F) != 8
            self._inflate = zlib.decompressobj(-15 if raw_deflate else
                                               31 if "gzip" in self.encoding else 15)
        data = raw
        while data:
            try:
                part = self._inflate.decompress(data, self.STEP)
            except zlib.error as exc:
                raise StreamFailure("protocol_error",
                                    f"corrupt {self.encoding} body: {exc}") from None
            self.total += len(part)
            if self.total > self.cap:
                raise StreamFailure("protocol_error", f"the {self.encoding} reply inflates to "
                                                      f"more than {self.cap:,} bytes")
            data = self._inflate.unconsumed_tail
            if part:
                yield part
            elif data:      # no progress with input left: never loop on it
                raise StreamFailure("protocol_error", f"corrupt {self.encoding} body")

    def head(self, raw: bytes, limit: int) -> bytes:
        """At most `limit` decoded bytes of `raw` (an error reply's start)."""
        out = b""
        for part in self.pieces(raw):
            out += part[:limit - len(out)]
            if len(out) >= limit:
                break
        return out


async def _stream_one(client: Any, url: str, body: dict[str, Any], headers: dict[str, str],
                      endpoint: str, state: dict[str, Any]) -> RequestOutcome:
    import httpx

    t0 = time.perf_counter()
    arrivals = _Arrivals()
    reader = SseReader(endpoint)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            state["got_headers"] = True
            decoder = BoundedDecoder(response.headers.get("content-encoding"),
                                     int(bound("bench", "reply_bytes")))
            if response.status_code != 200:
                raw = b""
                async for part in response.aiter_raw():
                    raw += decoder.head(part, 4 * _ERROR_BODY_CHARS - len(raw))
                    if len(raw) >= 4 * _ERROR_BODY_CHARS:
                        break
                return RequestOutcome(False, f"http_{response.status_code}", _error_message(raw))
            async for part in response.aiter_raw():
                found = sum(reader.feed(piece) for piece in decoder.pieces(part)
                            if not reader.done)
                if found:
                    arrivals.add(time.perf_counter(), found)
                if reader.done:
                    break
            if not reader.done and reader.finish():
                arrivals.add(time.perf_counter(), 1)
            tokens = usage_tokens(reader.usage)
    except StreamFailure as failure:
        return RequestOutcome(False, failure.kind, failure.detail)
    except httpx.TimeoutException as exc:
        return RequestOutcome(False, "timeout", f"{type(exc).__name__}")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError) as exc:
        return _failure("dropped" if state.get("got_headers") else "connection_error", exc)
    except (httpx.TransportError, OSError) as exc:
        return _failure("connection_error", exc)
    except (httpx.DecodingError, UnicodeDecodeError) as exc:
        return _failure("protocol_error", exc)
    except httpx.HTTPError as exc:  # any other failure of the exchange (too many redirects...)
        return _failure("connection_error", exc)
    t_end = time.perf_counter()
    if not reader.done:
        return RequestOutcome(False, "incomplete_stream", "the stream ended without [DONE]")
    if not arrivals.count:
        return RequestOutcome(False, "incomplete_stream", "the stream carried no content")
    prompt_words = len(body.get("prompt", "").split()) if "prompt" in body else \
        len(body["messages"][0]["content"].split())
    return RequestOutcome(
        True, ttft_s=arrivals.first - t0, e2e_s=t_end - t0, itl=arrivals.gaps,
        prompt_tokens=tokens[0] if tokens else prompt_words,
        output_tokens=tokens[1] if tokens else arrivals.count,
        usage_reported=tokens is not None, content_chunks=arrivals.count)


async def _one_request(client: Any, config: BenchConfig, url: str, headers: dict[str, str],
                       index: int) -> RequestOutcome:
    state: dict[str, Any] = {}
    try:
        return await asyncio.wait_for(
            _stream_one(client, url, request_body(config, index), headers, config.endpoint, state),
            timeout=config.timeout_s)
    except asyncio.TimeoutError:
        where = "mid-stream" if state.get("got_headers") else "before the response"
        return RequestOutcome(False, "timeout", f"no complete answer within {config.timeout_s:g} s ({where})")


# ----------------------------------------------------------------------------- one level

ProgressCallback = Callable[[int, RequestOutcome], None]


def _merged(parts: Iterable[Distribution]) -> Distribution:
    out = Distribution()
    for part in parts:
        out.merge(part)
    return out


def summarize_level(concurrency: int, outcomes: Sequence[RequestOutcome], duration_s: float,
                    output_len: int, deadline_hit: bool = False) -> LevelResult:
    """Aggregate a level's outcomes (pure; the unit tests feed it synthetic outcomes)."""
    good = [o for o in outcomes if o.ok]
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for o in outcomes:
        if not o.ok:
            kind = o.error_kind or "unknown"
            errors[kind] = errors.get(kind, 0) + 1
            examples.setdefault(kind, safe_line(o.detail, limit=_ERROR_BODY_CHARS))
    tpot = [(o.e2e_s - o.ttft_s) / (o.output_tokens - 1) for o in good
            if o.output_tokens > 1 and o.e2e_s is not None and o.ttft_s is not None]
    return LevelResult(
        concurrency=concurrency, requests=len(outcomes), ok=len(good),
        errors=dict(sorted(errors.items())), error_examples=dict(sorted(examples.items())),
        duration_s=duration_s,
        input_tokens=sum(o.prompt_tokens for o in good),
        output_tokens=sum(o.output_tokens for o in good),
        ttft_ms=latency_stats([o.ttft_s for o in good if o.ttft_s is not None]),
        itl_ms=latency_stats(_merged(o.itl for o in good)),
        e2e_ms=latency_stats([o.e2e_s for o in good if o.e2e_s is not None]),
        tpot_ms=latency_stats(tpot),
        short_outputs=sum(1 for o in good if o.output_tokens < output_len),
        usage_missing=sum(1 for o in good if not o.usage_reported),
        deadline_hit=deadline_hit)


async def run_level(config: BenchConfig, concurrency: int,
                    on_request: ProgressCallback | None = None,
                    first_index: int = 0) -> LevelResult:
    """One closed-loop level: `concurrency` workers sending requests back to back."""
    import httpx

    url = endpoint_url(config.url, config.endpoint)
    headers = {"Accept": "text/event-stream", "Accept-Encoding": ACCEPT_ENCODING}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    total = config.requests_for(concurrency)
    limit = total if total is not None else MAX_REQUESTS_PER_LEVEL
    outcomes: list[RequestOutcome] = []
    issued = 0
    start = last_end = time.perf_counter()
    stop_at = math.inf

    async def worker(client: Any) -> None:
        nonlocal issued, last_end
        while issued < limit and time.perf_counter() < stop_at:
            index = first_index + issued
            issued += 1
            outcome = await _one_request(client, config, url, headers, index)
            last_end = time.perf_counter()
            outcomes.append(outcome)
            if on_request is not None:
                on_request(concurrency, outcome)
            if outcome.error_kind == "connection_error":
                await asyncio.sleep(ERROR_BACKOFF_S)

    timeout = httpx.Timeout(config.timeout_s)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    deadline_hit = False
    async with httpx.AsyncClient(timeout=timeout, limits=limits,
                                 trust_env=not _is_loopback(url)) as client:
        # The level's clock starts once the client exists (its set-up is not load time).
        start = last_end = time.perf_counter()
        if config.duration_s is not None:
            stop_at = start + config.duration_s
        tasks = [asyncio.ensure_future(worker(client)) for _ in range(concurrency)]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=config.level_deadline_s(concurrency))
        except asyncio.TimeoutError:
            deadline_hit = True
            cut = RequestOutcome(False, "timeout", "cut by the level's deadline")
            outcomes.extend([cut] * (issued - len(outcomes)))
            last_end = time.perf_counter()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return summarize_level(concurrency, outcomes, last_end - start, config.output_len, deadline_hit)


async def run_bench_async(config: BenchConfig, on_request: ProgressCallback | None = None,
                          on_level: Callable[[int, int | None], None] | None = None) -> BenchResult:
    """All levels in order. on_level(concurrency, planned requests or None) precedes each level;
    on_request(concurrency, outcome) follows each finished request."""
    levels = []
    first_index = 0
    for concurrency in config.concurrency:
        if on_level is not None:
            on_level(concurrency, config.requests_for(concurrency))
        level = await run_level(config, concurrency, on_request, first_index)
        first_index += level.requests
        levels.append(level)
    return BenchResult(config, tuple(levels))


def run_bench(config: BenchConfig, on_request: ProgressCallback | None = None,
              on_level: Callable[[int, int | None], None] | None = None) -> BenchResult:
    """Run a bench from synchronous code (its own event loop). Bounded by config.deadline_s()."""
    return asyncio.run(run_bench_async(config, on_request, on_level))
