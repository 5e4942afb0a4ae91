"""Compiled CUDA kernels, kept in memory and on disk so that a machine compiles each
kernel once: :func:`compiled` gives ``(cubin, entry name)`` for a kernel, its argument
types and a compute capability, from the cache when it is there, else compiled
(:mod:`._compile`) and stored.

A kernel is named by how it was built (``built_by``: its factory and the factory's
arguments, see :func:`._launch.kernel_factory`; a module-level kernel by its module
and name). The file's key hashes that name with the argument types, the compute
capability, the versions of Numba and numba-cuda, and the source of the hbkernels
package, so a change to any of them compiles afresh.

Where: ``HBK_CUDA_CACHE_DIR`` (``off`` for no disk cache), else
``$NUMBA_CACHE_DIR/hbkernels-cuda``, else ``~/.cache/hbkernels/cuda`` (``$XDG_CACHE_HOME``
respected), else a private ``hbkernels-cuda-<uid>`` under the temporary directory;
where none is writable, kernels compile in every process. Files are written
atomically; an unreadable one is compiled again and replaced.
"""
import functools
import hashlib
import os
from pathlib import Path

from .._files import write_atomic
from .._numba_cache import private_temp_dir

STATS = {"memory": 0, "disk": 0, "compiled": 0}  # where each compiled() answer came from
_MAGIC = b"hbkernels-cubin-1\n"
_MEMORY = {}


@functools.lru_cache(maxsize=None)
def source_hash():
    """SHA-256 of every ``.py`` file of the installed hbkernels package (names and bytes)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _writable_dir(path):
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return str(path) if os.access(path, os.W_OK) else None


@functools.lru_cache(maxsize=None)
def directory():
    """The directory compiled kernels are kept in, or None (no disk cache)."""
    explicit = os.environ.get("HBK_CUDA_CACHE_DIR")
    if explicit is not None:
        return None if explicit.strip().lower() in ("", "off", "0", "none") else \
            _writable_dir(explicit)
    numba_dir = os.environ.get("NUMBA_CACHE_DIR")
    if numba_dir:
        found = _writable_dir(os.path.join(numba_dir, "hbkernels-cuda"))
        if found:
            return found
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return _writable_dir(os.path.join(home, "hbkernels", "cuda")) or private_temp_dir("cuda")


def identity(kernel):
    """How ``kernel`` was built: ``built_by`` of a factory's kernel, else module and name."""
    built_by = getattr(kernel, "built_by", None)
    if built_by is not None:
        return built_by
    return (kernel.py_func.__module__, kernel.py_func.__qualname__)


def key(kernel, argtypes, cc):
    """The cache key (hex) of ``kernel`` compiled for ``argtypes`` on ``cc``."""
    import numba
    import numba_cuda

    material = repr((source_hash(), identity(kernel), tuple(str(t) for t in argtypes),
                     tuple(cc), numba.__version__, getattr(numba_cuda, "__version__", "")))
    return hashlib.sha256(material.encode()).hexdigest()


def load(path):
    """``(cubin, entry name)`` stored at ``path``, or None (missing or not such a file)."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if not data.startswith(_MAGIC):
        return None
    name, sep, cubin = data[len(_MAGIC):].partition(b"\n")
    return (cubin, name.decode()) if sep and cubin else None


def save(path, cubin, name):
    write_atomic(path, lambda f: f.write(_MAGIC + name.encode() + b"\n" + cubin))


def compiled(kernel, argtypes, cc, fresh=False):
    """``(cubin, entry name)`` of ``kernel`` for ``argtypes`` (Numba types) on ``cc``;
    ``fresh``: compile it even when cached (replacing a file the driver refused)."""
    from . import _compile

    k = key(kernel, argtypes, cc)
    if k in _MEMORY and not fresh:
        STATS["memory"] += 1
        return _MEMORY[k]
    where = directory()
    path = os.path.join(where, k + ".cubin") if where else None
    found = load(path) if path and not fresh else None
    if found is not None:
        STATS["disk"] += 1
    else:
        ptx = _compile.ptx(kernel, argtypes, cc)
        found = (_compile.link(ptx, cc)[0], _compile.entry_name(ptx))
        STATS["compiled"] += 1
        if path:
            try:
                save(path, *found)
            except OSError:
                pass  # a full or read-only disk: the kernel still runs
    _MEMORY[k] = found
    return found
