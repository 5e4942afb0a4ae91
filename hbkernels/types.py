"""Small containers of the public contract."""
import math
import os
from typing import Any, NamedTuple


class Ragged(NamedTuple):
    """A batch of variable-length id lists in CSR form.

    ``values[offsets[b]:offsets[b + 1]]`` are the ids of bag ``b``; ``offsets``
    has ``B + 1`` entries, starts at 0, never decreases and ends at ``len(values)``.

    >>> import numpy as np, hbkernels as hbk
    >>> r = hbk.Ragged(np.array([3, 1, 4]), np.array([0, 2, 2, 3]))
    >>> r.batch_size
    3
    """

    values: Any
    offsets: Any

    @property
    def batch_size(self) -> int:
        return int(self.offsets.shape[0]) - 1


class Partitioned(NamedTuple):
    """Ids grouped by owning shard: ``ids == input[order]``; shard ``s`` holds
    ``ids[sum(counts[:s]) : sum(counts[:s + 1])]``, in input order (stable)."""

    ids: Any
    counts: Any
    order: Any


class SparseGrad(NamedTuple):
    """A row-sparse gradient of a table: ``rows[k]`` is the gradient of row ``ids[k]``.

    :func:`hbkernels.embedding_bag_backward` returns distinct ids; a
    ``SparseGrad`` built by hand may repeat ids (the optimizers sum duplicates).
    """

    ids: Any
    rows: Any


#: the placements of a table: the replicated one, then the sharded ones in the order
#: the planner prefers them on a tie, the placements over the ranks of a node last
PLACEMENTS = ("data_parallel", "row_wise", "table_wise", "column_wise", "table_row_wise",
              "table_column_wise", "grid")
#: the placements over the ranks of a node, each with the placement it is on a single node
#: (whose measured costs a machine profile gives it)
NODE_PLACEMENTS = {"table_row_wise": "row_wise", "table_column_wise": "column_wise",
                   "grid": "row_wise"}
#: the placements the others are made of on one node
FLAT_PLACEMENTS = tuple(p for p in PLACEMENTS if p not in NODE_PLACEMENTS)


class JaggedRows(NamedTuple):
    """The output of a sequence table (``TableSpec(combiner=None)``) for one feature:
    ``values`` ``[N, dim]``, the row of every id in input order, and ``offsets``
    ``[B + 1]``, the input's, so sample ``b``'s rows are ``values[offsets[b]:offsets[b + 1]]``.
    Its gradient is a ``[N, dim]`` array (or a ``JaggedRows`` holding one)."""

    values: Any
    offsets: Any


