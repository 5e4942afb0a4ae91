"""Compile every CUDA kernel the test suite launches for a real GPU, with no GPU.

Numba's simulator runs kernels as Python, so it never types them with Numba,
lowers them to PTX, or assembles them for a real architecture: a kernel can pass
every simulator test and still fail to compile on a GPU. This module closes that
gap in two steps:

1. under the simulator, :func:`record_launches` notes each kernel launch as
   ``(how the kernel was built, argument types)``, the types
   ``hbkernels.cuda._launcher`` compiles it for on a GPU (``conftest.py`` installs it);
2. in a process without the simulator, :func:`compile_all` rebuilds each
   kernel from its factory (``hbkernels.cuda._launch.kernel_factory``; ``tpb``
   at the real GPU's value), compiles it through Numba and NVVM
   to PTX, checks the PTX entry's parameters against what the launcher packs,
   and links it with nvJitLink (ptxas) into a cubin for the
   architecture; the report gives each kernel's error, or its registers,
   spills and shared memory.

``tests/test_compile_kernels.py`` does both in every simulator run of the suite.
By hand (a table of every kernel's resources, as in ``bench/results/``)::

    python3 tests/compile_kernels.py record launches.pkl     # runs the suite (pytest args may follow)
    python3 tests/compile_kernels.py compile launches.pkl report.json --csv resources.csv

``record`` runs the suite in one process; a run under pytest-xdist (``pytest -n auto``)
saves the same file when ``HBK_SAVE_LAUNCHES=launches.pkl`` is set.

Needs the NVVM, NVRTC and nvJitLink libraries (the ``test`` extra installs their
wheels), not a driver.
"""
import importlib
import inspect
import json
import os
import pickle
import pkgutil
import re
import sys
import types as pytypes

ARCH = "sm_90"  # what the suite compiles for: an H100
LAUNCHES = {}  # (source, argument types) -> launches seen, filled by record_launches
BLOCK_THREADS = {}  # the same keys -> set of threads per block those launches used (simulator)
GEOMETRY = ("tpb",)  # factory parameters rebuilt at the real GPU's values
MOST_SIZES = 4  # factory sizes compiled per kernel and argument types (see representatives)


# -- step 1: record, under the simulator --------------------------------------------------
def kernel_source(kernel):
    """``(module, name, factory args or None, position or None)`` of a launched kernel."""
    built_by = getattr(kernel, "built_by", None)
    if built_by is not None:
        return built_by
    fn = kernel.fn
    return (fn.__module__, fn.__qualname__, None, None)


def representatives(launches):
    """The keys of ``launches`` to compile: of the launches of one kernel, one set of argument
    types and the same factory flags, those whose factory integers (a width D, a count:
    the same code at another size) are the smallest, the largest, and spread between them,
    :data:`MOST_SIZES` in all; every other launch is compiled."""
    groups = {}
    for key in launches:
        (module, name, args, position), argtypes = key
        args = args or ()
        sizes = tuple(a for a in args if isinstance(a, int) and not isinstance(a, bool))
        flags = tuple(None if isinstance(a, int) and not isinstance(a, bool) else repr(a)
                      for a in args)
        groups.setdefault((module, name, position, argtypes, flags), []).append((sizes, key))
    chosen = set()
    for members in groups.values():
        members.sort(key=lambda m: m[0])
        last = len(members) - 1
        picks = {round(i * last / (MOST_SIZES - 1)) for i in range(MOST_SIZES)}
        chosen.update(members[i][1] for i in picks)
    return chosen


def record_launches():
    """Note each kernel launch in LAUNCHES (and its threads per block in BLOCK_THREADS), with
    the argument types the launcher compiles it for on a GPU."""
    from hbkernels.cuda import _launcher

    def record(kernel, argtypes, threads):
        key = (kernel_source(kernel), tuple(argtypes))
        LAUNCHES[key] = LAUNCHES.get(key, 0) + 1
        BLOCK_THREADS.setdefault(key, set()).add(int(threads))

    _launcher.RECORDER[0] = record


