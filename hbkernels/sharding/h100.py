"""A machine profile of an H100 node for ``hbkernels plan --simulate`` (``--profile
h100-node``): eight H100 SXM GPUs joined by NVLink 4, each with a 400 Gb/s InfiniBand
port to the other nodes (as a DGX H100), one rank a GPU.

Each constant says where it comes from (the profile's ``sources``):

* the kernels (lookup and fused update per id, ``unique`` per id), **measured** on one
  H100 80GB HBM3 on 2026-11-27 (:data:`MEASURED`: CUDA-event medians of whole calls,
  ``bench/results/h100-measured-2026-11-27.csv``, E = 1e7 rows, B = 65,536 bags of L ids);
  those calls went through the launch path that preceded the current one, whose host time
  per call (about 0.4 ms) the two-point fits below take out of the per-id figures;
* the host time of a step, **modelled**: the current launch path's host time of a step
  of ``hbkernels train``'s 8 tables (batch 1024 on one rank), and of the ``unique`` each
  table's ids take at more than one rank and the ``partition`` of a sharded placement,
  measured on an H200 node's host on 2026-11-30
  (``bench/results/nvidia-h200-gpu-check-2026-11-30.md``), not on an H100 node;
* NVLink and InfiniBand bandwidths, **published** peak figures per GPU and direction;
* the collective latency, **assumed** (no NCCL collective has been timed on these GPUs).

Fits, per width D (ms from the CSV, ns in the profile): a lookup's ns per id is
``(t(L=32) - t(L=1)) / (31·B)`` (the fixed cost of a call cancels), ``uniform`` ids
taking the L = 1 figure of Zipf ids (no such case was measured); the fused row-wise
Adagrad step's ns per id is ``t / (32·B)`` (its fixed cost, under a tenth of it, kept in),
measured at D = 64 and 128 on Zipf ids only: other widths follow by
:func:`~hbkernels.sharding.cost.per_id_ns`'s line, ``uniform`` ids take Zipf's figure;
``unique``'s ns per id is the slope between its two sizes. No per-bag cost is separable
from these cases: 0."""

from ..types import PLACEMENTS

NAME = "h100-node"
BAGS = 65_536

#: CUDA-event medians (ms) of bench/results/h100-measured-2026-11-27.csv, provider
#: hbkernels-unchecked: (case, D, L, ids) -> ms; unique: ("unique", None, n, None) -> ms
MEASURED = {
    ("forward", 128, 32, "zipf"): 0.5763, ("forward", 128, 1, "zipf"): 0.4802,
    ("forward", 128, 32, "uniform"): 0.7911,
    ("forward", 64, 32, "zipf"): 0.5684, ("forward", 64, 1, "zipf"): 0.4084,
    ("forward", 64, 32, "uniform"): 0.5827,
    ("forward", 16, 32, "zipf"): 0.7228, ("forward", 16, 1, "zipf"): 0.3798,
    ("forward", 16, 32, "uniform"): 0.4972,
    ("fused_rowwise_adagrad", 128, 32, "zipf"): 7.9394,
    ("fused_rowwise_adagrad", 64, 32, "zipf"): 5.2662,
    ("unique", None, 4_194_304, None): 1.3130,  # provider hbkernels
    ("unique", None, 67_108_864, None): 8.5920,
}
#: host µs of the current launch path measured on an H200 node's host (the check of
#: 2026-11-30, runs 1 and 2): a step of hbkernels train's 8 tables at batch 1024 on one
#: rank; ``unique`` with its inverse; ``partition`` over 8 ranks
HOST_US = {"step": (710.4, 780.5), "unique": (160.0, 173.1), "partition": (228.2, 248.6)}
#: bytes per second per GPU and direction
NVLINK = 450e9  # NVLink 4: 900 GB/s per H100 SXM GPU, both directions together
INFINIBAND = 50e9  # one ConnectX-7 NDR port per GPU: 400 Gb/s
LATENCY_US = 25.0
LAYOUTS = {"scattered": "zipf", "uniform": "uniform"}  # the profile's layouts -> the CSV's ids

