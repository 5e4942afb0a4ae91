"""Shared machinery of the benchmarks: data, timing, verification, CSV rows, CLI.

Every op script builds its inputs once on the device, lists its providers
(hbkernels first, then peers such as NumPy/CuPy, PyTorch, JAX) and hands them
to :meth:`Context.compare`, which

1. makes a few copies of the inputs to rotate between (so a cache does not
   keep the previous repetition's data warm: the copies together span
   several times the L2 of a GPU or the last-level cache of a CPU);
2. runs every provider once and checks its result against a peer's with
   ``np.testing.assert_allclose`` (a wrong kernel fails the run, never gets
   timed);
3. times each provider after warm-up: CUDA events around every repetition on
   a GPU, ``time.perf_counter`` on the CPU; keeps median, p20 and p80 in ms;
4. appends one CSV row per provider (:data:`COLUMNS`) and prints it.

Peers that are not installed are skipped with a note; ``HBK_BENCH_NO=torch,jax``
makes the benchmarks behave as if those were not installed.
"""
import argparse
import csv
import importlib
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from hbkernels._machine import cpu_name, simulator_enabled
from hbkernels._simulator import xp as simulated_cupy
from hbkernels._validate import is_bfloat16
from hbkernels.memory import aligned_empty

from .options import add_run_arguments

COLUMNS = (
    "op", "provider", "mode", "size", "dtype",
    "median_ms", "p20_ms", "p80_ms", "gbps", "device",
)
RESULTS_DIR = Path("bench") / "results"   # under the current directory (the checkout's root)
HBK = "hbkernels"
DISABLE_ENV = "HBK_BENCH_NO"
PERMUTATION_SEED = 20240601  # one fixed scattering of hot rows for every id stream
MiB = 1 << 20


# -- optional peers -----------------------------------------------------------
def optional_module(name):
    """``name`` imported, or None when it is missing or disabled by ``HBK_BENCH_NO``."""
    disabled = {s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip()}
    if name.split(".")[0] in disabled:
        return None
    try:
        return importlib.import_module(name)
    except (ImportError, OSError):
        return None


# -- data ---------------------------------------------------------------------
def zipf_cdf(num_rows, alpha):
    """CDF of the bounded Zipf law P(rank k) ∝ k**-alpha over k = 1..num_rows."""
    weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -float(alpha)
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return cdf


#: where an id space's rows lie by popularity (:func:`zipf_ids`)
LAYOUTS = ("scattered", "ranked", "uniform")


def zipf_ids(n, num_rows, alpha, *, seed=0, xp=np, dtype=np.int64, layout="scattered"):
    """``n`` ids in ``[0, num_rows)`` whose popularity ranks follow Zipf(alpha).

    Ranks come from the inverse CDF of the bounded law (no rejection, no
    modulo folding). ``layout`` (:data:`LAYOUTS`): ``"scattered"``, rank r maps
    to row ``perm[r]`` through one fixed random permutation, so the hot rows are
    spread across the table as in a hashed id space; ``"ranked"``, rank r is row
    r, the hot rows packed at the table's start as a vocabulary numbered by
    frequency gives; ``"uniform"``, every row alike (``alpha`` is not used). The
    same ``seed`` gives the same ids with NumPy and CuPy (``xp``); the search
    runs on ``xp``'s device.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    cdf = xp.asarray(zipf_cdf(num_rows, 0.0 if layout == "uniform" else alpha))
    u = xp.asarray(np.random.default_rng(seed).random(n))
    ranks = xp.minimum(xp.searchsorted(cdf, u, side="right"), num_rows - 1)
    if layout != "scattered":
        return ranks.astype(dtype)
    perm = xp.asarray(np.random.default_rng(PERMUTATION_SEED).permutation(num_rows))
    return perm[ranks].astype(dtype)


def bags_size(cfg):
    """The size column of bags of ``cfg`` (:meth:`Context.fixed_bags`)."""
    layout = cfg.get("layout", "scattered")
    skew = "" if layout == "uniform" else f" zipf={cfg['alpha']}"
    return f"E={cfg['E']} D={cfg['D']} B={cfg['B']} L={cfg['L']}{skew} layout={layout}"


def float_dtype(name):
    """The dtype of a float dtype name: NumPy's, or ml_dtypes' for ``"bfloat16"``."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def random_table(num_rows, dim, dtype, *, seed=0, xp=np, line_offset=0):
    """A ``[num_rows, dim]`` table of uniform values in [-1, 1), made on ``xp``'s device
    (``dtype`` a dtype or its name; bf16 on the GPU needs CuPy >= 14). On the CPU
    its data start ``line_offset`` bytes after a cache line: 0 as torch's own
    tensors and hbkernels' tables (:func:`hbkernels.aligned_empty`), 16 as a plain
    large NumPy array."""
    dtype = float_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    if xp is np or xp is simulated_cupy:
        table = np.random.default_rng(seed).random((num_rows, dim), dtype=np.float32)
    else:
        table = xp.random.RandomState(seed).random_sample((num_rows, dim), dtype=xp.float32)
    table *= 2
    table -= 1
    if xp is simulated_cupy:
        return xp.asarray(table, dtype)
    if xp is not np:
        return table if np.dtype(dtype) == np.float32 else table.astype(dtype)
    placed = placed_empty((num_rows, dim), dtype, line_offset)
    placed[...] = table if np.dtype(dtype) == np.float32 else table.astype(dtype)
    return placed


