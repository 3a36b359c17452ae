"""Parse `systemctl status nvidia-fabricmanager` and its journal: is fabric manager running, why not.

On HGX/DGX systems with NVSwitch, CUDA fails with error 802 ("system not yet initialized")
until nvidia-fabricmanager has run and trained the fabric. Reads the status box (`Active:`
line, the journal lines under it) and plain `journalctl -u nvidia-fabricmanager` output in any
locale's month names.

Returned shape (`parse(text).to_dict()`):

    {
      "running": true | false | null,
          # `Active: active (running)` -> true; any other `Active:` state -> false; without an
          # Active line, `Job for nvidia-fabricmanager.service failed` (systemctl start) ->
          # false, else the journal's last start/stop event (`Started ...` -> true, `Failed`,
          # `Stopping`, `Stopped`, `... exited, code=exited, status=1/FAILURE` -> false);
          # null when none
      "failure": "request to query NVSwitch device information ... [NV_WARN_NOTHING_TO_DO]"
                 | null,
          # fabric manager's (or its start script's) first error or warning since the last
          # start (the cause) when it printed one, else systemd's failure line or systemctl's
          # `Job ... failed`, or `Unit ... could not be found.`; null when none
    }

Lines are cut at 4096 characters and read with anchored, bounded patterns (linear time).
Raises ParseError when no line is about nvidia-fabricmanager.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.base.errors import ParseError
from cluster.base.results import Record
from cluster.inspection.parsers._lines import clean_lines, head_text, require_text

KIND = "fabricmanager"

_MENTION = re.compile(r"nvidia-fabricmanager|nv-fabricmanager|fabric ?manager", re.I)
_ACTIVE = re.compile(r"^\s{0,16}Active: ([a-z-]{1,32})(?: \(([^)]{0,64})\))?")
# `... nv-fabricmanager[4177]: message` / `... nvidia-fabricmanager[12]: message`
_FM_LOG = re.compile(r"(?:nv-fabricmanager|nvidia-fabricmanager|nv-fabricmanage|"
                     r"nvidia-fabricmanager-start\.sh)\[\d{1,10}\]: ")
# fabric manager's own prefix in its messages: `[May 16 2025 15:10:21] [INFO] [tid 30042] `
_FM_PREFIX = re.compile(r"^\[[^\]]{1,40}\] \[([A-Z]{1,10})\] (?:\[tid \d{1,10}\] )?")
_SYSTEMD = re.compile(r"systemd\[\d{1,10}\]: ")
_STARTING = ("starting nvidia fabric manager", "starting nvidia-fabricmanager")
_STARTED = ("started nvidia fabric manager", "started nvidia-fabricmanager")
_STOPPED = ("stopped nvidia fabric manager", "stopped nvidia-fabricmanager",
            "stopping nvidia fabric manager", "stopping nvidia-fabricmanager",
            "failed to start nvidia fabric manager", "failed to start nvidia-fabricmanager")
# what `systemctl start|restart` prints when the start failed (the state right now)
_JOB_FAILED = re.compile(r"^Job for nvidia-fabricmanager(?:\.service)? failed")
_FAILED_UNIT = re.compile(r"nvidia-fabricmanager(?:\.service)?: (?:Control process exited|"
                          r"Main process exited|Failed with result)", re.I)
_NOT_FOUND = re.compile(r"Unit nvidia-fabricmanager(?:\.service)? (?:could not be found|"
                        r"not found)", re.I)
_ERROR_WORDS = ("error", "failed", "nv_err_", "nv_warn_", "fatal")


@dataclass(frozen=True)
class FabricManager(Record):
    """Whether nvidia-fabricmanager runs, and its failure (see the module docstring)."""

    running: bool | None
    failure: str | None


def _fm_message(line: str) -> tuple[str, str | None] | None:
    """(message, level) of a fabric manager journal line, or None."""
    m = _FM_LOG.search(line)
    if m is None:
        return None
    message = line[m.end():].strip()
    prefix = _FM_PREFIX.match(message)
    if prefix:
        return message[prefix.end():].strip(), prefix.group(1)
    return message, None


def _is_error(message: str, level: str | None) -> bool:
    if level is not None:
        return level in ("ERROR", "WARNING", "WARN", "FATAL", "CRITICAL")
    lowered = message.lower()
    return any(word in lowered for word in _ERROR_WORDS)


def _systemd_message(line: str) -> str | None:
    m = _SYSTEMD.search(line)
    return line[m.end():].strip() if m else None


def parse(text: str) -> FabricManager:
    """Parse systemctl status / journal output; see the module docstring for the shape."""
    lines = clean_lines(require_text(KIND, text))
    if not any(_MENTION.search(line) for line in lines):
        raise ParseError(KIND, "no line about nvidia-fabricmanager (systemctl status or "
                               "journalctl -u nvidia-fabricmanager output) found")
    active: bool | None = None
    job_failed = False
    journal_running: bool | None = None
    fm_failure: str | None = None
    unit_failure: str | None = None
    for line in lines:
        m = _ACTIVE.match(line)
        if m:
            active = m.group(1) == "active" and m.group(2) == "running"
            if not active and m.group(1) == "failed" and unit_failure is None:
                unit_failure = line.strip()
            continue
        if _NOT_FOUND.search(line):
            active = False
            unit_failure = line.strip()
            continue
        if _JOB_FAILED.match(line.strip()):
            job_failed = True
            unit_failure = unit_failure or line.strip()
            continue
        fm = _fm_message(line)
        if fm is not None:
            if _is_error(*fm) and fm_failure is None:
                fm_failure = fm[0]   # the first error since the last start: the cause
            continue
        message = _systemd_message(line)
        if message is None:
            continue
        lowered = message.lower()
        if lowered.startswith(_STARTING):
            fm_failure = None
        elif lowered.startswith(_STARTED):
            journal_running, fm_failure = True, None
            unit_failure = unit_failure if job_failed else None
        elif lowered.startswith(_STOPPED) or _FAILED_UNIT.search(message):
            journal_running = False
            if unit_failure is None and not lowered.startswith("stopped"):
                unit_failure = message
    running = active if active is not None else (False if job_failed else journal_running)
    return FabricManager(running=running, failure=fm_failure or unit_failure)


def detect(text: str) -> bool:
    """The nvidia-fabricmanager unit in a status box or journal lines of it."""
    head = head_text(text)
    for line in head.splitlines():
        if "nvidia-fabricmanager.service" in line or _FM_LOG.search(line) \
                or _NOT_FOUND.search(line):
            return True
    return False
