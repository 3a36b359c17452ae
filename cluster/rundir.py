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
from typing import Any, Iterable

from cluster.remote import CommandResult
from cluster.results import to_jsonable

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
SECRET_ENV_NAMES = ("CLUSTER_API_KEY", "VLLM_API_KEY", "OPENAI_API_KEY", "HF_TOKEN",
                    "HUGGING_FACE_HUB_TOKEN")
MASK = "***"


def secret_values(names: Iterable[str] = ()) -> tuple[str, ...]:
    """The values of secret environment variables present here (to scrub from records)."""
    out = []
    for name in set(SECRET_ENV_NAMES) | set(names):
        value = os.environ.get(name)
        if value and len(value) >= 4:
            out.append(value)
    return tuple(out)


def redact(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
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
        (path / "nodes").mkdir(parents=True, exist_ok=False)
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

    def write_json(self, name: str, data: Any) -> Path:
        target = self.path / name
        text = self.scrub(json.dumps(to_jsonable(data), indent=2, sort_keys=False))
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(target)
        return target

    def write_text(self, name: str, text: str) -> Path:
        target = self.path / name
        target.write_text(self.scrub(text))
        return target

    def finish(self, exit_code: int) -> None:
        meta = json.loads((self.path / "run.json").read_text())
        meta.update(finished=_now().isoformat(timespec="seconds"), exit_code=exit_code)
        self.write_json("run.json", meta)


def list_runs(root: str | os.PathLike) -> list[dict[str, Any]]:
    """Past runs under root, newest first: {"path", "command", "started", "finished", "exit_code"}."""
    base = Path(root)
    if not base.is_dir():
        return []
    runs = []
    for meta_file in base.glob("*/run.json"):
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            continue
        runs.append({"path": str(meta_file.parent), "command": meta.get("command"),
                     "started": meta.get("started"), "finished": meta.get("finished"),
                     "exit_code": meta.get("exit_code")})
    runs.sort(key=lambda r: Path(r["path"]).name, reverse=True)
    return runs


def latest_report(root: str | os.PathLike, name: str) -> Path | None:
    """The newest <run>/<name> under root (e.g. the last preflight.json), or None."""
    candidates = sorted(Path(root).glob(f"*/{name}"), key=lambda p: p.parent.name, reverse=True)
    return candidates[0] if candidates else None


def _now() -> _dt.datetime:
    return _dt.datetime.now().astimezone()
