"""Run records: every run writes a time-stamped directory with per-node command logs and its report.

Layout: <run_root>/<YYYYmmdd-HHMMSS-ffffff>-<command>/
    run.json            command line, start/end time, exit code, inventory path
    nodes/<node>.log    every command run on that node: command, status, exit code, duration,
                        stdout, stderr (secrets redacted)
    <name>.json         reports written by the command (preflight.json, up.json, ...)
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from cluster.base.errors import UsageError
from cluster.base.results import to_jsonable

if TYPE_CHECKING:  # annotations only
    from cluster.nodes.remote import CommandResult

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
SECRET_ENV_NAMES = ("CLUSTER_API_KEY", "VLLM_API_KEY", "OPENAI_API_KEY", "HF_TOKEN",
                    "HUGGING_FACE_HUB_TOKEN")
MASK = "***"
MAX_RUN_JSON = 1 << 20     # a run.json is a few hundred bytes; a larger one is not ours


def secret_values(names: Iterable[str] = ()) -> tuple[str, ...]:
    """The values of secret environment variables present here (to scrub from records)."""
    out = []
    for name in set(SECRET_ENV_NAMES) | set(names):
        value = os.environ.get(name)
        if value and len(value) >= 4:
            out.append(value)
    return tuple(out)


def redact(text: str, secrets: Iterable[str]) -> str:
    """Every secret masked, the longest first (one that holds a shorter one is masked whole)."""
    for s in sorted(set(secrets), key=len, reverse=True):
        if s:
            text = text.replace(s, MASK)
    return text


@dataclass
class RunDir:
    """One run's directory; thread-safe appends of node logs."""

    path: Path
    command: str
    secrets: tuple[str, ...] = ()
    started: str = field(default_factory=lambda: _now().isoformat(timespec="seconds"))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def create(cls, root: str | os.PathLike, command: str, argv: Iterable[str] = (),
               inventory_path: str | None = None, secrets: Iterable[str] = ()) -> "RunDir":
        stamp = _now().strftime("%Y%m%d-%H%M%S-%f")
        path = Path(root) / f"{stamp}-{_SAFE.sub('_', command)}"
        try:
            (path / "nodes").mkdir(parents=True, exist_ok=False)
        except OSError as exc:
            raise UsageError(f"run directory {root}: cannot create a run record there "
                             f"({exc.strerror or exc}): set run_dir in the inventory or "
                             "$CLUSTER_RUN_DIR to a writable directory") from None
        run = cls(path=path, command=command, secrets=tuple(secrets) + secret_values())
        run.write_json("run.json", {"command": command, "argv": [run.scrub(a) for a in argv],
                                    "inventory": inventory_path, "started": run.started,
                                    "finished": None, "exit_code": None})
        return run

    def scrub(self, text: str) -> str:
        return redact(text, self.secrets)

    def record(self, result: CommandResult) -> None:
        """A Session hook: append one command's result to nodes/<node>.log."""
        lines = [f"=== {_now().isoformat(timespec='milliseconds')} {result.status} "
                 f"exit={result.exit_code} {result.duration_s:.2f}s",
                 f"$ {result.command}"]
        if result.error:
            lines.append(f"! {result.error}")
        if result.stdout:
            lines += ["--- stdout", result.stdout.rstrip("\n")]
        if result.stderr:
            lines += ["--- stderr", result.stderr.rstrip("\n")]
        text = self.scrub("\n".join(lines) + "\n")
        name = _SAFE.sub("_", result.node)
        with self._lock:
            with open(self.path / "nodes" / f"{name}.log", "a") as fh:
                fh.write(text)

    def note(self, line: str) -> None:
        """Append one progress line (time-stamped, secrets scrubbed) to events.log."""
        text = self.scrub(f"{_now().isoformat(timespec='milliseconds')} {line}\n")
        with self._lock:
            with open(self.path / "events.log", "a") as fh:
                fh.write(text)

    def write_json(self, name: str, data: Any) -> Path:
        return self.write_text(name, json.dumps(to_jsonable(data), indent=2, sort_keys=False)
                               + "\n")

    def write_text(self, name: str, text: str) -> Path:
        """Write a file of the run, secrets scrubbed, atomically (a reader never sees half)."""
        target = self.path / name
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(self.scrub(text))
        tmp.replace(target)
        return target

    def finish(self, exit_code: int) -> None:
        meta = json.loads((self.path / "run.json").read_text())
        meta.update(finished=_now().isoformat(timespec="seconds"), exit_code=exit_code)
        self.write_json("run.json", meta)


def list_runs(root: str | os.PathLike) -> list[dict[str, Any]]:
    """Past runs under root, newest first: {"path", "command", "started", "finished", "exit_code"}.

    A run whose run.json cannot be read as ours (not JSON, not an object, wrong types, too
    large) is listed with its fields None and an "error" saying why, never a crash.
    """
    base = Path(root)
    if not base.is_dir():
        return []
    runs = [read_run(meta_file) for meta_file in base.glob("*/run.json")]
    runs.sort(key=lambda r: Path(r["path"]).name, reverse=True)
    return runs


_RUN_FIELDS = {"command": (str,), "started": (str,), "finished": (str, type(None)),
               "exit_code": (int, type(None))}


def read_run(meta_file: Path) -> dict[str, Any]:
    """One run's summary from its run.json; fields None plus "error" when it is malformed."""
    entry: dict[str, Any] = {"path": str(meta_file.parent), "command": None, "started": None,
                             "finished": None, "exit_code": None}
    problem = None
    try:
        with open(meta_file, "rb") as fh:
            raw = fh.read(MAX_RUN_JSON + 1)
        if len(raw) > MAX_RUN_JSON:
            problem = f"run.json is larger than {MAX_RUN_JSON >> 20} MiB"
        else:
            meta = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except OSError as exc:
        problem = f"run.json cannot be read ({exc.strerror or exc})"
    except (ValueError, RecursionError):
        problem = "run.json is not valid JSON"
    if problem is None and not isinstance(meta, dict):
        problem = f"run.json is not a JSON object (a {type(meta).__name__})"
    if problem is None:
        for key, kinds in _RUN_FIELDS.items():
            value = meta.get(key)
            ok = isinstance(value, kinds) and not isinstance(value, bool) and \
                (not isinstance(value, int) or 0 <= value <= 255) and \
                (not isinstance(value, str) or len(value) <= 4096)
            if not ok and not (value is None and key == "command"):
                problem = f"run.json: {key} is {_kind(value)}"
                break
            entry[key] = value
    if problem is not None:
        entry.update(command=None, started=None, finished=None, exit_code=None, error=problem)
    return entry


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _kind(value: Any) -> str:
    if isinstance(value, (bool, int)) and not isinstance(value, bool):
        return f"out of range ({value})"
    return {dict: "an object", list: "a list", str: "too long", bool: "a boolean",
            float: "a number", type(None): "missing"}.get(type(value), type(value).__name__)


def latest_report(root: str | os.PathLike, name: str) -> Path | None:
    """The newest <run>/<name> under root (e.g. the last preflight.json), or None."""
    candidates = sorted(Path(root).glob(f"*/{name}"), key=lambda p: p.parent.name, reverse=True)
    return candidates[0] if candidates else None


def _now() -> _dt.datetime:
    return _dt.datetime.now().astimezone()
