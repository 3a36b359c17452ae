"""Programs about the cluster's Ray jobs, in one place: what runs ON the cluster as a Ray job's
entrypoint, and the on-head programs that submit those jobs and read them back.

Entrypoints (run by Ray's job supervisor on the head, their ranks/readers as Ray actors):
  - nccl_allreduce.py: `cluster nccl-check`'s timed torch.distributed all-reduce (stdlib, Ray
    and torch only; shipped as a file, `cluster` is not imported on the cluster).
  - health_runner.py: the periodic node-health job (`python -m cluster.ray_jobs.health_runner`,
    with the `cluster` package shipped as its runtime_env py_modules); it runs health.act
    through health_remedy.py (an ENTRYPOINT_MODULES module: imported there, never a program).
On-head programs (node programs, declared here as PROGRAMS: shipped and read by
cluster/node_programs/__init__.py, the one runner and reader; each prints one JSON document):
  - nccl_job.py: submits the all-reduce job, waits, reads its result file back.
  - health_submit.py: starts the health job or keeps the running one.

Nothing here is imported by the laptop's CLI at start; the entrypoints import only the standard
library, Ray, torch and (health_runner) the toolkit's pure modules.
"""

from pathlib import Path

from cluster.node_programs import declare_programs

HERE = Path(__file__).resolve().parent
# Run by Ray's job supervisor, never shipped over SSH as programs (no JSON answer).
ENTRYPOINTS = ("nccl_allreduce", "health_runner")
# Modules an entrypoint imports on the cluster (shipped with the package, never run as programs).
ENTRYPOINT_MODULES = ("health_remedy",)
# The on-head programs, declared to the one runner (cluster.ray imports this package).
PROGRAMS = declare_programs(HERE, ("nccl_job", "health_submit", "health_readings"))


def entrypoint_path(name: str) -> Path:
    """The file of the Ray job entrypoint `name` (one of ENTRYPOINTS), shipped as a file."""
    if name not in ENTRYPOINTS:
        raise ValueError(f"not a Ray job entrypoint: {name!r}")
    return HERE / f"{name}.py"
