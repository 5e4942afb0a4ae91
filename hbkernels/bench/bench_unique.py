"""unique: hbk.unique(ids, return_inverse=True) vs np.unique / cupy.unique and
torch.unique (all with return_inverse=True) on Zipf ids.

hbk's order is unspecified (the CPU gives first-occurrence order), the peers
sort; ``hbkernels-sorted`` (sorted=True) is the like-for-like row. Results are
compared as (sorted distinct ids, uniq[inverse]).

CPU: 4M Zipf(1.1) int64 ids over E=1e6. GPU: 4M and 64M Zipf(1.05) ids over E=1e7.
GB/s counts ids read + inverse written + distinct ids written.

    python3 -m hbkernels.bench.bench_unique --device cpu
"""
import numpy as np

import hbkernels as hbk
from .common import HBK, Provider, cli_main, to_host

OP = "unique"


def configs(ctx):
    if ctx.simulated:
        return [dict(N=16, E=64, alpha=1.1)]
    if ctx.smoke:
        return [dict(N=4096, E=1000, alpha=1.1)]
    if ctx.is_cuda:
        return [dict(N=4 << 20, E=10**7, alpha=1.05), dict(N=64 << 20, E=10**7, alpha=1.05)]
    return [dict(N=4 << 20, E=10**6, alpha=1.1)]


def canon(result):
    uniq, inverse = to_host(result)
    return np.sort(uniq), uniq[inverse]


def run(ctx):
    xp, torch = ctx.xp, ctx.torch
    for cfg in configs(ctx):
        N, E = cfg["N"], cfg["E"]
        ids = ctx.zipf_ids(N, E, cfg["alpha"])
        providers = [
            Provider(HBK, lambda a: hbk.unique(a["ids"], return_inverse=True)),
            Provider(HBK + "-sorted", lambda a: hbk.unique(a["ids"], return_inverse=True, sorted=True)),
            Provider(ctx.xp_name, lambda a: xp.unique(a["ids"], return_inverse=True)),
            torch and Provider("torch", lambda a: torch.unique(a["ids"], return_inverse=True),
                               prepare=ctx.as_torch),
        ]
        ctx.compare(OP, "inverse", f"N={N} E={E} zipf={cfg['alpha']}", "int64", {"ids": ids},
                    providers, nbytes=lambda res, n=N: 16 * n + 8 * len(res[0]), canon=canon)
        del ids
        ctx.release()


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
