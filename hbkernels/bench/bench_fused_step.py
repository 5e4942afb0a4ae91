"""fused_step: one training step of a pooled table (forward, backward, sparse
optimizer update) in hbkernels (``hbk.embedding_bag`` then
``optimizer.fused_step``) vs FBGEMM's TBE (forward, then ``backward`` of its
output, which applies TBE's fused optimizer), for every rule both run on the
CPU: SGD, Adagrad and row-wise Adagrad (:data:`.anchors.TBE_RULES`).

CPU: E=1e6 rows, B=16384 bags of L=32 ids, fp32, D in {16, 64, 128}, in each id
layout (``layout=`` in the size column, :func:`.common.zipf_ids`): Zipf(1.1) ids
scattered over the table (on a cache line, hbkernels' own tables and TBE's, and 16
bytes past one, "plain", as a large NumPy array); Zipf(1.1) and Zipf(1.05) ranked by
frequency (hot rows packed at the table's start); uniform. Each case also times
``gather-scatter`` (:mod:`.bounds`): each distinct row its ids name read and written
once, the least memory traffic of that layout. Row-wise Adagrad's cases also time, as
parts of the step: hbkernels' update alone (``fused_step``, ``hbkernels-update``), its
``embedding_bag_backward`` alone (``hbkernels-backward``), the update's phases before its
sums (``hbkernels-checks``: the offsets and gradient checked; ``hbkernels-grouping``:
the occurrences grouped by id, :func:`hbkernels.cpu.grouping.group_occurrences`, whose first
pass also finds an id out of range), and TBE's
forward alone (``fbgemm-tbe-forward``; TBE's update alone is its step less its forward, as
the two are timed in the same rounds). Each provider steps its own
copy of the table from the same start; the rows of the first 512 distinct ids after
the first step are checked against TBE's before anything is timed. Without TBE the
benchmark notes it and records nothing.

    python3 -m hbkernels.bench.bench_fused_step --device cpu
"""
import numpy as np

import hbkernels as hbk
from hbkernels._dispatch import NUMPY
from hbkernels._modes import Bounds, Combiner
from hbkernels.cpu.grouping import group_occurrences
from hbkernels.cpu.sparse_update import checks_before_grouping, fused_checks
from .anchors import TBE_RULES, fbgemm_tbe, tbe_table, tbe_weights
from .bounds import gather_scatter
from .common import HBK, LAYOUTS, Provider, bags_size, cli_main, placed_empty

OP = "fused_step"
LR, EPS = 0.01, 1e-8
CHECKED_IDS = 512


def configs(ctx):
    if ctx.smoke:
        return [dict(E=1000, D=8, B=64, L=4, alpha=1.1, line_offset=0, layout=layout)
                for layout in LAYOUTS]
    layouts = [("scattered", 1.1, 0), ("scattered", 1.1, 16), ("ranked", 1.1, 0),
               ("ranked", 1.05, 0), ("uniform", 0.0, 0)]
    return [dict(E=10**6, D=dim, B=16384, L=32, alpha=alpha, line_offset=line, layout=layout)
            for dim in (16, 64, 128) for layout, alpha, line in layouts]


def optimizer(name):
    if name == "SGD":
        return hbk.optim.SGD(lr=LR)
    return getattr(hbk.optim, name)(lr=LR, eps=EPS)


PART_RULES = ("RowWiseAdagrad",)  # the rules whose cases time the step's parts too
HBK_PARTS = ("update", "backward", "checks", "grouping")
#: every provider a case may time
PROVIDERS = (HBK, "fbgemm-tbe", *(f"{HBK}-{part}" for part in HBK_PARTS), "fbgemm-tbe-forward")


def hbk_provider(ctx, name, line_offset, part=None):
    """hbkernels' step; ``part`` "update" (the fused step alone), "backward"
    (``embedding_bag_backward`` alone), "checks" or "grouping" (those phases of the
    update alone)."""
    opt = optimizer(name)

    def prepare(a):
        w = placed_empty(a["w"].shape, np.float32, line_offset)
        w[...] = a["w"]
        return {**a, "w": w, "state": opt.init_state(w)}

    def update(a):
        opt.fused_step(a["w"], a["state"], a["grad"], a["ids"], a["offsets"])
        return a["w"]

    def run(a):
        hbk.embedding_bag(a["w"], a["ids"], a["offsets"])
        return update(a)

    def backward(a):
        return hbk.embedding_bag_backward(a["grad"], a["ids"], a["offsets"],
                                          num_rows=a["w"].shape[0])

    def checks(a):
        return fused_checks(NUMPY, a["grad"], None, a["ids"], a["offsets"], a["w"].shape[0],
                            checks_before_grouping(Bounds.RAISE), True)

    def grouping(a):
        return group_occurrences(a["ids"], a["offsets"], None, Combiner.SUM, a["w"].shape[0],
                                 True, np.float32, stop_at_bad=True)

    if part is None:
        return Provider(HBK, run, prepare=prepare)
    call = {"update": update, "backward": backward, "checks": checks, "grouping": grouping}[part]
    return Provider(f"{HBK}-{part}", call, prepare=prepare if part == "update" else None)


def tbe_provider(ctx, name, forward_only=False):
    """TBE's step (forward, then backward with its fused optimizer), or its forward alone."""
    torch = ctx.torch

    def prepare(a):
        return {"tbe": tbe_table(a["w"], rule=TBE_RULES[name], lr=LR, eps=EPS),
                **ctx.as_torch({k: a[k] for k in ("ids", "offsets", "grad")})}

    def run(a):
        out = a["tbe"](a["ids"], a["offsets"])
        out.backward(a["grad"])
        return tbe_weights(a["tbe"])

    def forward(a):
        with torch.no_grad():
            return a["tbe"](a["ids"], a["offsets"])

    if forward_only:
        return Provider("fbgemm-tbe-forward", forward, prepare=prepare)
    return Provider("fbgemm-tbe", run, prepare=prepare)


def run(ctx):
    if ctx.is_cuda or ctx.torch is None or fbgemm_tbe() is None:
        ctx.note(f"{OP}: needs FBGEMM's TBE on the CPU (recipe: hbkernels/bench/anchors.py); skipped")
        return
    rng = np.random.default_rng(ctx.seed)
    for cfg in configs(ctx):
        E, D, B, L = cfg["E"], cfg["D"], cfg["B"], cfg["L"]
        ids, offsets = ctx.fixed_bags(cfg)
        grad = rng.standard_normal((B, D), dtype=np.float32)
        table = ctx.random_table(E, D, "float32")
        checked = hbk.unique(ids)[:CHECKED_IDS]
        size = bags_size(cfg)
        if cfg["line_offset"]:
            size += f" plain (line+{cfg['line_offset']}B)"
        nbytes = B * L * D * 4 * 2 + ids.nbytes + offsets.nbytes + 2 * B * D * 4
        for name in TBE_RULES:
            providers = [hbk_provider(ctx, name, cfg["line_offset"]), tbe_provider(ctx, name)]
            parts = [] if name not in PART_RULES else [
                *(hbk_provider(ctx, name, cfg["line_offset"], part) for part in HBK_PARTS),
                tbe_provider(ctx, name, forward_only=True)]
            ctx.compare(OP, name, size, "float32",
                        {"w": table, "ids": ids, "offsets": offsets, "grad": grad},
                        providers, nbytes=nbytes, canon=lambda w: (w[checked],),
                        rtol=1e-5, atol=1e-6, bounds=[gather_scatter()], parts=parts)
        del table
        ctx.release()


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
