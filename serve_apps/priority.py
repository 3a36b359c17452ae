"""The nice value of a Serve replica or rank actor and the vLLM processes it starts."""

from __future__ import annotations

import os


def set_process_priority(nice: int) -> str:
    """Give every thread of this process the nice value `nice`; returns what happened.

    Ray starts workers (Serve replicas included) at nice 15; on a busy node that starves the
    API server and the engine core it spawns against anything at nice 0. Linux keeps nice
    per thread and children inherit their creator thread's value, so set it on all threads
    before the engine starts. Lowering nice needs root (CAP_SYS_NICE); without it: a warning.
    """
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except PermissionError:
        return f"kept nice {before} (lowering it to {nice} needs root or CAP_SYS_NICE)"
    except ProcessLookupError:
        pass
    return f"nice {before} -> {nice} on {len(tids)} threads"
