"""``hbkernels warmup``: compile the kernels once, into the on-disk caches, so that later
processes start warm.

    hbkernels warmup                              # D = 16, 32, 64, 128 in float32, and train's step
    hbkernels warmup --dims 8,24 --dtypes float32,bfloat16 --no-train
    hbkernels warmup --device cuda                # the CUDA kernels (and train's step on the GPU)

Numba compiles a kernel on its first call with a new combination of argument
types (and, for the CPU kernels, embedding width D) and keeps it in a cache:
Numba's for the CPU kernels, ``hbkernels.cuda._kernel_cache``'s cubins for the CUDA
kernels (``hbkernels info`` says where; a read-only install gets a private one).
This command makes those first calls on tiny inputs on the ``--device``: for every D
and dtype asked, ``embedding_bag`` (weighted or not, every ``bounds``), its backward,
``lookup`` and its backward, ``segment_sum``, ``unique``, a ``HashTable``'s
calls, and every optimizer's ``step`` and ``fused_step``, with int32 and int64 ids; then two
steps of ``hbkernels train`` (its default model, at each ``--dims`` entry
that ``train --dim`` would use: ``--train-dim``). Run it once after
installing, or in a container's build; it prints what it compiled and how
long each part took.
"""
import os
import subprocess
import sys
import tempfile
import time

from ._errors import CLIError

DEFAULT_DIMS = "16,32,64,128"
ID_DTYPES = ("int32", "int64")
OPTIMIZERS = ("SGD", "Adagrad", "RowWiseAdagrad", "Adam", "Ftrl")
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")


def warm_ops(dim, dtype, id_dtype, device="cpu"):
    """Call every op once on ``device``, on tiny inputs of width ``dim``, table dtype
    ``dtype``, ids of ``id_dtype``."""
    import numpy as np

    import hbkernels as hbk
    from .._dispatch import device_family, host
    from ..bench.common import float_dtype

    put = device_family(device).put
    dtype = float_dtype(dtype)
    rows = 64
    table = hbk.aligned_empty((rows, dim), dtype)
    table[...] = 0.5
    table = put(table)
    values = put(np.array([0, 5, rows - 1, 5, 7], id_dtype))
    offsets = put(np.array([0, 2, 2, 5], id_dtype))
    psw = put(np.ones(values.shape[0], np.float32))
    grad = put(np.ones((offsets.shape[0] - 1, dim), dtype))
    for bounds in ("raise", "zero", "unchecked"):
        for weights in (None, psw):
            hbk.embedding_bag(table, values, offsets, combiner="mean", per_sample_weights=weights,
                              bounds=bounds)
            hbk.embedding_bag_backward(grad, values, offsets, num_rows=rows, combiner="mean",
                                       per_sample_weights=weights, bounds=bounds)
        hbk.lookup(table, values, bounds=bounds)
        hbk.lookup_backward(put(np.ones((values.shape[0], dim), dtype)), values, num_rows=rows,
                            bounds=bounds)
    hbk.segment_sum(put(np.ones((values.shape[0], dim), dtype)), values, rows)
    hbk.unique(values, return_inverse=True, return_counts=True)
    ids = hbk.HashTable(4, evict="lfu", admit_count=2, device=device)
    for _ in range(3):
        ids.slots(values)
    ids.slots(values, insert=False)
    ids.erase(values[:1])
    for name in OPTIMIZERS:
        opt = getattr(hbk.optim, name)(lr=0.01)
        weights = put(host(table).copy())
        state = opt.init_state(weights)
        opt.fused_step(weights, state, grad, values, offsets)
        opt.step(weights, state, hbk.embedding_bag_backward(grad, values, offsets, num_rows=rows))
    hbk.synchronize()


def warm_train(dim, device="cpu"):
    """Two steps of ``hbkernels train --dim dim --device device`` on a small batch in a
    child process (same environment, so the same kernel cache), output discarded."""
    with tempfile.TemporaryDirectory(prefix="hbkernels-warmup-") as tmp:
        argv = [sys.executable, "-m", "hbkernels", "train", "--steps", "2", "--batch-size", "64",
                "--eval-samples", "64", "--dim", str(dim), "--device", device,
                "--metrics", os.path.join(tmp, "metrics.json")]
        res = subprocess.run(argv, cwd=tmp, capture_output=True, text=True)
    if res.returncode:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise CLIError(f"warming up `hbkernels train --dim {dim}` failed: {last}")


def parse_list(text, convert, what):
    try:
        items = [convert(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        items = []
    if not items:
        raise CLIError(f"--{what} must be a comma-separated list, got {text!r}")
    return items


def run(args):
    from .._numba_cache import cache_info
    from ..bench.common import float_dtype

    dims = parse_list(args.dims, int, "dims")
    if min(dims) < 1:
        raise CLIError(f"--dims must be >= 1, got {args.dims!r}")
    dtypes = parse_list(args.dtypes, str, "dtypes")
    for name in dtypes:
        try:
            dtype = float_dtype(name)
        except (TypeError, ImportError) as exc:
            raise CLIError(f"--dtypes: {name!r} is not a float dtype here ({exc})") from None
        if name not in FLOAT_DTYPES or dtype.itemsize == 0:
            raise CLIError(f"--dtypes: {name!r} is not a float dtype here; choose from "
                           f"{', '.join(FLOAT_DTYPES)}")
    cache = cache_info()
    where = cache['location'] if cache['caching'] else 'off'
    if args.device == "cuda":
        from ..cuda import _kernel_cache

        where = _kernel_cache.directory() or "off (every process compiles)"
    print(f"hbkernels warmup: {args.device} kernel cache {where}", flush=True)
    started = time.perf_counter()
    for dim in dims:
        for dtype in dtypes:
            t0 = time.perf_counter()
            for id_dtype in ID_DTYPES:
                warm_ops(dim, dtype, id_dtype, args.device)
            print(f"  ops D={dim} {dtype}: {time.perf_counter() - t0:.1f} s", flush=True)
    if args.train:
        t0 = time.perf_counter()
        warm_train(args.train_dim, args.device)
        print(f"  hbkernels train --dim {args.train_dim}: {time.perf_counter() - t0:.1f} s",
              flush=True)
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


def add_command(subparsers):
    from ._help import HelpFormatter, plain

    p = subparsers.add_parser(
        "warmup", help="compile the kernels into the on-disk cache (once, after installing)",
        description=plain(__doc__), formatter_class=HelpFormatter)
    p.add_argument("--dims", default=DEFAULT_DIMS, help=f"embedding widths (default {DEFAULT_DIMS})")
    p.add_argument("--dtypes", default="float32",
                   help="table dtypes: float32, float64, float16, bfloat16 (default float32)")
    p.add_argument("--train-dim", type=int, default=16,
                   help="the --dim of the `hbkernels train` step warmed up (default 16)")
    p.add_argument("--no-train", dest="train", action="store_false",
                   help="skip the `hbkernels train` step")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="whose kernels to compile: the CPU's (default) or the GPU's")
    p.set_defaults(run=run)
