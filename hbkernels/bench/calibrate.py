"""Calibration: the constants of a :class:`hbkernels.sharding.profile.MachineProfile`
measured on this machine and these ranks (``hbkernels plan --calibrate``).

For each table width and id layout (:data:`.common.LAYOUTS`, Zipf(``alpha``) ids over a
table of ``rows`` rows): ``embedding_bag`` and the optimizer's ``fused_step`` on ``bags``
bags of ``hotness`` ids (t_h), on ``bags`` bags of one id (t_1), on a quarter of the bags
of ``hotness`` ids (t_q) and on a bag of one id (the fixed cost of a call), ``reps`` times
each, in turn, and ``hbkernels.unique`` (with the inverse) on the ids of t_h (at the first
width). A repeat's cost per id is ``(t_h - t_1) / (bags·(hotness - 1))`` and per
bag ``(t_h - t_q) / (bags - bags/4) - hotness·per id`` (each at least 0). A
collection's step (forward and backward) on these ranks of one id in each of 1 and of 8
tables, placed each way, gives its own cost around the kernels (its collectives' latency
included): a step's and each table's more; a collection of the given tables (or 8 of
``rows // 8`` rows) on a batch of bags per table of ``hotness`` ids and of one, its cost
per id and per bag beyond what the other constants predict (:func:`per_id_constants`). Then, at more than
one rank, ``reps`` ``alltoallv`` calls of one float32 to each rank (the latency) and ``alltoallv``
calls sending ``exchange_bytes`` to each other rank (the bandwidth: bytes a rank sends to
the others per second). Every rank measures, the ranks in step (a barrier before each
timed call), as a step's calls share the machine; rank 0's kernel figures go in the profile
(the collectives' are the same on every rank). Host-side wall time: CPU tables only.
"""
import dataclasses
import datetime
import os
import platform
import time

import numpy as np

import hbkernels as hbk
from hbkernels._machine import cpu_name
from hbkernels._version import __version__
from hbkernels.threads import rank_share, set_num_threads
from hbkernels.sharding.profile import MEASURED, PER_KEY, MachineProfile, Spread, assumed_profile
from hbkernels.types import FLAT_PLACEMENTS
from .common import LAYOUTS, random_table, zipf_ids

#: untimed calls of a collection's step before it is timed (its first calls compile or load)
WARMUP = 3
#: the optimizers a profile's updates may be measured with (their ``fused_step``)
OPTIMIZERS = ("SGD", "Adagrad", "RowWiseAdagrad", "Adam", "Ftrl")


