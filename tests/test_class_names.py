"""One meaning per class name (issue 43 item 3): the names that had two meanings in cluster/ and
playbooks/ (the planner's deployment Plan and `up`/`down`'s Ray plan; checks/base.py's
NodeCheck and deploy's own NodeCheck/Checks) are each defined once."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_MEANING = {"Plan": "cluster/planning/planner.py",
               "NodeCheck": "cluster/inspection/checks/base.py",
               "Checks": None}


def class_definitions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for folder in ("cluster", "playbooks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    found[node.name].append(str(path.relative_to(ROOT)))
    return found


def test_each_of_these_class_names_has_one_meaning():
    found = class_definitions()
    assert {name: found.get(name, []) for name in ONE_MEANING} == \
        {name: [where] if where else [] for name, where in ONE_MEANING.items()}


def test_the_scan_sees_every_class():
    found = class_definitions()
    assert found["RayActionPlan"] == ["cluster/ray/ray_cluster.py"]
    assert found["DeployReadiness"] == ["cluster/serving/deploy.py"]
