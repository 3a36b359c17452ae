"""Where `cluster plan --model` reads the model's config.json from: a path on this machine,
`NODE:PATH` (a path on an inventory node, read over the session by the command), or a Hugging
Face repo id `ORG/NAME` (its config.json only, through huggingface_hub).

    model_source("./llama-70b", nodes)        -> ModelSource("local", "./llama-70b")
    model_source("gpu-01:/models/llama", ...) -> ModelSource("node", "/models/llama", "gpu-01")
    model_source("deepseek-ai/DeepSeek-V3")   -> ModelSource("hub", "deepseek-ai/DeepSeek-V3")

The hub's token is the environment's HF_TOKEN (never argv, never in a message: scrubbed), its
endpoint HF_ENDPOINT, which must be https (http only to a loopback address and only with
--allow-http-endpoint: the relay's rule, cluster/node_programs/hf_pull.py endpoint_problem).
Every config.json is read bounded (limits.yaml files.config_json).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Sequence

from cluster.base.bounds import bound
from cluster.base.errors import PlanError, UsageError
from cluster.base.textsafe import safe_line
from cluster.planning.modelinfo import ModelInfo, loads_json, model_info_from_config, read_json_file

REPO_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}\Z")
MODEL_FORMS = ("--model PATH (a model directory or config.json on this machine), "
               "--model NODE:PATH (read on that inventory node) or --model ORG/NAME "
               "(a Hugging Face repo id)")


@dataclass(frozen=True)
class ModelSource:
    """kind local | node | hub; `where` the path or repo id; `node` for kind node."""

    kind: str
    where: str
    node: str | None = None

    def config_path(self) -> str:
        """The config.json path on the node (kind node): PATH itself when it names a .json."""
        path = PurePosixPath(self.where)
        return str(path if path.suffix == ".json" else path / "config.json")


def model_source(spec: str, nodes: Sequence[str] = ()) -> ModelSource:
    """What --model names (UsageError in one line when it names nothing)."""
    if Path(spec).expanduser().exists():
        return ModelSource("local", spec)
    text = safe_line(spec, limit=4096)
    node, sep, path = spec.partition(":")
    if sep and node in nodes:
        if not path.startswith("/"):
            raise UsageError(f"--model {text}: the path on {node} must be absolute")
        return ModelSource("node", path, node)
    if REPO_ID_RE.match(spec) and not spec.startswith("."):
        return ModelSource("hub", spec)
    hint = (f"; NODE is one of the inventory's nodes ({', '.join(list(nodes)[:4])}"
            f"{', ...' if len(nodes) > 4 else ''})" if sep and nodes else "")
    raise UsageError(f"--model {text}: no such path on this machine, and not NODE:PATH or "
                     f"ORG/NAME; pass {MODEL_FORMS}{hint}")


def info_from_text(text: str, source: ModelSource) -> ModelInfo:
    """ModelInfo of a config.json's text read on a node (bounded by the caller's read)."""
    limit = bound("files", "config_json")
    where = f"{source.node}:{source.config_path()}"
    if len(text.encode("utf-8", "surrogateescape")) > limit:
        raise PlanError(f"{where}: config.json is larger than {limit:,} bytes: refused")
    config = loads_json(text, f"{where}: config.json")
    name = PurePosixPath(source.where).name if not source.where.endswith(".json") \
        else PurePosixPath(source.where).parent.name
    try:
        return model_info_from_config(config, name=name or "model", path=source.where)
    except PlanError as exc:
        raise PlanError(f"{where}: {exc}") from None


def hub_info(repo: str, *, allow_http: bool = False) -> ModelInfo:
    """ModelInfo of a hub repo's config.json (downloaded into huggingface_hub's cache, nothing
    else of the repo). UsageError/PlanError in one line, the token scrubbed from it."""
    from cluster.node_programs.hf_pull import endpoint_problem, scrub

    token = os.environ.get("HF_TOKEN") or None
    endpoint = os.environ.get("HF_ENDPOINT") or None
    problem = endpoint and endpoint_problem(endpoint, allow_http)
    if problem:
        raise UsageError(problem)
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise UsageError(f"--model {repo}: reading a hub repo needs huggingface_hub on this "
                         "machine (pip install huggingface_hub)") from None
    limit = bound("files", "config_json")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ahead = hf_hub_download(repo, "config.json", token=token, endpoint=endpoint,
                                    dry_run=True)
            size = getattr(ahead, "file_size", None)
            if size is not None and size > limit:
                raise PlanError(f"{repo}: config.json is {size:,} bytes, larger than {limit:,}: "
                                "refused")
            path = hf_hub_download(repo, "config.json", token=token, endpoint=endpoint)
    except PlanError:
        raise
    except Exception as exc:  # noqa: BLE001 - the library's errors are many: one line each
        raise PlanError(safe_line(scrub(f"--model {repo}: config.json from the hub: "
                                        f"{type(exc).__name__}: {exc}", token), limit=400)) from None
    config = read_json_file(Path(path), f"{repo} config.json", max_bytes=limit)
    try:
        return model_info_from_config(config, name=repo.split("/")[-1], path=repo)
    except PlanError as exc:
        raise PlanError(f"{repo} config.json: {exc}") from None
