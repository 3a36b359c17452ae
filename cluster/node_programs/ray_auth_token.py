"""On the head: the Ray auth token (token authentication), found as Ray finds it, printed as
one JSON document {"token": str or null, "source": where or null, "error": str or null}.

    ray_auth_token.py [--path FILE]    FILE: the RAY_AUTH_TOKEN_PATH the head's Ray was given

Order (Ray's AuthenticationTokenLoader): $RAY_AUTH_TOKEN, the file $RAY_AUTH_TOKEN_PATH
(--path first), ~/.ray/auth_token; when none has one, the environment of the running
gcs_server / raylet (the env that Ray was started with). Read-only; files are read up to 64 KiB.
The token goes to stdout only (the caller reads it into memory); an error never quotes a file.
"""

import json
import os
import sys

from cluster.node_programs._common import RAY_DAEMONS, pids_named, process_env, token_and_source


def find(path_arg, proc="/proc"):
    """(token, source): the login environment's (with --path), else a running Ray daemon's."""
    token, source = token_and_source(os.environ, "login", path_arg)
    if token:
        return token, source
    for pid in pids_named(RAY_DAEMONS, proc):
        env = process_env(pid, proc)
        if env is None:
            continue
        # the daemon's own variables or token file, never this login's ~/.ray
        token, source = token_and_source(dict(env, HOME="/nonexistent"), "ray process %s" % pid)
        if token:
            return token, source
    return None, None


def main(argv):
    path_arg = argv[argv.index("--path") + 1] if "--path" in argv[:-1] else None
    out = {"token": None, "source": None, "error": None}
    try:
        out["token"], out["source"] = find(path_arg)
    except (OSError, ValueError) as exc:
        out["error"] = "%s: %s" % (type(exc).__name__, getattr(exc, "strerror", None) or exc)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
