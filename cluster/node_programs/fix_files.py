"""On a node, the one way `cluster fix` and `cluster fix --undo` read and change a file: check,
read, then write or remove only the files named, never through a symbolic link. One JSON document
on stdout.

    check   stdin: {"files": [PATH...], "dirs": [PATH...]}   read-only: per path "ok" (a regular
            file, absent, or for dirs a directory) or why it is refused
    read    stdin: {"files": [PATH...]}   read-only (as root): per path {"status": "ok", "text":
            its UTF-8 text, or null when absent} or why it is refused
    apply   stdin: {"ops": [{"op": "write", "path": P, "text": T} | {"op": "remove", "path": P}]}
            (as root) per op "ok" or why not

Each path must be absolute and normalized. It is walked from / one component at a time, each
directory opened with O_NOFOLLOW | O_DIRECTORY relative to the one before (openat), so a link
anywhere on the path (planted before or during the run) is refused, never followed; the file
itself is never opened through a link either. A write goes to a new file created exclusively
(O_CREAT | O_EXCL | O_NOFOLLOW) in the same directory, then renamed over the old one; a file
that is a mount point (a bind-mounted /etc/fstab in a container) is rewritten in place, still
O_NOFOLLOW. Missing parent directories of a write are made (0755), never through a link.
"""

import errno
import json
import os
import stat
import sys

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
MAX_PATHS = 1000
MAX_READ_BYTES = 8 << 20        # a file read bigger than this is refused (a config file is small)


class Refused(Exception):
    pass


def components(path):
    if not isinstance(path, str) or not path.startswith("/") or "\x00" in path \
            or os.path.normpath(path) != path or path == "/":
        raise Refused("not an absolute, normalized path")
    return path.split("/")[1:]


def _lstat(name, dir_fd):
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_parent(path, make=False):
    """(fd of the path's directory, its last component), or (None, name) when a directory on
    the way does not exist (and `make` is false). Refused at a link or a non-directory."""
    parts = components(path)
    fd = os.open("/", DIR_FLAGS)
    walked = ""
    try:
        for comp in parts[:-1]:
            walked += "/" + comp
            st = _lstat(comp, fd)
            if st is None:
                if not make:
                    os.close(fd)
                    return None, parts[-1]
                os.mkdir(comp, 0o755, dir_fd=fd)
                st = _lstat(comp, fd)
            if st is None or stat.S_ISLNK(st.st_mode):
                raise Refused("%s is a symbolic link" % walked)
            if not stat.S_ISDIR(st.st_mode):
                raise Refused("%s is not a directory" % walked)
            try:
                nfd = os.open(comp, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused("%s is a symbolic link" % walked)
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def check_path(path, want_dir):
    fd, name = open_parent(path)
    if fd is None:
        return "ok"
    try:
        st = _lstat(name, fd)
    finally:
        os.close(fd)
    if st is None:
        return "ok"
    if stat.S_ISLNK(st.st_mode):
        raise Refused("%s is a symbolic link" % path)
    if want_dir and not stat.S_ISDIR(st.st_mode):
        raise Refused("%s is not a directory" % path)
    if not want_dir and not stat.S_ISREG(st.st_mode):
        raise Refused("%s is not a regular file" % path)
    return "ok"


def read_file(path):
    """The file's UTF-8 text, or None when it (or a directory on the way) does not exist."""
    fd, name = open_parent(path)
    if fd is None:
        return None
    try:
        try:
            inp = os.open(name, os.O_RDONLY | NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Refused("%s is a symbolic link" % path)
            raise
    finally:
        os.close(fd)
    try:
        if not stat.S_ISREG(os.fstat(inp).st_mode):
            raise Refused("%s is not a regular file" % path)
        data = _read_at_most(inp, MAX_READ_BYTES + 1)
    finally:
        os.close(inp)
    if len(data) > MAX_READ_BYTES:
        raise Refused("%s is larger than %d bytes" % (path, MAX_READ_BYTES))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused("%s is not UTF-8 text" % path)


def _read_at_most(fd, limit):
    parts, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 20, limit - size))
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


def write_file(path, text):
    data = text.encode("utf-8")
    fd, name = open_parent(path, make=True)
    try:
        st = _lstat(name, fd)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise Refused("%s is %s" % (path, "a symbolic link" if stat.S_ISLNK(st.st_mode)
                                        else "not a regular file"))
        mode = stat.S_IMODE(st.st_mode) if st is not None else 0o644
        tmp = ".%s.cluster-fix.%d" % (name, os.getpid())
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600, dir_fd=fd)
        try:
            _write_all(out, data)
            os.fchmod(out, mode)
            os.fsync(out)
        finally:
            os.close(out)
        try:
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            os.unlink(tmp, dir_fd=fd)
            if exc.errno not in (errno.EBUSY, errno.EXDEV, errno.EPERM):
                raise
            inplace = os.open(name, os.O_WRONLY | os.O_TRUNC | NOFOLLOW, dir_fd=fd)
            try:
                if not stat.S_ISREG(os.fstat(inplace).st_mode):
                    raise Refused("%s is not a regular file" % path)
                _write_all(inplace, data)
            finally:
                os.close(inplace)
    finally:
        os.close(fd)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def remove_file(path):
    fd, name = open_parent(path)
    if fd is None:
        return
    try:
        st = _lstat(name, fd)
        if st is None:
            return
        if not stat.S_ISREG(st.st_mode):
            raise Refused("%s is %s" % (path, "a symbolic link" if stat.S_ISLNK(st.st_mode)
                                        else "not a regular file"))
        os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def _each(items, do):
    out = []
    for item in items[:MAX_PATHS]:
        try:
            got = do(item)
            out.append(dict(got, status="ok") if isinstance(got, dict) else {"status": "ok"})
        except Refused as exc:
            out.append({"status": "refused", "why": str(exc)})
        except OSError as exc:
            out.append({"status": "error", "why": "%s: %s" % (item.get("path") if
                                                              isinstance(item, dict) else item,
                                                              exc.strerror or exc)})
    return out


def main(argv):
    request = json.loads(sys.stdin.read(64 << 20))
    if not isinstance(request, dict):
        raise SystemExit("the request is not a JSON object")
    if argv[1:] == ["check"]:
        files = [p for p in request.get("files") or []]
        dirs = [p for p in request.get("dirs") or []]
        doc = {"files": _each(files, lambda p: check_path(p, False)),
               "dirs": _each(dirs, lambda p: check_path(p, True))}
    elif argv[1:] == ["read"]:
        doc = {"files": _each([p for p in request.get("files") or []],
                              lambda p: {"text": read_file(p)})}
    elif argv[1:] == ["apply"]:
        def do(op):
            if not isinstance(op, dict):
                raise Refused("not an operation")
            if op.get("op") == "write" and isinstance(op.get("text"), str):
                write_file(op.get("path"), op["text"])
            elif op.get("op") == "remove":
                remove_file(op.get("path"))
            else:
                raise Refused("unknown operation")
        doc = {"ops": _each(request.get("ops") or [], do)}
    else:
        raise SystemExit("usage: fix_files.py check|read|apply (a JSON request on stdin)")
    sys.stdout.write(json.dumps(doc) + "\n")


if __name__ == "__main__":
    main(sys.argv)
