"""embedding_bag: hbk.embedding_bag vs torch.nn.functional.embedding_bag, FBGEMM's
TBE where installed (:mod:`.anchors`) and a plain gather-then-reduce in
NumPy/CuPy, combiners sum and mean, fixed bag length.

CPU: E=1e6 rows, B=16384 bags of Zipf(1.1) ids: D=64, L=32 in fp32, fp16 and
bf16; then fp32 at every D in {16, 64, 128} and L in {1, 32}, with the table
on a cache line (as torch's tensors and hbk.aligned_empty) and 16 bytes past
one (as a plain large NumPy array: "plain"); then D=64, L=32 at E=1e5 and 1e7,
and at B=65536 (cost against E and against the work B*L*D); last, D=64 and 128,
L=32 with uniform ids over 1e7 and 5e6 rows of a plain table: nearly every row comes
from DRAM (the random-row limit of the memory); then, sum at every D with L=32, the
other id layouts (``layout=`` in the size column, :func:`.common.zipf_ids`): Zipf(1.1)
and Zipf(1.05) ranked by frequency (hot rows packed at the table's start) and uniform
over 1e6 rows. The L=32 cases on a cache line also time ``gather-scatter``
(:mod:`.bounds`, each distinct row the ids name read once): the least memory traffic of
the layout.
GPU: E=1e7, D=128, B=65536, L=32, Zipf(1.05), fp32, fp16 and bf16 (CuPy >= 14).
Results are checked against the NumPy (CuPy) gather + fp32 reduction first.
GB/s counts rows read (B*L*D*itemsize) + ids and offsets read + output written.

    python3 -m hbkernels.bench.bench_embedding_bag --device cpu
"""
import hbkernels as hbk
from .anchors import fbgemm_tbe, tbe_table
from .bounds import gather_scatter
from .common import HBK, LAYOUTS, Provider, bags_size, cli_main

OP = "embedding_bag"
MODES = ("sum", "mean")
DTYPES = ("float32", "float16", "bfloat16")
TOLERANCE = {"float32": (1e-5, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (2e-2, 5e-2)}


def configs(ctx):
    if ctx.smoke:
        return [dict(E=1000, D=8, B=64, L=4, alpha=1.1, dtypes=("float32",), layout=layout)
                for layout in LAYOUTS]
    if ctx.is_cuda:
        return [dict(E=10**7, D=128, B=65536, L=32, alpha=1.05, dtypes=DTYPES)]
    return [dict(E=10**6, D=64, B=16384, L=32, alpha=1.1, dtypes=DTYPES)] + [
        dict(E=10**6, D=dim, B=16384, L=bag, alpha=1.1, dtypes=("float32",), line_offset=line)
        for dim in (16, 64, 128) for bag in (1, 32) for line in (0, 16)] + [
        dict(E=rows, D=64, B=bags, L=32, alpha=1.1, dtypes=("float32",))   # cost vs E and B
        for rows, bags in ((10**5, 16384), (10**7, 16384), (10**6, 65536))] + [
        dict(E=rows, D=dim, B=16384, L=32, alpha=0.0, dtypes=("float32",), line_offset=16,
             layout="uniform")
        for rows, dim in ((10**7, 64), (5 * 10**6, 128))] + [  # every row from DRAM
        dict(E=10**6, D=dim, B=16384, L=32, alpha=alpha, dtypes=("float32",), modes=("sum",),
             layout=layout)
        for dim in (16, 64, 128)
        for layout, alpha in (("ranked", 1.1), ("ranked", 1.05), ("uniform", 0.0))]


def tbe_provider(ctx, mode):
    """FBGEMM's TBE forward (no autograd) on its own copy of the table, or None."""
    if ctx.is_cuda or ctx.torch is None:
        return None

    def prepare(a):
        return {**ctx.as_torch({k: a[k] for k in ("ids", "offsets")}),
                "tbe": tbe_table(a["w"], combiner=mode)}

    def run(a):
        with ctx.torch.no_grad():
            return a["tbe"](a["ids"], a["offsets"])

    if fbgemm_tbe() is None:
        ctx.note("FBGEMM's TBE is not installed: fbgemm-tbe peers are skipped (recipe: hbkernels/bench/anchors.py)")
        return None
    return Provider("fbgemm-tbe", run, prepare=prepare)


def gather_reduce(xp, mode, B, L):
    """The plain array-library peer: gather all B*L rows, reduce each bag (fp32 accumulation)."""
    def run(a):
        rows = xp.take(a["w"], a["ids"], axis=0).reshape(B, L, -1)
        out = rows.sum(axis=1, dtype=xp.float32) if mode == "sum" else rows.mean(axis=1, dtype=xp.float32)
        return out.astype(a["w"].dtype, copy=False)
    return run


def run(ctx):
    xp, torch = ctx.xp, ctx.torch
    for cfg in configs(ctx):
        E, D, B, L = cfg["E"], cfg["D"], cfg["B"], cfg["L"]
        ids, offsets = ctx.fixed_bags(cfg)
        size = bags_size(cfg)
        line_offset = cfg.get("line_offset", 0)
        # the memory traffic of the layout, beside the L=32 cases on a cache line (CPU)
        bounded = not ctx.is_cuda and not line_offset and (L == 32 or ctx.smoke)
        bounds = [gather_scatter(step=False)] if bounded else []
        if line_offset:
            size += f" plain (line+{line_offset}B)"
        for dtype in cfg["dtypes"]:
            try:
                w = ctx.random_table(E, D, dtype, line_offset=line_offset)
            except (ImportError, TypeError, ValueError, NotImplementedError) as error:  # no bf16 here
                ctx.note(f"{OP} {dtype} skipped: {error}")
                continue
            item = w.dtype.itemsize
            nbytes = B * L * D * item + ids.nbytes + offsets.nbytes + B * D * item
            rtol, atol = TOLERANCE[dtype]
            for mode in cfg.get("modes", MODES):
                providers = [
                    Provider(HBK, lambda a, m=mode: hbk.embedding_bag(
                        a["w"], a["ids"], a["offsets"], combiner=m)),
                    Provider(HBK + "-unchecked", lambda a, m=mode: hbk.embedding_bag(
                        a["w"], a["ids"], a["offsets"], combiner=m, bounds="unchecked")),
                    torch and Provider("torch", lambda a, m=mode: torch.nn.functional.embedding_bag(
                        a["ids"], a["w"], a["offsets"], mode=m, include_last_offset=True),
                        prepare=ctx.as_torch),
                    Provider(ctx.xp_name, gather_reduce(xp, mode, B, L)),
                    tbe_provider(ctx, mode) if dtype == "float32" else None,
                ]
                ctx.compare(OP, mode, size, dtype, {"w": w, "ids": ids, "offsets": offsets},
                            providers, nbytes=nbytes, rtol=rtol, atol=atol,
                            bounds=bounds if dtype == "float32" else [])
            del w
            ctx.release()
    report_ratios(ctx)


def report_ratios(ctx):
    for row in ctx.rows:
        if row["op"] != OP or row["provider"] != HBK:
            continue
        line = f"{OP} {row['mode']} {row['dtype']} {row['size']}:"
        ratio = ctx.ratio(OP, row["mode"], row["dtype"], HBK, "torch", size=row["size"])
        if ratio is not None:
            line += f" time hbk/torch = {ratio:.2f} (hbk {1 / ratio:.2f}x torch's speed)"
        if ctx.is_cuda and ctx.copy_gbps and row["gbps"]:
            line += f"; hbk at {100 * float(row['gbps']) / ctx.copy_gbps:.0f}% of copy bandwidth"
        print(line)


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
