"""Atomic file writes (a file is written under a temporary name, flushed to disk and
renamed over its final name, so a reader (or a crash) sees the old file or the
new one, never a part), appends that leave a file's first bytes as they were
(:func:`append_linked`), reads of regular files only, and a lock that processes
take in turn (:func:`locked`)."""
import contextlib
import errno
import json
import mmap
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


@contextlib.contextmanager
def locked(path):
    """Hold an exclusive lock on file ``path`` (created where missing, kept afterwards)
    while the block runs, waiting for a process that holds it; where the lock cannot be
    had (no ``fcntl``, a read-only directory) the block runs unlocked. The lock goes
    with the process, so a killed holder never blocks the others."""
    try:
        import fcntl

        f = open(path, "ab")  # noqa: SIM115 - closed below, after the block
    except (ImportError, OSError):
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


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


def append_linked(source, path, end, align, write):
    """Append to regular file ``source`` under a second name ``path`` (a hard link), where
    ``source`` holds ``end`` bytes: ``write(fileobj)`` from the first multiple of ``align``
    at or after ``end`` (zeros before it), flushed to disk, then the new name renamed into
    place. Returns ``(what write returned, where it began)``, or None, with nothing
    changed, where it cannot append: ``source`` is not a regular file of ``end`` bytes
    that opens for writing (a symbolic link is not followed), or the file system makes
    no hard links. The first ``end`` bytes never change; on an error the file is cut
    back to them and ``path`` is not made."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        os.link(source, tmp, follow_symlinks=False)
    except OSError:
        return None
    fd, appending = -1, False
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:  # a symbolic link, or not writable: a file of its own instead
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != end:
            return None
        appending = True
        start = -(-end // align) * align
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.seek(end)
            f.write(bytes(start - end))
            out = write(f)
            f.flush()
            os.fsync(fd)
        os.replace(tmp, path)
        tmp = None
        return out, start
    except BaseException:
        if appending:
            try:
                os.ftruncate(fd, end)
            except OSError:
                pass
        raise
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None and os.path.lexists(tmp):
            os.remove(tmp)


def truncate_to(path, end, tail):
    """Cut regular file ``path`` back to ``end`` bytes where it holds ``end + tail``
    (what one :func:`append_linked` of ``tail`` bytes left); otherwise leave it."""
    try:
        if os.stat(path).st_size == end + tail:
            os.truncate(path, end)
    except OSError:
        pass


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


READ_WHOLE = 1 << 24  # a file up to this size is read once into memory; a larger one is mapped


def read_regular(name):
    """The bytes of regular file ``name`` (:func:`open_regular`) as a read-only
    memoryview: read once where it holds up to :data:`READ_WHOLE` bytes, memory-mapped
    where it holds more. Raises what opening or reading it raises (``OSError``,
    :class:`~hbkernels.CheckpointError`)."""
    fd, size = open_regular(name)
    try:
        return memoryview(read_upto(fd, size) if size <= READ_WHOLE
                          else mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
    finally:
        os.close(fd)


def read_upto(fd, n):
    """Up to ``n`` bytes of ``fd`` from where it is (fewer only at the end of the file)."""
    data = os.read(fd, n)
    while len(data) < n and (more := os.read(fd, n - len(data))):
        data += more
    return data
