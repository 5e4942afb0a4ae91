"""Atomic file writes (a file is written under a temporary name, flushed to disk and
renamed over its final name, so a reader (or a crash) sees the old file or the
new one, never a part), and reads of regular files only."""
import errno
import json
import os
import stat
import uuid

from .errors import CheckpointError


def fsync_dir(path):
    """Flush directory ``path``'s entries (a rename in it) to disk, where the OS allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path, write):
    """``write(fileobj)`` into ``path`` via a temp file, fsync and rename; returns what
    ``write`` returns. On any error the temp file is removed and ``path`` is unchanged."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            out = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return out


def write_json_atomic(path, obj):
    """``obj`` as indented JSON (non-JSON numbers such as NumPy floats as float) in
    ``path``, atomically (:func:`write_atomic`)."""
    text = (json.dumps(obj, indent=1, default=float) + "\n").encode()
    write_atomic(path, lambda f: f.write(text))


_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def open_regular(name):
    """``(fd, size)``: a read-only file descriptor of ``name``, a regular file (never a
    symlink, a device or a pipe), and its size."""
    try:
        fd = os.open(name, _READ)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{name}: is a symbolic link; a checkpoint reads only its "
                                  f"own regular files") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{name}: not a regular file; a checkpoint reads only its own "
                              f"regular files")
    return fd, st.st_size


def read_upto(fd, n):
    """Up to ``n`` bytes of ``fd`` from where it is (fewer only at the end of the file)."""
    data = os.read(fd, n)
    while len(data) < n and (more := os.read(fd, n - len(data))):
        data += more
    return data
