"""`cluster plan` from an admin's seat (issue 41 item 3): the inventory and the latest preflight
run give the facts, flags override them; the model from a path, NODE:PATH or a hub repo id; one
line when facts or the model are missing; --alternatives; pasteable per-node `vllm serve`
lines; vLLM's validation timed and silent."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from cluster.planning.planner import make_plan
from fakes import CONFIGS, H100, REPO, cluster_cli, cluster_main, model_config, plan_cluster, write_inventory

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed")
GPU = {"reachable": True, "gpu_count": 8, "gpu_model": H100, "gpu_memory_mib": 81559,
       "nvlink": True, "ib_ports": [{"ca": "mlx5_0", "port": 1, "state": "Active",
                                     "rate_gbps": 400, "link_layer": "InfiniBand"},
                                    {"ca": "mlx5_1", "port": 1, "state": "Active",
                                     "rate_gbps": 200, "link_layer": "InfiniBand"},
                                    {"ca": "mlx5_2", "port": 1, "state": "Down",
                                     "rate_gbps": 10, "link_layer": "InfiniBand"}]}


def _inventory(tmp_path: Path, names: list[str], model_path: str | None = None,
               local: bool = False) -> Path:
    nodes = "\n".join(f"  - {{name: {n}, address: 10.1.0.{i + 1}, node_ip: 10.2.0.{i + 1}"
                      + (", local: true" if local else "") + "}"
                      for i, n in enumerate(names))
    model = f"model_path: {model_path}\n" if model_path else ""
    return write_inventory(tmp_path, f"nodes:\n{nodes}\nrun_dir: {tmp_path}/runs\n{model}")


def _run(tmp_path: Path, nodes: dict, name: str = "20260101-100000-000000-preflight") -> Path:
    path = tmp_path / "runs" / name / "preflight.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"command": "preflight", "results": [],
                                "facts": {"nodes": nodes}}))
    return path


def _plan(capsys, *argv: str) -> tuple[int, dict | str, str]:
    code, out, err = cluster_main(capsys, "plan", *argv)
    return code, (json.loads(out) if "--json" in argv and out.strip() else out), err


# ---------------------------------------------------------------- facts


def test_facts_are_the_inventorys_nodes_from_the_latest_run_with_nvlink_and_ib_rate(capsys, tmp_path):
    inv = _inventory(tmp_path, ["rb-01", "rb-02"])
    _run(tmp_path, {"rb-01": {**GPU, "gpu_count": 4}}, "20250101-100000-000000-preflight")
    _run(tmp_path, {"rb-01": GPU, "rb-02": GPU, "elsewhere": GPU})
    code, doc, err = _plan(capsys, "-i", str(inv), "--model", str(CONFIGS / "llama-3.1-405b-instruct.json"),
                           "--json", "--no-validate")
    assert code == 0, err
    assert doc["gpu"]["nodes"] == 2 and doc["gpu"]["gpus_per_node"] == 8
    assert doc["gpu"]["ib_rate_gbps"] == 200          # the slowest Active port, not the Down one
    assert doc["cluster_source"].endswith("20260101-100000-000000-preflight/preflight.json")
    assert doc["placement"]["bundles_per_node"] == {"rb-01": 8, "rb-02": 8}
    assert (doc["tensor_parallel_size"], doc["pipeline_parallel_size"]) == (8, 2)


def test_each_flag_overrides_the_fact_it_names(capsys, tmp_path):
    inv = _inventory(tmp_path, ["rb-01", "rb-02"])
    _run(tmp_path, {"rb-01": GPU, "rb-02": GPU})
    code, doc, err = _plan(capsys, "-i", str(inv), "--model", str(CONFIGS / "llama-3.1-70b-instruct.json"),
                           "--gpu-model", "NVIDIA H200", "--nodes", "1", "--ib-rate-gbps", "800",
                           "--json", "--no-validate")
    assert code == 0, err
    assert doc["gpu"]["model"] == "NVIDIA H200" and doc["gpu"]["memory_gib"] > 130
    assert doc["gpu"]["nodes"] == 1 and doc["gpu"]["gpus_per_node"] == 8   # count: from the run
    assert doc["gpu"]["nvlink"] is True and doc["gpu"]["ib_rate_gbps"] == 800
    assert "--gpu-model" in doc["cluster_source"] and "preflight.json" in doc["cluster_source"]


def test_a_run_without_gpu_facts_is_one_line_naming_the_command_and_the_flags(capsys, tmp_path):
    names = [f"rb-{i:02d}" for i in range(1, 17)]
    inv = _inventory(tmp_path, names)
    _run(tmp_path, {n: {"reachable": False} for n in names})
    code, out, err = _plan(capsys, "-i", str(inv), "--model", str(CONFIGS / "llama-3.1-8b.json"),
                           "--no-validate")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and len(err) < 400, err
    assert "None" not in err and err.count("rb-") <= 8
    assert "unreachable" in err and "16 node(s)" in err
    assert "cluster preflight" in err and "--gpus-per-node" in err
    shutil.rmtree(tmp_path / "runs")                 # no run at all: one line too
    code, _, err = _plan(capsys, "-i", str(inv), "--model", str(CONFIGS / "llama-3.1-8b.json"),
                         "--no-validate")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "cluster preflight" in err and "--gpus-per-node G with --gpu-model NAME" in err


def test_the_planner_reads_a_saved_run_through_one_typed_reading(tmp_path):
    from cluster.planning.planner import ClusterFacts, read_saved_run

    path = _run(tmp_path, {"a": GPU, "b": {"reachable": True, "gpu_count": True},
                           "c": {**GPU, "gpu_memory_mib": -5}})
    saved = {s.node: s for s in read_saved_run(path)}
    assert saved["a"].gpu_count == 8 and saved["a"].nvlink is True and saved["a"].ib_rate_gbps == 200
    assert saved["b"].problem == "gpu_count True" and saved["c"].problem
    facts = ClusterFacts.from_saved_run(tuple(saved.values()), str(path), only=["a", "d"])
    assert [n.node for n in facts.nodes] == ["a"]
    assert facts.skipped == ("not in the run: d (1 node(s))",)


# ---------------------------------------------------------------- the model


def test_no_model_and_a_model_path_not_on_this_machine_say_which_flag(capsys, tmp_path):
    inv = _inventory(tmp_path, ["gpu-01"], model_path="/models/not-on-this-laptop")
    code, _, err = _plan(capsys, "-i", str(inv), "--gpus-per-node", "8", "--gpu-model", "H100",
                         "--no-validate")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--model gpu-01:/models/not-on-this-laptop" in err and "ORG/NAME" in err
    (tmp_path / "b").mkdir()
    inv = _inventory(tmp_path / "b", ["gpu-01"])
    code, _, err = _plan(capsys, "-i", str(inv), "--gpus-per-node", "8", "--gpu-model", "H100",
                         "--no-validate")
    assert code == 2 and "no model: pass --model PATH" in err and "NODE:PATH" in err


def test_model_as_node_colon_path_is_read_on_that_node(capsys, tmp_path):
    model_dir = tmp_path / "on-node" / "Llama-3.1-8B"
    model_dir.mkdir(parents=True)
    shutil.copy(CONFIGS / "llama-3.1-8b.json", model_dir / "config.json")
    inv = _inventory(tmp_path, ["gpu-01"], local=True)
    code, doc, err = _plan(capsys, "-i", str(inv), "--model", f"gpu-01:{model_dir}",
                           "--gpus-per-node", "8", "--gpu-model", "H100", "--json", "--no-validate")
    assert code == 0, err
    assert doc["model"] == str(model_dir) and doc["model_name"] == "Llama-3.1-8B"
    code, _, err = _plan(capsys, "-i", str(inv), "--model", f"gpu-01:{tmp_path}/nothing",
                         "--gpus-per-node", "8", "--gpu-model", "H100", "--no-validate")
    assert code == 2 and "cannot read" in err and len(err.strip().splitlines()) == 1


def _hub_cache(home: Path, repo: str, config: Path) -> None:
    """huggingface_hub's cache layout holding one file of `repo` (what a download leaves)."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    snapshot = root / "snapshots" / sha
    snapshot.mkdir(parents=True)
    shutil.copy(config, snapshot / "config.json")