class TableSpec(NamedTuple):
    """One embedding table of an :class:`hbkernels.EmbeddingCollection`.

    ``num_rows`` x ``dim`` weights of ``dtype`` (float32 or float16), pooled per
    bag with ``combiner`` (``"sum"``, ``"mean"``, ``"sqrtn"``), or, with
    ``combiner=None``, a sequence table: not pooled, the collection returns the
    row of every id (:class:`JaggedRows`, for attention over a user's history),
    trained and sharded as the pooled tables are. ``features``
    names the input features looked up in this table (default: the table's
    own name); several features may share one table (shared embedding
    columns), a feature belongs to one table. ``hotness`` is the mean number of
    ids per sample of each feature (used by ``plan="auto"``). ``device="cpu"``
    keeps the table in host memory while the rest of the collection runs on
    the GPU (HybridBackend's ``emb_device``); ``None`` follows the collection.
    ``init_scale``: rows start uniform in ``±init_scale`` (default
    ``1/sqrt(num_rows)``, or ``1/sqrt(capacity)`` for a dynamic table).

    ``storage``: where the rows and their optimizer state live: ``"device"``
    (the collection's device), ``"host"`` (host memory) or ``"mmap"`` (files in
    the directory ``path``, rows made on first touch: tables larger than RAM).
    ``cache_rows=K`` keeps up to K hot rows of a ``"host"``/``"mmap"`` table in
    the fast tier (the collection's device; RAM for ``"mmap"`` on the CPU),
    evicted by ``cache_policy`` (``"lru"``, ``"lfu"``); without a cache the
    kernels read the slow tier on the CPU (see ``docs/tiered.md``).

    ``num_rows=None`` makes a dynamic table: its ids are any int64 (raw hashes);
    ``capacity`` rows in all over the ranks, given out and taken back by a
    :class:`hbkernels.HashTable` per rank with ``evict`` (``"lru"``, ``"lfu"``,
    ``"none"``) and ``admit_count`` (see ``docs/dynamic.md``).

    >>> import hbkernels as hbk
    >>> hbk.TableSpec("item", num_rows=1000, dim=16, features=("item", "clicked_item")).num_rows
    1000
    """

    name: str
    num_rows: Any
    dim: int
    combiner: Any = "sum"
    dtype: str = "float32"
    features: Any = None
    hotness: float = 1.0
    device: Any = None
    capacity: Any = None
    evict: str = "lru"
    admit_count: int = 1
    init_scale: Any = None
    storage: str = "device"
    path: Any = None
    cache_rows: Any = None
    cache_policy: str = "lru"

    @property
    def tiered(self):
        """Rows kept outside the collection's device (``storage`` ``"host"`` or ``"mmap"``)."""
        return self.storage != "device"

    @property
    def resident_rows(self):
        """Rows (with their optimizer state) the collection's memory holds: all of them
        on ``"device"`` or uncached ``"host"``, the cache's for a cached tier, none for an
        uncached ``"mmap"`` table."""
        if self.cache_rows is not None:
            return min(self.cache_rows, self.rows)
        return 0 if self.storage == "mmap" else self.rows

    @property
    def dynamic(self):
        """A dynamic table (``num_rows=None``): any int64 id, rows given out by a
        :class:`hbkernels.HashTable` of ``capacity`` slots over all ranks."""
        return self.num_rows is None

    @property
    def rows(self):
        """Rows held over all ranks: ``num_rows``, or a dynamic table's ``capacity``."""
        return self.capacity if self.dynamic else self.num_rows

    @property
    def scale(self):
        """Initial rows are uniform in ``±scale``: ``init_scale``, by default
        ``1/sqrt(rows)`` (TorchRec's default for a static table)."""
        import math

        return float(self.init_scale) if self.init_scale is not None else 1.0 / math.sqrt(self.rows)


def table_spec(spec):
    """``spec`` checked and normalised (features a tuple, dtype a name)."""
    import numpy as np

    if not isinstance(spec, TableSpec):
        raise TypeError(f"tables must be hbk.TableSpec, got {type(spec).__name__}")
    if not isinstance(spec.name, str) or not spec.name:
        raise ValueError(f"a table needs a non-empty name, got {spec.name!r}")
    if spec.num_rows is None:
        _dynamic(spec)
    elif _count(spec.num_rows) is None:
        raise ValueError(f"table {spec.name!r}: num_rows must be an integer >= 1 (or None: a dynamic "
                         f"table), got {spec.num_rows!r}")
    elif spec.capacity is not None:
        raise ValueError(f"table {spec.name!r}: capacity is for dynamic tables (num_rows=None); "
                         f"this one has num_rows={spec.num_rows}")
    if spec.init_scale is not None:
        _positive(spec, "init_scale", spec.init_scale)
    if _count(spec.dim) is None:
        raise ValueError(f"table {spec.name!r}: dim must be an integer >= 1, got {spec.dim!r}")
    if spec.combiner not in ("sum", "mean", "sqrtn", None):
        raise ValueError(f"table {spec.name!r}: combiner must be sum, mean, sqrtn or None (a "
                         f"sequence table), got {spec.combiner!r}")
    try:
        dtype = np.dtype(spec.dtype)
    except TypeError:  # not a dtype at all
        dtype = None
    if dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
        raise ValueError(f"table {spec.name!r}: dtype must be float32 or float16, got "
                         f"{repr(spec.dtype) if dtype is None else dtype.name}")
    features = (spec.name,) if spec.features is None else spec.features
    features = (features,) if isinstance(features, str) else tuple(features)
    if not features or not all(isinstance(f, str) and f for f in features):
        raise ValueError(f"table {spec.name!r}: features must be non-empty names, got {spec.features!r}")
    _positive(spec, "hotness", spec.hotness)
    if spec.device not in (None, "cpu", "cuda"):
        raise ValueError(f"table {spec.name!r}: device must be None, 'cpu' or 'cuda', got {spec.device!r}")
    _storage(spec)
    return spec._replace(num_rows=None if spec.dynamic else int(spec.num_rows), dim=int(spec.dim),
                         dtype=dtype.name, features=features, hotness=float(spec.hotness),
                         capacity=None if spec.capacity is None else int(spec.capacity),
                         admit_count=int(spec.admit_count),
                         init_scale=None if spec.init_scale is None else float(spec.init_scale),
                         path=None if spec.path is None else os.fspath(spec.path),
                         cache_rows=None if spec.cache_rows is None else int(spec.cache_rows))


