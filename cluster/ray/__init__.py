"""Layer 7, ray: the Ray cluster and the head's services: bring-up/down plans and steps,
Ray's state, rollouts, the head's Prometheus, the dashboard (API, tunnel, proxy), the
health job, the NCCL job's laptop side. cluster/ray_jobs/ (programs that run ON the
cluster as Ray jobs) is the same layer. May import: base .. remedy.
Importing this package declares cluster/ray_jobs/'s on-head programs to the one runner.
"""

from cluster import ray_jobs  # noqa: F401  (declares the Ray jobs' on-head programs)