def _hub_env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CLUSTER_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO),
               XDG_STATE_HOME=str(tmp_path / "state"), **extra)
    return env


def test_model_as_a_hub_repo_id_reads_its_config_only(tmp_path):
    _hub_cache(tmp_path / "hf", "mistralai/Mixtral-8x7B-Instruct-v0.1",
               CONFIGS / "mixtral-8x7b-instruct-v0.1.json")
    got = cluster_cli("plan", "--model", "mistralai/Mixtral-8x7B-Instruct-v0.1", "--gpus-per-node",
                      "8", "--gpu-model", "H100", "--json", "--no-validate", cwd=tmp_path,
                      env=_hub_env(tmp_path, HF_TOKEN="hf_secret_token_123"))
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert doc["model"] == "mistralai/Mixtral-8x7B-Instruct-v0.1"
    assert doc["engine_args"]["model"] == "mistralai/Mixtral-8x7B-Instruct-v0.1"
    assert doc["model_name"] == "Mixtral-8x7B-Instruct-v0.1" and doc["enable_expert_parallel"]


def test_a_hub_repo_the_cache_lacks_or_a_clear_text_endpoint_is_one_line_without_the_token(tmp_path):
    secret = "hf_secret_token_123"
    got = cluster_cli("plan", "--model", "org/missing", "--gpus-per-node", "8", "--gpu-model", "H100",
                      "--no-validate", cwd=tmp_path, env=_hub_env(tmp_path, HF_TOKEN=secret))
    assert got.returncode == 2 and len(got.stderr.strip().splitlines()) == 1, got.stderr
    assert "org/missing" in got.stderr and secret not in got.stderr + got.stdout
    got = cluster_cli("plan", "--model", "org/name", "--gpus-per-node", "8", "--gpu-model", "H100",
                      "--no-validate", cwd=tmp_path,
                      env=_hub_env(tmp_path, HF_TOKEN=secret, HF_ENDPOINT="http://hub.example"))
    assert got.returncode == 2 and "HF_ENDPOINT must be https" in got.stderr
    assert secret not in got.stderr + got.stdout


