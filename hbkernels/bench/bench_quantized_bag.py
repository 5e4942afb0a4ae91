"""quantized embedding_bag: hbk.embedding_bag on a QuantizedTable (int8 and int4) vs FBGEMM's
int-N inference TBE on the same codes (CPU build, where installed: :mod:`.anchors`), hbkernels'
float32 forward on the dequantized table, and a NumPy gather of dequantized rows.

CPU: B=16384 bags of L=32 ids, D in {64, 128}, E in {1e6, 1e7}, Zipf(1.1) ids and uniform
ids ("zipf=0.0": nearly every row from DRAM), combiner sum, float32 output.
GPU: E=1e7, D=128, B=65536, L=32, Zipf(1.05), against the float32 forward (TBE's CPU build
has no GPU kernels).
GB/s counts what the quantized op moves: each id's codes and scale and bias (row bytes
+ 4), ids and offsets read, the float32 output written; every provider of a case is
given the same figure, so the ratio of GB/s is the ratio of speeds.

    python3 -m hbkernels.bench.bench_quantized_bag --device cpu
"""
import numpy as np

import hbkernels as hbk
from .anchors import fbgemm_intn, tbe_quantized_table
from .common import HBK, Provider, cli_main

OP = "quantized_bag"
FP32 = HBK + "-fp32"
TBE = "fbgemm-intn-tbe"


def configs(ctx):
    if ctx.simulated:
        return [dict(E=64, D=3, B=2, L=2, alpha=1.1, bits=(8, 4))]
    if ctx.smoke:
        return [dict(E=1000, D=8, B=64, L=4, alpha=1.1, bits=(8, 4))]
    if ctx.is_cuda:
        return [dict(E=10**7, D=128, B=65536, L=32, alpha=1.05, bits=(8, 4))]
    return [dict(E=rows, D=dim, B=16384, L=32, alpha=alpha, bits=(8, 4))
            for rows in (10**6, 10**7) for dim in (64, 128) for alpha in (1.1, 0.0)]


def tbe_provider(ctx, bits):
    """FBGEMM's int-N TBE on its own copy of the codes, or None."""
    if ctx.is_cuda or ctx.torch is None:
        return None
    if fbgemm_intn() is None:
        ctx.note("FBGEMM's int-N TBE is not installed: its peer is skipped "
                 "(recipe: hbkernels/bench/anchors.py)")
        return None
    torch = ctx.torch

    def prepare(a):
        q = hbk.QuantizedTable.from_rows(a["rows"], bits, a["w"].shape[1])
        ids, offsets = (torch.from_numpy(a[k].astype(np.int32)) for k in ("ids", "offsets"))
        return {"tbe": tbe_quantized_table(q), "ids": ids, "offsets": offsets}

    def run(a):
        with torch.no_grad():
            return a["tbe"](a["ids"], a["offsets"])

    return Provider(TBE, run, prepare=prepare)


def gather_dequantized(xp, B, L):
    """The plain peer: gather the dequantized rows, sum each bag in float32."""
    def run(a):
        return xp.take(a["w"], a["ids"], axis=0).reshape(B, L, -1).sum(axis=1, dtype=xp.float32)
    return run


def run(ctx):
    xp = ctx.xp
    for cfg in configs(ctx):
        E, D, B, L = cfg["E"], cfg["D"], cfg["B"], cfg["L"]
        ids, offsets = ctx.fixed_bags(cfg)
        size = f"E={E} D={D} B={B} L={L} zipf={cfg['alpha']}"
        table = ctx.random_table(E, D, "float32")
        for bits in cfg["bits"]:
            q = hbk.quantize_rows(table, bits=bits)
            inputs = {"rows": q.rows, "w": q.dequantize(), "ids": ids, "offsets": offsets}
            nbytes = B * L * (q.codes.shape[1] + 4) + ids.nbytes + offsets.nbytes + B * D * 4

            def quantized(a, bits=bits):
                return hbk.embedding_bag(hbk.QuantizedTable.from_rows(a["rows"], bits, D),
                                         a["ids"], a["offsets"])

            providers = [
                Provider(HBK, quantized),
                Provider(FP32, lambda a: hbk.embedding_bag(a["w"], a["ids"], a["offsets"])),
                tbe_provider(ctx, bits),
                Provider(ctx.xp_name, gather_dequantized(xp, B, L)),
            ]
            ctx.compare(OP, "sum", size, f"int{bits}", inputs, providers, nbytes=nbytes,
                        rtol=1e-5, atol=1e-4, reference=(TBE, FP32))
            del q, inputs
            ctx.release()
        del table
    report_ratios(ctx)


def report_ratios(ctx):
    for row in ctx.rows:
        if row["op"] != OP or row["provider"] != HBK:
            continue
        parts = []
        for peer in (TBE, FP32):
            ratio = ctx.ratio(OP, row["mode"], row["dtype"], HBK, peer, size=row["size"])
            if ratio is not None:
                parts.append(f"{1 / ratio:.2f}x {peer}'s speed")
        print(f"{OP} {row['dtype']} {row['size']}: hbk {', '.join(parts)}")


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
