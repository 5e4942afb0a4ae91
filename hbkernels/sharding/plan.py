"""Placement planner of sharded embedding tables, with a cost model.

Per table (R rows, D columns of ``itemsize`` s bytes, hotness h, F features,
local batch B = ``batch_size_hint`` (default 1024), N ranks, wire itemsize
w), the distinct ids of one rank's step and of all ranks' steps are estimated
as ``u = R·(1 - (1 - 1/R)^(B·h·F))`` and ``U = R·(1 - (1 - 1/R)^(N·B·h·F))``. A row of c columns with its optimizer
state takes ``row(c) = c·(s + 4·e) + 4·p`` bytes (e, p: state floats per
element and per row). Memory counts the rows a rank keeps resident: a table in a
slow tier (``storage``) counts its cache's share, ``TableSpec.resident_rows / R``,
of each shard. Estimates per rank and step:

* ``data_parallel``: wire ``(N-1)·u·(8 + 4D)`` (allgatherv of ids and fp32
  gradient rows), lookup ``u·D·s + 2·U·row(D)``, memory ``R·row(D)``.
* sharded (``row_wise``, ``table_wise``, ``column_wise`` and the placements over a
  node's G ranks): shard j on rank o
  holds ``rows_j`` rows x ``c_j`` columns and serves a fraction ``f_j`` of the
  ids (row_wise: N shards of all columns, ``f = 1/N``, ``rows = ceil(R/N)``;
  table_wise: one shard of everything; column_wise: ``min(N, D)`` column
  slices sized as ``numpy.array_split``, ``f = 1``; table_row_wise: G shards of all
  columns on one node, ``f = 1/G``; table_column_wise: ``min(G, D)`` column slices on one
  node, ``f = 1``; grid: a column slice per whole node (at most D), each row-wise over the
  node's G ranks, ``f = 1/G``). Each other rank sends
  ``f·u`` ids and gradient rows to o and receives ``f·u`` rows: it sends
  ``f·u·(8 + c·w)`` and receives ``f·u·c·w``; o sends ``(N-1)·f·u·c·w`` and
  receives ``(N-1)·f·u·(8 + c·w)``. Wire bytes are the busier direction of a
  rank's full-duplex link, ``max(sent, received)``. o reads ``N·f·u·c·s``
  bytes for lookups and reads and writes ``2·f·U·row(c)`` for the update,
  and holds ``rows·row(c)``.

Step cost ``= max_r (wire_r / net_bw + lookup_r / mem_bw) + latency · k``, with
k collectives: 3 (ids, rows, gradients) per distinct width of the sharded
tables (tables of one width are coalesced) and 1 (gradient allgatherv) per
distinct width of the replicated ones; no collective at N = 1.

With a machine profile (``make_plan(..., profile=P)``), a table's seconds per rank are
those of the time model of :mod:`hbkernels.sharding.cost` instead, and a plan's step cost its
predicted step (:meth:`Plan.predict`); ``ranks_per_node`` G puts ranks ``[k·G, (k+1)·G)``
on node k, and a table's estimate counts the wire bytes to and from other nodes
(``across_bytes``). Under the hierarchical exchange (``exchange``, by default where nodes
hold several ranks) a rank sends its ``f·u`` ids of a shard to the relay of the shard on its
node (the rank of the owner's index there, else the owner), and each relay sends the owner
``f·U_k`` ids, ``U_k`` the distinct ids of node k's ranks' draws together, and gets their
rows back: ids cross between two nodes once.

``"auto"``: at N = 1 every table is ``table_wise`` on rank 0. Otherwise the
tables, largest first, each take the sharded placement with the least
``max_r (load_r + time_r)`` given the load of the tables placed before (ties:
row_wise, table_wise, column_wise, then, where the ranks span nodes, table_row_wise,
table_column_wise and grid; those that cut columns not with per-row optimizer
state, which needs whole rows; owners are the least loaded ranks that
fit, ties to the lowest rank, a placement over a node's ranks on the node of the least
loaded rank); then, smallest first, a table becomes
``data_parallel`` when it fits on every rank and the plan's step cost does not
increase. Explicit placements take part in the same balancing.

>>> from hbkernels.types import TableSpec
>>> plan = make_plan([TableSpec("item", 10**7, 64, hotness=10),
...                   TableSpec("country", 200, 8)], world_size=4, batch_size_hint=4096)
>>> plan["item"].kind, plan["country"].kind
('row_wise', 'data_parallel')
>>> Plan.from_json(plan.to_json()) == plan
True
"""
import collections.abc
import dataclasses