def defined_kernels():
    """``(module, name)`` of every kernel factory and module-level kernel in hbkernels.cuda."""
    import hbkernels.cuda

    found = set()
    for info in pkgutil.iter_modules(hbkernels.cuda.__path__):
        module = importlib.import_module(f"hbkernels.cuda.{info.name}")
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue  # imported from elsewhere
            if getattr(obj, "builds_kernels", False):
                found.add((module.__name__, name))
            elif hasattr(obj, "py_func") or hasattr(obj, "fn"):  # a dispatcher (real or simulated)
                if not _is_device_function(obj):
                    found.add((module.__name__, name))
    return found


def _is_device_function(dispatcher):
    if hasattr(dispatcher, "_device"):  # simulator
        return dispatcher._device
    return dispatcher.targetoptions.get("device", False)


def save(launches, path):
    """Write ``launches`` (a LAUNCHES-like dict or its items) to ``path`` atomically."""
    from hbkernels._files import write_atomic

    write_atomic(path, lambda f: pickle.dump(dict(launches), f))


# -- under pytest-xdist: each worker records its own launches ------------------------------
def share(suite_dir, worker):
    """Save this worker's launches as ``launches-<worker>.pkl`` in ``suite_dir``, where
    :func:`gather` reads them (after each test that launched a kernel not seen before)."""
    if len(LAUNCHES) != share.saved:
        save(LAUNCHES, os.path.join(suite_dir, f"launches-{worker}.pkl"))
        share.saved = len(LAUNCHES)


share.saved = 0
OTHERS_DONE = "others-done"  # written by the controller when every test before the last module ended


def gather(suite_dir, worker, timeout, compiler=None):
    """Add every other worker's launches to LAUNCHES, once the controller says that every
    test outside the last module has ended (its :data:`OTHERS_DONE` file in ``suite_dir``);
    meanwhile ``compiler`` (a :class:`Background`) compiles the launches seen so far."""
    import time

    own = dict(LAUNCHES)
    deadline = time.monotonic() + timeout
    while True:
        done = os.path.exists(os.path.join(suite_dir, OTHERS_DONE))  # then every file is final
        LAUNCHES.clear()
        LAUNCHES.update(own)
        for name in sorted(os.listdir(suite_dir)):
            if name.startswith("launches-") and name.endswith(".pkl") and name != f"launches-{worker}.pkl":
                with open(os.path.join(suite_dir, name), "rb") as f:
                    for key, count in pickle.load(f).items():
                        LAUNCHES[key] = LAUNCHES.get(key, 0) + count
        if compiler is not None:  # small batches: what is left at the end is split over cores
            compiler.poll(most=8)
        if done:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other workers' tests had not all ended after {timeout} s")
        time.sleep(2.0)


# -- step 2: compile, without the simulator -----------------------------------------------
_RESOURCES = {
    "registers": r"used (\d+) registers",
    "stack_bytes": r"(\d+) stack",
    "shared_bytes": r"(\d+) bytes smem",
    "local_bytes": r"(\d+) bytes lmem",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
}


def _pretend_device(cc):
    """Numba asks the current device for its compute capability when it compiles
    a device function; with no GPU, answer ``cc``."""
    import numba.cuda.dispatcher as dispatcher

    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=cc)


def rebuild(source):
    """``(real dispatcher, factory arguments used)`` for a recorded kernel source."""
    module_name, name, args, position = source
    module = importlib.import_module(module_name)
    obj = getattr(module, name)
    if args is None:
        return obj, None
    params = list(inspect.signature(obj.__wrapped__).parameters)
    launch = importlib.import_module("hbkernels.cuda._launch")
    real = {"tpb": launch.threads_per_block()}
    args = tuple(real[p] if p in GEOMETRY else a for p, a in zip(params, args))
    built = obj(*args)
    return (built if position is None else built[position]), args


