"""Bytes within and across nodes of the flat and the hierarchical exchange, per id layout.

Under ``mpiexec -n N``: the ranks in nodes of ``--ranks-per-node`` G, ``hbkernels train``'s
default tables (width ``--dim``, placed as ``--plan``), each rank a local batch of
``--batch-size / N`` samples whose ids follow each layout of ``--layouts`` (Zipf(1.05) ranks
scattered over a table, Zipf ranks at its start, uniform: :func:`~.common.zipf_ids`, a fresh
batch each step). For each layout, a collection of each exchange (``flat``,
``hierarchical``) trains ``--steps`` steps on the same batches; a row gives, summed over
the ranks and averaged over the steps, the bytes the ranks sent within their node and to
other nodes (``EmbeddingCollection.stats``), and the median over the steps of the slowest
rank's step, each rank on its share of the cores (on one machine the "nodes" share its memory:
the time is not a network's).
Rank 0 appends one row per layout and exchange to ``--out`` (CSV) and prints them.

    mpiexec -n 4 python3 -m mpi4py -m hbkernels.bench.exchange_bytes --ranks-per-node 2 --out exchange.csv
"""
import argparse
import time

import numpy as np

COLUMNS = ("layout", "ranks", "ranks_per_node", "plan", "exchange", "batch_size", "steps",
           "within_node_bytes", "across_node_bytes", "ids_bytes", "rows_bytes", "grads_bytes",
           "step_ms")
EXCHANGES = ("flat", "hierarchical")


def batch(tables, rank, world, batch_size, layout, step):
    """This rank's features of one step: each table's bags of its hotness in ids."""
    from .common import zipf_ids
    from .. import Ragged

    local = batch_size // world
    out = {}
    for k, t in enumerate(tables):
        hot = max(1, int(round(t.hotness)))
        seed = 1_000_003 * step + 1009 * rank + k
        ids = zipf_ids(local * hot, t.num_rows, 1.05, seed=seed, layout=layout)
        out[t.name] = Ragged(ids, np.arange(0, local * hot + 1, hot, dtype=np.int64))
    return out


def measure(comm, tables, args, layout, exchange):
    """One row of :data:`COLUMNS`."""
    import hbkernels as hbk

    coll = hbk.EmbeddingCollection(tables, comm=comm, optimizer=hbk.optim.Adagrad(lr=0.05),
                                   plan=args.plan, batch_size_hint=args.batch_size // comm.world_size,
                                   ranks_per_node=args.ranks_per_node, exchange=exchange)
    keys = COLUMNS[7:12]
    sent, times = np.zeros(len(keys), np.int64), []
    for step in range(args.steps):
        feats = batch(tables, comm.rank, comm.world_size, args.batch_size, layout, step)
        comm.allreduce(np.zeros(1, np.int64))  # the ranks start together
        t0 = time.perf_counter()
        out = coll.forward(feats)
        coll.backward({f: np.ones_like(o) for f, o in out.items()})
        times.append(time.perf_counter() - t0)
        sent += [coll.stats[k] for k in keys]
    sent = comm.allreduce(sent)
    slowest = comm.allreduce(np.array(times), op="max")
    return dict(zip(COLUMNS, (layout, comm.world_size, coll.ranks_per_node, args.plan, exchange,
                              args.batch_size, args.steps,
                              *(int(s) // args.steps for s in sent),
                              round(1e3 * float(np.median(slowest)), 3))))


def main(argv=None):
    import hbkernels as hbk
    from .common import LAYOUTS, append_rows
    from ..cli.train import DEFAULT_TABLES
    from ..data.__main__ import parse_table
    from ..threads import rank_share, set_num_threads

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4096, help="global batch")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--plan", default="row_wise")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--out", default=None, help="CSV to append rows to")
    args = p.parse_args(argv)
    comm = hbk.dist.init()
    set_num_threads(rank_share(comm.world_size))  # each rank its share of the cores, as hbkernels train
    tables = [hbk.TableSpec(t.name, num_rows=t.num_rows, dim=args.dim, hotness=t.hotness)
              for t in map(parse_table, DEFAULT_TABLES)]
    rows = [measure(comm, tables, args, layout, exchange)
            for layout in args.layouts.split(",") for exchange in EXCHANGES]
    if comm.rank != 0:
        return 0
    if args.out:
        append_rows(args.out, rows, COLUMNS)
    print(" ".join(COLUMNS))
    for row in rows:
        print(" ".join(str(row[c]) for c in COLUMNS), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
