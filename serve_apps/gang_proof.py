"""A gang replica's fabric proof before its engine starts: the groups of its layout on the nodes
Ray placed its bundles on, all-reduced with the engine's backend, as `cluster deploy` proves a
layout before Serve starts it (issue 42 item 3: a gang the health job replaced, or any new
replica of a gang, is proven on its new nodes, not on the nodes the deployment was proven on).

    plan = gang_proof_plan(config, bundles, device)     # None: no group of two ranks
    result = run_gang_proof(pg, plan, bundles, gpu_ids) # nccl-check's ranks in the replica's PG
    why = proof_problem(plan, result)                   # None: every group formed and all-reduced

The ranks are nccl-check's (cluster/ray_jobs/nccl_allreduce.py RankWorker, run_groups), one
actor per rank slot in the bundle of its node, holding nothing of the bundle on the CPU build
(gloo); on GPUs a slot of bundle 0 (the replica holds that node's GPUs) sees the replica's own
GPU of its index, a slot of a further bundle holds one GPU of it, free until the rank actors
start. Every actor is killed before the engine starts. A group that cannot form or does not
finish fails the replica: its engine never starts and Serve tries a new replica (a new placement).
Bandwidth thresholds are the deploy's proof's (judged against the inventory on the laptop); here
a group must form and complete its all-reduce.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from cluster.planning.fabric_groups import Layout, NodeSlots
from cluster.planning.fabric_proof import ProofPlan, job_args, plan_on_nodes

PROOF_START_S = 60.0        # the rank actors' start (a Ray worker each), at most


def gang_proof_plan(config: Any, bundles: Sequence[Mapping[str, Any]],
                    device: str) -> ProofPlan | None:
    """The proof plan of the replica's gang on its bundles' nodes (bundle i = node rank i),
    nodes named by their IP (what the replica knows them by); None without a group to prove."""
    gang = config.gang
    if gang is None:
        return None
    local = gang.tp * gang.pp * gang.dp // gang.nnodes
    nodes = [NodeSlots(str(b.get("node_ip") or b.get("node_id") or f"bundle{i}"),
                       str(b.get("node_ip") or ""), local)
             for i, b in enumerate(bundles[:gang.nnodes])]
    layout = Layout(tp=gang.tp, pp=gang.pp, dp=gang.dp, ep=gang.dp > 1, replicas=1,
                    nnodes=gang.nnodes)
    plan = plan_on_nodes(layout, device, nodes, config.port_range, {})
    return plan if plan.groups else None


def proof_args(plan: ProofPlan, deadline: float) -> Any:
    """nccl_allreduce's parsed arguments for this plan (its own parser: one format)."""
    from cluster.ray_jobs.nccl_allreduce import parse_args

    return parse_args(job_args(plan) + ["--deadline", repr(deadline), "--result-file", "-"])


def slot_options(plan: ProofPlan, bundles: Sequence[Mapping[str, Any]],
                 gpu_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Each rank slot's actor options: its node's bundle (node rank = bundle index), no share
    of it on the CPU build; on GPUs bundle 0's slots see the replica's GPU of their index
    (CUDA_VISIBLE_DEVICES), a further bundle's slots hold one GPU of it."""
    bundle_of = {str(b.get("node_ip") or b.get("node_id") or f"bundle{i}"): i
                 for i, b in enumerate(bundles)}
    out = []
    for slot in plan.slots:
        index = bundle_of[slot.node]
        options: dict[str, Any] = {"bundle_index": index, "num_cpus": 0, "num_gpus": 0,
                                   "env": {}}
        if plan.backend == "nccl":
            if index == 0:
                options["env"] = {"CUDA_VISIBLE_DEVICES": str(gpu_ids[slot.device])}
            else:
                options["num_gpus"] = 1
        out.append(options)
    return out


def run_gang_proof(pg: Any, plan: ProofPlan, bundles: Sequence[Mapping[str, Any]],
                   gpu_ids: Sequence[str]) -> dict[str, Any]:
    """Run the plan's groups in the replica's placement group; nccl_allreduce's result
    ({ok, groups: [{kind, ranks, ok, problems, busbw_gbps...}], problems})."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.ray_jobs.nccl_allreduce import Deadline, RankWorker, run_groups

    deadline = time.time() + PROOF_START_S + plan.timeout_s
    args = proof_args(plan, deadline)
    worker = ray.remote(RankWorker)
    actors = []
    result: dict[str, Any] = {"ok": False, "stage": "start", "problems": [], "versions": {},
                              "backend": plan.backend}
    try:
        for options in slot_options(plan, bundles, gpu_ids):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=options["bundle_index"],
                placement_group_capture_child_tasks=False)
            actors.append(worker.options(
                max_concurrency=2, num_cpus=options["num_cpus"], num_gpus=options["num_gpus"],
                scheduling_strategy=strategy,
                runtime_env={"env_vars": options["env"]} if options["env"] else None,
            ).remote(plan.backend))
        infos = ray.get([a.info.remote() for a in actors], timeout=PROOF_START_S)
        for info, slot in zip(infos, plan.slots):
            info.update(node=slot.node, ip=slot.ip or info.get("ip"))
        result["stage"] = "run"
        run_groups(args, actors, infos, args.nodes, Deadline(deadline), result)
    except Exception as exc:  # noqa: BLE001 - the proof's own failure is its result
        result["problems"].append(f"{type(exc).__name__}: {exc}"[:1000])
    finally:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
    return result


def proof_problem(plan: ProofPlan, result: Mapping[str, Any]) -> str | None:
    """None when every group of the plan formed and completed its all-reduce; else one
    sentence naming each failed group, its nodes and what its ranks said."""
    groups = list(result.get("groups") or [])
    bad = []
    for index, group in enumerate(plan.groups):
        got = groups[index] if index < len(groups) else None
        if got is not None and got.get("ok"):
            continue
        said = "; ".join((got or {}).get("problems") or []) or "not run"
        bad.append(f"{group.label} on {', '.join(group.nodes)} ({plan.backend}): {said}")
    if not bad and result.get("ok"):
        return None
    bad += [str(p) for p in result.get("problems") or []]
    return ("fabric proof of the new gang failed: " + " | ".join(bad))[:2000]


