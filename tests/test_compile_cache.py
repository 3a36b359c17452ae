"""cluster/serving/compile_cache.py: the ranks' compile-cache lines, the replica verdict, the union
of a cache directory over nodes as relay plans, and the deploy record's directories."""

from __future__ import annotations

import pytest

from cluster.serving import compile_cache as cc
from cluster.remedy.model_sync import FileEntry, Manifest
from fakes import fixture_text

HASH = "2ffb78c02e72367f2969d3072f66cfa80df36f23a944836c28b1f871cf48d4b2"
SUB = f"torch_aot_compile/{HASH}"
ROOT = "/tmp/vllm-cache"


def _manifest(*files: tuple[str, str]) -> Manifest:
    return Manifest(True, tuple(FileEntry(p, len(b), (b * 64)[:64]) for p, b in files))


def _cold_and_warm() -> tuple[str, str]:
    """The real cold-start lines of rank 1, and the same worker's warm-start line as vLLM
    formats it (vllm/compilation/decorators.py: "%sDirectly load AOT compilation from path
    %s") on the path the cold start saved to."""
    cold = fixture_text("vllm-compile-cache", "pp2_rank1_compiled.txt")
    saved = next(line for line in cold.splitlines() if "saved AOT compiled function" in line)
    prefix, _, path = saved.partition("saved AOT compiled function to ")
    warm = prefix.replace("[decorators.py:743]", "[decorators.py:319]") + \
        "Directly load AOT compilation from path " + path + "\n"
    return cold, warm


def test_a_ranks_own_lines_say_compiled_cold_and_loaded_warm():
    cold, warm = _cold_and_warm()
    (c,) = cc.read_ranks({"node2": [cold]})
    (w,) = cc.read_ranks({"node2": [warm]})
    assert (c.node, c.rank, c.dp, c.state) == ("node2", 1, 0, "compiled")
    assert (w.rank, w.dp, w.state) == (1, 0, "loaded")
    assert c.dir == w.dir and c.dir.sub.startswith("torch_aot_compile/")
    assert c.dir.path.endswith("/torch_compile_cache/" + c.dir.sub)


def test_the_newest_file_wins_for_one_rank_and_directory():
    cold, warm = _cold_and_warm()
    (r,) = cc.read_ranks({"node2": [warm, cold]})          # engine_logs: newest first
    assert r.state == "loaded"


def test_a_failed_load_is_compiled_with_vllms_reason():
    cold, _ = _cold_and_warm()
    saved = next(line for line in cold.splitlines() if "saved AOT compiled function" in line)
    path = saved.partition("saved AOT compiled function to ")[2]
    failed = (saved.split(" INFO ")[0] + " WARNING 12-02 01:02:03 [decorators.py:333] "
              "[backbone] Compiling model again due to a load failure from " + path +
              ", reason: Source code has changed since the last compilation.\n")
    (r,) = cc.read_ranks({"node2": [failed + cold]})
    assert r.state == "compiled" and r.note.startswith("load failed: Source code has changed")
    verdict = cc.replica_verdict(_ranks("node1", "node2"), (r,), set())
    assert verdict["staged_cache"] is False and "load failed" in verdict["cache_detail"]


def test_lines_without_a_cache_path_or_with_a_forged_one_give_no_reading():
    assert cc.read_ranks({"n": ["(Worker_PP0 pid=1) INFO Compiling a graph for compile "
                                "range (1, 512) takes 3.1 s\n"]}) == ()
    forged = [f"(Worker pid=1) Directly load AOT compilation from path /a/../etc/torch_compile_"
              f"cache/{SUB}/rank_0_0/model",
              f"(Worker pid=2) Directly load AOT compilation from path /x/torch_compile_cache/"
              f"torch_aot_compile/{HASH[:-1]}Z/rank_0_0/model",
              f"(Worker pid=3) Using cache directory: relative/torch_compile_cache/{SUB}/"
              f"rank_0_0 for vLLM's torch.compile"]
    assert cc.read_ranks({"n": ["\n".join(forged)]}) == ()
    assert cc.cache_dir("/ok", "../x") is None and cc.cache_dir("/ok", SUB) is not None


def test_a_long_hostile_line_is_read_in_linear_time():
    line = "/" * 200_000 + "torch_compile_cache/" + "a" * 200_000
    assert cc.read_ranks({"n": [line]}) == ()


def _ranks(*nodes):
    return [{"rank": i, "node": n} for i, n in enumerate(nodes)]