def placed_empty(shape, dtype, line_offset=0):
    """An uninitialised C-contiguous host array whose data start ``line_offset``
    bytes after a cache line."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return aligned_empty(nbytes + line_offset, np.uint8)[line_offset:].view(dtype).reshape(shape)


def to_host(x):
    """NumPy view/copy of a NumPy, CuPy, Numba, torch or JAX array (tuples mapped)."""
    if isinstance(x, (tuple, list)):
        return tuple(to_host(v) for v in x)
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__ or ""
    if mod.startswith("cupy"):
        return x.get()
    if mod.startswith("torch"):
        import torch

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:  # NumPy has bf16 through ml_dtypes only: the bits cross
            return x.view(torch.int16).numpy().view(float_dtype("bfloat16"))
        return x.numpy()
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    return np.asarray(x)


def as_arrays(result):
    """Default canonical form of a result: a tuple of host arrays."""
    host = to_host(result)
    return host if isinstance(host, tuple) else (host,)


def assert_same(got, expected, rtol, atol, what):
    if len(got) != len(expected):
        raise AssertionError(f"{what}: {len(got)} outputs, expected {len(expected)}")
    for i, (g, e) in enumerate(zip(got, expected)):
        g, e = np.asarray(g), np.asarray(e)
        if g.shape != e.shape:
            raise AssertionError(f"{what}: output {i} has shape {g.shape}, expected {e.shape}")
        if np.issubdtype(e.dtype, np.floating) or is_bfloat16(e.dtype):
            g, e = g.astype(np.float64), e.astype(np.float64)
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"{what}: output {i}")


# -- device -------------------------------------------------------------------
def gpu_name(cupy):
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def cuda_problem():
    """Why ``--device cuda`` cannot run here, in one line, or None when it can.

    Needs CuPy, a GPU that CuPy sees, and Numba's real CUDA target: under
    ``NUMBA_ENABLE_CUDASIM=1`` (the CPU-only test runs) the kernels would run
    in the simulator, which is no GPU to benchmark.
    """
    cupy = optional_module("cupy")
    if cupy is None:
        return "--device cuda needs CuPy (pip install 'hbkernels[cuda13]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        return f"--device cuda: CuPy finds no usable GPU ({type(exc).__name__}: {exc})".splitlines()[0]
    if count < 1:
        return "--device cuda: CuPy finds no GPU"
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return "--device cuda: NUMBA_ENABLE_CUDASIM is set; the CUDA simulator is no GPU to benchmark"
    try:
        from numba import cuda
    except ImportError:
        return "--device cuda needs numba-cuda (pip install 'hbkernels[cuda13]')"
    if not cuda.is_available():
        return "--device cuda: Numba finds no usable GPU"
    return None


def slug(name):
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def _cpu_cache_bytes():
    """Largest CPU cache (the LLC) in bytes, 32 MiB when sysfs does not say."""
    sizes = []
    for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        m = re.fullmatch(r"(\d+)([KMG]?)", p.read_text().strip())
        if m:
            sizes.append(int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])
    return max(sizes, default=32 * MiB)


def _cpu_free_bytes():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


# -- timing -------------------------------------------------------------------
@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int

    @classmethod
    def of(cls, times_ms):
        med, p20, p80 = np.percentile(np.asarray(times_ms, np.float64), [50, 20, 80])
        return cls(float(med), float(p20), float(p80), len(times_ms))


@dataclass
class Provider:
    """One implementation of an op. ``run(inputs)`` is what gets timed; ``prepare``
    (untimed, once per input copy) turns the device arrays into what ``run``
    takes (e.g. zero-copy torch tensors); ``block`` waits for an asynchronous
    result (JAX) and makes the timing use the wall clock."""

    name: str
    run: Callable[[dict], Any]
    prepare: Optional[Callable[[dict], dict]] = None
    block: Optional[Callable[[Any], Any]] = None


_UNSET = object()


class Context:
    """Device, timing policy and CSV of one benchmark run."""

    def __init__(self, device="cpu", out=None, *, smoke=False, reps=None, warmup=None,
                 providers=None, seed=0):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.device = device
        self.is_cuda = device == "cuda"
        self.smoke = smoke
        self.seed = seed
        self.on_gpu = self.is_cuda and not simulator_enabled()
        self.simulated = self.is_cuda and not self.on_gpu  # a rehearsal: tiny sizes, one rep
        if self.simulated:
            if not smoke:
                raise SystemExit("--device cuda: NUMBA_ENABLE_CUDASIM=1 runs the kernels in "
                                 "Numba's simulator, which is no GPU to time; there only --smoke "
                                 "runs (a rehearsal of the run, its times mean nothing)")
            self.xp, self.xp_name, self.device_name = simulated_cupy, "numpy", "CUDA simulator"
        elif self.is_cuda:
            problem = cuda_problem()
            if problem:
                raise SystemExit(problem)
            cupy = optional_module("cupy")
            self.xp, self.xp_name = cupy, "cupy"
            self.device_name = gpu_name(cupy)
        else:
            self.xp, self.xp_name = np, "numpy"
            self.device_name = cpu_name()
        self.out = Path(out) if out else RESULTS_DIR / f"{slug(self.device_name)}.csv"
        self.only = {s.strip() for s in providers.split(",") if s.strip()} if providers else None
        # timing policy: warm-up calls, then repetitions filling about budget_s
        if self.simulated:
            self.warmup, self.budget_s, self.min_reps, self.max_reps = 1, 0.0, 1, 1
        elif smoke:
            self.warmup, self.budget_s, self.min_reps, self.max_reps = 1, 0.0, 2, 2
        elif self.is_cuda:
            self.warmup, self.budget_s, self.min_reps, self.max_reps = 5, 0.5, 10, 200
        else:
            self.warmup, self.budget_s, self.min_reps, self.max_reps = 2, 1.0, 5, 50
        if warmup is not None:
            self.warmup = max(1, warmup)
        self.reps = reps
        self.rows = []
        self.copy_gbps = None
        self._torch = _UNSET
        self.notes = []  # in the order they came

    @classmethod
    def from_args(cls, args):
        return cls(args.device, args.out, smoke=args.smoke, reps=args.reps, warmup=args.warmup,
                   providers=args.providers, seed=args.seed)

    def note(self, msg):
        if msg not in self.notes:
            self.notes.append(msg)
            print(f"note: {msg}")

    # -- data on this device ----------------------------------------------------
    def zipf_ids(self, n, num_rows, alpha, seed_offset=0):
        return zipf_ids(n, num_rows, alpha, seed=self.seed + seed_offset, xp=self.xp)

    def fixed_bags(self, cfg):
        """``(ids, offsets)``: ``cfg``'s ``B`` bags of ``L`` Zipf(``alpha``) ids over ``E``
        rows in its ``layout`` (:data:`LAYOUTS`; default scattered), on this device."""
        ids = zipf_ids(cfg["B"] * cfg["L"], cfg["E"], cfg["alpha"], seed=self.seed, xp=self.xp,
                       layout=cfg.get("layout", "scattered"))
        return ids, self.xp.arange(cfg["B"] + 1, dtype=self.xp.int64) * cfg["L"]

    def random_table(self, num_rows, dim, dtype, seed_offset=0, line_offset=0):
        return random_table(num_rows, dim, dtype, seed=self.seed + seed_offset, xp=self.xp,
                            line_offset=line_offset)

    # -- peers ------------------------------------------------------------------
    @property
    def torch(self):
        """torch when it can run on this device, else None (with a note)."""
        if self._torch is _UNSET:
            torch = optional_module("torch")
            if torch is None:
                self.note("torch is not installed (or disabled): torch peers are skipped")
            elif self.is_cuda and not torch.cuda.is_available():
                self.note("torch has no CUDA here: torch peers are skipped")
                torch = None
            if torch is not None and self.is_cuda:
                # CUDA events are recorded on CuPy's current stream; torch must
                # launch on the same (legacy default) stream for them to bracket it
                cupy_stream = self.xp.cuda.get_current_stream().ptr
                if torch.cuda.current_stream().cuda_stream != cupy_stream:
                    raise RuntimeError("torch and CuPy are on different CUDA streams")
            self._torch = torch
        return self._torch

    def as_torch(self, inputs):
        """Zero-copy torch views of a dict of arrays (CPU: from_numpy, GPU: DLPack)."""
        t = self.torch
        conv = t.from_dlpack if self.is_cuda else t.from_numpy

        def view(a):  # bf16 crosses as its bits (NumPy and older CuPy export no bf16)
            if is_bfloat16(a.dtype):
                return conv(a.view(np.int16)).view(t.bfloat16)
            return conv(a)

        return {k: view(v) for k, v in inputs.items()}

    def jax_device(self):
        """(jax, device) when JAX has a backend for this device, else (None, None)."""
        jax = optional_module("jax")
        if jax is None:
            self.note("jax is not installed (or disabled): jax peers are skipped")
            return None, None
        try:
            return jax, jax.devices("gpu" if self.is_cuda else "cpu")[0]
        except RuntimeError:
            self.note(f"jax has no {self.device} backend here: jax peers are skipped")
            return None, None

    @property
    def add_at(self):
        """``f(out, indices, values)`` adding ``values`` into ``out`` at ``indices``, repeats
        summed: ``cupyx.scatter_add`` on a GPU, ``np.add.at`` elsewhere."""
        return optional_module("cupyx").scatter_add if self.on_gpu else np.add.at

    def selected(self, name):
        return self.only is None or name in self.only

    # -- memory -----------------------------------------------------------------
    def sync(self):
        if self.on_gpu:
            self.xp.cuda.runtime.deviceSynchronize()

    def release(self):
        """Give cached device memory back between cases (CuPy pool, torch cache)."""
        if self.on_gpu:
            self.sync()
            self.xp.get_default_memory_pool().free_all_blocks()
            if self._torch not in (_UNSET, None):
                self._torch.cuda.empty_cache()

    def cache_bytes(self):
        if self.on_gpu:
            props = self.xp.cuda.runtime.getDeviceProperties(self.xp.cuda.Device().id)
            return int(props.get("l2CacheSize", 50 * MiB))
        return _cpu_cache_bytes()

    def free_bytes(self):
        if self.on_gpu:
            return int(self.xp.cuda.runtime.memGetInfo()[0])
        return _cpu_free_bytes()

    def rotation(self, inputs):
        """``inputs`` plus copies of it, enough that the set spans 4x the cache
        (at least 2 on a GPU, at most 8, and within 40% of free memory)."""
        nbytes = max(1, sum(int(a.nbytes) for a in inputs.values()))
        want = math.ceil(4 * self.cache_bytes() / nbytes)
        n = min(max(want, 2 if self.is_cuda else 1), 8)
        n = max(1, min(n, int(0.4 * self.free_bytes()) // nbytes))
        return [inputs] + [{k: v.copy() for k, v in inputs.items()} for _ in range(n - 1)]

    # -- timing -----------------------------------------------------------------
    def measure(self, run, copies, block=None):
        """Time ``run(copy)`` rotating over ``copies``: warm-up, then repetitions."""
        return self.measure_together([(run, copies, block)])[0]

    def measure_together(self, cases):
        """Time each ``(run, copies, block)`` of ``cases`` (providers of one op):
        warm-up, then repetitions, a number per case filling about ``budget_s``.

        On a GPU each case runs its repetitions back to back between CUDA events.
        On the CPU the cases take turns, each case's calls spread evenly over
        the rounds, so that what drifts on a shared machine (other tenants,
        clocks) hits every provider alike and their ratio is fair; each round
        runs them in a fresh (seeded) order, so that the cache a slow peer
        leaves cold does not always greet the same provider."""
        calls = [self._caller(*case) for case in cases]
        if not calls:
            return []
        reps = []
        for call in calls:
            warm = []
            for i in range(self.warmup):
                t0 = time.perf_counter()
                call(i)
                self.sync()
                warm.append(time.perf_counter() - t0)
            reps.append(self.reps or int(np.clip(self.budget_s / max(min(warm), 1e-6),
                                                 self.min_reps, self.max_reps)))
        start = self.warmup  # go on rotating: the first timed copy is not the last warm one
        if self.on_gpu:
            return [Timing.of(self._ms_on_stream(call, start, n) if case[2] is None
                              else [self._ms_wall(call, start + i) for i in range(n)])
                    for call, case, n in zip(calls, cases, reps)]
        times = [[] for _ in calls]
        rounds = max(reps)
        order = np.random.default_rng(self.seed)
        for r in range(rounds):
            for k in order.permutation(len(calls)):  # no provider always runs after the same one
                n, t = reps[k], times[k]
                if (r + 1) * n // rounds > r * n // rounds:  # n calls spread over the rounds
                    t.append(self._ms_wall(calls[k], start + len(t)))
        return [Timing.of(t) for t in times]

    def _caller(self, run, copies, block):
        def call(i):
            result = run(copies[i % len(copies)])
            if block is not None:
                block(result)
        return call

    def _ms_on_stream(self, call, start, reps):
        cp = self.xp
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
        for i, (begin, end) in enumerate(events):
            begin.record()
            call(start + i)
            end.record()
        events[-1][1].synchronize()
        return [cp.cuda.get_elapsed_time(begin, end) for begin, end in events]

    def _ms_wall(self, call, i):
        self.sync()
        t0 = time.perf_counter()
        call(i)
        self.sync()
        return (time.perf_counter() - t0) * 1e3

    # -- one case: verify, then time every provider -------------------------------
    def compare(self, op, mode, size, dtype, inputs, providers, *, nbytes,
                canon=as_arrays, rtol=0.0, atol=0.0, reference=(), bounds=(), parts=()):
        """Verify every provider against a peer, then time and record each.

        ``providers[0]`` is hbkernels; ``None`` entries (peers not available)
        are dropped. ``nbytes`` is the bytes one call moves, or a function of
        hbkernels' canonical result. ``canon`` maps a host result to a tuple of
        arrays that must agree across providers (e.g. sorted for unique).
        Each row's speedup is against the fastest peer timed in this case, or
        the fastest of ``reference`` when given (e.g. hbkernels itself, for the
        overhead of a front end). ``bounds``: providers timed with the others
        and not verified (what the machine's memory allows the case, e.g.
        :func:`.bounds.gather_scatter`), a row each. ``parts``: providers of a part of
        the op (a forward alone, an update alone), timed with the others and not
        verified, a row each.
        """
        providers = [p for p in providers if p is not None]
        if not providers or providers[0].name != HBK:
            raise ValueError("providers[0] must be hbkernels")
        timed = [p for p in providers if self.selected(p.name)]
        peers = [p for p in providers if not p.name.startswith(HBK)]
        checked_peers = [p for p in peers if self.selected(p.name)] or peers[:1]
        if not checked_peers:
            raise RuntimeError(f"{op}: no peer to verify hbkernels against")
        runs = {p.name: p for p in [providers[0]] + timed + checked_peers}

        copies = self.rotation(inputs)
        prepared = {name: [p.prepare(c) if p.prepare else c for c in copies]
                    for name, p in runs.items()}
        what = f"{op} mode={mode} dtype={dtype} [{size}]"
        ref = checked_peers[0]
        expected = canon(to_host(ref.run(prepared[ref.name][0])))
        hbk_result = None
        for name, p in runs.items():
            if p is ref:
                continue
            got = canon(to_host(p.run(prepared[name][0])))
            assert_same(got, expected, rtol, atol, f"{what}: {name} vs {ref.name}")
            if name == HBK:
                hbk_result = got
        others = ", ".join(n for n in runs if n != ref.name)
        print(f"verified {others} against {ref.name}: {what}")

        if not timed:
            self.note(f"{op}: none of --providers {', '.join(sorted(self.only))} runs here "
                      f"(it has {', '.join(p.name for p in providers)}): nothing timed")
        moved = nbytes(hbk_result) if callable(nbytes) else nbytes
        unverified = [b for b in (*bounds, *parts) if self.selected(b.name)]
        for b in unverified:
            prepared[b.name] = [b.prepare(c) if b.prepare else c for c in copies]
        timings = self.measure_together([(p.run, prepared[p.name], p.block)
                                         for p in timed + unverified])
        for p, timing in zip(timed + unverified, timings):
            self.record(op, p.name, mode, size, dtype, timing, moved,
                        reference=tuple(reference) or tuple(p.name for p in peers))
        del prepared, copies
        self.release()

    # -- rows -------------------------------------------------------------------
    def record(self, op, provider, mode, size, dtype, timing, nbytes, reference=()):
        gbps = nbytes / (timing.median_ms * 1e6) if nbytes and timing.median_ms > 0 else None
        row = {
            "op": op, "provider": provider, "mode": mode, "size": size, "dtype": str(dtype),
            "median_ms": f"{timing.median_ms:.6g}", "p20_ms": f"{timing.p20_ms:.6g}",
            "p80_ms": f"{timing.p80_ms:.6g}", "gbps": "" if gbps is None else f"{gbps:.6g}",
            "device": self.device_name,
        }
        append_csv(self.out, row)
        self.rows.append({**row, "_reference": reference})
        print(f"  {op:<14} {mode:<8} {str(dtype):<8} {provider:<20} "
              f"{timing.median_ms:10.3f} ms  [{timing.p20_ms:.3f}, {timing.p80_ms:.3f}]"
              f"  {'' if gbps is None else f'{gbps:8.1f} GB/s'}  ({timing.reps} reps)")
        return row

    def copy_bandwidth(self):
        """Measure (once) a large same-device copy; records an ``op=copy`` row.

        GB/s counts bytes read plus bytes written. On a GPU this is a
        ``cudaMemcpyAsync`` device-to-device (the roofline the GB/s of the
        ops are compared with); on the CPU a single-threaded ``np.copyto``.
        """
        if self.copy_gbps is not None:
            return self.copy_gbps
        nbytes = 8 * MiB if self.smoke else (1024 * MiB if self.is_cuda else 256 * MiB)
        xp = self.xp
        src = xp.ones(nbytes, dtype=xp.uint8)
        dst = xp.empty_like(src)
        if self.on_gpu:
            def run(a):
                a["dst"].data.copy_from_device_async(a["src"].data, nbytes)
        else:
            def run(a):
                np.copyto(a["dst"], a["src"])
        timing = self.measure(run, [{"src": src, "dst": dst}])
        self.record("copy", self.xp_name, "d2d" if self.on_gpu else "memcpy",
                    f"bytes={nbytes}", "uint8", timing, 2 * nbytes)
        self.copy_gbps = 2 * nbytes / (timing.median_ms * 1e6)
        del src, dst
        self.release()
        return self.copy_gbps

    def results(self):
        """The rows of this run with numbers: see :func:`results`."""
        return results(self.rows, self.copy_gbps)

    def summary(self):
        """The table of this run: one line per row, speedup vs the case's peer."""
        return format_table(self.results())

    def ratio(self, op, mode, dtype, provider=HBK, peer="torch", size=None):
        """median(provider) / median(peer) for one op case (the first of any size unless
        ``size`` is given), or None if either is missing."""
        def median(name):
            for r in self.rows:
                if ((r["op"], r["mode"], r["dtype"], r["provider"]) == (op, mode, str(dtype), name)
                        and size in (None, r["size"])):
                    return float(r["median_ms"])
            return None

        a, b = median(provider), median(peer)
        return None if a is None or b is None else a / b


