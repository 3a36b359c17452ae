"""Programs about the cluster's Ray jobs, in one place: what runs ON the cluster as a Ray job's
entrypoint, and the on-head programs that submit those jobs and read them back.

Entrypoints (run by Ray's job supervisor on the head, their ranks/readers as Ray actors):
  - nccl_allreduce.py: `cluster nccl-check`'s timed torch.distributed all-reduce (stdlib, Ray
    and torch only; shipped as a file, `cluster` is not imported on the cluster).
  - health_runner.py: the periodic node-health job (`python -m cluster.ray_jobs.health_runner`,
    with the `cluster` package shipped as its runtime_env py_modules).
On-head programs (node programs: shipped and read by cluster/node_programs/__init__.py, the one
runner and reader; each prints one JSON document):
  - nccl_job.py: submits the all-reduce job, waits, reads its result file back.
  - health_submit.py: starts the health job or keeps the running one.

Nothing here is imported by the laptop's CLI at start; the entrypoints import only the standard
library, Ray, torch and (health_runner) the toolkit's pure modules.
"""

from cluster.node_programs import ENTRYPOINTS  # noqa: F401  (run by Ray, not shipped as programs)