def test_staged_cache_is_true_only_when_every_rank_loaded_and_one_read_a_staged_dir():
    d = cc.CacheDir(ROOT, SUB)
    loaded = (cc.RankCache("node1", 0, 0, d, "loaded", "w0"),
              cc.RankCache("node2", 1, 0, d, "loaded", "w1"))
    assert cc.replica_verdict(_ranks("node1", "node2"), loaded, {("node1", d)})["staged_cache"]
    own = cc.replica_verdict(_ranks("node1", "node2"), loaded, set())
    assert own["staged_cache"] is False and "own caches" in own["cache_detail"]
    mixed = (loaded[0], cc.RankCache("node2", 1, 0, d, "compiled", "w1"))
    verdict = cc.replica_verdict(_ranks("node1", "node2"), mixed, {("node1", d)})
    assert verdict["staged_cache"] is False and "rank 1 on node2" in verdict["cache_detail"]
    missing = cc.replica_verdict(_ranks("node1", "node2"), loaded[:1], {("node1", d)})
    assert missing["staged_cache"] is False
    assert cc.replica_verdict(_ranks("node1"), (), set())["staged_cache"] is False


def test_union_sends_each_file_from_its_first_holder_to_every_node_without_it():
    held = {"node1": _manifest(("rank_0_0/model", "a"), ("inductor_cache/x/k.py", "k")),
            "node2": _manifest(("rank_1_0/model", "b"), ("inductor_cache/x/k.py", "k"),
                               ("inductor_cache/locks/k.lock", "")),
            "node3": Manifest(False, ())}
    plan = cc.union_plan(held, ["node1", "node2", "node3"])
    assert plan.conflicts == ()
    by_source = {s.source: s for s in plan.sources}
    assert [f.path for f in by_source["node1"].reference.files] == \
        ["inductor_cache/x/k.py", "rank_0_0/model"]
    assert {n: [f.path for f in p.files] for n, p in by_source["node1"].plans.items()} == \
        {"node2": ["rank_0_0/model"], "node3": ["inductor_cache/x/k.py", "rank_0_0/model"]}
    assert [f.path for f in by_source["node2"].reference.files] == ["rank_1_0/model"]
    assert by_source["node2"].busy == ["node1", "node3"]


def test_a_path_held_with_different_bytes_is_never_staged():
    held = {"a": _manifest(("rank_0_0/model", "a")), "b": _manifest(("rank_0_0/model", "b")),
            "c": Manifest(False, ())}
    plan = cc.union_plan(held, ["a", "b", "c"])
    assert plan.conflicts == ("rank_0_0/model",)
    assert all(not s.busy for s in plan.sources)


def test_recorded_dirs_keep_only_what_vllm_writes():
    doc = {"compile_cache": {"dirs": [{"root": ROOT, "dir": SUB}, {"root": ROOT, "dir": SUB},
                                      {"root": "/x", "dir": "../../etc"},
                                      {"root": "rel", "dir": SUB}, "junk"]}}
    assert cc.recorded_dirs(doc) == (cc.CacheDir(ROOT, SUB),)
    assert cc.recorded_dirs({"compile_cache": {"dirs": "x"}}) == () == cc.recorded_dirs([])


@pytest.mark.parametrize("value", [True, False])
def test_a_plans_stage_caches_reaches_the_spec(tmp_path, value):
    from cluster.serving import deploy
    from cluster.planning.plan_file import PlanFileError, load_plan

    path = tmp_path / "plan.yaml"
    path.write_text(f"model: /models/tiny\npipeline_parallel_size: 2\nstage_caches: {value}\n")
    spec = deploy.spec_from_plan(load_plan(path))
    assert spec.stage_caches is value and spec.to_dict()["stage_caches"] is value
    path.write_text("model: /models/tiny\nstage_caches: yes please\n")
    with pytest.raises(PlanFileError, match="stage_caches"):
        load_plan(path)


def test_a_root_seen_in_a_line_is_used_only_when_it_is_vllms_default():
    assert cc.node_root(None, "/root/.cache/vllm") == "/root/.cache/vllm"
    assert cc.node_root(None, "/home/ray/.cache/vllm") == "/home/ray/.cache/vllm"
    assert cc.node_root(None, "/etc") is None and cc.node_root(None, "/tmp/x") is None
    assert cc.node_root("/tmp/vllm-cache", "/etc") == "/tmp/vllm-cache"
    assert cc.node_root("relative/dir", "/root/.cache/vllm") is None
    assert cc.node_root("/a/../etc", "/root/.cache/vllm") is None


def test_the_real_failed_load_of_a_warm_start_reads_compiled_with_its_reason():
    text = fixture_text("vllm-compile-cache", "pp2_rank1_load_failed.txt")
    (r,) = cc.read_ranks({"node2": [text]})
    assert (r.rank, r.state) == (1, "compiled")
    assert "finalize_loading" in r.note