# ---------------------------------------------------------------- alternatives


def test_deepseek_v3_on_16_by_8_h100_offers_tp8_pp2_beside_wide_ep_with_deepep(capsys):
    code, doc, err = _plan(capsys, "--model", str(CONFIGS / "deepseek-v3.json"), "--nodes", "16",
                           "--gpus-per-node", "8", "--gpu-model", "H100", "--alternatives", "2",
                           "--json", "--no-validate")
    assert code == 0, err
    assert doc["enable_expert_parallel"] and doc["engine_args"]["all2all_backend"].startswith("deepep")
    assert any("NVSHMEM" in t and "stock vLLM wheels" in t for t in doc["tradeoffs"])
    alts = doc["alternatives"]
    assert len(alts) == 2
    first = alts[0]
    assert (first["tensor_parallel_size"], first["pipeline_parallel_size"]) == (8, 2)
    assert not first["enable_expert_parallel"] and first["layout"] == "TP 8 × PP 2"
    assert any("R4 multi-node-tp-pp" in r for r in first["reasons"]) and first["tradeoffs"]
    assert first["node_commands"] and first["node_commands"][1]["node_rank"] == 1


def test_mixtral_offers_tp2_replicas_and_the_text_table_fits_80_columns(capsys):
    code, out, err = _plan(capsys, "--model", str(CONFIGS / "mixtral-8x7b-instruct-v0.1.json"),
                           "--gpus-per-node", "8", "--gpu-model", "H100", "--alternatives", "3",
                           "--no-validate")
    assert code == 0, err
    table = out[out.index("alternatives ("):].splitlines()
    assert all(len(line) <= 80 for line in table), [x for x in table if len(x) > 80]
    rows = [line.split() for line in table[2:6]]
    assert rows[0][0] == "*" and "EP" in table[2]
    tp2 = [r for r in rows if r[1:3] == ["TP", "2"] and "EP" not in r]
    assert tp2 and tp2[0][3:5] == ["2", "4"], rows          # 2 GPUs per replica, 4 replicas
    assert "all-reduce twice per layer" in out
    assert "validation: skipped: --no-validate" in out


