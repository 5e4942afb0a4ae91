"""Test backends: every op test runs on the CPU and on the CUDA path.

The CUDA path is a real GPU where one is present, else Numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, set here before numba.cuda is imported) with tiny
sizes. Tests that need real hardware carry ``@pytest.mark.gpu``.
"""
import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zlib

import numpy as np
import pytest


def _gpus_listed():
    """How many GPUs ``nvidia-smi -L`` lists (0 where it is missing or fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _probe_gpu():
    """``(usable, why not)``: whether Numba's real CUDA target runs here (a subprocess)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        return False, f"no CUDA driver ({error})"
    probe = "from numba import cuda; cuda.current_context(); print('usable')"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    try:
        res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env=env, timeout=300)
    except subprocess.TimeoutExpired:
        return False, "Numba's CUDA probe did not finish within 300 s"
    if res.stdout.strip() == "usable":
        return True, None
    return False, (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]


def cuda_path(setting, gpus_listed, probe):
    """``(NUMBA_ENABLE_CUDASIM value, refusal)`` for a run: ``setting`` is the variable's
    value (None: unset), ``gpus_listed`` how many GPUs nvidia-smi lists, ``probe()``
    :func:`_probe_gpu`. ``"1"`` asks for the simulator; any other value for a real GPU,
    which must work; unset, a GPU that works is used, else the simulator, except where
    nvidia-smi lists a GPU that Numba cannot use: the run is refused (``refusal`` says
    why), so a driver or library problem never turns into a simulator run that looks green."""
    if setting == "1":
        return "1", None
    if setting is None and not gpus_listed:
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return "1", None
    usable, why = probe()
    if usable:
        return "0", None
    if setting is None and not gpus_listed:
        return "1", None
    asked = (f"NUMBA_ENABLE_CUDASIM={setting} asks for a real GPU" if setting is not None
             else f"nvidia-smi lists {gpus_listed} GPU(s)")
    return None, (f"{asked}, but Numba cannot use it: {why}. The CUDA tests do not fall back "
                  f"to the simulator there; set NUMBA_ENABLE_CUDASIM=1 to run them in it anyway")


WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # None: the controller, or a run without xdist
REFUSAL = None
if WORKER is None:  # a worker inherits its controller's choice
    _setting, REFUSAL = cuda_path(os.environ.get("NUMBA_ENABLE_CUDASIM"),
                                  0 if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else _gpus_listed(),
                                  _probe_gpu)
    os.environ["NUMBA_ENABLE_CUDASIM"] = _setting or "1"
# one seed for the whole session: pytest-xdist's workers inherit it from the controller,
# so they all collect the same tests; JAX takes GPU memory as it needs it, not 75% of it
# per process, so that workers sharing a GPU fit
os.environ.setdefault("HBK_SESSION_SEED", str(np.random.SeedSequence().entropy % 2**32))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# OpenMP threads (Numba's parallel kernels, torch) sleep when idle instead of spinning: the
# workers share the cores, and a spinning pool takes the time another worker's test needs
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
SIMULATOR = os.environ["NUMBA_ENABLE_CUDASIM"] == "1"
if SIMULATOR:  # a simulated block's threads meet at barriers, passing the GIL around: with
    # the default 5 ms interval each barrier waits out the interval; 1 ms runs the
    # simulator's tests 2-3x faster
    sys.setswitchinterval(1e-3)
HAVE_NUMBA_CUDA = importlib.util.find_spec("numba.cuda") is not None
if SIMULATOR and HAVE_NUMBA_CUDA:  # note each kernel launch, to compile it for a real GPU
    import compile_kernels

    compile_kernels.record_launches()


