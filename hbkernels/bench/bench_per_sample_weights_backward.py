"""per_sample_weights_backward: hbk.per_sample_weights_backward(grad_out, weights,
values, offsets, per_sample_weights) (the gradient of a weighted embedding_bag
w.r.t. its weights) vs torch's ``aten._embedding_bag_per_sample_weights_backward``
(what ``F.embedding_bag``'s autograd runs; sum only, its ``offset2bag`` made
untimed by torch's forward) and the array library (gather the bag's gradient row
and the id's table row, multiply, sum over D).

Bags of L Zipf(1.1) ids, mode sum.
CPU: E=1e6 rows, D=64, B=16384, L=32, fp32.
GPU: E=1e7, D=128, B=65536, L=32, fp32.
GB/s counts the table rows and gradient rows read per id, ids, weights and
offsets read, and the result written.

    python3 -m hbkernels.bench.bench_per_sample_weights_backward --device cpu
"""
import numpy as np

import hbkernels as hbk
from .common import HBK, Provider, cli_main

OP = "per_sample_weights_backward"


def configs(ctx):
    if ctx.smoke:
        return [dict(E=1000, D=8, B=64, L=4)]
    if ctx.is_cuda:
        return [dict(E=10**7, D=128, B=65536, L=32)]
    return [dict(E=10**6, D=64, B=16384, L=32)]


def gather_dot(xp, L):
    """The array-library peer for equal-length bags: ``Σ_d g[bag(j), d]·W[values[j], d]``."""
    def run(a):
        g = xp.repeat(a["grad"], L, axis=0)
        return (g * a["w"][a["ids"]]).sum(axis=1)
    return run


def torch_peer(ctx):
    torch = ctx.torch
    if torch is None:
        return None

    def prepare(a):
        t = ctx.as_torch(a)
        _, offset2bag, _, _ = torch.ops.aten._embedding_bag(
            t["w"], t["ids"], t["offsets"], False, 0, False, t["psw"], True, -1)
        return dict(t, offset2bag=offset2bag)

    def run(t):
        return torch.ops.aten._embedding_bag_per_sample_weights_backward(
            t["grad"], t["w"], t["ids"], t["offsets"][:-1], t["offset2bag"], 0, -1)

    return Provider("torch", run, prepare=prepare)


def run(ctx):
    xp = ctx.xp
    for cfg in configs(ctx):
        E, D, B, L = cfg["E"], cfg["D"], cfg["B"], cfg["L"]
        ids = ctx.zipf_ids(B * L, E, 1.1)
        offsets = xp.arange(B + 1, dtype=xp.int64) * L
        w = ctx.random_table(E, D, "float32")
        grad = ctx.random_table(B, D, "float32", seed_offset=1)
        psw = xp.asarray(np.random.default_rng(ctx.seed).uniform(0.5, 1.5, B * L)
                         .astype(np.float32))
        nbytes = 2 * B * L * D * 4 + ids.nbytes + offsets.nbytes + 2 * psw.nbytes
        providers = [
            Provider(HBK, lambda a: hbk.per_sample_weights_backward(
                a["grad"], a["w"], a["ids"], a["offsets"], a["psw"])),
            torch_peer(ctx),
            Provider(ctx.xp_name, gather_dot(xp, L)),
        ]
        ctx.compare(OP, "sum", f"E={E} D={D} B={B} L={L} zipf=1.1", "float32",
                    {"w": w, "ids": ids, "offsets": offsets, "grad": grad, "psw": psw},
                    providers, nbytes=nbytes, rtol=1e-4, atol=1e-4)
        del w, grad
        ctx.release()


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
