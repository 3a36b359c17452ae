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

MAX_BYTES = 64 << 10
TOKEN, TOKEN_PATH = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"


def read_file(path):
    """The file's stripped text, None when it does not exist."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as fh:
        data = fh.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ValueError("%s is larger than %d bytes" % (path, MAX_BYTES))
    return data.decode("utf-8", "replace").strip() or None


def from_env(env, label, path_arg=None):
    """(token, source) from one environment (os.environ or a process's), or (None, None)."""
    if env.get(TOKEN, "").strip():
        return env[TOKEN].strip(), label + " " + TOKEN
    for path in (path_arg, env.get(TOKEN_PATH)):
        if path:
            token = read_file(path)
            if token:
                return token, label + " " + TOKEN_PATH
            return None, None  # Ray reads only the named file then
    return None, None


def process_envs():
    """The environments of the head's running gcs_server and raylet."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/comm" % pid) as fh:
                if fh.read().strip() not in ("gcs_server", "raylet"):
                    continue
            with open("/proc/%s/environ" % pid, "rb") as fh:
                raw = fh.read(1 << 20)
        except OSError:
            continue
        env = {}
        for item in raw.split(b"\0"):
            key, _, value = item.decode("utf-8", "replace").partition("=")
            if key:
                env[key] = value
        yield pid, env


def find(path_arg):
    token, source = from_env(os.environ, "login", path_arg)
    if token:
        return token, source
    if not (path_arg or os.environ.get(TOKEN_PATH)):
        token = read_file("~/.ray/auth_token")
        if token:
            return token, "~/.ray/auth_token"
    for pid, env in process_envs():
        token, source = from_env(env, "ray process %s" % pid)
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
