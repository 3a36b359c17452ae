"""The probes that more than one check reads: one command per tool output, named once.

Checks refer to these builders, so a tool's output is fetched once per node however many
checks judge it (preflight keeps one probe per name).
"""

from __future__ import annotations

from cluster.checks.base import static_probe

GPU_QUERY_FIELDS = ("index", "name", "memory.total", "pci.bus_id", "driver_version")

GPU_QUERY = static_probe("gpu-query", "nvidia-smi --query-gpu=" + ",".join(GPU_QUERY_FIELDS)
                         + " --format=csv,nounits")
NVIDIA_SMI = static_probe("nvidia-smi", "nvidia-smi")
NVIDIA_SMI_Q = static_probe("nvidia-smi-q", "nvidia-smi -q")
GPU_TOPO = static_probe("gpu-topo", "nvidia-smi topo -m")
IBSTAT = static_probe("ibstat", "ibstat")
