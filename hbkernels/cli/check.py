"""``hbkernels check``: whether the CUDA path works on this machine, in seconds, before
anything long runs on it.

    hbkernels check          # exit status 0 when every check passed, else 1

One line per check, ``ok`` or ``FAILED``, with its seconds:

* ``embedding_bag``: one call compiled for this GPU (or taken from the kernel cache),
  run on CUDA arrays, equal to :mod:`hbkernels.reference`'s result;
* ``fused_step``: one row-wise Adagrad step likewise, its rows and state equal to the
  reference's;
* ``bounds``: an id out of range does not stop the call; ``hbk.synchronize()`` raises it
  as :class:`hbkernels.BoundsError` naming the op;
* ``libraries``: the CUDA driver and runtime versions, and the file and version of
  each compiler library this process loaded: NVVM (Numba's compiler), nvJitLink (the
  linker that makes the kernels' cubins) and NVRTC (CuPy's compiler).

Under Numba's simulator (``NUMBA_ENABLE_CUDASIM=1``) the same calls run on simulated
arrays and no GPU library is needed.
"""
import re
import time

import numpy as np

CHECKS = ("embedding_bag", "fused_step", "bounds", "libraries")


def _inputs():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((30, 5)).astype(np.float32)
    values = rng.integers(0, 30, 12).astype(np.int64)
    values[:4] = 29  # a repeated id at the table's edge: the fused step sums its rows
    offsets = np.array([0, 3, 3, 7, 12], np.int64)
    grad = rng.standard_normal((4, 5)).astype(np.float32)
    return table, values, offsets, grad


def check_embedding_bag(put, host):
    import hbkernels as hbk

    table, values, offsets, _ = _inputs()
    want = hbk.reference.embedding_bag(table, values, offsets, "mean")
    got = host(hbk.embedding_bag(put(table), put(values), put(offsets), combiner="mean"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return f"{len(offsets) - 1} bags of width {table.shape[1]} equal to the reference's"


def check_fused_step(put, host):
    import hbkernels as hbk

    table, values, offsets, grad = _inputs()
    opt = hbk.optim.RowWiseAdagrad(lr=0.1)
    want, want_state = hbk.reference.optimizer_state(opt, table)
    bag_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    hbk.reference.optimizer_step(opt, want, want_state, values, grad[bag_of], 1)
    weights = put(table)
    state = opt.init_state(weights)
    opt.fused_step(weights, state, put(grad), put(values), put(offsets))
    np.testing.assert_allclose(host(weights), want, rtol=1e-5, atol=1e-6)
    for name, value in want_state.items():
        np.testing.assert_allclose(host(state[name]), value, rtol=1e-5, atol=1e-6)
    return f"row-wise Adagrad over {len(np.unique(values))} rows equal to the reference's"


def check_bounds(put, host):
    import hbkernels as hbk

    table, values, offsets, _ = _inputs()
    values[9] = table.shape[0]
    hbk.embedding_bag(put(table), put(values), put(offsets))
    try:
        hbk.synchronize()
    except hbk.BoundsError as error:
        if "embedding_bag" not in str(error) or "values[9]" not in str(error):
            raise AssertionError(f"the error does not name the op and position: {error}") from None
        return f"raised at hbk.synchronize(): {error}"
    raise AssertionError("hbk.synchronize() raised nothing for an id out of range")


def _loaded(pattern):
    """The files this process has mapped whose names match ``pattern``."""
    try:
        with open("/proc/self/maps") as f:
            found = {line.split()[-1] for line in f if re.search(pattern, line)}
    except OSError:
        return "?"
    return ", ".join(sorted(found)) or "not loaded"


def _version(ask):
    try:
        return ".".join(str(int(v)) for v in ask())
    except Exception as error:  # noqa: BLE001 - any failure is what the line reports
        return f"unavailable ({type(error).__name__}: {error})".splitlines()[0]


def check_libraries(simulated):
    if simulated:
        return "the simulator: no GPU library is used"
    import cupy
    from numba.cuda.cudadrv import nvvm

    def cuda_version(number):
        return lambda: divmod(int(number()), 1000)

    def nvjitlink():
        from cuda.bindings import nvjitlink

        return nvjitlink.version()

    parts = [
        f"driver CUDA {_version(cuda_version(cupy.cuda.runtime.driverGetVersion))}",
        f"runtime {_version(cuda_version(cupy.cuda.runtime.runtimeGetVersion))}",
        f"NVVM {_version(lambda: nvvm.NVVM().get_version())} from {_loaded(r'libnvvm')}",
        f"nvJitLink {_version(nvjitlink)} from {_loaded(r'libnvJitLink')}",
        f"NVRTC {_version(cupy.cuda.nvrtc.getVersion)} from {_loaded(r'libnvrtc')}",
    ]
    return "; ".join(parts)


def run_checks(out=print):
    """Run every check, printing a line each through ``out``; returns how many failed."""
    from .._dispatch import device_family, host
    from .._machine import simulator_enabled

    simulated = simulator_enabled()
    family = device_family("cuda")
    checks = {"embedding_bag": lambda: check_embedding_bag(family.put, host),
              "fused_step": lambda: check_fused_step(family.put, host),
              "bounds": lambda: check_bounds(family.put, host),
              "libraries": lambda: check_libraries(simulated)}
    failed = 0
    for name in CHECKS:
        t0 = time.perf_counter()
        try:
            said, ok = checks[name](), True
        except Exception as error:  # noqa: BLE001 - every failure is reported, the rest run
            said, ok = f"{type(error).__name__}: {error}".strip(), False
            failed += 1
        out(f"{'ok    ' if ok else 'FAILED'} {name:<14} {time.perf_counter() - t0:6.2f} s  {said}")
    return failed


def run(args):
    from .._machine import simulator_enabled
    from ._errors import CLIError
    from .info import probe_cuda

    if simulator_enabled():
        where = "Numba's CUDA simulator"
    else:
        devices, reason = probe_cuda()
        if not devices:
            raise CLIError(f"no CUDA GPU ({reason}); NUMBA_ENABLE_CUDASIM=1 checks the "
                           f"CUDA path in Numba's simulator")
        where = devices[0]["name"]
    print(f"hbkernels check: the CUDA path on {where}", flush=True)
    t0 = time.perf_counter()
    failed = run_checks(lambda line: print(line, flush=True))
    verdict = "every check passed" if not failed else f"{failed} of {len(CHECKS)} checks FAILED"
    print(f"hbkernels check: {verdict} in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


def add_command(subparsers):
    from ._help import HelpFormatter, plain

    p = subparsers.add_parser(
        "check", help="check that the CUDA path works here (compile, run, compare, errors)",
        description=plain(__doc__), formatter_class=HelpFormatter)
    p.set_defaults(run=run)
