"""lookup: hbk.lookup(weights, ids) vs np.take / cupy.take (axis=0) and
torch.index_select on Zipf ids.

CPU: E=1e6, D=64, N=16384*32 Zipf(1.1) ids, fp32.
GPU: E=1e7, D=128, N=65536*32 Zipf(1.05) ids, fp32 and fp16.
GB/s counts rows read + ids read + rows written.

    python3 -m hbkernels.bench.bench_lookup --device cpu
"""
import numpy as np

import hbkernels as hbk
from .common import HBK, Provider, cli_main

OP = "lookup"


def configs(ctx):
    if ctx.smoke:
        return [dict(E=1000, D=8, N=256, alpha=1.1, dtypes=("float32",))]
    if ctx.is_cuda:
        return [dict(E=10**7, D=128, N=65536 * 32, alpha=1.05, dtypes=("float32", "float16"))]
    return [dict(E=10**6, D=64, N=16384 * 32, alpha=1.1, dtypes=("float32",))]


def run(ctx):
    xp, torch = ctx.xp, ctx.torch
    for cfg in configs(ctx):
        E, D, N = cfg["E"], cfg["D"], cfg["N"]
        ids = ctx.zipf_ids(N, E, cfg["alpha"])
        size = f"E={E} D={D} N={N} zipf={cfg['alpha']}"
        for dtype in cfg["dtypes"]:
            w = ctx.random_table(E, D, dtype)
            nbytes = 2 * N * D * np.dtype(dtype).itemsize + ids.nbytes
            providers = [
                Provider(HBK, lambda a: hbk.lookup(a["w"], a["ids"])),
                Provider(HBK + "-unchecked", lambda a: hbk.lookup(a["w"], a["ids"], bounds="unchecked")),
                Provider(ctx.xp_name, lambda a: xp.take(a["w"], a["ids"], axis=0)),
                torch and Provider("torch", lambda a: torch.index_select(a["w"], 0, a["ids"]),
                                   prepare=ctx.as_torch),
            ]
            ctx.compare(OP, "gather", size, dtype, {"w": w, "ids": ids}, providers,
                        nbytes=nbytes)
            del w
            ctx.release()


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