import numpy as np

from ..bench.common import LAYOUTS
from ..types import NODE_PLACEMENTS, PLACEMENTS, TableSpec, table_spec
from .cost import ProfileCost, collectives, expected_distinct, shards_of
from .profile import DEFAULT_COST, MachineProfile, as_profile, assumed_profile

DEFAULT_BATCH_SIZE = 1024
_SHARDED = PLACEMENTS[1:]  # the sharded placements, in the tie order of "auto"
_COLUMN_SLICED = ("column_wise", "table_column_wise", "grid")  # placements that cut columns
_ID_BYTES = 8
#: the exchanges of sharded tables (the collection's ``exchange=``; :func:`exchange_of`)
EXCHANGES = ("auto", "flat", "hierarchical")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a table lives: ``kind`` (one of PLACEMENTS), the ``ranks`` holding
    it (column_wise: the rank of each column slice) and the column boundaries."""

    kind: str
    ranks: tuple
    columns: tuple

    def slice_ranks(self, slice_index):
        """The ranks holding column slice ``slice_index``: ``ranks`` cut into one equal run
        per slice (all of them for a table whole; one rank a slice for column_wise; a
        node's ranks for each slice of a grid)."""
        per_slice = len(self.ranks) // (len(self.columns) - 1)
        return self.ranks[slice_index * per_slice:(slice_index + 1) * per_slice]

    def to_json(self):
        return {"kind": self.kind, "ranks": list(self.ranks), "columns": list(self.columns)}

    @classmethod
    def from_json(cls, d):
        return cls(d["kind"], tuple(d["ranks"]), tuple(d["columns"]))


@dataclasses.dataclass(frozen=True)
class TableEstimate:
    """Per step, per rank: wire bytes (max of sent and received), bytes of
    table rows read and written, bytes of weights and optimizer state held, and of the
    wire bytes those to and from ranks of other nodes."""

    wire_bytes: tuple
    lookup_bytes: tuple
    memory_bytes: tuple
    #: of ``wire_bytes``, what crosses between nodes (max of sent and received)
    across_bytes: tuple = ()

    def seconds(self, assumptions):
        """Per rank: ``wire / net_bw + lookup / mem_bw``."""
        return [w / assumptions["network_bytes_per_s"] + b / assumptions["memory_bytes_per_s"]
                for w, b in zip(self.wire_bytes, self.lookup_bytes)]


def _spec_json(spec):
    return dict(spec._asdict(), features=list(spec.features))


class Plan(collections.abc.Mapping):
    """Table name -> :class:`Placement`, with the estimates it was chosen by."""

    def __init__(self, placements, *, tables, world_size, request, estimates, batch_size_hint, assumptions,
                 profile=None, id_layout="scattered"):
        self._placements = dict(placements)
        #: the :class:`~hbkernels.sharding.profile.MachineProfile` the plan was costed with (None: the byte model)
        self.profile = profile
        self.id_layout = id_layout
        self.tables = dict(tables)
        self.world_size = world_size
        self.request = request
        self.estimates = dict(estimates)
        self.batch_size_hint = batch_size_hint
        self.assumptions = dict(assumptions)

    def __getitem__(self, name):
        return self._placements[name]

    def __iter__(self):
        return iter(self._placements)

    def __len__(self):
        return len(self._placements)

    def __eq__(self, other):
        if isinstance(other, Plan):
            return self.to_json() == other.to_json()
        return super().__eq__(other)

    __hash__ = None

    def __repr__(self):
        return f"Plan({ {name: p.kind for name, p in self.items()} }, world_size={self.world_size})"

    @property
    def step_seconds(self):
        """The step cost the plan was chosen by: with a profile, its predicted sparse step
        (:meth:`predict`); without, the byte model's estimate (module docstring)."""
        if self.profile is not None:
            return self.predict().seconds
        return _step_seconds(self.tables, self._placements, self.estimates, self.world_size, self.assumptions)

    def predict(self):
        """The :class:`~hbkernels.sharding.cost.StepEstimate` of a sparse step per rank by
        the plan's profile, or by :func:`~hbkernels.sharding.profile.assumed_profile` (the
        built-in defaults, labelled as such) where it has none."""
        profile = self.profile or assumed_profile(sorted({s.dim for s in self.tables.values()}
                                                         | {int(c) for p in self.values()
                                                            for c in np.diff(p.columns)}))
        return ProfileCost(profile, self.id_layout, self.assumptions["batch_size"]).step(
            self.tables, self._placements, self.estimates, self.world_size)

    def __str__(self):
        def ranks(p):
            return "all" if p.kind in ("data_parallel", "row_wise") else ",".join(map(str, p.ranks))

        rows = [("table", "rows", "dim", "hotness", "placement", "ranks", "wire MB/step", "memory MB/rank")]
        for name, p in self.items():
            spec, est = self.tables[name], self.estimates[name]
            held = f"<={spec.capacity} (dynamic)" if spec.dynamic else str(spec.num_rows)
            rows.append((name, held, str(spec.dim), f"{spec.hotness:g}", p.kind, ranks(p),
                         f"{max(est.wire_bytes) / 1e6:.3f}", f"{max(est.memory_bytes) / 1e6:.3f}"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        a = self.assumptions

        def mb(field):   # per rank, summed over the tables
            return " ".join(f"{sum(x) / 1e6:.3f}" for x in zip(*(getattr(e, field) for e in self.estimates.values())))

        batch = f"{a['batch_size']}" + ("" if self.batch_size_hint else " (default, no batch_size_hint)")
        limit = "unlimited" if a["memory_per_rank"] is None else f"{a['memory_per_rank'] / 1e6:.3f} MB"
        if self.profile is None:
            cost = (f"estimated step cost: {self.step_seconds * 1e3:.4f} ms (bytes at built-in rates, "
                    f"not measured: hbkernels plan --calibrate)")
        else:
            cost = f"predicted sparse step: {self.predict()}, ids {self.id_layout}"
        lines += [f"per rank ({self.world_size}): wire MB/step {mb('wire_bytes')}; memory MB {mb('memory_bytes')}",
                  cost,
                  f"assumptions: batch {batch} per rank, "
                  + ("" if self.profile is not None else
                     f"network {a['network_bytes_per_s'] / 1e9:g} GB/s, memory {a['memory_bytes_per_s'] / 1e9:g} "
                     f"GB/s, latency {a['collective_latency_s'] * 1e6:g} us/collective, ")
                  + f"wire itemsize {a['wire_itemsize']}, optimizer state floats "
                  f"{a['state_floats_per_element']}/element {a['state_floats_per_row']}/row, "
                  f"memory limit {limit}"]
        return "\n".join(lines)

    def to_json(self):
        return {"world_size": self.world_size,
                "request": dict(self.request) if isinstance(self.request, dict) else self.request,
                "batch_size_hint": self.batch_size_hint, "assumptions": dict(self.assumptions),
                "tables": [_spec_json(spec) for spec in self.tables.values()],
                "placements": {name: p.to_json() for name, p in self.items()},
                "estimates": {name: {field: list(values) for field, values in dataclasses.asdict(e).items()}
                              for name, e in self.estimates.items()},
                "profile": None if self.profile is None else self.profile.to_json(),
                "id_layout": self.id_layout}

    @classmethod
    def from_json(cls, d):
        tables = [table_spec(TableSpec(**t)) for t in d["tables"]]
        return cls({name: Placement.from_json(p) for name, p in d["placements"].items()},
                   tables={t.name: t for t in tables}, world_size=d["world_size"], request=d["request"],
                   estimates={name: TableEstimate(**{field: tuple(values) for field, values in e.items()})
                              for name, e in d["estimates"].items()},
                   batch_size_hint=d["batch_size_hint"], assumptions=d["assumptions"],
                   profile=None if d.get("profile") is None else MachineProfile.from_json(d["profile"]),
                   id_layout=d.get("id_layout", "scattered"))


def _element_bytes(spec, assumptions):
    """Bytes a table holds per element: its dtype's, or a quantized table's bits / 8."""
    return assumptions.get("element_bytes", {}).get(spec.name, np.dtype(spec.dtype).itemsize)


def estimate(spec, placement, world_size, assumptions):
    """The :class:`TableEstimate` of ``spec`` placed as ``placement`` (formulas in the module docstring)."""
    n, a = world_size, assumptions
    s = _element_bytes(spec, a)
    draws = a["batch_size"] * spec.hotness * len(spec.features)
    u, u_all = expected_distinct(spec.rows, draws), expected_distinct(spec.rows, n * draws)

    def row_bytes(cols):
        return cols * (s + 4 * a["state_floats_per_element"]) + 4 * a["state_floats_per_row"]

    per_node = min(a.get("ranks_per_node") or n, n)

    if placement.kind == "data_parallel":
        gradients = u * (_ID_BYTES + 4 * spec.dim)
        remote = [n - size for size in _node_sizes(n, per_node) for _ in range(size)]
        return TableEstimate(((n - 1) * gradients,) * n,
                             (u * spec.dim * s + 2 * u_all * row_bytes(spec.dim),) * n,
                             (spec.resident_rows * row_bytes(spec.dim),) * n,
                             tuple(k * gradients for k in remote))
    shards = shards_of(spec, placement, n)
    lookup, memory = [0.0] * n, [0.0] * n
    w = a["wire_itemsize"]
    for owner, cols, fraction, rows in shards:
        lookup[owner] += n * fraction * u * cols * s + 2 * fraction * u_all * row_bytes(cols)
        memory[owner] += rows * spec.resident_rows / spec.rows * row_bytes(cols)
    if a.get("exchange") == "hierarchical":
        node_ids = [expected_distinct(spec.rows, size * draws) for size in _node_sizes(n, per_node)]
        sent, received, far_sent, far_received = _relayed_bytes(shards, n, per_node, u, node_ids, w)
    else:
        sent, received, far_sent, far_received = _flat_bytes(shards, n, per_node, u, w)
    return TableEstimate(tuple(map(float, np.maximum(sent, received))), tuple(lookup), tuple(memory),
                         tuple(map(float, np.maximum(far_sent, far_received))))


def _node_sizes(world_size, per_node):
    """Ranks of each node: ``per_node``, the last node the rest."""
    return [min(per_node, world_size - k) for k in range(0, world_size, per_node)]


def _flat_bytes(shards, n, per_node, u, w):
    """``(sent, received, of them sent across nodes, received across nodes)`` per rank of a
    sharded table's flat exchange: each rank asks each shard's owner for its ``f·u`` ids
    (ids and gradients: ``8 + c·w`` bytes each) and receives their rows (``c·w``)."""
    sent, received, far_sent, far_received = (np.zeros(n) for _ in range(4))
    node = np.arange(n) // per_node
    for owner, cols, fraction, _ in shards:
        ids = fraction * u
        asks, answers = ids * (_ID_BYTES + cols * w), ids * cols * w  # one rank's, each way
        peers = np.arange(n) != owner
        far = node != node[owner]
        sent += peers * asks
        received += peers * answers
        far_sent += far * asks
        far_received += far * answers
        sent[owner] += (n - 1) * answers
        received[owner] += (n - 1) * asks
        far_sent[owner] += far.sum() * answers
        far_received[owner] += far.sum() * asks
    return sent, received, far_sent, far_received


def _relayed_bytes(shards, n, per_node, u, node_ids, w):
    """:func:`_flat_bytes` of the hierarchical exchange (:mod:`hbkernels.sharding._hierarchical`):
    each rank asks the relay of each shard on its node (the rank of the owner's index there,
    else the owner) for its ``f·u`` ids; each relay asks the owner once for its node's
    distinct ones, ``f·node_ids[k]`` (node k's ranks' draws together)."""
    sent, received, far_sent, far_received = (np.zeros(n) for _ in range(4))
    g = per_node
    sizes = np.array(_node_sizes(n, g))
    for owner, cols, fraction, _ in shards:
        ids = fraction * u
        asks, answers = ids * (_ID_BYTES + cols * w), ids * cols * w
        local, home = owner % g, owner // g
        for k, size in enumerate(sizes):
            members = np.arange(k * g, k * g + size)
            relay = k * g + local if local < size else owner
            askers = members[members != relay]
            sent[askers] += asks
            received[askers] += answers
            received[relay] += askers.size * asks
            sent[relay] += askers.size * answers
            if relay == owner and k != home:  # no relay on node k: its ranks ask the owner
                far_sent[askers] += asks
                far_received[askers] += answers
                far_received[owner] += askers.size * asks
                far_sent[owner] += askers.size * answers
            if relay != owner:  # the relay asks the owner, across nodes, once for its node
                once = fraction * node_ids[k]
                relay_asks, relay_answers = once * (_ID_BYTES + cols * w), once * cols * w
                for x, y in ((sent, received), (far_sent, far_received)):
                    x[relay] += relay_asks
                    y[owner] += relay_asks
                    x[owner] += relay_answers
                    y[relay] += relay_answers
    return sent, received, far_sent, far_received


def _step_seconds(tables, placements, estimates, world_size, assumptions):
    per_rank = [sum(ts) for ts in zip(*(e.seconds(assumptions) for e in estimates.values()))]
    if world_size == 1:
        return max(per_rank)
    k = collectives(tables, placements)
    return max(per_rank) + assumptions["collective_latency_s"] * k


def _columns(spec, slices):
    """The column boundaries of ``slices`` slices of ``spec``, sized as ``numpy.array_split``."""
    sizes = [len(c) for c in np.array_split(np.arange(spec.dim), min(slices, spec.dim))]
    return tuple(int(c) for c in np.cumsum([0] + sizes))


def _place(kind, spec, world_size, order, per_node=None):
    """``kind`` for ``spec``, owners taken from ``order`` (ranks, most preferred first);
    ranks ``[k·G, (k+1)·G)`` share node k (``per_node`` G; None: one node). A placement
    over a node's ranks takes the node of the most preferred rank; a ``grid`` one column
    slice per whole node (at most D), the nodes in the order of their most preferred rank."""
    if kind in ("data_parallel", "row_wise"):
        return Placement(kind, tuple(range(world_size)), (0, spec.dim))
    g = per_node or world_size
    node = order[0] // g
    mine = [r for r in order if r // g == node]  # the node's ranks, most preferred first
    if kind == "table_wise":
        return Placement(kind, (order[0],), (0, spec.dim))
    if kind == "column_wise":
        columns = _columns(spec, world_size)
        return Placement(kind, tuple(order[:len(columns) - 1]), columns)
    if kind == "table_column_wise":
        columns = _columns(spec, len(mine))
        return Placement(kind, tuple(mine[:len(columns) - 1]), columns)
    if kind == "table_row_wise":
        return Placement(kind, tuple(sorted(mine)), (0, spec.dim))
    whole = [k for k in dict.fromkeys(r // g for r in order) if (k + 1) * g <= world_size] or [node]
    columns = _columns(spec, len(whole))
    nodes = whole[:len(columns) - 1]
    return Placement(kind, tuple(r for k in nodes for r in range(k * g, min((k + 1) * g, world_size))),
                     columns)


def _requested_kinds(request, names):
    expected = f"'auto', one of {PLACEMENTS}, or a dict of table name -> one of those"
    if isinstance(request, str):
        if request != "auto" and request not in PLACEMENTS:
            raise ValueError(f"plan must be {expected}, got {request!r}")
        return dict.fromkeys(names, request)
    if not isinstance(request, collections.abc.Mapping):
        raise ValueError(f"plan must be {expected}, got {type(request).__name__}")
    unknown = sorted(set(request) - set(names))
    if unknown:
        raise ValueError(f"plan names unknown tables {unknown}; the tables are {list(names)}")
    for name, kind in request.items():
        if kind != "auto" and kind not in PLACEMENTS:
            raise ValueError(f"plan[{name!r}] must be 'auto' or one of {PLACEMENTS}, got {kind!r}")
    return {name: request.get(name, "auto") for name in names}


def _check_same_tables(plan, specs, world_size):
    """A ValueError unless :class:`Plan` ``plan`` places exactly ``specs`` (the same
    names, rows, widths and kinds of table) on ``world_size`` ranks."""
    def shape(spec):
        return spec.num_rows, spec.dim, spec.dynamic, spec.capacity

    same = (plan.world_size == world_size and set(plan) == set(specs)
            and all(shape(plan.tables[n]) == shape(specs[n]) for n in specs))
    if not same:
        raise ValueError(f"plan is a Plan of tables {sorted(plan)} on {plan.world_size} ranks, "
                         f"not of these tables on {world_size}")


def _checked_tables(tables):
    specs = [table_spec(t) for t in tables]
    if not specs:
        raise ValueError("make_plan needs at least one table")
    seen_tables, feature_owner = set(), {}
    for spec in specs:
        if spec.name in seen_tables:
            raise ValueError(f"duplicate table name {spec.name!r}")
        seen_tables.add(spec.name)
        for feature in spec.features:
            if feature in feature_owner:
                raise ValueError(f"feature {feature!r} is used by tables {feature_owner[feature]!r} "
                                 f"and {spec.name!r}; a feature belongs to one table")
            feature_owner[feature] = spec.name
    return {spec.name: spec for spec in specs}


def _assumptions(world_size, batch_size_hint, memory_per_rank, state_floats_per_element,
                 state_floats_per_row, wire_itemsize, cost, element_bytes=None):
    if isinstance(world_size, bool) or int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if batch_size_hint is not None and (int(batch_size_hint) != batch_size_hint or batch_size_hint < 1):
        raise ValueError(f"batch_size_hint must be None or an integer >= 1, got {batch_size_hint!r}")
    if memory_per_rank is not None and not memory_per_rank > 0:
        raise ValueError(f"memory_per_rank must be None or > 0 bytes, got {memory_per_rank!r}")
    if not (state_floats_per_element >= 0 and state_floats_per_row >= 0):
        raise ValueError("state_floats_per_element and state_floats_per_row must be >= 0")
    if wire_itemsize not in (2, 4):
        raise ValueError(f"wire_itemsize must be 4 (fp32) or 2 (fp16), got {wire_itemsize!r}")
    cost = dict(cost or {})
    unknown = sorted(set(cost) - set(DEFAULT_COST))
    if unknown:
        raise ValueError(f"unknown cost parameters {unknown}; expected some of {sorted(DEFAULT_COST)}")
    params = dict(DEFAULT_COST, **cost)
    if not (params["network_bytes_per_s"] > 0 and params["memory_bytes_per_s"] > 0
            and params["collective_latency_s"] >= 0):
        raise ValueError(f"cost needs bandwidths > 0 and a latency >= 0, got {params}")
    return dict(params, batch_size=int(batch_size_hint or DEFAULT_BATCH_SIZE), wire_itemsize=wire_itemsize,
                state_floats_per_element=state_floats_per_element, state_floats_per_row=state_floats_per_row,
                memory_per_rank=memory_per_rank, element_bytes=dict(element_bytes or {}))


def exchange_of(exchange, world_size, ranks_per_node=None):
    """``"flat"`` or ``"hierarchical"``: the exchange ``exchange`` (one of :data:`EXCHANGES`)
    means on ``world_size`` ranks in nodes of ``ranks_per_node`` (None: one node); ``"auto"``
    is hierarchical where the ranks span nodes of more than one rank. A ``ValueError`` for
    another ``exchange``."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    g = min(ranks_per_node or world_size, world_size)
    relays = exchange == "hierarchical" or exchange == "auto" and 1 < g < world_size
    return "hierarchical" if relays and world_size > 1 else "flat"


def make_plan(tables, world_size, request="auto", *, batch_size_hint=None, memory_per_rank=None,
              state_floats_per_element=0, state_floats_per_row=0, wire_itemsize=4, cost=None,
              element_bytes=None, profile=None, id_layout="scattered", ranks_per_node=None,
              exchange="auto"):
    """A :class:`Plan` of ``tables`` over ``world_size`` ranks (algorithm in the module docstring).

    ``request``: ``"auto"``, one of PLACEMENTS for every table, a dict of
    table name -> one of those or ``"auto"`` (missing tables: ``"auto"``), or a
    :class:`Plan` of the same tables and world size (returned as it is).
    ``element_bytes``: ``{table: bytes}`` held per element where it is not the dtype's
    (a quantized table's ``bits / 8``).
    ``memory_per_rank`` (bytes) bounds what each rank holds; ``cost``
    overrides some of :data:`DEFAULT_COST` (network 10 GB/s, memory 50 GB/s,
    50 us per collective). ``profile``: a
    :class:`~hbkernels.sharding.profile.MachineProfile` (or the path of its JSON file, or
    its dict) of ``hbkernels plan --calibrate``: placements are then ranked by the time
    model of :mod:`hbkernels.sharding.cost` with its constants, for ids laid out as
    ``id_layout`` (one of the profile's layouts: ``"scattered"``, ``"ranked"``,
    ``"uniform"``), and ``cost`` is not taken. ``ranks_per_node``: ranks
    ``[k·G, (k+1)·G)`` share node k (default: one node), for the estimates' bytes across nodes
    and the placements over a node's ranks; ``exchange``: the sharded tables' exchange whose
    bytes the estimates count, as the collection's ``exchange`` (``"auto"``: hierarchical
    where the ranks span nodes of more than one rank).
    """
    specs = _checked_tables(tables)
    if isinstance(request, Plan):  # a plan made before, kept as it is
        _check_same_tables(request, specs, world_size)
        return request
    a = _assumptions(world_size, batch_size_hint, memory_per_rank, state_floats_per_element,
                     state_floats_per_row, wire_itemsize, cost, element_bytes)
    profile = as_profile(profile, "profile")
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or int(ranks_per_node) != ranks_per_node or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be None or an integer >= 1, got {ranks_per_node!r}")
        a["ranks_per_node"] = int(ranks_per_node)
    a["exchange"] = exchange_of(exchange, world_size, a.get("ranks_per_node"))
    if id_layout not in LAYOUTS:
        raise ValueError(f"id_layout must be one of {LAYOUTS}, got {id_layout!r}")
    if profile is not None and cost:
        raise ValueError("give make_plan a profile or cost constants, not both")
    timing = None if profile is None else ProfileCost(profile, id_layout, a["batch_size"])
    n, limit = int(world_size), memory_per_rank
    per_node = min(a.get("ranks_per_node") or n, n)

    def seconds(spec, placement, est):
        """Per rank: the table's seconds by the profile, else by the byte model."""
        if timing is None:
            return est.seconds(a)
        return timing.table_seconds(spec, placement, n, est.wire_bytes, est.across_bytes)

    def step(placed, placed_estimates):
        if timing is None:
            return _step_seconds(specs, placed, placed_estimates, n, a)
        return timing.step(specs, placed, placed_estimates, n).seconds
    kinds = _requested_kinds(request, list(specs))
    for name, kind in kinds.items():  # a dynamic table is cut by a hash of its ids
        if specs[name].dynamic:
            if kind not in ("auto", "row_wise"):
                raise ValueError(f"table {name!r} is dynamic (num_rows=None): it is placed "
                                 f"row_wise, by a hash of its ids; got {kind!r}")
            kinds[name] = "row_wise"
    if n == 1:
        kinds = {name: "table_wise" if kind == "auto" else kind for name, kind in kinds.items()}
    load, held = [0.0] * n, [0.0] * n   # seconds and bytes per rank of the tables placed so far
    placements, estimates = {}, {}

    def footprint(name):
        spec = specs[name]
        return spec.rows * spec.dim * _element_bytes(spec, a)

    def peak_memory(est, replacing=None):
        """(bytes, rank) of the fullest rank once ``est`` is added (and ``replacing`` removed)."""
        return max((h - (replacing.memory_bytes[r] if replacing else 0) + m, r)
                   for r, (h, m) in enumerate(zip(held, est.memory_bytes)))

    def count(name, placement, est, sign):
        for r, (t, m) in enumerate(zip(seconds(specs[name], placement, est), est.memory_bytes)):
            load[r] += sign * t
            held[r] += sign * m

    names = list(specs)
    for name in sorted(names, key=lambda x: (-footprint(x), names.index(x))):
        spec = specs[name]
        whole = estimate(spec, _place("table_wise", spec, n, (0,)), n, a).memory_bytes[0]
        order = sorted(range(n), key=lambda r: (limit is not None and held[r] + whole > limit, load[r], r))
        options = []
        auto = tuple(k for k in _SHARDED if (k not in _COLUMN_SLICED or not a["state_floats_per_row"])
                     and (k not in NODE_PLACEMENTS or per_node < n))
        for kind in (auto if kinds[name] == "auto" else (kinds[name],)):
            placement = _place(kind, spec, n, order, per_node)
            est = estimate(spec, placement, n, a)
            score = max(lt + t for lt, t in zip(load, seconds(spec, placement, est)))
            options.append((score, placement, est))
        fitting = [o for o in options if limit is None or peak_memory(o[2])[0] <= limit]
        if not fitting:
            need, rank, kind = min((*peak_memory(est), p.kind) for _, p, est in options)
            raise ValueError(f"table {name!r} does not fit memory_per_rank={limit} bytes: as {kind} rank {rank} "
                             f"would hold {need:.0f} bytes, {held[rank]:.0f} of them for other tables")
        _, placements[name], estimates[name] = min(fitting, key=lambda o: o[0])
        count(name, placements[name], estimates[name], +1)

    for name in sorted(names, key=lambda x: (footprint(x), names.index(x))):
        if n == 1 or kinds[name] != "auto":
            continue
        sharded = placements[name], estimates[name]
        replica = _place("data_parallel", specs[name], n, ())
        replica_est = estimate(specs[name], replica, n, a)
        if limit is not None and peak_memory(replica_est, replacing=sharded[1])[0] > limit:
            continue
        before = step(placements, estimates)
        placements[name], estimates[name] = replica, replica_est
        if step(placements, estimates) > before:
            placements[name], estimates[name] = sharded
        else:
            count(name, sharded[0], sharded[1], -1)
            count(name, replica, replica_est, +1)

    return Plan({name: placements[name] for name in names}, tables=specs, world_size=n,
                request=dict(request) if isinstance(request, collections.abc.Mapping) else request,
                estimates={name: estimates[name] for name in names}, batch_size_hint=batch_size_hint,
                assumptions=a, profile=profile, id_layout=id_layout)
