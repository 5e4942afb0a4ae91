"""The records of an :class:`~hbkernels.EmbeddingCollection`'s step: what a forward
keeps for its backward (:class:`Saved`, per fused array an :class:`ExchangeContext`
or a :class:`LocalContext` and their :class:`Pool` launches), what the flat path of a
GPU lays out once per signature (:class:`Door`, :class:`FlatLayout`, :class:`FlatPlan`)
and the memory a reserved step holds (:class:`Reservation`)."""
from typing import Any, NamedTuple

class Pool(NamedTuple):
    """One ``embedding_bag`` launch of a forward: its combiner and CSR input over the
    fused rows, and ``pieces`` ``[(feature, c0, c1, first bag, bags)]`` of the output;
    ``bounds``: ``"zero"`` for a dynamic table's rows (an id not admitted is row -1),
    else ``"unchecked"``."""

    combiner: Any
    values: Any
    offsets: Any
    psw: Any
    pieces: list
    bounds: str = "unchecked"
    at: Any = None  # (first value, first bound) in its flat launch's rows and bounds

    @property
    def n_values(self):
        return int(self.values.shape[0])

    @property
    def bags(self):
        return int(self.offsets.shape[0]) - 1


class FlatPool:
    """A :class:`Pool` of a flat launch (:meth:`EmbeddingCollection._pool_flat`): its
    ``n_values`` values and ``bags`` bags from ``at`` in the launch's rows and bounds, whose
    views (``values``, ``offsets``, ``psw``) are made where they are read (a view costs
    the host a call)."""

    __slots__ = ("combiner", "pieces", "at", "n_values", "bags", "_flat", "_weighted")
    bounds = "unchecked"

    def __init__(self, combiner, flat, at, n_values, bags, pieces, weighted):
        self.combiner, self.pieces, self.at, self.n_values, self.bags = (combiner, pieces, at,
                                                                         n_values, bags)
        self._flat, self._weighted = flat, weighted  # (rows, bounds, weights or None)

    @property
    def values(self):
        return self._flat[0][self.at[0]:self.at[0] + self.n_values]

    @property
    def offsets(self):
        return self._flat[1][self.at[1]:self.at[1] + self.bags + 1]

    @property
    def psw(self):
        return self._flat[2][self.at[0]:self.at[0] + self.n_values] if self._weighted else None


class Relay(NamedTuple):
    """What a rank relays of a hierarchical exchange (:mod:`~hbkernels.sharding._hierarchical`):
    the ids its node's ranks sent it for the ranks of its index on every node, kept once."""

    recv_counts: Any  # ids received from each rank of its node (the others: 0)
    inverse: Any  # received id k is distinct id inverse[k]
    distinct: int  # distinct ids relayed
    order: Any  # the distinct ids in their owners' order (the partition's order)
    send_counts: Any  # distinct ids sent to each owner


class Sent(NamedTuple):
    """A sharded fused array's ids on their way to their owners
    (:meth:`~hbkernels.sharding._alltoall.AlltoallExchange._send_ids`)."""

    requests: list  # (feature, route) pairs of the fused array's sharded slices
    starts: list  # each request's first in the distinct ids
    total: int  # distinct ids requested by this rank
    keys: Any  # what this rank sends, in send order
    send_counts: Any  # to each rank
    order: Any  # the partition's order: the distinct ids in send order
    recv_keys: Any  # keys this rank owns, as received
    recv_counts: Any  # from each rank
    relay: Any = None  # a hierarchical exchange's Relay (then send_counts go to this node)


class ExchangeContext(NamedTuple):
    """What backward needs of one sharded fused array's forward exchange (world size > 1)."""

    group: Any
    pools: list
    rows: int  # distinct ids requested by this rank
    order: Any  # the partition's order
    send_counts: Any
    recv_keys: Any  # fused rows this rank served, as received
    recv_counts: Any
    relay: Any = None  # a hierarchical exchange's Relay


class LocalContext(NamedTuple):
    """What backward needs of a fused array pooled from this rank's own rows; ``flat``:
    ``(key, rows, bounds, per-sample weights or None)`` of the flat array's launch that
    pooled it, if one did."""

    group: Any
    pools: list
    flat: Any = None


class Saved(NamedTuple):
    inputs: dict
    exchanges: list
    locals: list
    flat: Any = None  # a forward of the flat path (_forward_flat): its FlatCall


class Door(NamedTuple):
    """What the flat path (:meth:`EmbeddingCollection._forward_flat`) takes from a
    forward's signature, its features' names (in the order given) and batches."""

    at: list  # per feature of the launch (in its order), its index in the order given
    order: list  # the features, in the launch's order
    limits: list  # each one's table rows (its ids are checked against them)
    inputs: dict  # feature -> Feature (no arrays): what backward reads of the forward
    lay: Any  # the launch's FlatLayout
    tables: list  # each feature's table
    # the check's table (ragged.features_table), then the launch's plan from element
    # ``base``, the fields that counts change left 0; where those fields are (the
    # first values, the counts, pool_tables.placed's columns)
    host: Any
    base: int
    placed: Any


class FlatCall(NamedTuple):
    """A forward of the flat path, for its backward."""

    door: Door
    counts: list  # each feature's values, in the launch's order
    rows_at: list  # each segment's first row in ``rows``, then their total
    rows: Any  # what the launch wrote for the backward
    bounds: Any