def _session_cache(dispatcher, argtypes, cc):
    """Where this session keeps the compile of ``dispatcher`` for ``argtypes`` and ``cc``
    (a path without suffix), or None outside a pytest-xdist session. The kernel model and
    the compile check compile many of the same kernels: the second takes the first's."""
    suite = os.environ.get("HBK_SUITE_DIR")
    if not suite:
        return None
    import hashlib

    fn = dispatcher.py_func
    source = getattr(dispatcher, "built_by", None) or (fn.__module__, fn.__qualname__)
    key = repr((source, tuple(str(t) for t in argtypes), tuple(cc)))
    folder = os.path.join(suite, "compiled")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:32])


def compile_one(dispatcher, argtypes, cc, cubin=False):
    """Compile to PTX and link to a cubin for ``cc`` as the launcher does on a GPU
    (:mod:`hbkernels.cuda._compile`), and check that the PTX entry's parameters are
    what the launcher packs for ``argtypes``; returns the resources ptxas reports,
    or ``(resources, the cubin's bytes)`` when ``cubin`` is true (for a disassembler).
    Within a pytest-xdist session a kernel compiled once is not compiled again (by any
    of its processes: one compiles, the others wait for its result)."""
    cache = _session_cache(dispatcher, argtypes, cc)
    if not cache:
        return _compile_one(dispatcher, argtypes, cc, cubin, None)
    from hbkernels._numba_cache import compile_lock

    with compile_lock(cache):  # another process compiling it: its result, once written
        if os.path.exists(cache + ".json"):
            with open(cache + ".json") as f:
                resources = json.load(f)
            with open(cache + ".cubin", "rb") as f:
                code = f.read()
            return (resources, code) if cubin else resources
        return _compile_one(dispatcher, argtypes, cc, cubin, cache)


def _compile_one(dispatcher, argtypes, cc, cubin, cache):
    from hbkernels.cuda import _compile

    ptx = _compile.ptx(dispatcher, argtypes, cc)
    _compile.check_entry(ptx, argtypes, _compile.entry_name(ptx))
    code, log = _compile.link(ptx, cc)
    resources = {}
    for key, pattern in _RESOURCES.items():
        values = [int(v) for v in re.findall(pattern, log)]
        resources[key] = max(values) if values else 0
    if cache:  # the cubin first: the report's presence says both are whole
        from hbkernels._files import write_atomic, write_json_atomic

        write_atomic(cache + ".cubin", lambda f: f.write(code))
        write_json_atomic(cache + ".json", resources)
    return (resources, code) if cubin else resources


def blocks_per_sm(registers, shared_bytes, threads=256, sm_registers=65536, sm_shared=228 * 1024,
                  max_threads=2048, max_blocks=32):
    """Resident blocks of ``threads`` per SM (H100 limits: registers allocated per warp in
    units of 256, i.e. 8 per thread; at most ``max_blocks`` blocks)."""
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = sm_registers // per_warp // warps
    by_shared = sm_shared // shared_bytes if shared_bytes else max_threads
    return min(by_registers, by_shared, max_threads // (32 * warps), max_blocks)


def compile_all(launches, cc):
    """A report row per recorded launch: kernel, argument types, error or resources;
    compiled in the order of ``launches``, the rows in the order of their keys."""
    _pretend_device(cc)
    rows = []
    for key, count in launches.items():
        (source, argtypes) = key
        module_name, name, args, position = source
        row = {"kernel": f"{module_name}.{name}" + (f"[{position}]" if position is not None else ""),
               "factory_args": repr(args), "argtypes": [str(t) for t in argtypes],
               "launches": count}
        try:
            dispatcher, args = rebuild(source)
            row["factory_args"] = repr(args)
            row.update(compile_one(dispatcher, argtypes, cc))
        except Exception as error:  # noqa: BLE001 - every failure goes in the report
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append((str(key), row))
    return [row for _, row in sorted(rows, key=lambda r: r[0])]


def write_csv(rows, path, threads=256):
    """One line per kernel and factory arguments (its most demanding argument types)."""
    import csv

    worst = {}
    for r in rows:
        if "error" not in r:
            key = (r["kernel"], r["factory_args"])
            if key not in worst or r["registers"] > worst[key]["registers"]:
                worst[key] = r
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["kernel", "factory_args", "registers", "shared_bytes", "spill_store_bytes",
                      f"blocks_per_sm_at_{threads}", "occupancy"])
        for (kernel, args), r in sorted(worst.items()):
            blocks = blocks_per_sm(r["registers"], r["shared_bytes"], threads)
            out.writerow([kernel.removeprefix("hbkernels.cuda."), args, r["registers"],
                          r["shared_bytes"], r["spill_store_bytes"], blocks,
                          f"{blocks * threads / 2048:.3f}"])