def _seconds(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _rates(call, batches, bags, hotness, reps, sync):
    """``(Spreads of ns per id, ns per bag, µs of a one-id call)`` of ``call(batch)`` over
    ``reps`` repeats of the ``batches`` ``(hotness, 1, quarter, one id)`` in turn (after
    one of each, untimed), each call after a ``sync()``; module docstring."""
    for batch in batches:
        call(batch)
    quarter = bags // 4

    def timed(batch):
        sync()
        return _seconds(lambda: call(batch))

    per_id, per_bag, one = [], [], []
    for _ in range(reps):
        t_h, t_1, t_q, t_one = (timed(b) for b in batches)
        ns_id = max(t_h - t_1, 0.0) / (bags * (hotness - 1))
        per_id.append(1e9 * ns_id)
        per_bag.append(1e9 * max((t_h - t_q) / (bags - quarter) - hotness * ns_id, 0.0))
        one.append(1e6 * t_one)
    return Spread.of(per_id), Spread.of(per_bag), Spread.of(one)


def _unique_rate(ids, reps, sync):
    """Spread of ns per id of ``hbkernels.unique(ids, return_inverse=True)``."""
    hbk.unique(ids, return_inverse=True)
    per_id = []
    for _ in range(reps):
        sync()
        per_id.append(1e9 * _seconds(lambda: hbk.unique(ids, return_inverse=True)) / ids.shape[0])
    return Spread.of(per_id)


def _batches(ids, ones, bags, hotness):
    """``(ids, offsets)`` of: ``bags`` bags of ``hotness`` ids, ``bags`` bags of one id, a
    quarter of the first, one bag of one id."""
    def bagged(values, count, length):
        return values[:count * length], np.arange(count + 1, dtype=np.int64) * length

    return (bagged(ids, bags, hotness), bagged(ones, bags, 1), bagged(ids, bags // 4, hotness),
            bagged(ids, 1, 1))


def kernel_constants(widths, layouts=LAYOUTS, *, rows=1_000_000, bags=4096, hotness=8,
                     alpha=1.05, optimizer="Adagrad", reps=15, seed=0, sync=lambda: None):
    """``{field: {(width, layout): Spread}}`` of the profile's per-id and per-bag fields
    (:data:`~hbkernels.sharding.profile.PER_KEY`), with ``unique_ns_per_id`` by layout, and
    ``{"lookup", "update": Spread}``, the
    µs of a call on one id (over every case); module docstring. ``sync()`` goes before
    each timed call (ranks measuring together: a barrier, so that they share the cores as
    the same calls of a step do)."""
    fields = {field: {} for field in PER_KEY}
    fields["unique_ns_per_id"] = {}
    calls = {"lookup": [], "update": []}
    for dim in widths:
        table = random_table(rows, dim, "float32", seed=seed)
        grad = np.random.default_rng(seed + 1).standard_normal((bags, dim)).astype(np.float32)
        opt = getattr(hbk.optim, optimizer)(lr=0.01)
        state = opt.init_state(table)
        for layout in layouts:
            ids = zipf_ids(bags * hotness, rows, alpha, seed=seed, layout=layout)
            ones = zipf_ids(bags, rows, alpha, seed=seed + 2, layout=layout)
            batches = _batches(ids, ones, bags, hotness)
            key = dim, layout
            fields["lookup_ns_per_id"][key], fields["lookup_ns_per_bag"][key], call = _rates(
                lambda b: hbk.embedding_bag(table, *b), batches, bags, hotness, reps, sync)
            calls["lookup"].append(call.median)
            fields["update_ns_per_id"][key], fields["update_ns_per_bag"][key], call = _rates(
                lambda b: opt.fused_step(table, state, grad[:b[1].shape[0] - 1], *b),
                batches, bags, hotness, reps, sync)
            calls["update"].append(call.median)
            if dim == widths[0]:
                fields["unique_ns_per_id"][layout] = _unique_rate(ids, reps, sync)
    return fields, {k: Spread.of(v) for k, v in calls.items()}


def collection_constants(comm, dim, kinds=FLAT_PLACEMENTS, *, tables=8, reps=15, sync=lambda: None):
    """``({kind: µs of a step}, {kind: µs more per table})``: a collection's ``forward``
    and ``backward`` on the ranks of ``comm`` of one id per table, with ``tables`` tables
    against one (width ``dim``, its default optimizer), each placed as ``kind``: its work
    around the kernels, its collectives included; ``sync()`` as in
    :func:`kernel_constants`. Collective."""
    def step_of(count, kind):
        specs = [hbk.TableSpec(f"t{k}", num_rows=64, dim=dim) for k in range(count)]
        coll = hbk.EmbeddingCollection(specs, comm=comm, device="cpu", plan=kind)
        ids = {s.name: np.array([k % 64], np.int64) for k, s in enumerate(specs)}

        def step():
            out = coll.forward(ids)
            coll.backward({f: np.ones(o.shape, np.float32) for f, o in out.items()})
        return step

    fixed, extra = {}, {}
    for kind in kinds:
        one, many = step_of(1, kind), step_of(tables, kind)
        for _ in range(WARMUP):
            one()
            many()
        t_ones, t_extra = [], []
        for _ in range(reps):
            sync()
            t_one = _seconds(one)
            sync()
            t_many = _seconds(many)
            t_ones.append(1e6 * t_one)
            t_extra.append(1e6 * max(t_many - t_one, 0.0) / (tables - 1))
        fixed[kind], extra[kind] = Spread.of(t_ones), Spread.of(t_extra)
    return fixed, extra


def per_id_constants(comm, profile, specs, layout, kinds=FLAT_PLACEMENTS, *, batch=1024, hotness=8,
                     alpha=1.05, reps=15, sync=lambda: None):
    """``({kind: ns per id}, {kind: ns per bag})``: a collection's own cost per id and per
    bag of a rank's batch, beyond what ``profile`` (this calibration's other constants)
    predicts of its step: the tables ``specs`` (their rows and widths), all placed as
    ``kind``, a batch per rank of ``batch`` bags per table of ``hotness`` ids (r_h: measured
    - predicted) and of one id (r_1), Zipf in ``layout``; per repeat ``(r_h - r_1) /
    (bags·(hotness - 1))`` per id and ``r_1 / bags - per id`` per bag (each at least 0, over
    the rank's bags of every table); ``sync()`` as in :func:`kernel_constants`. Collective."""
    from hbkernels.sharding.cost import ProfileCost

    count = int(batch)

    def case(kind, length):
        """``(step, predicted seconds on this rank)`` of bags of ``length`` ids."""
        offsets = np.arange(count + 1, dtype=np.int64) * length
        shaped = [hbk.TableSpec(s.name, num_rows=s.num_rows, dim=s.dim, hotness=length) for s in specs]
        inputs = {s.name: hbk.Ragged(zipf_ids(count * length, s.num_rows, alpha, seed=1000 * comm.rank + k,
                                              layout=layout), offsets) for k, s in enumerate(shaped)}
        grads = {s.name: np.ones((count, s.dim), np.float32) for s in shaped}
        coll = hbk.EmbeddingCollection(shaped, comm=comm, device="cpu", plan=kind, batch_size_hint=count)
        est = ProfileCost(profile, layout, count).step(coll.plan.tables, dict(coll.plan),
                                                      coll.plan.estimates, comm.world_size)

        def step():
            coll.forward(inputs)
            coll.backward(grads)

        for _ in range(WARMUP):
            step()
        return step, est.per_rank[comm.rank]

    all_bags = len(specs) * count
    per_id, per_bag = {}, {}
    for kind in kinds:
        (long, long_predicted), (short, short_predicted) = case(kind, hotness), case(kind, 1)
        ids, bagged = [], []
        for _ in range(reps):
            sync()
            r_h = _seconds(long) - long_predicted
            sync()
            r_1 = _seconds(short) - short_predicted
            ns_id = max(r_h - r_1, 0.0) / (all_bags * (hotness - 1))
            ids.append(1e9 * ns_id)
            bagged.append(1e9 * max(r_1 / all_bags - ns_id, 0.0))
        per_id[kind], per_bag[kind] = Spread.of(ids), Spread.of(bagged)
    return per_id, per_bag


def collective_constants(comm, *, exchange_bytes=4 << 20, reps=20):
    """``(latency µs, bytes a rank sends per second)`` of ``comm``'s ``alltoallv`` of one
    float32 and of ``exchange_bytes`` to each rank (module docstring); collective."""
    world = comm.world_size
    token, ones = np.zeros(world, np.float32), np.ones(world, np.int64)
    count = max(1, exchange_bytes // 4)
    send = np.zeros(world * count, np.float32)
    counts = np.full(world, count, np.int64)
    comm.barrier()
    comm.alltoallv(token, ones)
    comm.alltoallv(send, counts)
    latency, bandwidth = [], []
    for _ in range(reps):
        comm.barrier()
        latency.append(1e6 * _seconds(lambda: comm.alltoallv(token, ones)))
        comm.barrier()
        bandwidth.append((world - 1) * count * 4 / _seconds(lambda: comm.alltoallv(send, counts)))
    return Spread.of(latency), Spread.of(bandwidth)


def calibrate(comm=None, widths=(16, 64, 128), layouts=LAYOUTS, *, rows=1_000_000, bags=4096,
              hotness=8, alpha=1.05, optimizer="Adagrad", reps=15, exchange_bytes=4 << 20,
              threads=None, tables=None, batch=None):
    """The :class:`~hbkernels.sharding.profile.MachineProfile` of this machine and the
    ranks of ``comm`` (default :func:`hbkernels.dist.init`); collective. At one rank the
    collective constants are the assumed ones (``measured_collectives`` False). The
    kernels run on ``threads`` threads (default: a rank's share of the cores, as
    ``hbkernels train`` gives it, :func:`hbkernels.threads.rank_share`). A collection's
    own cost per id and per bag is measured on ``tables`` (:class:`hbkernels.TableSpec`
    list; default: 8 tables of ``rows // 8`` rows at the first width) with ``batch`` bags
    per rank and table (default ``bags // 4``): calibrate on the tables you will train."""
    comm = comm if comm is not None else hbk.dist.init()
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    for name, value, least in (("rows", rows, 1), ("bags", bags, 4), ("hotness", hotness, 2),
                               ("reps", reps, 1)):
        if isinstance(value, bool) or int(value) != value or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    widths = tuple(int(d) for d in widths)
    if not widths or min(widths) < 1:
        raise ValueError(f"widths must be one or more integers >= 1, got {widths!r}")
    bad = [lay for lay in layouts if lay not in LAYOUTS]
    if bad or not layouts:
        raise ValueError(f"layouts must be some of {LAYOUTS}, got {list(layouts)}")
    if tables is None:
        tables = [hbk.TableSpec(f"t{k}", num_rows=max(64, int(rows) // 8), dim=widths[0]) for k in range(8)]
    specs = [hbk.TableSpec(t.name, num_rows=t.num_rows, dim=t.dim) for t in tables]
    if not specs or any(s.num_rows is None for s in specs):
        raise ValueError("tables must be one or more static TableSpecs")
    batch = max(1, int(bags) // 4) if batch is None else int(batch)
    if batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    threads = set_num_threads(rank_share(comm.world_size) if threads is None else int(threads))
    sync = comm.barrier if comm.world_size > 1 else (lambda: None)
    fields, calls = kernel_constants(widths, tuple(layouts), rows=int(rows), bags=int(bags),
                                     hotness=int(hotness), alpha=alpha, optimizer=optimizer,
                                     reps=int(reps), sync=sync)
    step_us, table_us = collection_constants(comm, widths[0], reps=int(reps), sync=sync)
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
               "optimizer": optimizer, "reps": int(reps), "threads": threads,
               "collection_tables": [[s.name, s.num_rows, s.dim] for s in specs], "collection_batch": batch}
    provisional = MachineProfile(MEASURED, machine, **fields, call_us=calls, step_us=step_us,
                                 table_us=table_us, host_ns_per_id=dict.fromkeys(FLAT_PLACEMENTS, Spread.exactly(0.0)),
                                 host_ns_per_bag=dict.fromkeys(FLAT_PLACEMENTS, Spread.exactly(0.0)),
                                 collective_latency_us=latency, network_bytes_per_s=bandwidth,
                                 measured_collectives=measured)
    per_id, per_bag = per_id_constants(comm, provisional, specs, layouts[0], batch=batch,
                                       hotness=int(hotness), alpha=alpha, reps=int(reps), sync=sync)
    return dataclasses.replace(provisional, host_ns_per_id=per_id, host_ns_per_bag=per_bag)
