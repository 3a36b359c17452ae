"""The README stays true (issue 41 item 2): its main path, the `$ cluster ...` lines of its
```console blocks (tests/fakes.py readme_commands), runs as written, in order, on a simulated
two-node CPU cluster whose nodes lack a memlock limit (the simcluster `cpu` profile), each
command ending with the exit code the README writes after it (`# exit N`, else 0).

The commands run in a folder holding the cluster's inventory as `cluster.yaml` (the README's
commands name none: `./cluster.yaml` is the CLI's default), with `CLUSTER_API_KEY` set as the
README's inventory and bench line expect. Only the words of README_TO_SIMULATED change, whole
argv words or their parts: the model path (the tiny test model at the same path on every node)
and the head's address in the bench URL. Anything else in a README command (a subcommand, a
flag, a value) runs as written, so a rename fails here. Ray and the app are stopped at the end.
About 4 minutes on the 2-core test machine (3:39: preflight, fix, up, a 15 s plan, a ~100 s
deploy, a 16-request bench).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from fakes import README, REPO, cluster_cli, readme_commands
from integration_kit import ClusterCli, derive_inventory, node_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.vllm]

KEY = "sk-readme-3f81c0"            # a test-only key, in the nodes' env as the README's inventory puts it
PROFILES = {"node1": "cpu", "node2": "cpu"}
README_MODEL = "/models/Qwen2.5-0.5B-Instruct"
README_HEAD = "10.0.0.1"

cli = ClusterCli(timeout=1200, env={"CLUSTER_API_KEY": KEY})


@pytest.fixture(scope="module")
def workdir(simcluster_factory, tiny_model_builder, tmp_path_factory) -> tuple[Path, Path]:
    """(the folder the README's commands run in, the tiny model's path on the nodes): the
    folder's cluster.yaml is the two simulated nodes' inventory with the API key in every
    node's env; Ray is stopped afterwards, the app's engines with it."""
    model = node_tiny_model(tiny_model_builder, "dense", needs=("vllm", "openai"))
    sim = simcluster_factory(2, PROFILES)
    folder = tmp_path_factory.mktemp("readme")
    derive_inventory(sim, folder, ray={"memory": 4 * 1024 ** 3},
                     every_node={"env": {"CLUSTER_API_KEY": KEY}})
    yield folder, model
    # `down` stops Ray and the app's engines with it (test_gang_e2e checks no vLLM process is
    # left); an `undeploy` first cost ~50 s of the engine modules' worker
    cli(folder / "cluster.yaml", "down", "--yes", timeout=300)


def readme_to_simulated(model: Path, folder: Path) -> dict[str, str]:
    """README_TO_SIMULATED: the README's words -> this cluster's (the only substitutions)."""
    head = yaml.safe_load((folder / "cluster.yaml").read_text())["nodes"][0]["address"]
    return {README_MODEL: str(model), README_HEAD: head}


def as_simulated(argv: tuple[str, ...], mapping: dict[str, str]) -> list[str]:
    out = []
    for word in argv:
        for readme, simulated in mapping.items():
            word = word.replace(readme, simulated)
        out.append(word)
    return out


def test_the_readme_main_path_runs_as_written(workdir):
    folder, model = workdir
    commands = readme_commands(README.read_text())
    assert commands, "no `$ cluster` line in a ```console block of README.md"
    mapping = readme_to_simulated(model, folder)
    assert all(any(r in " ".join(c.argv) for c in commands) for r in mapping), \
        "a README_TO_SIMULATED word is not in the README: the mapping is stale"
    for command in commands:
        argv = as_simulated(command.argv, mapping)
        p = run_in(folder, argv)
        assert p.returncode == command.exit_code, (
            f"README: {command.line}\nran: cluster {' '.join(argv)}\nexit {p.returncode}, "
            f"the README says {command.exit_code}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def run_in(workdir: Path, argv: list[str]):
    """`cluster ARGV...` from the work folder (its ./cluster.yaml, no -i), as an admin types
    it; this checkout's toolkit first on the path (the folder is outside it)."""
    env = {k: v for k, v in os.environ.items() if k != "CLUSTER_INVENTORY"}
    env.update(CLUSTER_API_KEY=KEY,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    return cluster_cli(*argv, cwd=workdir, timeout=1200, env=env)
