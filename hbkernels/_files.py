"""Atomic file writes: a file is written under a temporary name, flushed to disk and
renamed over its final name, so a reader (or a crash) sees the old file or the
new one, never a part."""
import json
import os
import uuid


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
