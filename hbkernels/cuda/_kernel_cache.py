"""Compiled CUDA kernels, kept in memory and on disk so that a machine compiles each
kernel once: :func:`compiled` gives ``(cubin, entry name)`` for a kernel, its argument
types and a compute capability, from the cache when it is there, else compiled
(:mod:`._compile`) and stored.

A kernel is named by how it was built (``built_by``: its factory and the factory's
arguments, see :func:`._launch.kernel_factory`; a module-level kernel by its module
and name). The file's key hashes that name with the argument types, the compute
capability, the versions of Numba and numba-cuda, and the source of the kernel's
module and of every hbkernels module it imports, directly or through others
(:func:`source_hash`): a change to any of them compiles afresh, and a change
elsewhere in the package keeps the compiled kernels.

Where: ``HBK_CUDA_CACHE_DIR`` (``off`` for no disk cache), else
``$NUMBA_CACHE_DIR/hbkernels-cuda``, else ``~/.cache/hbkernels/cuda`` (``$XDG_CACHE_HOME``
respected), else a private ``hbkernels-cuda-<uid>`` under the temporary directory;
where none is writable, kernels compile in every process. Files are written
atomically; an unreadable one is compiled again and replaced. Processes that need the
same kernel at once compile it once: each takes the key's lock file
(``<key>.lock``) and looks on the disk again before compiling.

Before a kernel is linked, the parameters of its PTX entry are held to the ones the
launcher packs for its argument types (:func:`._compile.check_entry`).
"""
import ast
import functools
import hashlib
import os
import sys
from pathlib import Path

from .._files import locked, write_atomic
from .._numba_cache import private_temp_dir

STATS = {"memory": 0, "disk": 0, "compiled": 0}  # where each compiled() answer came from
_MAGIC = b"hbkernels-cubin-1\n"
_MEMORY = {}


_PACKAGE = Path(__file__).resolve().parent.parent  # the hbkernels package's directory


def _module_path(name):
    """The source file of module ``name``: in hbkernels by its name, else where the
    imported module says; None where there is none."""
    parts = name.split(".")
    if parts[0] == _PACKAGE.name:
        base = _PACKAGE.joinpath(*parts[1:])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None
    found = getattr(sys.modules.get(name), "__file__", None)
    return Path(found) if found else None


@functools.lru_cache(maxsize=None)
def _imported(name):
    """The hbkernels modules that module ``name`` imports, anywhere in it."""
    path = _module_path(name)
    if path is None:
        return frozenset()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            sources = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            sources = [(source, a.name) for a in node.names]
        else:
            continue
        for source, member in sources:
            if source.split(".")[0] != _PACKAGE.name:
                continue
            sub = f"{source}.{member}" if member else None
            out.add(sub if sub and _module_path(sub) else source)
    return frozenset(out)


@functools.lru_cache(maxsize=None)
def source_hash(module):
    """SHA-256 of the source of ``module`` (a dotted name) and of every hbkernels module
    it imports, directly or through others: all the code a kernel of ``module`` can
    compile in (names and bytes)."""
    digest, seen, todo = hashlib.sha256(), set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += sorted(_imported(name) - seen)
    for name in sorted(seen):
        path = _module_path(name)
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path else b"") + b"\0")
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

    name = identity(kernel)
    material = repr((source_hash(name[0]), name, tuple(str(t) for t in argtypes),
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
    k = key(kernel, argtypes, cc)
    if k in _MEMORY and not fresh:
        STATS["memory"] += 1
        return _MEMORY[k]
    where = directory()
    if where is None:
        found = _compile_and_save(kernel, argtypes, cc, None)
    else:
        path = os.path.join(where, k + ".cubin")
        found = _from_disk(path, fresh)
        if found is None:
            with locked(os.path.join(where, k + ".lock")):  # a peer compiling it: wait for its file
                found = _from_disk(path, fresh) or _compile_and_save(kernel, argtypes, cc, path)
    _MEMORY[k] = found
    return found


def _from_disk(path, fresh):
    found = None if fresh else load(path)
    if found is not None:
        STATS["disk"] += 1
    return found


def _compile_and_save(kernel, argtypes, cc, path):
    from . import _compile

    ptx = _compile.ptx(kernel, argtypes, cc)
    name = _compile.entry_name(ptx)
    _compile.check_entry(ptx, argtypes, ".".join(map(str, identity(kernel)[:2])))
    found = (_compile.link(ptx, cc)[0], name)
    STATS["compiled"] += 1
    if path:
        try:
            save(path, *found)
        except OSError:
            pass  # a full or read-only disk: the kernel still runs
    return found