SOURCES = {
    "lookup_ns_per_id": "measured: H100 80GB HBM3, 2026-11-27, embedding_bag (bounds unchecked), "
                        "(t(L=32) - t(L=1)) / (31 B) at B = 65,536, D = 16, 64, 128; uniform ids "
                        "minus Zipf's L = 1 call (bench/results/h100-measured-2026-11-27.csv)",
    "update_ns_per_id": "measured: H100 80GB HBM3, 2026-11-27, fused row-wise Adagrad step, t / (32 B) "
                        "at D = 64, 128 on Zipf ids; D = 16 on their line, uniform ids as Zipf's",
    "unique_ns_per_id": "measured: H100 80GB HBM3, 2026-11-27, hbkernels.unique, the slope between "
                        "4,194,304 and 67,108,864 ids",
    "lookup_ns_per_bag": "none separable from the measured cases: 0",
    "update_ns_per_bag": "none separable from the measured cases: 0",
    "call_us": "measured: H100, 2026-11-27, embedding_bag's L = 1 call less its ids (the launch "
               "path before the current one); update: as lookup (not measured)",
    "step_us": "modelled: the current launch path's host time of a step of hbkernels train's 8 "
               "tables, measured on an H200 node's host on 2026-11-30 (710-781 µs), plus one "
               "table's unique (below); sharded placements add a partition (228-249 µs)",
    "table_us": "modelled: each table's unique with its inverse at more than one rank "
                "(160-173 µs, H200 node's host, 2026-11-30)",
    "host_ns_per_id": "modelled: 0 (the host's work does not grow with the batch on a GPU)",
    "host_ns_per_bag": "modelled: 0",
    "collective_latency_us": "assumed: 25 µs an NCCL collective (not measured on these GPUs)",
    "network_bytes_per_s": "published: NVLink 4, 900 GB/s per H100 SXM GPU both ways together "
                           "(NVIDIA H100 Tensor Core GPU datasheet): 450 GB/s each way",
    "across_bytes_per_s": "published: one ConnectX-7 400 Gb/s NDR InfiniBand port per GPU (NVIDIA "
                          "DGX H100 user guide): 50 GB/s each way",
}


def _mean(pair):
    return sum(pair) / len(pair)


def _lookup_ns(dim, ids):
    fixed = MEASURED[("forward", dim, 1, "zipf")]
    return 1e6 * (MEASURED[("forward", dim, 32, ids)] - fixed) / (31 * BAGS)


def _update_ns(dim):
    at = {d: 1e6 * MEASURED[("fused_rowwise_adagrad", d, 32, "zipf")] / (32 * BAGS) for d in (64, 128)}
    if dim in at:
        return at[dim]
    return at[64] + (at[128] - at[64]) * (dim - 64) / 64


def profile_json():
    """The profile, as :meth:`~hbkernels.sharding.profile.MachineProfile.to_json` writes one."""
    widths = (16, 64, 128)

    def exactly(x):
        return [x, x, x]

    def per_key(of):
        return {f"{d}/{layout}": exactly(of(d, ids)) for d in widths for layout, ids in LAYOUTS.items()}

    (n0, t0), (n1, t1) = sorted((k[2], v) for k, v in MEASURED.items() if k[0] == "unique")
    unique = 1e6 * (t1 - t0) / (n1 - n0)
    call = 1e3 * min(MEASURED[("forward", d, 1, "zipf")] - 1e-6 * BAGS * _lookup_ns(d, "zipf")
                     for d in widths)
    step, partition, per_table = (_mean(HOST_US[k]) for k in ("step", "partition", "unique"))
    sharded = [k for k in PLACEMENTS if k != "data_parallel"]
    return {
        "version": 3, "source": "measured",
        "machine": {"device": "NVIDIA H100 80GB HBM3 (8 a node, NVLink 4; 400 Gb/s InfiniBand a GPU)",
                    "cpu": "H100 node", "world_size": 1, "ranks_per_node": 8, "date": "2026-11-27",
                    "backend": "nccl", "alpha": 1.05,
                    "label": "H100 node profile (kernels measured on one H100 2026-11-27; host "
                             "modelled, NVLink/InfiniBand published, latency assumed)"},
        "lookup_ns_per_id": per_key(lambda d, ids: _lookup_ns(d, ids)),
        "update_ns_per_id": per_key(lambda d, ids: _update_ns(d)),
        "lookup_ns_per_bag": per_key(lambda d, ids: 0.0),
        "update_ns_per_bag": per_key(lambda d, ids: 0.0),
        "unique_ns_per_id": {layout: exactly(unique) for layout in LAYOUTS},
        "call_us": {"lookup": exactly(call), "update": exactly(call)},
        "step_us": {k: exactly(step + per_table + (partition if k in sharded else 0.0))
                    for k in PLACEMENTS},
        "table_us": {k: exactly(per_table) for k in PLACEMENTS},
        "host_ns_per_id": {k: exactly(0.0) for k in PLACEMENTS},
        "host_ns_per_bag": {k: exactly(0.0) for k in PLACEMENTS},
        "collective_latency_us": exactly(LATENCY_US),
        "network_bytes_per_s": exactly(NVLINK),
        "measured_collectives": False,
        "across_bytes_per_s": exactly(INFINIBAND),
        "sources": dict(SOURCES),
    }
