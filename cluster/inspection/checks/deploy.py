"""Deploy's node checks, checks of the one framework (checks/base.py): the model directory on a
node that may host a bundle and, for an endpoint with a key, the key's variable in the raylet's
environment (its state only, never its value). `cluster deploy` runs them through the facts
layer's one round trip per node (cluster/serving/deploy.py check_nodes)."""

from __future__ import annotations

from cluster.inspection.checks.base import NodeCheck, NodeContext, Verdict, error, fail, ok
from cluster.inspection.facts import MODEL_DIR, directory_probe, node_program_asking

MODEL_FILES = "model-files"
API_KEY = "api-key"


def _incomplete(ctx: NodeContext) -> Verdict | None:
    if ctx.facts.error:
        return error(f"check failed: {ctx.facts.error[:200]}")
    return None


def evaluate_model_files(ctx: NodeContext) -> Verdict:
    """data: where the path leads: `model` (config.json there), `dir` (without it), `none`."""
    problem = _incomplete(ctx)
    if problem:
        return problem
    out = ctx.output(MODEL_DIR)
    where = ctx.reading(MODEL_DIR)
    if where is None:
        detail = (out.stderr or out.stdout).strip()[:200]
        return error(f"check failed: model directory probe: {detail}", probe=MODEL_DIR.name)
    if where == "model":
        return ok("config.json present", data=where, probe=MODEL_DIR.name)
    return fail("no config.json in the directory" if where == "dir" else "no directory",
                data=where, probe=MODEL_DIR.name)


def api_key_check(variable: str) -> NodeCheck:
    """Is `variable` set in the raylet's env (Ray workers inherit it)? data: set | empty |
    unset | no-raylet."""
    def evaluate(ctx: NodeContext) -> Verdict:
        problem = _incomplete(ctx)
        if problem:
            return problem
        raylet = ctx.facts.raylet
        state = "no-raylet" if raylet is None else raylet.key_states.get(variable, "unset")
        if state == "set":
            return ok(f"${variable} set in the raylet's environment", data=state)
        return fail(f"${variable}: {state} in the raylet's environment", data=state)

    return NodeCheck(API_KEY, f"${variable} in the Ray environment",
                     (node_program_asking((variable,)),), evaluate)


def deploy_checks(model: str, api_key_env: str | None) -> tuple[NodeCheck, ...]:
    """The model directory check, and the API-key check when the endpoint has a key."""
    model_files = NodeCheck(MODEL_FILES, f"model files at {model}", (directory_probe(model),),
                            evaluate_model_files)
    return (model_files, api_key_check(api_key_env)) if api_key_env else (model_files,)