def results(rows, copy_gbps=None):
    """``rows`` (:attr:`Context.rows`) as dicts of numbers, grouped by case
    (op, mode, size, dtype) in the order the cases ran.

    Adds ``speedup`` (the case's reference peer's median over this row's: > 1
    is faster than the peer; the reference is the fastest of the providers the
    case names in ``_reference``, see :meth:`Context.compare`; None for that
    peer itself or when the case has none), ``vs`` (that peer) and ``pct_copy`` (GB/s as % of the copy
    bandwidth measured in the same run; None without GB/s or copy row).
    """
    # the copy row's own (rounded) GB/s, so that it reads exactly 100%
    copy_gbps = next((float(r["gbps"]) for r in rows if r["op"] == "copy" and r["gbps"]), copy_gbps)
    groups = {}
    for row in rows:
        groups.setdefault((row["op"], row["mode"], row["size"], row["dtype"]), []).append(row)
    out = []
    for case in groups.values():
        named = [r for r in case if r["provider"] in (case[0].get("_reference") or ())]
        ref = min(named, key=lambda r: float(r["median_ms"])) if named else None   # the fastest
        for r in case:
            ms = float(r["median_ms"])
            gbps = float(r["gbps"]) if r["gbps"] else None
            against = ref is not None and r is not ref and ms > 0
            out.append({
                "op": r["op"], "mode": r["mode"], "dtype": r["dtype"], "size": r["size"],
                "provider": r["provider"], "median_ms": ms, "p20_ms": float(r["p20_ms"]),
                "p80_ms": float(r["p80_ms"]), "gbps": gbps,
                "pct_copy": 100 * gbps / copy_gbps if gbps and copy_gbps else None,
                "speedup": float(ref["median_ms"]) / ms if against else None,
                "vs": ref["provider"] if against else None,
                "device": r["device"],
            })
    return out


