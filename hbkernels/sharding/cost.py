"""The time model of a sparse step: a collection's ``forward`` and ``backward`` per rank,
predicted from a :class:`~hbkernels.sharding.profile.MachineProfile`.

Per table t (width D, ``hotness`` h, F features) at a local batch of B samples on N ranks,
a rank's batch holds ``b = B·F`` bags of ``n = B·h·F`` ids, ``u`` of them distinct
(:func:`expected_distinct` of the id layout). A shard j of the table holds ``c_j``
columns and serves a fraction ``f_j`` of the ids (:mod:`hbkernels.sharding.plan`). With
``L(c)`` and ``Lb(c)`` the profile's lookup nanoseconds per id and per bag at width c,
``S(c)`` and ``Sb(c)`` its update's (each linear in the width between, and beyond, the two
nearest widths measured), ``lookup(k bags, m ids) = k·Lb + m·L`` and ``update`` alike, a
rank r spends:

* **lookups**: ``lookup(b, n)`` at width D, pooling its own batch (at N > 1 a table cut
  into column slices: at the width of each slice, pooled apart); at N > 1 also
  ``n·Q`` deduplicating its ids (``Q``: the profile's ``unique`` ns per id) and, for each
  shard j it owns, ``a_j·Q + lookup(a_j, a_j)`` at width c_j deduplicating and gathering
  the rows the ranks ask of it, ``a_j = N·f_j·u`` (their distinct ids, one row each);
* **updates**: at N = 1, ``update(b, n)`` (the fused step on the batch); at N > 1, the
  pooling's lookups again on each rank (its bags' gradients spread to their ids) and a sharded
  table's owner ``update(a_j, a_j)`` at width c_j (every rank's distinct ids with their
  summed gradients); a replicated (``data_parallel``) table ``update(N·u, N·u)`` on every
  rank (the gathered gradients of every rank's distinct ids);
* **exchange**: at N > 1, the plan's wire bytes (the busier direction of the rank's link)
  over the profile's network bandwidth, plus its collective latency for each collective
  (:func:`collectives`) beyond those of one width (which ``step_us`` holds); where the
  profile has a link to other nodes of its own (``across_bytes_per_s``) and the ranks span
  nodes, the bytes to other nodes go over it while the rest go over the node's links, at
  once: ``max(within / network, across / across_bandwidth)``;
* **host**: the collection's own cost of a step on the profile's ranks: for each table
  ``table_us[kind]`` of its placement, ``n·host_ns_per_id[kind]`` and
  ``b·host_ns_per_bag[kind]``, and once the fixed
  cost ``step_us[kind] - table_us[kind]`` of the placement whose is the largest (a plan
  that mixes replicated and sharded tables runs both paths: the smaller one's fixed cost
  is left out).

The predicted step is the busiest rank's sum. A profile measured at the world size it
predicts has the sharing of cores among ranks in its figures; one measured elsewhere does not.
"""
import dataclasses
import math

import numpy as np

from .profile import ASSUMED

#: the id layouts whose distinct ids :func:`expected_distinct` counts
ZIPF_LAYOUTS = ("scattered", "ranked")
_BINS = 4096  # log-spaced rank bins of expected_distinct beyond _EXACT rows
_EXACT = 1 << 16


def expected_distinct(rows, draws, alpha=0.0):
    """Expected distinct values among ``draws`` independent draws from ``rows`` values
    whose popularity ranks k = 1..rows have probability ∝ k**-alpha (uniform at
    ``alpha`` 0): ``sum_k 1 - (1 - p_k)**draws``; beyond 65,536 rows over log-spaced bins
    of ranks."""
    rows, draws = int(rows), float(draws)
    if rows <= 1 or draws <= 0:
        return float(min(rows, draws > 0))
    if alpha == 0:
        return rows * -math.expm1(draws * math.log1p(-1 / rows))
    if rows <= _EXACT:
        ranks, counts = np.arange(1, rows + 1, dtype=np.float64), np.ones(rows)
    else:
        edges = np.unique(np.round(np.geomspace(1, rows + 1, _BINS)).astype(np.int64))
        counts = np.diff(edges).astype(np.float64)
        ranks = np.sqrt(edges[:-1] * (edges[1:] - 1.0).clip(edges[:-1]))
    weights = ranks ** -float(alpha)
    norm = _zipf_norm(rows, alpha)
    p = weights / norm
    return float(np.sum(counts * -np.expm1(draws * np.log1p(-np.minimum(p, 1 - 1e-16)))))


