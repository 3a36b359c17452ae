"""Plan files for `cluster deploy`: real plans load; malformed ones (a fuzz-style corpus of 40+
broken files) give one PlanFileError naming file:line and key, and through the CLI exit 2 with
one line on stderr and no traceback."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import yaml

from cluster.base.errors import UsageError
from cluster.planning.plan_file import KNOWN_KEYS, PlanFileError, load_plan, parse_plan
from fakes import cluster_cli, real_plan, write_inventory

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "model_configs"


BASE = real_plan("llama-3.1-70b-instruct")


# ---------------------------------------------------------------- good plans


def test_every_key_the_planner_writes_is_known():
    for model, nodes in (("llama-3.1-70b-instruct", 1), ("deepseek-v3", 2),
                         ("llama-3.1-405b-instruct", 2)):
        doc = real_plan(model, nodes=nodes, tokens_per_s_per_gpu=1000)
        assert set(doc) <= KNOWN_KEYS, set(doc) - KNOWN_KEYS


def test_dense_plan_loads_with_its_layout():
    plan = parse_plan(yaml.safe_dump(BASE, sort_keys=False), "plan.yaml")
    assert plan.model == "/models/llama-3.1-70b-instruct"
    assert plan.served_model_name == BASE["served_model_name"]
    assert (plan.tensor_parallel_size, plan.pipeline_parallel_size) == (4, 1)
    assert plan.replicas == 2 and not plan.enable_expert_parallel
    assert plan.placement_strategy == "STRICT_PACK"
    assert plan.engine_args["max_model_len"] == BASE["max_model_len"]


def test_moe_plan_loads_with_dp_and_ep():
    plan = parse_plan(yaml.safe_dump(real_plan("deepseek-v3", nodes=2)), "moe.yaml")
    assert plan.enable_expert_parallel and plan.data_parallel_size == 16
    assert plan.engine_args["data_parallel_size"] == 16


def test_plan_from_a_bare_config_json_names_the_directory(tmp_path):
    doc = copy.deepcopy(BASE)
    doc["model"] = doc["engine_args"]["model"] = "/models/llama/config.json"
    del doc["served_model_name"], doc["engine_args"]["served_model_name"]
    assert parse_plan(yaml.safe_dump(doc), "p.yaml").served_model_name == "llama"


def test_load_plan_reads_a_file_written_by_cluster_plan(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(BASE, sort_keys=False, allow_unicode=True))
    assert load_plan(path).path == str(path)


# ---------------------------------------------------------------- malformed plans


def _with(path: tuple, value) -> str:
    doc = copy.deepcopy(BASE)
    cur = doc
    for key in path[:-1]:
        cur = cur[key]
    if value is _DELETE:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return yaml.safe_dump(doc, sort_keys=False)


_DELETE = object()

# (case id, file text, the key the error must name, or None when only path:line is required)
MALFORMED = [
    ("empty", "", None),
    ("only-comment", "# nothing here\n", None),
    ("yaml-syntax", "model: /m\ntensor_parallel_size: [1, 2\n", None),
    ("yaml-tab-indent", "model: /m\nengine_args:\n\tdtype: bf16\n", None),
    ("bad-timestamp", "model: /m\nreasons: 2024-13-45 99:99:99\n", None),
    ("a-list", "- model: /m\n", "(document)"),
    ("a-scalar", "just a string\n", "(document)"),
    ("duplicate-key", "model: /m\nreplicas: 1\nreplicas: 2\n", "replicas"),
    ("non-string-key", "model: /m\n1: 2\n", "1"),
    ("unknown-key-typo", _with(("tensor_paralel_size",), 2), "tensor_paralel_size"),
    ("unknown-key", _with(("deploy_now",), True), "deploy_now"),
    ("model-missing", _with(("model",), _DELETE), "model"),
    ("model-null", _with(("model",), None), "model"),
    ("model-list", _with(("model",), ["/m"]), "model"),
    ("model-shell", _with(("model",), "/models/x; rm -rf /"), "model"),
    ("model-subst", _with(("model",), "$(reboot)"), "model"),
    ("served-empty", _with(("served_model_name",), ""), "served_model_name"),
    ("served-space", _with(("served_model_name",), "my model"), "served_model_name"),
    ("served-number", _with(("served_model_name",), 7), "served_model_name"),
    ("tp-zero", _with(("tensor_parallel_size",), 0), "tensor_parallel_size"),
    ("tp-negative", _with(("tensor_parallel_size",), -2), "tensor_parallel_size"),
    ("tp-string", _with(("tensor_parallel_size",), "four"), "tensor_parallel_size"),
    ("tp-float", _with(("tensor_parallel_size",), 2.5), "tensor_parallel_size"),
    ("tp-bool", _with(("tensor_parallel_size",), True), "tensor_parallel_size"),
    ("tp-huge", _with(("tensor_parallel_size",), 10 ** 30), "tensor_parallel_size"),
    ("pp-list", _with(("pipeline_parallel_size",), [2]), "pipeline_parallel_size"),
    ("dp-zero", _with(("data_parallel_size",), 0), "data_parallel_size"),
    ("replicas-string", _with(("replicas",), "2"), "replicas"),
    ("ep-string", _with(("enable_expert_parallel",), "yes"), "enable_expert_parallel"),
    ("max-len-tiny", _with(("max_model_len",), 3), "max_model_len"),
    ("max-len-string", _with(("max_model_len",), "8k"), "max_model_len"),
    ("engine-args-list", _with(("engine_args",), ["--tp", "4"]), "engine_args"),
    ("engine-args-string", _with(("engine_args",), "tp=4"), "engine_args"),
    ("engine-arg-dashes", _with(("engine_args", "max-num-seqs"), 8), "engine_args.max-num-seqs"),
    ("engine-arg-api-key", _with(("engine_args", "api_key"), "sk-123"), "engine_args.api_key"),
    ("engine-arg-hf-token", _with(("engine_args", "hf_token"), "hf_x"), "engine_args.hf_token"),
    ("engine-tp-disagrees", _with(("engine_args", "tensor_parallel_size"), 8),
     "engine_args.tensor_parallel_size"),
    ("engine-model-disagrees", _with(("engine_args", "model"), "/other"), "engine_args.model"),
    ("engine-dense-dp", _with(("engine_args", "data_parallel_size"), 2),
     "engine_args.data_parallel_size"),
    ("engine-util-too-big", _with(("engine_args", "gpu_memory_utilization"), 1.5),
     "engine_args.gpu_memory_utilization"),
    ("engine-seqs-zero", _with(("engine_args", "max_num_seqs"), 0), "engine_args.max_num_seqs"),
    ("engine-value-object", "model: /m\nengine_args:\n  dtype: !!python/object:os.system {}\n",
     None),
    ("placement-list", _with(("placement",), ["PACK"]), "placement"),
    ("placement-strategy", _with(("placement", "strategy"), "PACKED"), "placement.strategy"),
    ("placement-bundle-neg", _with(("placement", "bundle"), {"GPU": -1}), "placement.bundle.GPU"),
    ("validation-invalid", _with(("validation",), {"status": "invalid", "detail": "bad dtype"}),
     "validation.status"),
    ("validation-string", _with(("validation",), "ok"), "validation"),
]


@pytest.mark.parametrize("case, text, key", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_plan_gives_one_clear_error(tmp_path, case, text, key):
    path = tmp_path / f"{case}.yaml"
    path.write_text(text)
    with pytest.raises(PlanFileError) as err:
        load_plan(path)
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path}:"), message
    if case not in ("bad-timestamp",):
        assert err.value.line is not None, message
        assert message.startswith(f"{path}:{err.value.line}: "), message
    if key is not None:
        assert err.value.key == key, message
    assert isinstance(err.value, UsageError)


def test_corpus_is_large_enough():
    assert len(MALFORMED) >= 25


@pytest.mark.parametrize("content, why", [
    (b"\xff\xfe\x00m\x00o", "not UTF-8"),
    (b"model: /m\x00\n", "NUL"),
])
def test_binary_files_are_refused_with_a_line(tmp_path, content, why):
    path = tmp_path / "plan.yaml"
    path.write_bytes(content)
    with pytest.raises(PlanFileError, match=why):
        load_plan(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(PlanFileError, match="cannot read"):
        load_plan(tmp_path / "nope.yaml")
    with pytest.raises(PlanFileError, match="directory"):
        load_plan(tmp_path)


def test_random_mutations_load_or_raise_plan_file_error():
    """Random damage to a good plan: it loads, or raises PlanFileError; never anything else."""
    rng = random.Random(7)
    good = yaml.safe_dump(BASE, sort_keys=False)
    lines = good.splitlines()
    junk = ["", "{", "]", ":", "- x", "  bad: [", "tensor_parallel_size: -1", "model: 5",
            "\t", "&a", "*a", "replicas: 1e9", "engine_args: 3", "? x"]
    for _ in range(300):
        mutated = list(lines)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(mutated))
            op = rng.choice(("drop", "junk", "dup", "cut"))
            if op == "drop":
                mutated.pop(i)
            elif op == "junk":
                mutated[i] = rng.choice(junk)
            elif op == "dup":
                mutated.insert(i, mutated[i])
            else:
                mutated[i] = mutated[i][: rng.randrange(len(mutated[i]) + 1)]
        try:
            parse_plan("\n".join(mutated) + "\n", "mutant.yaml")
        except PlanFileError as exc:
            assert "\n" not in str(exc) and str(exc).startswith("mutant.yaml")


@pytest.mark.parametrize("case", ["yaml-syntax", "tp-string", "model-shell", "engine-arg-api-key",
                                  "a-list"])
def test_cli_exits_2_with_one_line_and_no_traceback(tmp_path, case):
    text = next(t for c, t, _ in MALFORMED if c == case)
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    inventory = write_inventory(tmp_path, "nodes:\n  - {name: h, address: 127.0.0.1, local: true}\n"
                                          f"run_dir: {tmp_path / 'runs'}\n")
    p = cluster_cli("-i", str(inventory), "deploy", "--plan", str(plan), "--yes")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"cluster deploy: {plan}:"), p.stderr
    assert not (tmp_path / "runs").exists(), "a bad plan must fail before any run starts"


# ---------------------------------------------------------------- sizes that disagree (issue 41)


def _edited(edits: dict) -> str:
    """BASE (TP 4, 2 replicas, 4 GPUs each) with `edits` ({"a.b": value}) applied, as YAML."""
    doc = copy.deepcopy(BASE)
    for dotted, value in edits.items():
        *parents, last = dotted.split(".")
        cur = doc
        for key in parents:
            cur = cur[key]
        cur[last] = value
    return yaml.safe_dump(doc, sort_keys=False)


SIZE_CASES = [
    # the case: TP edited to 3 (top and engine_args), the plan still says 4 GPUs
    ("tp3-of-4", {"tensor_parallel_size": 3, "engine_args.tensor_parallel_size": 3},
     "gpus_per_replica", ["4", "tensor_parallel_size 3", "pipeline_parallel_size 1", "= 3"]),
    ("placement-gpus", {"placement.gpus_per_replica": 8}, "placement.gpus_per_replica",
     ["8", "tensor_parallel_size 4", "= 4"]),
    ("gpus-used", {"gpus_used": 4}, "gpus_used", ["4", "replicas 2", "= 8"]),
    ("placement-replicas", {"placement.replicas": 3}, "placement.replicas", ["3", "replicas: 2"]),
    ("dense-dp", {"data_parallel_size": 3}, "data_parallel_size", ["3", "replicas 2"]),
    ("dense-ep-size", {"expert_parallel_size": 4}, "expert_parallel_size",
     ["4", "enable_expert_parallel is false"]),
    ("gang-nnodes", {"placement.gang": {"nnodes": 3}}, "placement.gang.nnodes",
     ["3", "tensor_parallel_size 4", "do not split evenly"]),
]


@pytest.mark.parametrize("case, edits, key, words", SIZE_CASES, ids=[c[0] for c in SIZE_CASES])
def test_a_plan_whose_sizes_disagree_is_refused_naming_the_fields(case, edits, key, words):
    with pytest.raises(PlanFileError) as err:
        parse_plan(_edited(edits), "plan.yaml")
    message = str(err.value)
    assert err.value.key == key and err.value.line is not None, message
    assert "\n" not in message and all(w in message for w in words), message


def test_moe_plan_sizes_agree_and_a_wrong_ep_size_is_refused():
    doc = real_plan("deepseek-v3", nodes=2)
    assert parse_plan(yaml.safe_dump(doc), "moe.yaml").data_parallel_size == 16
    doc["expert_parallel_size"] = 8
    with pytest.raises(PlanFileError, match="8 disagrees with tensor_parallel_size 1 x "
                                            "data_parallel_size 16 = 16") as err:
        parse_plan(yaml.safe_dump(doc), "moe.yaml")
    assert err.value.key == "expert_parallel_size"


def test_cli_refuses_a_tp3_plan_of_4_gpus_before_any_node_is_contacted(tmp_path):
    """The hand-edited plan of issue 41: exit 2, one line naming the fields, no run started
    (the inventory's node is a closed port: nothing would answer anyway)."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(_edited({"tensor_parallel_size": 3, "engine_args.tensor_parallel_size": 3}))
    inventory = write_inventory(tmp_path, "nodes:\n  - {name: h, address: 127.0.0.1, port: 1}\n"
                                          f"run_dir: {tmp_path / 'runs'}\n")
    for extra in ((), ("--dry-run",)):
        p = cluster_cli("-i", str(inventory), "deploy", "--plan", str(plan), "--yes", *extra)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "gpus_per_replica: 4 disagrees with tensor_parallel_size 3" \
            in lines[0], p.stderr
        assert not (tmp_path / "runs").exists(), "refused before any run (and any node)"


# ---------------------------------------------------------------- Hypothesis (issue 17)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PLAN_TEXT = yaml.safe_dump(BASE, sort_keys=False)
_RAW = st.sampled_from(["2020-01-01", "2020-13-45", ".nan", ".inf", "yes", "~", "!!binary a",
                        "!!binary aGk=", "0x10", "022", "22:00", "&a [1]", "*a", "*nope",
                        "!!python/object:os.system ls", "[" * 80, "\x1b", "1.0e+400", "-7"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_PLAN_TEXT)), st.integers(0, 4),
                          st.one_of(_RAW, st.text(max_size=3))), min_size=1, max_size=4))
def test_hypothesis_mutated_real_plan_loads_or_raises_plan_file_error(edits):
    text = _PLAN_TEXT
    for pos, cut, insert in edits:
        pos = min(pos, len(text))
        text = text[:pos] + insert + text[pos + cut:]
    try:
        plan = parse_plan(text, "fuzz.yaml")
    except PlanFileError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("fuzz.yaml"), str(exc)
        return
    assert 1 <= plan.tensor_parallel_size <= 4096 and 1 <= plan.replicas <= 4096
