"""``hbkernels compact``: a chain of incremental checkpoints as one full save.

    hbkernels compact ckpt/inc-0042 --out ckpt/full-0042
    mpiexec -n 2 hbkernels compact CKPT --out DIR    # each rank its shards

Loads ``CKPT`` (the newest save of a chain: ``EmbeddingCollection.save(...,
incremental=True)`` chains each save to the one before; or a collection's whole save, or a
``hbkernels train --checkpoint`` directory: its newest step's) on this process's ranks,
replaying its chain, and saves the collection whole to ``--out``: the same tables,
optimizer state, dynamic ids, scores and pending ids, loadable without the chain.
"""
import os

from ._errors import CLIError, writable_dir


def add_command(subparsers):
    from ._help import HelpFormatter, plain

    p = subparsers.add_parser(
        "compact", help="write a chain of incremental checkpoints as one full save",
        description=plain(__doc__.split("\n\n")[0]), formatter_class=HelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT",
                   help="the newest save of a chain, or a train --checkpoint directory (its newest step)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the full save goes")
    p.set_defaults(run=run)


def run(args):
    import hbkernels as hbk
    from ..sharding.checkpoint import Checkpoint

    if not os.path.isdir(args.checkpoint):
        raise CLIError(f"no checkpoint directory {args.checkpoint}")
    from ..train import collection_checkpoint

    source, newest = collection_checkpoint(args.checkpoint)
    chain = Checkpoint(source).chain()
    out = os.path.abspath(args.out)
    if any(os.path.abspath(c.path) == out for c in chain):
        raise CLIError(f"--out {args.out} holds a save of the chain it reads")
    writable_dir(args.out)
    comm = hbk.dist.init()
    if comm.rank == 0 and newest is not None:
        print(f"{args.checkpoint}: its newest step, {newest.name} ({source})", flush=True)
    coll = hbk.EmbeddingCollection.load(source, comm, device="cpu", memory_per_rank=None)
    coll.save(args.out)
    if comm.rank == 0:
        n = len(chain) - 1
        print(f"a full save and {n} incremental save{'' if n == 1 else 's'} -> {args.out}",
              flush=True)
    return 0