def _zipf_norm(rows, alpha):
    """``sum_{k=1..rows} k**-alpha``: exact to 65,536 terms, then the Euler–Maclaurin tail."""
    head = min(rows, _EXACT)
    total = float(np.sum(np.arange(1, head + 1, dtype=np.float64) ** -float(alpha)))
    if rows > head:
        a, b = head + 0.5, rows + 0.5
        total += (math.log(b / a) if alpha == 1 else (b ** (1 - alpha) - a ** (1 - alpha)) / (1 - alpha))
    return total


def per_id_ns(table, dim):
    """A profile's ns per id (``{(width, layout): Spread}`` restricted to one layout, as
    ``{width: ns}``) at ``dim``: linear between, and beyond, the two nearest widths measured
    (never below 0); one width measured: its figure."""
    widths = sorted(table)
    if dim in table:
        return table[dim]
    if len(widths) == 1:
        return table[widths[0]]
    nearest = sorted(sorted(widths, key=lambda w: (abs(w - dim), w))[:2])
    (w0, y0), (w1, y1) = ((w, table[w]) for w in nearest)
    return max(0.0, y0 + (y1 - y0) * (dim - w0) / (w1 - w0))


def slice_widths(spec, placement):
    """The widths of a table's column slices as placed (its own width where it is whole)."""
    return tuple(int(c) for c in np.diff(placement.columns))


