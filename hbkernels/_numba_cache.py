"""Where Numba keeps hbkernels' compiled CPU kernels, decided once, so that a
read-only install (package directory and ``$HOME`` not writable, as in a
non-root container) still imports and runs.

Numba looks for a cache location when a ``cache=True`` function is decorated
(not compiled: decorating compiles nothing): ``NUMBA_CACHE_DIR`` if set, else
``__pycache__`` beside the source, else the user's cache directory; with none
writable it raises. :func:`cached_njit` decorates with caching where Numba
finds a place; where it finds none, it points Numba at a private directory
under the system's temporary directory (``hbkernels-numba-<uid>``, created
mode 0700 and used only when this user owns it and nobody else can write to
it); where that fails too, the kernels compile on every run without a cache.
:func:`cache_info` says which of these is in effect.

Processes that start together (the ranks of a job, a test runner's workers) need the same
kernels at the same time: each kernel's compiles are taken in turn across the
processes of this user (a lock file per kernel and signature, :func:`compile_lock`), so the second
process loads from the cache what the first compiled instead of compiling it too.
"""
import contextlib
import hashlib
import os
import tempfile
import threading
import time

import numba
from numba import njit

_state = {"mode": None, "dir": None}   # mode: "numba" | "temporary" | "off"


def private_temp_dir(kind="numba"):
    """``<tmp>/hbkernels-<kind>-<uid>``, made if missing, or None when it cannot be
    this user's private directory."""
    try:
        path = os.path.join(tempfile.gettempdir(), f"hbkernels-{kind}-{os.getuid()}")
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & 0o022 or not os.access(path, os.W_OK):
        return None
    return path


def _use_dir(path):
    os.environ["NUMBA_CACHE_DIR"] = path   # Numba re-reads its config from the environment
    numba.config.CACHE_DIR = path


LOCK_WAIT_SECONDS = 300  # then compile anyway: a stopped process never stalls another for long
_HELD = threading.local()  # the lock files this thread holds (a compile inside a compile)


@contextlib.contextmanager
def compile_lock(name):
    """Hold the lock file of ``name`` (shared by this user's processes), waiting
    for it at most :data:`LOCK_WAIT_SECONDS`; nothing is held where no lock file can be
    made or ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        yield
        return
    held = getattr(_HELD, "names", None)
    if held is None:
        held = _HELD.names = set()
    folder = private_temp_dir("compile-locks")
    if name in held or folder is None:
        yield
        return
    path = os.path.join(folder, hashlib.sha256(name.encode()).hexdigest()[:24])
    try:
        f = open(path, "a")
    except OSError:
        yield
        return
    with f:
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        locked = False
        while not locked and time.monotonic() < deadline:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except OSError:
                time.sleep(0.05)
        held.add(name)
        try:
            yield
        finally:
            held.discard(name)
            if locked:
                fcntl.flock(f, fcntl.LOCK_UN)


def _constant(value):
    """``value`` (a closure's variable) as text that is the same in every process."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, tuple):
        return "(" + ",".join(map(_constant, value)) + ")"
    return f"{type(value).__qualname__}:{getattr(value, '__qualname__', '')}"


def _compiles_in_turn(dispatcher):
    """``dispatcher`` whose compiles (a signature not in memory: loaded from the cache, or
    compiled and saved there) take :func:`compile_lock`'s lock of the function, its
    closure's variables (a kernel factory's constants) and the signature."""
    compile_ = dispatcher.compile
    fn = dispatcher.py_func
    cells = ",".join(_constant(c.cell_contents) for c in fn.__closure__ or ())
    name = f"{fn.__module__}.{fn.__qualname__}({cells})"

    def compile(sig):
        with compile_lock(f"{name}{sig}"):
            return compile_(sig)

    dispatcher.compile = compile
    return dispatcher


def cached_njit(function, **options):
    """``njit(cache=True, **options)(function)`` with the fallbacks of this module:
    never raises for want of a cache location, compiles nothing; its compiles are taken
    in turn by this user's processes (:func:`_compiles_in_turn`)."""
    if _state["mode"] != "off":
        try:
            dispatcher = _compiles_in_turn(njit(cache=True, **options)(function))
            if _state["mode"] is None:
                _state["mode"] = "numba"
            return dispatcher
        except RuntimeError as error:   # "cannot cache function ...: no locator available"
            if "cannot cache" not in str(error) or _state["mode"] == "temporary":
                raise
        path = private_temp_dir()
        if path is not None:
            _use_dir(path)
            try:
                dispatcher = _compiles_in_turn(njit(cache=True, **options)(function))
                _state.update(mode="temporary", dir=path)
                return dispatcher
            except RuntimeError as error:
                if "cannot cache" not in str(error):
                    raise
        _state.update(mode="off", dir=None)
    return njit(**options)(function)


def cache_info():
    """``{"caching": bool, "location": str, "numba_cache_dir": str or None}``: whether
    compiled kernels are kept between runs, and where (``"__pycache__ beside the
    sources, else the user cache directory"`` when Numba's own choice is in effect)."""
    mode = _state["mode"]
    configured = numba.config.CACHE_DIR or None
    if mode == "off":
        where = "none: no writable location (kernels compile on every run)"
    elif configured:
        where = configured
    else:
        where = "__pycache__ beside the sources, else the user cache directory (Numba's choice)"
    return {"caching": mode != "off", "location": where, "numba_cache_dir": configured}
