"""On the head: the Ray auth token (token authentication), found as Ray finds it, printed as
one JSON document {"token": str or null, "source": where or null, "error": str or null}.

    ray_auth_token.py [--path FILE]    FILE: the RAY_AUTH_TOKEN_PATH the head's Ray was given

Order: $RAY_AUTH_TOKEN, the file $RAY_AUTH_TOKEN_PATH (--path first), then the environment of
the running gcs_server / raylet (the env that Ray was started with: the inventory's token
reaches `ray start` on its stdin), then ~/.ray/auth_token (a default file the running Ray did
not read must not win over the token it was started with). Read-only; files are read up to 64 KiB.
The token goes to stdout only (the caller reads it into memory); an error never quotes a file.
"""

import json
import os
import sys

from cluster.node_programs._common import find_token


def find(path_arg, proc="/proc"):
    """(token, source): the login environment's RAY_AUTH_TOKEN or token path (--path first),
    else a running Ray daemon's, else ~/.ray/auth_token (find_token)."""
    return find_token(os.environ, path_arg, scan_ray=True, label="login", proc=proc)


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
