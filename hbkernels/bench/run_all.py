"""Run every op benchmark on one device, print one table, append all rows to one CSV.

    python3 -m hbkernels.bench.run_all --device cpu            # bench/results/<cpu>.csv
    python3 -m hbkernels.bench.run_all --device cuda --smoke   # quick check on a GPU
    python3 -m hbkernels.bench.run_all --device cuda --ops embedding_bag,unique

An op that fails (e.g. its CUDA kernel module does not exist yet, or its
result disagrees with the peer) is reported and the others still run; the
exit status is then 1.
"""
import sys
import traceback

from . import (
    bench_checkpoint,
    bench_embedding_bag,
    bench_embedding_bag_backward,
    bench_fused_step,
    bench_hash_table,
    bench_launch,
    bench_lookup,
    bench_partition,
    bench_per_sample_weights_backward,
    bench_quantized_bag,
    bench_segment_reduce,
    bench_segment_sum,
    bench_tiered,
    bench_train,
    bench_unique,
)
from .bounds import BOUND
from .common import HBK, Context, parser

BENCHMARKS = {
    "embedding_bag": bench_embedding_bag,
    "embedding_bag_backward": bench_embedding_bag_backward,
    "fused_step": bench_fused_step,
    "lookup": bench_lookup,
    "unique": bench_unique,
    "hash_table": bench_hash_table,
    "segment_sum": bench_segment_sum,
    "segment_reduce": bench_segment_reduce,
    "partition": bench_partition,
    "per_sample_weights_backward": bench_per_sample_weights_backward,
    "train": bench_train,
    "tiered": bench_tiered,
    "host_per_call": bench_launch,
    "quantized_bag": bench_quantized_bag,
    "checkpoint": bench_checkpoint,
}


ARRAYS = "<arrays>"
"""Stands in :data:`PROVIDERS` for the device's array library: numpy on the CPU, cupy on a GPU."""

#: the providers each op that honours ``--providers`` can time (hash_table, host_per_call
#: and checkpoint time all theirs)
PROVIDERS = {
    "embedding_bag": (HBK, HBK + "-unchecked", ARRAYS, "torch", "fbgemm-tbe", BOUND),
    "embedding_bag_backward": (*bench_embedding_bag_backward.PROVIDERS, ARRAYS, BOUND),
    "fused_step": (*bench_fused_step.PROVIDERS, BOUND),
    "lookup": (HBK, HBK + "-unchecked", ARRAYS, "torch"),
    "unique": (HBK, HBK + "-sorted", ARRAYS, "torch"),
    "segment_sum": (HBK, HBK + "-unchecked", ARRAYS, "torch", "jax"),
    "segment_reduce": (HBK, ARRAYS, "torch"),
    "partition": (HBK, ARRAYS, "torch"),
    "per_sample_weights_backward": (HBK, ARRAYS, "torch"),
    "train": (HBK, "torchrec", bench_train.DYNAMIC),
    "tiered": tuple(name for name, _ in bench_tiered.providers(rows=100, fits=True)),
    "quantized_bag": (HBK, bench_quantized_bag.FP32, ARRAYS, bench_quantized_bag.TBE),
}


def provider_names(ops, device):
    """The providers ``ops`` can time on ``device`` (:data:`PROVIDERS`), each once, in order."""
    arrays = {"cpu": "numpy", "cuda": "cupy"}[device]
    names = [arrays if n == ARRAYS else n for op in ops for n in PROVIDERS.get(op, ())]
    return list(dict.fromkeys(names))


def check_providers(spec, ops, device):
    """ValueError unless every provider named in ``spec`` ("a,b", None: all) is one that
    ``ops`` can time on ``device``."""
    wanted = [s.strip() for s in spec.split(",") if s.strip()] if spec else []
    if not wanted:
        return
    names = provider_names(ops, device)
    if not names:
        raise ValueError(f"--providers does not apply to {', '.join(ops)}: "
                         f"{'it times' if len(ops) == 1 else 'they time'} every provider")
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise ValueError(f"unknown provider{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"choose from {', '.join(names)} (what the ops chosen time on {device})")


def select_ops(spec=None):
    """The ops named in ``spec`` ("a,b", None: all), in the order given; ValueError on an unknown one."""
    ops = [o.strip() for o in spec.split(",") if o.strip()] if spec else list(BENCHMARKS)
    unknown = [o for o in ops if o not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown op{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"choose from {', '.join(BENCHMARKS)}")
    if not ops:
        raise ValueError(f"no op named in {spec!r}; choose from {', '.join(BENCHMARKS)}")
    return ops


def run_ops(ctx, ops, progress=None):
    """Measure the copy bandwidth, then run ``ops`` on ``ctx``; returns the failures.

    An op that raises is reported (traceback on stderr, one line in the
    returned list) and the others still run. ``progress(step, done)`` is
    called before (``done=False``) and after (``done=True``) each step:
    "copy", then every op.
    """
    progress = progress or (lambda step, done: None)
    progress("copy", False)
    ctx.copy_bandwidth()
    progress("copy", True)
    failed = []
    for op in ops:
        progress(op, False)
        print(f"\n== {op}")
        try:
            BENCHMARKS[op].run(ctx)
        except Exception as exc:  # keep going: one missing kernel must not hide the others
            traceback.print_exc()
            failed.append(f"{op}: {type(exc).__name__}: {exc}".splitlines()[0])
            ctx.release()
        progress(op, True)
    return failed


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ops", default=None,
                   help=f"comma-separated subset of {','.join(BENCHMARKS)} (default: all)")
    args = p.parse_args(argv)
    try:
        ops = select_ops(args.ops)
        check_providers(args.providers, ops, args.device)
    except ValueError as exc:
        p.error(str(exc))
    ctx = Context.from_args(args)
    print(f"device: {ctx.device_name} ({ctx.device}); rows -> {ctx.out}")
    failed = run_ops(ctx, ops)
    print()
    print(ctx.summary())
    print(f"\nrows appended to {ctx.out}")
    if failed:
        print("\nFAILED:\n  " + "\n  ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