class FlatPlan(NamedTuple):
    """One flat array's update (:meth:`EmbeddingCollection._flat_plan`)."""

    tables: list  # update_tables.Table
    pools: list  # update_tables.Pool
    places: list  # (first element in the flat gradient, feature, c0, c1, bags) per piece
    counters: list  # each fused array's step count (its state's "step")
    hp: Any  # the rule's hyper-parameters (the last array's step)
    size: int  # elements of the flat gradient


class FlatLayout(NamedTuple):
    """What a flat pooling launch takes from its signature
    (:meth:`EmbeddingCollection._flat_layout`): the rest comes from its features' counts
    of values."""

    order: list  # the features, in the order of their values in the launch
    segment_features: list  # per segment: its feature's index in ``order``
    segment_pools: list  # per segment: the first segment of its pool
    launch: Any  # pool_tables.Layout, the counts' fields left 0
    out_size: int  # output elements
    bounds_size: int  # the pools' bounds
    width: int  # the one width of every output, else 0
    outputs: list  # (feature, first output element, batch, dim), in the order of ``order``
    pools: list  # ((group, replicated), [(combiner, first segment, end segment, first bound,
    #              bags, pieces, weighted)])

    def columns(self, counts):
        """``(columns, rows_at, firsts)`` of a call whose features (in :attr:`order`) hold
        ``counts`` values: the fields ``pool_tables.placed`` writes, per segment its
        first value, count, first row and first row in its pool; each segment's first
        row, then their total; each feature's first value, then their total."""
        firsts = [0]
        for n in counts:
            firsts.append(firsts[-1] + n)
        rows_at, columns = [0], []
        for k, pool_first in zip(self.segment_features, self.segment_pools):
            at = rows_at[-1]
            columns += (firsts[k], counts[k], at, at - rows_at[pool_first])
            rows_at.append(at + counts[k])
        return columns, rows_at, firsts

    def pooled(self, rows_at):
        """``[((group, replicated), [(combiner, first row, values, first bound, bags, pieces,
        weighted)])]``: each pair's pools in a call whose segments start at ``rows_at``
        (:meth:`columns`)."""
        return [(pair, [(combiner, rows_at[s0], rows_at[s1] - rows_at[s0], first_bound, bags,
                         pieces, weighted)
                        for combiner, s0, s1, first_bound, bags, pieces, weighted in pools])
                for pair, pools in self.pools]

    def results(self, out):
        """``{feature: its [batch, dim] output}``: views of the launch's ``out``."""
        if self.width:  # one width: rows
            by_rows, width = out.reshape(-1, self.width), self.width
            return {f: by_rows[first // width:first // width + batch]
                    for f, first, batch, _ in self.outputs}
        return {f: out[first:first + batch * dim].reshape(batch, dim)
                for f, first, batch, dim in self.outputs}


class ReservedFlat(NamedTuple):
    """A flat array's part of a :class:`Reservation`."""

    pooled: Any  # the pooling launch's pool_tables.Pooled
    contexts: dict  # (group, replicated) -> LocalContext, its pools views of what it writes
    outputs: dict  # feature -> [(0, dim, [B, dim] view of the launch's output)]
    step: Any  # update_tables.StepSpace
    grad: Any  # the flat fp32 gradient the update reads
    psw: Any  # the per-sample weights of the launch's rows, or None
    segments: list  # (feature, first row) of each pool, in the rows


class Reservation(NamedTuple):
    """The memory of a training step sized once (:meth:`EmbeddingCollection.reserve`)."""

    batch: int
    capacity: dict  # feature -> ids at most
    weighted: frozenset
    firsts: dict  # feature -> (first value, first offset) in the staged inputs
    staged: Any  # ragged.Staged: every feature's values and offsets, the check's table
    table: Any  # the check's table on the host (its counts rewritten each forward)
    psw: Any  # per-sample weights (ones where a feature has none), or None
    ones: Any  # offsets of one-id bags, 0..batch
    flats: dict  # flat key -> ReservedFlat


class CapturedStep:
    """A training step captured into a CUDA graph (:meth:`EmbeddingCollection.capture`);
    :meth:`replay` runs it with the host's part of a step around it."""

    def __init__(self):
        self._checks = None  # the checks' graphs.Captured
        self._before = []  # what the host does before each replay
        self._after = []  # and after it

    def replay(self, launch):
        """One step: ``launch()`` queues a replay of the graph (``graph.replay`` in torch,
        on the current stream). Before it, the step's id counts and its step sizes
        (Adam's) or rounding keys reach the device where they changed; after it, the
        step's checks are noted (their errors raise at the next wait, as an uncaptured
        step's do), each table's step count advances, and the rows it updated are noted
        for an incremental save."""
        for before in self._before:
            before()
        launch()
        self._checks.replayed()
        for after in self._after:
            after()


def flat_members(contexts):
    """``[(group, [(combiner, first row, values, first bound, bags, pieces)])]``: what
    a flat array's update takes of the pools of ``contexts`` (the LocalContexts of its
    launch)."""
    return [(ctx.group, [(p.combiner, p.at[0], p.n_values, p.at[1], p.bags, p.pieces)
                         for p in ctx.pools]) for ctx in contexts]


class Feature(NamedTuple):
    table: str
    values: Any  # int64 ids
    offsets: Any
    psw: Any
    batch: int
    uniq: Any  # ids to send: distinct ones (the values themselves when dedup is off); None at world size 1
    inverse: Any  # values == uniq[inverse]; None at world size 1
    sequence_offsets: Any = None  # a sequence table's input offsets (its bags are single ids)
