"""The field kit's all-reduce: one torch.distributed process per local GPU (started by torchrun).

Standard library and torch only. Each rank joins the group (the backend given, NCCL by default),
checks one all-reduce for correctness, times --iters all-reduces of --size-mb MiB, and rank 0
prints one line `FIELD_KIT_ALLREDUCE <json>` (world size, backend, versions, bus bandwidth).
NCCL's own log goes where the caller points NCCL_DEBUG_FILE (or to stderr).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

MARKER = "FIELD_KIT_ALLREDUCE "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--size-mb", type=float, default=64.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    if not (0 < args.size_mb <= 4096 and 1 <= args.iters <= 1000 and 1 <= args.timeout_s <= 600):
        print("field_kit_allreduce: --size-mb 0..4096, --iters 1..1000, --timeout-s 1..600",
              file=sys.stderr)
        return 2

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout_s))
    numel = max(1, int(args.size_mb * (1 << 20)) // 4)
    check = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(check)
    expected = world * (world + 1) / 2
    correct = bool(torch.allclose(check, torch.full_like(check, expected)))
    data = torch.zeros(numel, dtype=torch.float32, device=device)
    for _ in range(3):
        dist.all_reduce(data)
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(data)
    _sync(device)
    per_iter = (time.perf_counter() - start) / args.iters
    size = numel * 4
    algbw = size / per_iter / 1e9
    busbw = algbw * (2 * (world - 1) / world) if world > 1 else 0.0
    if rank == 0:
        nccl = None
        if args.backend == "nccl":
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        print(MARKER + json.dumps({
            "backend": args.backend, "world_size": world, "correct": correct,
            "size_bytes": size, "iters": args.iters, "time_per_iter_s": per_iter,
            "algbw_gbps": round(algbw, 3), "busbw_gbps": round(busbw, 3),
            "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}), flush=True)
    dist.destroy_process_group()
    return 0 if correct else 1


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
