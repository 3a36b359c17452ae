"""Where an internal error's traceback goes: a file, never the terminal.

The CLI prints one line for an unexpected exception and names the file written here:
$CLUSTER_CRASH_DIR, else $XDG_STATE_HOME/cluster/crash (~/.local/state/cluster/crash), else the
temporary directory. Known secret values are scrubbed from the traceback before it is written.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
import tempfile
import traceback
from pathlib import Path

MAX_BYTES = 1 << 20


def _candidates() -> list[Path]:
    out = []
    if os.environ.get("CLUSTER_CRASH_DIR"):
        out.append(Path(os.environ["CLUSTER_CRASH_DIR"]))
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                             "state")
    out.append(Path(state) / "cluster" / "crash")
    out.append(Path(tempfile.gettempdir()) / f"cluster-crash-{os.getuid()}")
    return out


def write(exc: BaseException) -> str | None:
    """Write exc's traceback (with argv) to a new crash file; its path, or None if none could be."""
    from cluster.report.rundir import redact, secret_values

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    text = f"argv: {sys.argv!r}\n{text}"[:MAX_BYTES]
    text = redact(text, secret_values())
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    for folder in _candidates():
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = folder / f"{stamp}-{os.getpid()}.log"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as fh:
                fh.write(text)
            return str(path)
        except OSError:
            continue
    return None