class Backend:
    """Moves NumPy test data to the backend under test and back."""

    def __init__(self, name):
        self.name = name
        self.is_cuda = name == "cuda"
        # the simulator runs every thread in Python: keep sizes tiny there
        self.small = self.is_cuda and SIMULATOR
        self._cupy = None
        if self.is_cuda and not SIMULATOR and importlib.util.find_spec("cupy"):
            import cupy

            self._cupy = cupy

    def put(self, a):
        if a is None or not self.is_cuda:
            return a
        a = np.asarray(a, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        if self._cupy is not None:
            return self._cupy.asarray(a)
        from numba import cuda

        return cuda.to_device(a)

    def get(self, a):
        if isinstance(a, np.ndarray):
            if type(a).__name__ == "SimArray":  # hbkernels._simulator's CUDA arrays
                assert self.is_cuda, "a CPU call returned a simulated CUDA array"
                return np.asarray(a)
            assert not self.is_cuda, "a CUDA call returned a NumPy array"
            return a
        assert self.is_cuda, f"a CPU call returned {type(a).__name__}"
        if self._cupy is not None:
            return self._cupy.asnumpy(a)
        return a.copy_to_host()

    def __repr__(self):
        return f"Backend({self.name}{', simulator' if self.small else ''})"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request):
    if request.param == "cuda" and not HAVE_NUMBA_CUDA:
        pytest.skip("numba-cuda is not installed")
    return Backend(request.param)


SESSION_SEED = int(os.environ.get("HBK_TEST_SEED") or os.environ["HBK_SESSION_SEED"])


def pytest_report_header(config):
    mode = "simulator" if SIMULATOR else "real GPU"
    return f"hbkernels: HBK_TEST_SEED={SESSION_SEED} (set it to replay), CUDA path: {mode}"


@pytest.fixture
def cuda_backend():
    """The CUDA path alone, for tests that have no CPU counterpart."""
    if not HAVE_NUMBA_CUDA:
        pytest.skip("numba-cuda is not installed")
    return Backend("cuda")


@pytest.fixture
def rng(request):
    """Fresh random data each session; replay a failure with HBK_TEST_SEED."""
    return np.random.default_rng([SESSION_SEED, zlib.crc32(request.node.nodeid.encode())])


LAST_MODULE = "test_compile_kernels.py"  # compiles what the tests before it launched
SESSION = {"deselected": 0, "whole_suite": False, "compiler": None, "kernel_model": None}


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 8 (each holds torch, JAX and TensorFlow)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


class LastModuleWaits:
    """The controller's side of a run under pytest-xdist: writes
    :data:`compile_kernels.OTHERS_DONE` into the run's shared directory when every test
    outside :data:`LAST_MODULE` has ended, so that the worker running that module gathers
    every worker's launches (:func:`compile_kernels.gather`)."""

    def __init__(self, suite_dir):
        self.suite_dir, self.waiting = suite_dir, None

    def pytest_xdist_node_collection_finished(self, node, ids):
        if self.waiting is None:  # every worker collects the same tests
            self.waiting = {i for i in ids if os.path.basename(i.split("::")[0]) != LAST_MODULE}
            self._check()

    def pytest_runtest_logreport(self, report):
        if self.waiting and report.when not in ("setup", "call"):
            self.waiting.discard(report.nodeid)  # its teardown, or a crashed worker's report
            self._check()

    def _check(self):
        if not self.waiting:
            open(os.path.join(self.suite_dir, compile_kernels.OTHERS_DONE), "w").close()


def pytest_configure(config):
    if REFUSAL:
        raise pytest.UsageError(REFUSAL)
    if (WORKER is None and getattr(config.option, "numprocesses", None)
            and SIMULATOR and HAVE_NUMBA_CUDA):
        SESSION["suite_dir"] = tempfile.mkdtemp(prefix="hbk-suite-")
        os.environ["HBK_SUITE_DIR"] = SESSION["suite_dir"]  # the workers start after this
        config.pluginmanager.register(LastModuleWaits(SESSION["suite_dir"]), "hbk-last-module")
    report_dir = os.environ.get("HBK_TEST_REPORT_DIR")
    if report_dir and WORKER is None:
        # a run that may be killed: its tally and failures written as it goes, by the
        # controller alone (it sees every worker's reports)
        import run_report

        config.pluginmanager.register(run_report.Reporter(report_dir), "hbk-run-report")