TABLE_HEAD = ("op", "mode", "dtype", "size", "provider", "median ms", "GB/s", "% copy",
              "speedup", "vs")


def format_table(rows):
    """Plain-text table of :func:`results` rows (``hbkernels/bench/run_all.py``, ``hbkernels bench``)."""
    table = [list(TABLE_HEAD)]
    for r in rows:
        table.append([
            r["op"], r["mode"], r["dtype"], r["size"], r["provider"], f"{r['median_ms']:.3f}",
            "" if r["gbps"] is None else f"{r['gbps']:.1f}",
            "" if r["pct_copy"] is None else f"{r['pct_copy']:.{0 if r['pct_copy'] >= 10 else 1}f}%",
            "" if r["speedup"] is None else f"{r['speedup']:.2f}x",
            r["vs"] or "",
        ])
    widths = [max(len(line[i]) for line in table) for i in range(len(TABLE_HEAD))]
    text = []
    for k, line in enumerate(table):
        text.append("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
        if k == 0:
            text.append("  ".join("-" * w for w in widths))
    return "\n".join(text)


def append_csv(path, row):
    """Append one row to ``path``, creating it (and its folder) with the header."""
    append_rows(path, [row])


def append_rows(path, rows, columns=COLUMNS):
    """Append ``rows`` (dicts; keys beyond ``columns`` left out) to the CSV ``path``,
    creating it (and its folder) with the header ``columns``; a file with another header
    is a ``ValueError``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != tuple(columns):
            raise ValueError(f"{path} has the header {header}, expected {list(columns)}; "
                             "pass another --out")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(rows)


# -- command line -------------------------------------------------------------
def parser(description):
    p = argparse.ArgumentParser(description=description)
    add_run_arguments(p)
    p.add_argument("--out", default=None,
                   help="CSV to append rows to (default: bench/results/<device-slug>.csv)")
    return p


def cli_main(run, argv=None, description=None):
    """``main`` of one op script: parse, measure copy bandwidth, run, print the table."""
    args = parser(description).parse_args(argv)
    ctx = Context.from_args(args)
    print(f"device: {ctx.device_name} ({ctx.device}); rows -> {ctx.out}")
    ctx.copy_bandwidth()
    run(ctx)
    print()
    print(ctx.summary())
    return ctx
