"""On-node code the programs share, written once: the Ray auth-token reader, the /proc scan for a
process's environment, the stop/running/detach helpers of the detached servers, the private
directory and file makers (private_dir, create_private), and `answer`
(a program's one document on a stdout nothing else can write to).

Never run by itself. A program imports it with one line,
`from cluster.node_programs._common import NAMES`, which works when the program is imported
as a module (tests); when the program is shipped to a node, the runner replaces that line by
this file's text (cluster/node_programs/__init__.py `source`), so the node runs one
self-contained file. Stdlib only, Python 3.8+, no annotations.
"""

import os
import signal
import time

TOKEN_FILE = os.path.join(".ray", "auth_token")
RAY_DAEMONS = ("gcs_server", "raylet")


MAX_TOKEN_BYTES = 64 << 10


def _read_stripped(path):
    """A token file's stripped text (at most MAX_TOKEN_BYTES: ValueError beyond)."""
    with open(path, "rb") as fh:
        data = fh.read(MAX_TOKEN_BYTES + 1)
    if len(data) > MAX_TOKEN_BYTES:
        raise ValueError("%s is larger than %d bytes" % (path, MAX_TOKEN_BYTES))
    return data.decode("utf-8", "replace").strip()


def token_file(env):
    """The token file Ray reads: $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    home = env.get("HOME") or os.path.expanduser("~")
    return env.get("RAY_AUTH_TOKEN_PATH") or os.path.join(home, TOKEN_FILE)


def token_and_source(env, label="", path=None, default_file=True):
    """(token, where it came from) for the environment `env` in Ray's own order: RAY_AUTH_TOKEN,
    the file `path` or $RAY_AUTH_TOKEN_PATH (only that file), ~/.ray/auth_token (unless not
    `default_file`); (None, None)."""
    token = (env.get("RAY_AUTH_TOKEN") or "").strip()
    if token:
        return token, (label + " RAY_AUTH_TOKEN").strip()
    named = path or env.get("RAY_AUTH_TOKEN_PATH")
    if not named and not default_file:
        return None, None
    file = os.path.expanduser(named) if named else token_file(env)
    if os.path.isfile(file):
        token = _read_stripped(file) or None
        where = (label + " RAY_AUTH_TOKEN_PATH").strip() if named else "~/" + TOKEN_FILE
        return (token, where) if token else (None, None)
    return None, None


def pid_namespace(pid, proc="/proc"):
    """The PID namespace of process `pid` ("self": this one) as /proc names it, or None."""
    try:
        return os.readlink(os.path.join(proc, str(pid), "ns", "pid"))
    except OSError:
        return None


def running_ray_token(proc="/proc"):
    """(token, source) from the environment the node's own gcs_server / raylet was started with
    (its RAY_AUTH_TOKEN or the file its RAY_AUTH_TOKEN_PATH names), else (None, None). Only
    daemons of this process's PID namespace: a container's (or a simulated node's) Ray is
    another cluster's."""
    own = pid_namespace("self", proc)
    for pid in pids_named(RAY_DAEMONS, proc):
        if pid_namespace(pid, proc) != own:
            continue
        found = process_env(pid, proc)
        if found is None:
            continue
        try:
            token, source = token_and_source(found, "ray process %s" % pid, default_file=False)
        except OSError:
            continue
        if token:
            return token, source
    return None, None


def find_token(env, path=None, scan_ray=False, label="", proc="/proc"):
    """(token, source) for a client on this node: `env`'s RAY_AUTH_TOKEN or token path (`path`
    first), then (scan_ray) the token the running Ray was started with (the inventory's env
    reaches `ray start` on its stdin, never a client's command line), then ~/.ray/auth_token;
    (None, None). The running Ray's own token wins over a default file it did not read."""
    token, source = token_and_source(env, label, path, default_file=False)
    if not token and scan_ray:
        token, source = running_ray_token(proc)
    if not token:
        token, source = token_and_source(env, label, path)
    return token, source


def auth_token(env, scan_ray=False, proc="/proc"):
    """The Ray auth token for a client on this node, or None (find_token). Never printed by a
    program."""
    return find_token(env, scan_ray=scan_ray, proc=proc)[0]


def export_token(token):
    """Put `token` where Ray's own clients in this process read it (RAY_AUTH_TOKEN, with
    RAY_AUTH_MODE=token unless set): this process's environment only, never a command line."""
    if token:
        os.environ["RAY_AUTH_TOKEN"] = token
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def comm_of(pid, proc="/proc"):
    """The process's command name (/proc/PID/comm), or None when it cannot be read."""
    try:
        return _read_stripped(os.path.join(proc, str(pid), "comm"))
    except OSError:
        return None


def pids_named(comms, proc="/proc"):
    """The pids (strings, /proc's order) of the processes whose comm is one of `comms`."""
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    return [pid for pid in entries if pid.isdigit() and comm_of(pid, proc) in comms]


def process_env(pid, proc="/proc"):
    """The process's environment (/proc/PID/environ: NAME=value items; values decoded as UTF-8
    with replacement), or None when it cannot be read (gone, another user's)."""
    try:
        with open(os.path.join(proc, str(pid), "environ"), "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            key, _, value = item.decode("utf-8", "replace").partition("=")
            env[key] = value
    return env


def running(pid, proc="/proc"):
    """Alive and not a zombie (a zombie holds no socket; its reaper may be slow)."""
    try:
        with open(os.path.join(proc, "%d" % pid, "stat")) as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_tagged(pid, tag, wait_s, proc="/proc"):
    """SIGTERM the process `pid` if its command line holds `--tag TAG` (ours), then wait up to
    wait_s for it to go: {"stopped": pid, "gone": bool}, or {"stopped": None} (not ours, gone)."""
    if pid <= 1:
        return {"stopped": None}
    try:
        with open(os.path.join(proc, "%d" % pid, "cmdline"), "rb") as f:
            ours = (b"\0--tag\0" + tag.encode() + b"\0") in f.read() + b"\0"
        if not ours:
            return {"stopped": None}
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return {"stopped": None}
    end = time.monotonic() + wait_s    # its ports are free when stop returns (ray start next)
    while running(pid, proc) and time.monotonic() < end:
        time.sleep(0.02)
    return {"stopped": pid, "gone": not running(pid, proc)}


def detach_grandchild():
    """In the first child: a new session and a second fork. True in the grandchild, which runs
    on with stdio on /dev/null (so the SSH command returns); False in the first child."""
    os.setsid()
    if os.fork():
        return False
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    return True


def run_detached(run, close_in_parent):
    """Runs `run()` in a detached grandchild (a new session, stdio on /dev/null, so the SSH
    command returns) and returns its pid, None when it could not be read. The parent calls
    `close_in_parent()` (its copies of the sockets the grandchild serves) before it waits for
    the first child."""
    read, write = os.pipe()
    first = os.fork()
    if first == 0 and detach_grandchild():
        os.close(read)
        os.write(write, str(os.getpid()).encode())
        os.close(write)
        try:
            run()
        finally:
            os._exit(0)
    if first == 0:
        os._exit(0)
    os.close(write)
    close_in_parent()
    os.waitpid(first, 0)
    got = os.read(read, 32)
    os.close(read)
    return int(got) if got.isdigit() else None


def private_dir(path):
    """`path` as this user's private directory, made 0700 when missing; an existing one must be a
    real directory (not a link) owned by this user that no one else can write (read/search bits
    for others are taken away): else PermissionError, the directory untouched. Its parent must
    be one only its owner (or a sticky bit) protects, e.g. /tmp or $HOME."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise PermissionError("refused %s: not a directory of its own (%s)"
                              % (path, os.strerror(exc.errno or 0)))
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise PermissionError("refused %s: owned by uid %d, mode %o (this user's private "
                                  "directory expected)" % (path, st.st_uid, st.st_mode & 0o7777))
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def create_private(path, mode=0o600):
    """A new file at `path` opened for writing (O_EXCL | O_NOFOLLOW: never an existing file or
    a link someone planted there): its fd."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)


def answer(work, *args):
    """Print work(*args)'s document as the program's one answer on stdout. While it runs, fd 1
    points at stderr, so nothing else a library prints there (Ray's client, a C extension) can
    mix into the document."""
    import json
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        doc = work(*args)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
