"""Calibration: the constants of a :class:`hbkernels.sharding.profile.MachineProfile`
measured on this machine and these ranks (``hbkernels plan --calibrate``).

For each table width and id layout (:data:`.common.LAYOUTS`, Zipf(``alpha``) ids over a
table of ``rows`` rows in bags of ``hotness``, ``bags`` bags): ``embedding_bag`` and the
optimizer's ``fused_step`` on the whole batch and on a bag of one id, ``reps`` times each,
in turn; a repeat's cost per id is (batch time - one-id time) / ids. A one-rank
collection's step (forward and backward) of one id in each of 1 and of 8 tables gives its
own cost around the kernels: a step's and each table's more. Then, at more than
one rank, ``reps`` ``allreduce`` calls of one float64 (the latency) and ``alltoallv``
calls sending ``exchange_bytes`` to each other rank (the bandwidth: bytes a rank sends to
the others per second). Every rank measures; rank 0's kernel figures go in the profile
(the collectives' are the same on every rank). Host-side wall time: CPU tables only.
"""
import datetime
import os
import platform
import time

import numpy as np

import hbkernels as hbk
from hbkernels._machine import cpu_name
from hbkernels._version import __version__
from hbkernels.sharding.profile import MEASURED, MachineProfile, Spread, assumed_profile
from .common import LAYOUTS, random_table, zipf_ids

#: the optimizers a profile's updates may be measured with (their ``fused_step``)
OPTIMIZERS = ("SGD", "Adagrad", "RowWiseAdagrad", "Adam", "Ftrl")


