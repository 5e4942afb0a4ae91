"""A cluster you do not have: each placement of some tables on N ranks (G to a node), with
the step a profile predicts for it, the memory a rank holds and the bytes it sends, of them
those that cross between nodes (``hbkernels plan --simulate``)."""
import collections
import dataclasses

from ..types import PLACEMENTS, TableSpec
from .plan import make_plan

#: the plans a simulation compares: every table placed one way, then ``"auto"``
PLANS = PLACEMENTS + ("auto",)

#: MLPerf Training's DLRM-DCNv2 (recommendation_v2, mlcommons/training
#: recommendation_v2/torchrec_dlrm): the 26 tables of Criteo 1TB with their rows capped at
#: 40 M (``--num_embeddings_per_feature``), D = 128, and the ids per sample of its synthetic
#: multi-hot dataset (``--multi_hot_sizes``); its global batch is 65,536
MLPERF_DCNV2_ROWS = (40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000,
                     3_067_956, 405_282, 10, 2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000,
                     40_000_000, 590_152, 12_973, 108, 36)
MLPERF_DCNV2_HOTNESS = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
MLPERF_DCNV2_BATCH = 65_536


def mlperf_dcnv2_tables():
    """The 26 tables of MLPerf's DLRM-DCNv2 (:data:`MLPERF_DCNV2_ROWS`)."""
    return [TableSpec(f"cat_{k}", num_rows=rows, dim=128, hotness=hot)
            for k, (rows, hot) in enumerate(zip(MLPERF_DCNV2_ROWS, MLPERF_DCNV2_HOTNESS))]


#: table sets by name (``hbkernels plan --simulate --shape NAME``): name -> (tables, global batch)
SHAPES = {"mlperf-dcnv2": (mlperf_dcnv2_tables, MLPERF_DCNV2_BATCH)}


@dataclasses.dataclass(frozen=True)
class Simulated:
    """One plan of a simulation: its :class:`~hbkernels.sharding.plan.Plan`, its predicted
    :class:`~hbkernels.sharding.cost.StepEstimate`, and per rank at most: bytes held, wire
    bytes of a step, of them across nodes; or why the plan cannot be made (``refused``)."""

    request: str
    plan: object = None
    step: object = None
    memory_bytes: float = 0.0
    wire_bytes: float = 0.0
    across_bytes: float = 0.0
    refused: str = ""


def simulate(tables, world_size, *, ranks_per_node=None, profile=None, batch_size_hint=None,
             id_layout="scattered", state_floats_per_element=0, state_floats_per_row=0,
             memory_per_rank=None, exchange="auto"):
    """A :class:`Simulated` for each of :data:`PLANS` (arguments as
    :func:`~hbkernels.sharding.plan.make_plan`'s; ``batch_size_hint``: per rank)."""
    out = []
    for request in PLANS:
        try:
            plan = make_plan(tables, world_size, request, batch_size_hint=batch_size_hint,
                             memory_per_rank=memory_per_rank, profile=profile, id_layout=id_layout,
                             state_floats_per_element=state_floats_per_element,
                             state_floats_per_row=state_floats_per_row, ranks_per_node=ranks_per_node,
                             exchange=exchange)
        except ValueError as error:
            out.append(Simulated(request, refused=str(error)))
            continue

        def most(field):
            return max(sum(x) for x in zip(*(getattr(e, field) for e in plan.estimates.values())))

        out.append(Simulated(request, plan, plan.predict(), most("memory_bytes"), most("wire_bytes"),
                             most("across_bytes")))
    return out


def table(simulated):
    """The simulation as aligned text lines, one per plan."""
    head = ("plan", "predicted ms", "host", "lookups", "updates", "exchange", "memory MB/rank",
            "wire MB/rank", "across nodes MB/rank", "placements")
    rows = [head]
    for s in simulated:
        if s.refused:
            rows.append((s.request, "-", "", "", "", "", "", "", "", f"refused: {s.refused}"))
            continue
        parts = s.step.parts_ms()
        kinds = collections.Counter(p.kind for p in s.plan.values())
        rows.append((s.request, f"{1e3 * s.step.seconds:.3f}", *(f"{parts[k]:.3f}" for k in parts),
                     f"{s.memory_bytes / 1e6:.1f}", f"{s.wire_bytes / 1e6:.3f}", f"{s.across_bytes / 1e6:.3f}",
                     ", ".join(f"{k} x{c}" for k, c in kinds.items())))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
