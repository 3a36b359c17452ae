"""On a node, before `cluster deploy`: is the model there, and does the node's Ray carry the
API-key variable? Prints one JSON document:

    deploy_check MODEL_DIR [KEY_NAME]
    {"model": bool (MODEL_DIR/config.json is a file), "model_dir": bool,
     "key": null (no KEY_NAME) | "set" | "empty" | "unset" | "no-raylet"}

The key is looked up in the environment of the node's raylet (Ray workers inherit it); only
whether it is set is printed, never its value. Read-only. Stdlib only, Python 3.8+.
"""

import json
import os
import sys

from cluster.node_programs._common import pids_named, process_env


def key_state(key, proc="/proc"):
    """set | empty | unset in the first readable raylet's environment; no-raylet without one."""
    for pid in pids_named(("raylet",), proc):
        env = process_env(pid, proc)
        if env is not None:
            return "set" if env.get(key) else ("empty" if key in env else "unset")
    return "no-raylet"


def main(argv, proc="/proc"):
    model = argv[0]
    key = argv[1] if len(argv) > 1 else ""
    return {"model": os.path.isfile(os.path.join(model, "config.json")),
            "model_dir": os.path.isdir(model), "key": key_state(key, proc) if key else None}


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1:])) + "\n")