def test_alternatives_are_whole_plans_in_the_library():
    from cluster.planning.planner import PlanOptions, plan_alternatives

    info, facts = model_config("mixtral-8x7b-instruct-v0.1"), plan_cluster("1x8-h100")
    chosen = make_plan(info, facts)
    alts = plan_alternatives(info, facts, PlanOptions(), 16)
    layouts = [chosen.layout] + [a.layout for a in alts]
    assert len(set(layouts)) == len(layouts) and alts[0].layout == "TP 2"
    assert all(a.kv_cache_tokens > 0 and a.reasons for a in alts)
    assert plan_alternatives(info, facts, PlanOptions(), 0) == ()


# ---------------------------------------------------------------- per-node vllm serve lines


def _commands(capsys, tmp_path, model: str) -> list[dict]:
    inv = _inventory(tmp_path, ["rb-01", "rb-02"])
    _run(tmp_path, {"rb-01": GPU, "rb-02": GPU})
    code, doc, err = _plan(capsys, "-i", str(inv), "--model", str(CONFIGS / f"{model}.json"),
                           "--json", "--no-validate")
    assert code == 0, err
    return doc["node_commands"]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_a_moe_dp_plan_over_nodes_has_every_per_node_flag(capsys, tmp_path):
    head, further = _commands(capsys, tmp_path, "deepseek-v3")
    assert head["argv"][:3] == ["vllm", "serve", str(CONFIGS / "deepseek-v3.json")]
    for c in (head, further):
        argv = c["argv"]
        assert _flag(argv, "--data-parallel-size") == "16"
        assert _flag(argv, "--data-parallel-size-local") == "8"
        assert _flag(argv, "--data-parallel-address") == "10.2.0.1"     # rb-01's node_ip
        assert _flag(argv, "--data-parallel-rpc-port") == "29550"
    assert "--headless" not in head["argv"] and "--data-parallel-start-rank" not in head["argv"]
    assert "--headless" in further["argv"] and _flag(further["argv"], "--data-parallel-start-rank") == "8"
    assert further["node"] == "rb-02"


def test_a_tp_pp_plan_over_nodes_has_every_per_node_flag(capsys, tmp_path):
    head, further = _commands(capsys, tmp_path, "llama-3.1-405b-instruct")
    for rank, c in enumerate((head, further)):
        argv = c["argv"]
        assert _flag(argv, "--nnodes") == "2" and _flag(argv, "--node-rank") == str(rank)
        assert _flag(argv, "--master-addr") == "10.2.0.1" and _flag(argv, "--master-port") == "29501"
        assert ("--headless" in argv) == (rank == 1)


@needs_vllm
@pytest.mark.parametrize("model", ["deepseek-v3", "llama-3.1-405b-instruct"])
def test_every_node_line_parses_in_vllms_own_serve_parser(capsys, tmp_path, model):
    from vllm import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for c in _commands(capsys, tmp_path, model):
        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
        parser.add_argument("model_tag")
        parser.add_argument("--headless", action="store_true")
        args = parser.parse_args(c["argv"][2:])
        assert args.headless == (c["node_rank"] > 0)


# ---------------------------------------------------------------- validation


@needs_vllm
def test_validation_says_how_long_it_took_and_lets_nothing_through(capfd):
    from cluster.planning.planner import validate_quietly

    plan = make_plan(model_config("llama-3.1-70b-instruct"), plan_cluster("1x8-h100"))
    check = validate_quietly(plan.engine_args)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert check.status == "ok" and check.seconds is not None and check.seconds > 0
    assert check.line().startswith("validation: ok in ") and " s: vLLM " in check.line()