def record(path, pytest_args):
    """Run pytest under the simulator in this process and save every launch to ``path``."""
    import pytest

    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    code = pytest.main(["-q", "-p", "no:cacheprovider", *(pytest_args or [here])])
    launches = importlib.import_module("compile_kernels").LAUNCHES  # what conftest recorded into
    save(launches, path)
    print(f"{len(launches)} distinct kernel launches saved to {path}")
    return int(code)


def have_cuda_compilers():
    """NVVM, NVRTC and nvJitLink loadable (wheels of the ``test`` extra), no driver needed."""
    import subprocess

    probe = ("from cuda.pathfinder import load_nvidia_dynamic_lib as load\n"
             "for lib in ('nvvm', 'nvrtc', 'nvJitLink'): load(lib)")
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def serve(cc):
    """Compile batches named on stdin, one ``launches.pkl report.json`` line each, until EOF;
    print ``done report.json`` after each (a worker that runs while the suite does)."""
    _pretend_device(cc)
    for line in sys.stdin:
        launches_path, report_path = line.split()
        with open(launches_path, "rb") as f:
            rows = compile_all(pickle.load(f), cc)
        with open(report_path, "w") as f:
            json.dump({"kernels": rows}, f)
        print("done", report_path, flush=True)
    return 0


class Background:
    """A worker process (:func:`serve`, at the lowest priority) that compiles launches while
    the suite still runs, on the core the single-threaded suite leaves idle; :meth:`finish`
    hands what it has not yet been given to fresh processes and returns every report row.
    Each process writes its output to a log file in ``workdir``."""

    def __init__(self, workdir, arch=ARCH, every=20.0):
        self.workdir, self.arch, self.every = workdir, arch, every
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=repo)
        self.sent = set()  # launch keys given to a process
        self.reports, self.procs = [], []
        self.worker = None
        self.last = 0.0

    def _start(self, *args, stdin=None):
        import subprocess

        log = open(os.path.join(self.workdir, f"log{len(self.procs)}.txt"), "w")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args, "--arch", self.arch],
                                stdin=stdin, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env=self.env, preexec_fn=lambda: os.nice(19))
        self.procs.append((proc, log))
        return proc

    def _batch(self, items):
        """Save ``items`` (launch key, count) as the next batch: ``(its path, its report's)``."""
        items = list(items)
        self.sent.update(k for k, _ in items)
        path = os.path.join(self.workdir, f"launches{len(self.reports)}.pkl")
        self.reports.append(path[:-3] + "json")
        save(items, path)
        return path, self.reports[-1]

    def poll(self, most=None):
        """Send the launches recorded since the last batch (those of :func:`representatives`,
        at most ``most`` of them), at
        most once every ``every`` s and only once the worker has compiled every batch sent
        before (what it has not been given when :meth:`finish` runs is split over fresh
        processes there)."""
        import subprocess
        import time

        now = time.monotonic()
        if now - self.last < self.every or len(LAUNCHES) == len(self.sent):
            return
        if not all(os.path.exists(report) for report in self.reports):
            return
        self.last = now
        if self.worker is None:
            self.worker = self._start("serve", stdin=subprocess.PIPE)
        chosen = representatives(LAUNCHES)
        new = [kv for kv in LAUNCHES.items() if kv[0] not in self.sent and kv[0] in chosen][:most]
        if new and self.worker.poll() is None:
            self.worker.stdin.write(" ".join(self._batch(new)) + "\n")
            self.worker.stdin.flush()

    def finish(self, shards, timeout):
        """Every report row: the worker's batches plus the rest, over ``shards`` fresh
        processes that run while the worker drains its queue. Within a pytest-xdist session
        (its compiles shared, :func:`compile_one`) each process takes the whole rest, each
        starting at its own place: a launch one has compiled the others read, so they end
        together; otherwise each takes a contiguous share (a factory's launches together)."""
        chosen = representatives(LAUNCHES)
        rest = sorted((kv for kv in LAUNCHES.items() if kv[0] not in self.sent and kv[0] in chosen),
                      key=lambda kv: str(kv[0]))
        shards = max(1, min(shards, len(rest)))
        shared = bool(os.environ.get("HBK_SUITE_DIR"))
        duplicates = set()  # reports of processes that compiled what another reports
        for i in range(shards if rest else 0):
            start, end = i * len(rest) // shards, (i + 1) * len(rest) // shards
            if shared:
                self._start("compile", *self._batch(rest[start:] + rest[:start]))
                if i:
                    duplicates.add(self.reports[-1])
            else:
                self._start("compile", *self._batch(rest[start:end]))
        if self.worker is not None:
            self.worker.stdin.close()
        for proc, log in self.procs:
            proc.wait(timeout=timeout)
            log.close()
        rows = []
        for report in self.reports:
            if report in duplicates:
                continue
            if not os.path.exists(report):
                logs = [open(log.name).read() for _, log in self.procs]
                raise RuntimeError(f"no compile report {report}:\n" + "\n".join(logs)[-6000:])
            with open(report) as f:
                rows += json.load(f)["kernels"]
        return rows

    def close(self):
        """Stop any process still running (a session that ends before :meth:`finish`)."""
        for proc, log in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def main(argv):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the tests under the simulator, save their launches")
    rec.add_argument("launches")
    rec.add_argument("pytest_args", nargs=argparse.REMAINDER)
    comp = sub.add_parser("compile", help="compile saved launches for a GPU architecture")
    comp.add_argument("launches", help="pickle written by record (or save())")
    comp.add_argument("report", help="JSON report to write")
    comp.add_argument("--arch", default="sm_90", help="target architecture (default sm_90, H100)")
    comp.add_argument("--csv", help="also write a table of each kernel's resources")
    srv = sub.add_parser("serve", help="compile the batches named on stdin (see Background)")
    srv.add_argument("--arch", default="sm_90")
    opts = parser.parse_args(argv)
    if opts.command == "record":
        return record(opts.launches, opts.pytest_args)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # before numba is imported (unpickling imports it)
    cc = divmod(int(opts.arch.removeprefix("sm_")), 10)  # sm_90 -> (9, 0), sm_100 -> (10, 0)
    if opts.command == "serve":
        return serve(cc)
    with open(opts.launches, "rb") as f:
        launches = pickle.load(f)
    rows = compile_all(launches, cc)
    with open(opts.report, "w") as f:
        json.dump({"arch": opts.arch, "kernels": rows}, f, indent=1)
    if opts.csv:
        write_csv(rows, opts.csv)
    failed = [r for r in rows if "error" in r]
    print(f"{len(rows) - len(failed)} of {len(rows)} kernel launches compiled for {opts.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