def _seconds(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _per_id(batch_call, one_call, ids, reps):
    """``(Spread of ns per id, Spread of µs of a one-id call)`` over ``reps`` repeats,
    each a batch call then a one-id call (after one of each, untimed)."""
    batch_call()
    one_call()
    per_id, one = [], []
    for _ in range(reps):
        t_batch = _seconds(batch_call)
        t_one = _seconds(one_call)
        per_id.append(1e9 * max(t_batch - t_one, 0.0) / ids)
        one.append(1e6 * t_one)
    return Spread.of(per_id), Spread.of(one)


def kernel_constants(widths, layouts=LAYOUTS, *, rows=1_000_000, bags=4096, hotness=8,
                     alpha=1.05, optimizer="Adagrad", reps=7, seed=0):
    """``(lookup ns per id, update ns per id, call µs)`` of the module docstring, the first
    two by ``(width, layout)``, the third by ``"lookup"`` and ``"update"`` (over every case)."""
    offsets = np.arange(bags + 1, dtype=np.int64) * hotness
    one_offsets = np.array([0, 1], np.int64)
    lookup, update, calls = {}, {}, {"lookup": [], "update": []}
    for dim in widths:
        table = random_table(rows, dim, "float32", seed=seed)
        grad = np.random.default_rng(seed + 1).standard_normal((bags, dim)).astype(np.float32)
        opt = getattr(hbk.optim, optimizer)(lr=0.01)
        state = opt.init_state(table)
        for layout in layouts:
            ids = zipf_ids(bags * hotness, rows, alpha, seed=seed, layout=layout)
            one = ids[:1].copy()
            lookup[dim, layout], call = _per_id(lambda: hbk.embedding_bag(table, ids, offsets),
                                                lambda: hbk.embedding_bag(table, one, one_offsets),
                                                ids.shape[0], reps)
            calls["lookup"].append(call.median)
            update[dim, layout], call = _per_id(
                lambda: opt.fused_step(table, state, grad, ids, offsets),
                lambda: opt.fused_step(table, state, grad[:1], one, one_offsets),
                ids.shape[0], reps)
            calls["update"].append(call.median)
    return lookup, update, {k: Spread.of(v) for k, v in calls.items()}


def collection_constants(dim, *, tables=8, reps=7):
    """``(µs of a step, µs more per table)``: a one-rank collection's ``forward`` and
    ``backward`` of one id per table, with ``tables`` tables against one (width ``dim``,
    its own default optimizer): the collection's work around its kernels."""
    local = hbk.dist.init("local")

    def step_of(count):
        specs = [hbk.TableSpec(f"t{k}", num_rows=64, dim=dim) for k in range(count)]
        coll = hbk.EmbeddingCollection(specs, comm=local, device="cpu")
        ids = {s.name: np.array([k % 64], np.int64) for k, s in enumerate(specs)}

        def step():
            out = coll.forward(ids)
            coll.backward({f: np.ones(o.shape, np.float32) for f, o in out.items()})
        return step

    one, many = step_of(1), step_of(tables)
    one()
    many()
    fixed, extra = [], []
    for _ in range(reps):
        t_one = _seconds(one)
        t_many = _seconds(many)
        fixed.append(1e6 * t_one)
        extra.append(1e6 * max(t_many - t_one, 0.0) / (tables - 1))
    return Spread.of(fixed), Spread.of(extra)


def collective_constants(comm, *, exchange_bytes=4 << 20, reps=20):
    """``(latency µs, bytes a rank sends per second)`` of ``comm``'s ``allreduce`` and
    ``alltoallv`` (module docstring); collective."""
    world = comm.world_size
    token = np.zeros(1, np.float64)
    count = max(1, exchange_bytes // 4)
    send = np.zeros(world * count, np.float32)
    counts = np.full(world, count, np.int64)
    comm.barrier()
    comm.allreduce(token)
    comm.alltoallv(send, counts)
    latency, bandwidth = [], []
    for _ in range(reps):
        comm.barrier()
        latency.append(1e6 * _seconds(lambda: comm.allreduce(token)))
        comm.barrier()
        bandwidth.append((world - 1) * count * 4 / _seconds(lambda: comm.alltoallv(send, counts)))
    return Spread.of(latency), Spread.of(bandwidth)


def calibrate(comm=None, widths=(16, 64, 128), layouts=LAYOUTS, *, rows=1_000_000, bags=4096,
              hotness=8, alpha=1.05, optimizer="Adagrad", reps=7, exchange_bytes=4 << 20):
    """The :class:`~hbkernels.sharding.profile.MachineProfile` of this machine and the
    ranks of ``comm`` (default :func:`hbkernels.dist.init`); collective. At one rank the
    collective constants are the assumed ones (``measured_collectives`` False)."""
    comm = comm if comm is not None else hbk.dist.init()
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    for name, value in (("rows", rows), ("bags", bags), ("hotness", hotness), ("reps", reps)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    widths = tuple(int(d) for d in widths)
    if not widths or min(widths) < 1:
        raise ValueError(f"widths must be one or more integers >= 1, got {widths!r}")
    bad = [lay for lay in layouts if lay not in LAYOUTS]
    if bad or not layouts:
        raise ValueError(f"layouts must be some of {LAYOUTS}, got {list(layouts)}")
    lookup, update, calls = kernel_constants(widths, tuple(layouts), rows=int(rows), bags=int(bags),
                                             hotness=int(hotness), alpha=alpha,
                                             optimizer=optimizer, reps=int(reps))
    calls["collection"], calls["collection_table"] = collection_constants(widths[0], reps=int(reps))
    measured = comm.world_size > 1
    if measured:
        latency, bandwidth = collective_constants(comm, exchange_bytes=exchange_bytes,
                                                  reps=max(int(reps), 5))
    else:
        assumed = assumed_profile(widths)
        latency, bandwidth = assumed.collective_latency_us, assumed.network_bytes_per_s
    machine = {"host": platform.node(), "cpu": cpu_name(), "cores": os.cpu_count(),
               "device": "cpu", "world_size": comm.world_size, "backend": comm.backend,
               "date": datetime.date.today().isoformat(), "hbkernels": __version__,
               "rows": int(rows), "bags": int(bags), "hotness": int(hotness), "alpha": alpha,
               "optimizer": optimizer, "reps": int(reps)}
    return MachineProfile(MEASURED, machine, lookup, update, calls, latency, bandwidth, measured)