def shards_of(spec, placement, world_size):
    """``[(rank, columns, fraction of the ids, rows)]`` of a sharded placement: the shards
    of its column slices, each holding ``rows`` rows of ``columns`` columns and serving
    that fraction of the table's ids (a slice row-wise over G ranks: 1/G each)."""
    out = []
    for s, cols in enumerate(slice_widths(spec, placement)):
        ranks = placement.slice_ranks(s)
        out += [(int(r), cols, 1 / len(ranks), -(-spec.rows // len(ranks))) for r in ranks]
    return out


def collectives(tables, placements):
    """Collectives of a step: 3 (ids, rows, gradients) per distinct slice width of the
    sharded tables (tables and slices of one width share their exchanges), 1 (the
    gradients' allgatherv) per distinct width of the replicated ones; ``tables``: name ->
    spec, ``placements``: name -> placement."""
    widths = {True: set(), False: set()}
    for name, placement in placements.items():
        widths[placement.kind == "data_parallel"].update(slice_widths(tables[name], placement))
    return 3 * len(widths[False]) + len(widths[True])


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """Predicted seconds of one sparse step on each rank, by part (the module
    docstring), and whether the profile behind them was ``"measured"`` or ``"assumed"``."""

    host: tuple
    lookup: tuple
    update: tuple
    exchange: tuple
    source: str
    machine: dict

    @property
    def per_rank(self):
        """Each rank's predicted seconds: the sum of its parts."""
        return tuple(map(sum, zip(self.host, self.lookup, self.update, self.exchange)))

    @property
    def seconds(self):
        """The predicted step: the busiest rank's seconds."""
        return max(self.per_rank)

    @property
    def busiest(self):
        return int(np.argmax(self.per_rank))

    def parts_ms(self, rank=None):
        """``{host, lookup, update, exchange}`` in ms on ``rank`` (default: the busiest)."""
        r = self.busiest if rank is None else rank
        return {part: 1e3 * getattr(self, part)[r] for part in ("host", "lookup", "update", "exchange")}

    def label(self):
        """Where the constants come from, in words."""
        if self.source == ASSUMED:
            return "built-in defaults, not measured: hbkernels plan --calibrate measures them"
        m = self.machine
        if "label" in m:
            return str(m["label"])
        return (f"profile measured on {m.get('cpu', '?')} at {m.get('world_size', '?')} rank(s), "
                f"{m.get('date', '?')}")

    def __str__(self):
        parts = ", ".join(f"{k} {v:.3f}" for k, v in self.parts_ms().items())
        return f"{1e3 * self.seconds:.3f} ms ({parts}; {self.label()})"


class ProfileCost:
    """A :class:`~hbkernels.sharding.profile.MachineProfile` applied to tables of one id
    ``layout`` at a local ``batch_size``: seconds per rank of a table's placement and of a
    plan's step (module docstring)."""

    def __init__(self, profile, layout, batch_size):
        self.profile, self.layout, self.batch_size = profile, layout, int(batch_size)
        self.alpha = float(profile.machine.get("alpha", 1.05)) if layout in ZIPF_LAYOUTS else 0.0

        def of(table):
            at = {d: s.median for (d, lay), s in table.items() if lay == layout}
            if not at:
                raise ValueError(f"the profile has no figures for id layout {layout!r}; it measured "
                                 f"{sorted({lay for _, lay in table})}")
            return at

        self.per_id = {"lookup": of(profile.lookup_ns_per_id), "update": of(profile.update_ns_per_id)}
        self.per_bag = {"lookup": of(profile.lookup_ns_per_bag), "update": of(profile.update_ns_per_bag)}
        if layout not in profile.unique_ns_per_id:
            raise ValueError(f"the profile has no figures for id layout {layout!r}")
        self.unique_s = 1e-9 * profile.unique_ns_per_id[layout].median
        self._distinct = {}

    def _op(self, op, width, bags, ids):
        """Seconds of ``op`` (``"lookup"`` or ``"update"``) on ``bags`` bags of ``ids`` ids."""
        return 1e-9 * (bags * per_id_ns(self.per_bag[op], width) + ids * per_id_ns(self.per_id[op], width))

    def distinct(self, rows, draws):
        key = (rows, draws)
        if key not in self._distinct:
            self._distinct[key] = expected_distinct(rows, draws, self.alpha)
        return self._distinct[key]

    def table_parts(self, spec, placement, world_size, wire_bytes, across_bytes=()):
        """``(lookup, update, wire)`` seconds per rank of ``spec`` placed as ``placement``
        (``kind``, ``ranks``, ``columns``), ``wire_bytes`` its plan's per rank and
        ``across_bytes`` of them to and from other nodes (empty: one node)."""
        n_ranks, op = int(world_size), self._op
        bags = self.batch_size * len(spec.features)
        n = bags * spec.hotness
        u = self.distinct(spec.rows, n)
        if n_ranks == 1:
            return (op("lookup", spec.dim, bags, n),), (op("update", spec.dim, bags, n),), (0.0,)
        pooling = sum(op("lookup", c, bags, n) for c in slice_widths(spec, placement))
        lookup, update = [pooling + n * self.unique_s] * n_ranks, [pooling] * n_ranks
        if placement.kind == "data_parallel":
            everyone = n_ranks * u
            update = [pooling + op("update", spec.dim, everyone, everyone)] * n_ranks
            shards = []
        else:
            shards = shards_of(spec, placement, n_ranks)
        for owner, cols, fraction, _ in shards:
            asked = n_ranks * fraction * u
            lookup[owner] += asked * self.unique_s + op("lookup", cols, asked, asked)
            update[owner] += op("update", cols, asked, asked)
        return tuple(lookup), tuple(update), self.wire_seconds(wire_bytes, across_bytes)

    def wire_seconds(self, wire_bytes, across_bytes=()):
        """Seconds per rank of ``wire_bytes``, ``across_bytes`` of them to other nodes."""
        bandwidth = self.profile.network_bytes_per_s.median
        if self.profile.across_bytes_per_s is None or not any(across_bytes):
            return tuple(w / bandwidth for w in wire_bytes)
        across = self.profile.across
        return tuple(max((w - a) / bandwidth, a / across) for w, a in zip(wire_bytes, across_bytes))

    def table_seconds(self, spec, placement, world_size, wire_bytes, across_bytes=()):
        """Seconds per rank of the table's lookups, updates and wire bytes."""
        return [sum(p) for p in zip(*self.table_parts(spec, placement, world_size, wire_bytes,
                                                      across_bytes))]

    def step(self, tables, placements, estimates, world_size):
        """The :class:`StepEstimate` of ``placements`` (table name -> placement) of
        ``tables`` (name -> spec) with the plan's byte ``estimates`` (name -> TableEstimate)."""
        n = int(world_size)
        step_us, table_us = self.profile.step_us, self.profile.table_us
        kinds = {p.kind for p in placements.values()}
        fixed = max((step_us[k].median - table_us[k].median for k in kinds), default=0.0)
        host = 1e-6 * (fixed + sum(table_us[p.kind].median for p in placements.values()))
        for name, p in placements.items():
            bags = self.batch_size * len(tables[name].features)
            host += 1e-9 * bags * (self.profile.host_ns_per_bag[p.kind].median
                                   + tables[name].hotness * self.profile.host_ns_per_id[p.kind].median)
        lookup, update, exchange = [0.0] * n, [0.0] * n, [0.0] * n
        for name, placement in placements.items():
            parts = self.table_parts(tables[name], placement, n, estimates[name].wire_bytes,
                                     estimates[name].across_bytes)
            for total, part in zip((lookup, update, exchange), parts):
                for r in range(n):
                    total[r] += part[r]
        if n > 1:
            measured = 3 * any(k != "data_parallel" for k in kinds) + ("data_parallel" in kinds)
            k = collectives(tables, placements) - measured
            latency = 1e-6 * self.profile.collective_latency_us.median * k
            exchange = [e + latency for e in exchange]
        return StepEstimate((host,) * n, tuple(lookup), tuple(update), tuple(exchange),
                            self.profile.source, dict(self.profile.machine))
