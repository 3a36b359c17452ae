"""On one node (the head): download a Hugging Face repo into a directory with huggingface_hub's
snapshot_download, for `cluster model pull ORG/NAME`; prints {"dir", "files", "bytes"} or
{"error"}.

Input on stdin after the program (a JSON document, never argv): {"repo", "revision", "dir",
"allow", "ignore", "endpoint", "allow_http", "token"}. The token (the head's HF_TOKEN from the
inventory) goes to huggingface_hub as its `token` argument only: not into the environment of
anything else, not into the output (scrubbed from error text before it is cut). The endpoint
(the inventory's HF_ENDPOINT, else the hub) must be https; http only to a loopback address
and only with "allow_http" (`--allow-http-endpoint`): the token is a Bearer header. Uses the
node's own huggingface_hub (the inventory's python), so it never runs as root: it runs as the
SSH user (playbooks/model_pull.py; program_call refuses a root wrap for a program with
NODE_IMPORTS).
"""

import ipaddress
import json
import os
import sys
from urllib.parse import urlsplit

from cluster.node_programs._common import answer

NODE_IMPORTS = ("huggingface_hub",)     # the node's own install, imported inside main only
MAX_INPUT = 1 << 20
MAX_FILES = 100000
ERROR_CHARS = 400
HUB = "https://huggingface.co"


def scrub(text, token):
    """text without the token, then cut (a cut first could leave a prefix of it); a text cut
    before it came here that ends in the token's first 4+ characters loses them too."""
    if not token:
        return text[:ERROR_CHARS]
    text = text.replace(token, "[secret]")[:ERROR_CHARS]
    for k in range(len(token) - 1, 3, -1):
        if text.endswith(token[:k]):
            return text[:-k] + "[secret]"
    return text


def is_loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def endpoint_problem(url, allow_http):
    """Why the token must not go to `url` (None when it may): https, or http to a loopback
    address with allow_http; no user:password in the URL."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return "HF_ENDPOINT is not a URL"
    if not host or parts.username is not None or parts.password is not None:
        return "HF_ENDPOINT must be https://HOST[:PORT][/PATH] (no user:password in it)"
    if parts.scheme == "https":
        return None
    if parts.scheme == "http" and allow_http and is_loopback(host):
        return None
    if parts.scheme == "http" and is_loopback(host):
        return "HF_ENDPOINT is http: allowed to a loopback address only with " \
               "--allow-http-endpoint (the token would travel in clear)"
    return "HF_ENDPOINT must be https (http sends the token in clear; http only to a " \
           "loopback address, with --allow-http-endpoint)"


def main(stdin):
    doc = json.loads(stdin.read(MAX_INPUT))
    token = doc.get("token") or None
    endpoint = doc.get("endpoint") or HUB
    problem = endpoint_problem(endpoint, doc.get("allow_http") is True)
    if problem:
        return {"error": problem}
    try:
        os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        os.environ["HF_ENDPOINT"] = endpoint      # the library's own default follows it too
        from huggingface_hub import snapshot_download

        path = snapshot_download(doc["repo"], revision=doc.get("revision"),
                                 local_dir=doc["dir"], allow_patterns=doc.get("allow") or None,
                                 ignore_patterns=doc.get("ignore") or None, token=token,
                                 endpoint=endpoint)
    except ImportError:
        return {"error": "huggingface_hub is not installed for this python"}
    except Exception as exc:            # the library's errors are many; one line with the kind
        return {"error": scrub("%s: %s" % (type(exc).__name__, exc), token),
                "denied": isinstance(exc, PermissionError)}
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
