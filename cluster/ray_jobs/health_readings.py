"""Runs ON the head (shipped by cluster/ray/health_job.py `read_health`, `python3 - PATH MAX_BYTES [ACTIONS_PATH]`):
the health job's readings file of the current Ray session, for `cluster status`.

Prints one JSON document: {"now": the head's clock (s since the epoch), "text": the file's text
(at most MAX_BYTES + 1 bytes read, so a longer file is seen as too long by the reader) or null
when there is no such file (the job has not written yet, or is disabled), "error": why it could
not be read, or null}; with a third argument ACTIONS_PATH (the job's health.act records) also
"actions_text" and "actions_error", read the same way. The path is opened without following a final symbolic link.
Stdlib only, Python 3.8+.
"""

import json
import os
import sys
import time


def read(path, max_bytes):
    """(text or None, error or None)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, "%s: %s" % (type(exc).__name__, exc)
    try:
        with os.fdopen(fd, "rb") as fh:
            return fh.read(max_bytes + 1).decode("utf-8", "replace"), None
    except OSError as exc:
        return None, "%s: %s" % (type(exc).__name__, exc)


def main(argv):
    path, max_bytes = argv[0], int(argv[1])
    text, error = read(path, max_bytes)
    out = {"now": time.time(), "text": text, "error": error}
    if len(argv) > 2:                   # the health job's actions file (health.act's records)
        out["actions_text"], out["actions_error"] = read(argv[2], max_bytes)
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1:]), ensure_ascii=False) + "\n")
