"""``hbkernels quantize``: a training checkpoint's tables, row-wise quantized for serving.

    hbkernels quantize ckpt --bits 4 --out serve/            # train --checkpoint ckpt's newest step
    hbkernels quantize CKPT --bits 8 --tables c0,c1 --out DIR    # only those tables
    mpiexec -n 2 hbkernels quantize CKPT --bits 4 --out DIR      # each rank its shards

Loads the collection checkpoint ``CKPT`` (a directory ``EmbeddingCollection.save``
wrote; or a ``hbkernels train --checkpoint`` directory: its newest step's, said in the
output; or one of its ``step-<n>`` directories) on this process's ranks with its saved
plan, quantizes its tables
(:meth:`hbkernels.EmbeddingCollection.quantized`: each row's codes with a float16
scale and bias) and saves the forward-only collection to ``--out``, which
``hbk.EmbeddingCollection.load`` reads at any world size. Prints each table's bytes in
memory before and after, and the checkpoint's bytes on disk (its codes packed as in
memory, its scales and biases float16).
"""
import os

from ..quantize import BITS, row_bytes
from ._errors import CLIError, writable_dir


def add_command(subparsers):
    from ._help import HelpFormatter, plain

    p = subparsers.add_parser(
        "quantize", help="quantize a checkpoint's tables to 8, 4 or 2 bits for serving",
        description=plain(__doc__.split("\n\n")[0]), formatter_class=HelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a collection checkpoint, or a train --checkpoint directory (its newest step)")
    p.add_argument("--bits", type=int, choices=BITS, required=True, help="bits per element")
    p.add_argument("--out", required=True, metavar="DIR", help="where the quantized checkpoint goes")
    p.add_argument("--tables", default=None, metavar="NAMES",
                   help="comma-separated tables to quantize (default: all; the others are copied)")
    p.set_defaults(run=run)


def run(args):
    import numpy as np

    import hbkernels as hbk

    if not os.path.isdir(args.checkpoint):
        raise CLIError(f"no checkpoint directory {args.checkpoint}")
    from ..train import collection_checkpoint

    source, newest = collection_checkpoint(args.checkpoint)
    if os.path.abspath(args.out) in (os.path.abspath(args.checkpoint), os.path.abspath(source)):
        raise CLIError("--out must not be the checkpoint it reads")
    writable_dir(args.out)
    comm = hbk.dist.init()
    if comm.rank == 0 and newest is not None:
        print(f"{args.checkpoint}: its newest step, {newest.name} ({source})", flush=True)
    coll = hbk.EmbeddingCollection.load(source, comm, device="cpu", memory_per_rank=None)
    tables = None if args.tables is None else [t for t in args.tables.split(",") if t]
    try:
        q = coll.quantized(bits=args.bits, tables=tables)
    except ValueError as e:
        raise CLIError(str(e)) from None
    q.save(args.out)
    if comm.rank == 0:
        for name, spec in coll.tables.items():
            before = spec.rows * spec.dim * np.dtype(spec.dtype).itemsize
            after = spec.rows * (row_bytes(spec.dim, args.bits) + 4) if name in q.quantize else before
            print(f"{name}: {spec.rows:,} x {spec.dim}, {before:,} -> {after:,} bytes in memory"
                  + (f" (int{args.bits})" if name in q.quantize else " (kept)"))
        on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(args.out)
                      for f in files)
        print(f"quantized checkpoint -> {args.out} ({on_disk:,} bytes)", flush=True)
    return 0
