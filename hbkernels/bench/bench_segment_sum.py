"""segment_sum: hbk.segment_sum(data, segment_ids, S) vs np.add.at / cupyx.scatter_add
into zeros, torch's index_add_ into zeros, and jax.ops.segment_sum when JAX is
installed (skipped otherwise).

The case is the embedding backward: N = B*L gradient rows summed into the
distinct ids they belong to (segment_ids = the inverse of unique(Zipf ids),
S = the number of distinct ids), so segment sizes follow the Zipf law.

CPU: N=16384*32, D=64, ids Zipf(1.1) over 1e6, fp32.
GPU: N=65536*32, D=128, ids Zipf(1.05) over 1e7, fp32.
GB/s counts data read + segment ids read + output written.

    python3 -m hbkernels.bench.bench_segment_sum --device cpu
"""
import numpy as np

import hbkernels as hbk
from .common import HBK, Provider, cli_main, to_host

OP = "segment_sum"


def configs(ctx):
    if ctx.smoke:
        return [dict(N=512, D=8, E=1000, alpha=1.1)]
    if ctx.is_cuda:
        return [dict(N=65536 * 32, D=128, E=10**7, alpha=1.05)]
    return [dict(N=16384 * 32, D=64, E=10**6, alpha=1.1)]


def scatter_add_peer(ctx, S):
    """zeros((S, D)) then np.add.at (CPU) or cupyx.scatter_add (GPU): the array-library peer."""
    xp = ctx.xp
    add_at = ctx.add_at

    def run(a):
        out = xp.zeros((S, a["data"].shape[1]), a["data"].dtype)
        add_at(out, a["seg"], a["data"])
        return out
    return run


def jax_peer(ctx, S):
    jax, device = ctx.jax_device()
    if jax is None:
        return None
    fn = jax.jit(lambda d, s: jax.ops.segment_sum(d, s, num_segments=S))

    def prepare(a):  # JAX keeps 32-bit ints unless x64 is on: hand it int32 ids
        return {"data": jax.device_put(to_host(a["data"]), device),
                "seg": jax.device_put(to_host(a["seg"]).astype(np.int32), device)}
    return Provider("jax", lambda a: fn(a["data"], a["seg"]), prepare=prepare,
                    block=lambda r: r.block_until_ready())


def run(ctx):
    xp, torch = ctx.xp, ctx.torch
    for cfg in configs(ctx):
        N, D, E = cfg["N"], cfg["D"], cfg["E"]
        uniq, seg = xp.unique(ctx.zipf_ids(N, E, cfg["alpha"]), return_inverse=True)
        seg = seg.reshape(-1).astype(xp.int64)
        S = int(uniq.shape[0])
        largest = int(xp.bincount(seg).max())
        data = ctx.random_table(N, D, "float32", seed_offset=1)
        nbytes = data.nbytes + seg.nbytes + S * D * data.itemsize
        providers = [
            Provider(HBK, lambda a: hbk.segment_sum(a["data"], a["seg"], S)),
            Provider(HBK + "-unchecked", lambda a: hbk.segment_sum(
                a["data"], a["seg"], S, bounds="unchecked")),
            Provider(ctx.xp_name, scatter_add_peer(ctx, S)),
            torch and Provider("torch", lambda a: torch.zeros(
                (S, D), dtype=a["data"].dtype, device=a["data"].device).index_add_(0, a["seg"], a["data"]),
                prepare=ctx.as_torch),
            jax_peer(ctx, S),
        ]
        # float sums in different orders: the error grows with the largest segment
        ctx.compare(OP, "sum", f"N={N} D={D} S={S} zipf={cfg['alpha']}", "float32",
                    {"data": data, "seg": seg}, providers, nbytes=nbytes,
                    rtol=1e-4, atol=max(1e-4, 4e-6 * largest))
        del data, seg, uniq
        ctx.release()


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
