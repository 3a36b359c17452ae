"""On one node (the head): download a Hugging Face repo into a directory with huggingface_hub's
snapshot_download, for `cluster model pull ORG/NAME`; prints {"dir", "files", "bytes"} or
{"error"}.

Input on stdin after the program (a JSON document, never argv): {"repo", "revision", "dir",
"allow", "ignore", "endpoint", "token"}. The token (the head's HF_TOKEN from the inventory) goes
to huggingface_hub as its `token` argument only: not into the environment of anything else, not
into the output. HF_ENDPOINT (the inventory's, given as "endpoint") selects a mirror or a local
hub. Uses the node's own huggingface_hub (the inventory's python).
"""

import json
import os
import sys

from cluster.node_programs._common import answer

NODE_IMPORTS = ("huggingface_hub",)     # the node's own install, imported inside main only
MAX_INPUT = 1 << 20
MAX_FILES = 100000


def scrub(text, token):
    return text.replace(token, "[secret]") if token else text


def main(stdin):
    doc = json.loads(stdin.read(MAX_INPUT))
    token = doc.get("token") or None
    try:
        os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        from huggingface_hub import snapshot_download

        path = snapshot_download(doc["repo"], revision=doc.get("revision"),
                                 local_dir=doc["dir"], allow_patterns=doc.get("allow") or None,
                                 ignore_patterns=doc.get("ignore") or None, token=token,
                                 endpoint=doc.get("endpoint") or None)
    except ImportError:
        return {"error": "huggingface_hub is not installed for this python"}
    except Exception as exc:            # the library's errors are many; one line with the kind
        return {"error": scrub("%s: %s" % (type(exc).__name__, str(exc)[:400]), token)}
    count, size = 0, 0
    for top, _dirs, names in os.walk(path):
        for name in names:
            count += 1
            size += os.path.getsize(os.path.join(top, name))
            if count > MAX_FILES:
                break
    return {"dir": path, "files": count, "bytes": size}


if __name__ == "__main__":
    answer(main, sys.stdin)      # the hub client's progress output goes to stderr
