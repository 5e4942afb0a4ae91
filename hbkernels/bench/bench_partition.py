"""partition: hbk.partition(ids, num_shards) (mode="mod") vs the sort-based peer:
shard = ids % n, order = argsort(shard, kind="stable"), ids[order] and
bincount(shard) — in NumPy on the CPU, CuPy on the GPU (its argsort is
stable), and torch (argsort(stable=True)).

CPU: 4M Zipf(1.1) int64 ids over 1e6, 8 shards.
GPU: 4M and 64M Zipf(1.05) ids over 1e7, 8 shards.
GB/s counts ids read + grouped ids and order written.

    python3 -m hbkernels.bench.bench_partition --device cpu
"""
import numpy as np

import hbkernels as hbk
from .common import HBK, Provider, cli_main

OP = "partition"


def configs(ctx):
    if ctx.smoke:
        return [dict(N=4096, E=1000, alpha=1.1, shards=4)]
    if ctx.is_cuda:
        return [dict(N=4 << 20, E=10**7, alpha=1.05, shards=8),
                dict(N=64 << 20, E=10**7, alpha=1.05, shards=8)]
    return [dict(N=4 << 20, E=10**6, alpha=1.1, shards=8)]


def sort_peer(xp, n):
    stable = {"kind": "stable"} if xp is np else {}  # CuPy's argsort is always stable

    def run(a):
        ids = a["ids"]
        shard = ids % n
        order = xp.argsort(shard, **stable)
        return ids[order], xp.bincount(shard, minlength=n), order
    return run


def torch_peer(torch, n):
    def run(a):
        ids = a["ids"]
        shard = ids % n
        order = torch.argsort(shard, stable=True)
        return ids[order], torch.bincount(shard, minlength=n), order
    return run


def run(ctx):
    xp, torch = ctx.xp, ctx.torch
    for cfg in configs(ctx):
        N, n = cfg["N"], cfg["shards"]
        ids = ctx.zipf_ids(N, cfg["E"], cfg["alpha"])
        providers = [
            Provider(HBK, lambda a: tuple(hbk.partition(a["ids"], n))),
            Provider(ctx.xp_name, sort_peer(xp, n)),
            torch and Provider("torch", torch_peer(torch, n), prepare=ctx.as_torch),
        ]
        ctx.compare(OP, f"mod{n}", f"N={N} E={cfg['E']} zipf={cfg['alpha']} shards={n}", "int64",
                    {"ids": ids}, providers, nbytes=3 * ids.nbytes + 8 * n)
        del ids
        ctx.release()


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