def takes_cuda_path(item):
    """Whether test ``item`` runs the CUDA path: it takes the ``cuda_backend`` fixture, or
    ``"cuda"`` as its ``backend`` or ``device`` parameter."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    return ("cuda_backend" in getattr(item, "fixturenames", ())
            or any(params.get(name) == "cuda" for name in ("backend", "device")))


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if takes_cuda_path(item):
            item.add_marker(pytest.mark.cuda)
    if SIMULATOR or not HAVE_NUMBA_CUDA:
        skip = pytest.mark.skip(reason="needs a real CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    items.sort(key=lambda item: item.path.name == LAST_MODULE)  # stable: the rest keep their order


def pytest_deselected(items):
    SESSION["deselected"] += len(items)


def pytest_collection_finish(session):
    """Note whether this session runs every test module with nothing deselected."""
    here = os.path.dirname(__file__)
    modules = {name for name in os.listdir(here) if name.startswith("test_") and name.endswith(".py")}
    collected = {item.path.name for item in session.items}
    SESSION["whole_suite"] = collected == modules and SESSION["deselected"] == 0
    # a worker of pytest-xdist starts neither process: the workers keep every core busy, the
    # last module compiles while it waits for the others, the kernel model's module computes it
    if WORKER is not None:
        return
    if (SIMULATOR and HAVE_NUMBA_CUDA and LAST_MODULE in collected
            and compile_kernels.have_cuda_compilers()):  # compile launches as the suite runs
        SESSION["compiler"] = compile_kernels.Background(tempfile.mkdtemp(prefix="hbk-compile-"))
    if HAVE_NUMBA_CUDA and "test_kernel_model.py" in collected:  # the model, beside the suite
        report = os.path.join(tempfile.mkdtemp(prefix="hbk-model-"), "model.json")
        here = os.path.dirname(os.path.abspath(__file__))
        proc = subprocess.Popen(
            [sys.executable, os.path.join(here, "kernel_model.py"), "--report", report, "--write",
             report[:-4] + "csv"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=os.path.dirname(here)), preexec_fn=lambda: os.nice(19))
        SESSION["kernel_model"] = (proc, report)


def pytest_runtest_logfinish(nodeid, location):
    if SESSION.get("compiler"):
        SESSION["compiler"].poll()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:  # a worker shares its launches before the controller sees this test end
        if WORKER is not None and os.environ.get("HBK_SUITE_DIR") and SIMULATOR and HAVE_NUMBA_CUDA:
            compile_kernels.share(os.environ["HBK_SUITE_DIR"], WORKER)


def pytest_sessionfinish(session, exitstatus):
    if SESSION.get("suite_dir"):
        shutil.rmtree(SESSION["suite_dir"], ignore_errors=True)
    if SESSION.get("compiler"):
        SESSION["compiler"].close()
        shutil.rmtree(SESSION["compiler"].workdir, ignore_errors=True)
    if SESSION.get("kernel_model"):
        proc, report = SESSION["kernel_model"]
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(os.path.dirname(report), ignore_errors=True)


# One tolerance table per dtype: (rtol, atol) for results computed in a
# different summation order than the float64 reference.
TOLERANCE = {
    np.dtype(np.float16): (1e-2, 1e-2),
    np.dtype(np.float32): (1e-5, 1e-5),
    np.dtype(np.float64): (1e-12, 1e-12),
}
try:  # bfloat16 (8 significant bits) when ml_dtypes is installed
    import ml_dtypes

    TOLERANCE[np.dtype(ml_dtypes.bfloat16)] = (1e-2, 1e-2)
except ImportError:
    pass


def assert_close(actual, expected, dtype):
    rtol, atol = TOLERANCE[np.dtype(dtype)]
    assert actual.dtype == np.dtype(dtype), f"dtype {actual.dtype}, expected {np.dtype(dtype)}"
    np.testing.assert_allclose(actual.astype(np.float64), expected, rtol=rtol, atol=atol)


def random_offsets(rng, batch, max_len, empty_fraction=0.25):
    """CSR offsets of ``batch`` bags, lengths in [0, max_len], some bags empty."""
    lengths = rng.integers(0, max_len + 1, size=batch)
    lengths[rng.random(batch) < empty_fraction] = 0
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
