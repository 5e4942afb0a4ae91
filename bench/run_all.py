"""Run every op benchmark on one device, print one table, append all rows to one CSV.

    PYTHONPATH=. python3 bench/run_all.py --device cpu            # bench/results/<cpu>.csv
    PYTHONPATH=. python3 bench/run_all.py --device cuda --smoke   # quick check on a GPU
    PYTHONPATH=. python3 bench/run_all.py --device cuda --ops embedding_bag,unique

An op that fails (e.g. its CUDA kernel module does not exist yet, or its
result disagrees with the peer) is reported and the others still run; the
exit status is then 1.
"""
import sys
import traceback

from bench import (
    bench_embedding_bag,
    bench_embedding_bag_backward,
    bench_lookup,
    bench_partition,
    bench_segment_reduce,
    bench_segment_sum,
    bench_unique,
)
from bench.common import Context, parser

BENCHMARKS = {
    "embedding_bag": bench_embedding_bag,
    "embedding_bag_backward": bench_embedding_bag_backward,
    "lookup": bench_lookup,
    "unique": bench_unique,
    "segment_sum": bench_segment_sum,
    "segment_reduce": bench_segment_reduce,
    "partition": bench_partition,
}


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--ops", default=None,
                   help=f"comma-separated subset of {','.join(BENCHMARKS)} (default: all)")
    args = p.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",")] if args.ops else list(BENCHMARKS)
    unknown = [o for o in ops if o not in BENCHMARKS]
    if unknown:
        p.error(f"unknown ops {unknown}; choose from {list(BENCHMARKS)}")
    ctx = Context.from_args(args)
    print(f"device: {ctx.device_name} ({ctx.device}); rows -> {ctx.out}")
    ctx.copy_bandwidth()
    failed = []
    for op in ops:
        print(f"\n== {op}")
        try:
            BENCHMARKS[op].run(ctx)
        except Exception as exc:  # keep going: one missing kernel must not hide the others
            traceback.print_exc()
            failed.append(f"{op}: {type(exc).__name__}: {exc}".splitlines()[0])
            ctx.release()
    print()
    print(ctx.summary())
    print(f"\nrows appended to {ctx.out}")
    if failed:
        print("\nFAILED:\n  " + "\n  ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