def _count(value):
    """``value`` as an int when it is an integer >= 1 (a Python or NumPy integer, not a
    bool or a float: :func:`hbkernels._validate.count`), else None."""
    from . import _validate

    try:
        return _validate.count("value", value, minimum=1)
    except ValueError:
        return None


def _positive(spec, field, value):
    """A ``ValueError`` naming the table, the field and what came unless ``value`` (of
    ``spec``'s ``field``) is a finite number > 0."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"table {spec.name!r}: {field} must be a finite number > 0, got {value!r}")


def _storage(spec):
    from ._modes import Eviction, codes

    if spec.storage not in ("device", "host", "mmap"):
        raise ValueError(f"table {spec.name!r}: storage must be 'device', 'host' or 'mmap', "
                         f"got {spec.storage!r}")
    if (spec.storage == "mmap") != (spec.path is not None):
        raise ValueError(f"table {spec.name!r}: " + (
            "storage='mmap' needs a path (a directory for the table's files)"
            if spec.path is None else f"path is for storage='mmap'; this table's storage is "
                                      f"{spec.storage!r}"))
    if spec.cache_rows is not None:
        if not spec.tiered:
            raise ValueError(f"table {spec.name!r}: cache_rows is for storage='host' or 'mmap' "
                             f"(a cache in front of the slow tier)")
        if _count(spec.cache_rows) is None:
            raise ValueError(f"table {spec.name!r}: cache_rows must be an integer >= 1 (or None: "
                             f"no cache), got {spec.cache_rows!r}")
    if spec.cache_policy not in set(codes(Eviction)) - {"none"}:
        raise ValueError(f"table {spec.name!r}: cache_policy must be 'lru' or 'lfu', "
                         f"got {spec.cache_policy!r}")
    if spec.tiered and spec.device is not None:
        raise ValueError(f"table {spec.name!r}: give storage={spec.storage!r} or device="
                         f"{spec.device!r}, not both (device='cpu' is storage='host' without a cache)")


def _dynamic(spec):
    from ._modes import Eviction, codes

    if _count(spec.capacity) is None:
        raise ValueError(f"table {spec.name!r}: a dynamic table (num_rows=None) needs a capacity, "
                         f"an integer >= 1, got {spec.capacity!r}")
    if spec.evict not in codes(Eviction):
        raise ValueError(f"table {spec.name!r}: evict must be one of {sorted(codes(Eviction))}, "
                         f"got {spec.evict!r}")
    if _count(spec.admit_count) is None:
        raise ValueError(f"table {spec.name!r}: admit_count must be an integer >= 1, "
                         f"got {spec.admit_count!r}")
