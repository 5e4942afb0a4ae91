"""segment_reduce: hbk.segment_reduce(data, offsets) (CSR, combiners sum and mean)
vs np.add.reduceat (CPU), cupyx.scatter_add over segment ids (GPU) and
torch.segment_reduce(offsets=..., initial=0).

Segment lengths are uniform in [0, 2L] with extra empty segments, the first
and last included: np.add.reduceat gives data[start] (or fails at the end)
for an empty segment, so the peer reduces the non-empty segments only and
leaves zeros for the empty ones, as hbk does.

CPU: B=16384 segments, mean length L=32, D=64, fp32.
GPU: B=65536, L=32, D=128, fp32.
GB/s counts data read + offsets read + output written.

    python3 -m hbkernels.bench.bench_segment_reduce --device cpu
"""
import numpy as np

import hbkernels as hbk
from .common import HBK, Provider, cli_main, optional_module

OP = "segment_reduce"
MODES = ("sum", "mean")
EMPTY_FRACTION = 0.05


def configs(ctx):
    if ctx.smoke:
        return [dict(B=64, L=4, D=8)]
    if ctx.is_cuda:
        return [dict(B=65536, L=32, D=128)]
    return [dict(B=16384, L=32, D=64)]


def csr_offsets(B, L, seed):
    """Offsets of B segments of lengths uniform in [0, 2L], some forced empty (first and last too)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 2 * L + 1, B)
    lengths[rng.random(B) < EMPTY_FRACTION] = 0
    lengths[[0, -1]] = 0
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def reduceat(data, offsets, mode):
    """NumPy segment reduction with empty segments handled (the CPU peer)."""
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    out = np.zeros((lengths.shape[0],) + data.shape[1:], data.dtype)
    if nonempty.any():
        # consecutive non-empty segments tile [first start, N) exactly, so reduceat
        # over their starts reduces each of them and nothing else
        out[nonempty] = np.add.reduceat(data, offsets[:-1][nonempty], axis=0)
    if mode == "mean":
        out /= np.maximum(lengths, 1).astype(data.dtype)[:, None]
    return out


def scatter_peer(mode):
    """CuPy peer: segment id of every row by searchsorted, then cupyx.scatter_add."""
    cupy, cupyx = optional_module("cupy"), optional_module("cupyx")

    def run(a):
        data, offsets = a["data"], a["offsets"]
        seg = cupy.searchsorted(offsets, cupy.arange(data.shape[0]), side="right") - 1
        out = cupy.zeros((offsets.shape[0] - 1,) + data.shape[1:], data.dtype)
        cupyx.scatter_add(out, seg, data)
        if mode == "mean":
            out /= cupy.maximum(cupy.diff(offsets), 1).astype(data.dtype)[:, None]
        return out
    return run


def run(ctx):
    xp, torch = ctx.xp, ctx.torch
    for cfg in configs(ctx):
        B, L, D = cfg["B"], cfg["L"], cfg["D"]
        offsets = xp.asarray(csr_offsets(B, L, ctx.seed))
        N = int(offsets[-1])
        data = ctx.random_table(N, D, "float32", seed_offset=1)
        nbytes = data.nbytes + offsets.nbytes + B * D * data.itemsize
        for mode in MODES:
            providers = [
                Provider(HBK, lambda a, m=mode: hbk.segment_reduce(a["data"], a["offsets"], combiner=m)),
                Provider(ctx.xp_name, scatter_peer(mode) if ctx.on_gpu
                         else lambda a, m=mode: reduceat(a["data"], a["offsets"], m)),
                torch and Provider("torch", lambda a, m=mode: torch.segment_reduce(
                    a["data"], m, offsets=a["offsets"], axis=0, initial=0.0), prepare=ctx.as_torch),
            ]
            ctx.compare(OP, mode, f"B={B} L~{L} D={D} N={N}", "float32",
                        {"data": data, "offsets": offsets}, providers, nbytes=nbytes,
                        rtol=1e-5, atol=1e-4)
        del data
        ctx.release()


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
