"""Named modes of the ops, as the kernels of both backends see them.

Each mode is an ``IntEnum``: the front end turns a user's string into the
member's int code once (:func:`codes`), and the kernels compare against the
members, never against bare numbers. The optimizer rules' codes live beside
them in :mod:`hbkernels._rules`.
"""
import enum


class Bounds(enum.IntEnum):
    """What an id outside ``[0, num_rows)`` (and a bad offset) does."""

    RAISE = 0  #: checked: :class:`~hbkernels.BoundsError` (bad offsets: ``ValueError``)
    ZERO = 1  #: such an id reads as a zero row and its gradient is dropped; offsets checked
    UNCHECKED = 2  #: nothing is checked: the caller guarantees ids and offsets are valid


class Combiner(enum.IntEnum):
    """How a bag's rows pool into one."""

    SUM = 0
    MEAN = 1  #: the sum divided by the sum of the bag's weights (its length unweighted)
    SQRTN = 2  #: the sum divided by the square root of the sum of squared weights


class PartitionMode(enum.IntEnum):
    """Which shard owns an id."""

    MOD = 0  #: shard ``id % num_shards``
    DIV = 1  #: contiguous blocks of :func:`shard_block` rows


def codes(mode):
    """``{lower-case name: int code}`` of an IntEnum, the strings the front end takes."""
    return {member.name.lower(): int(member) for member in mode}


def shard_block(mode, num_rows, num_shards):
    """Rows per shard under :attr:`PartitionMode.DIV` (``ceil(num_rows / num_shards)``,
    at least 1); 1 under :attr:`PartitionMode.MOD`."""
    return max(1, -(-num_rows // num_shards)) if mode == PartitionMode.DIV else 1


class Eviction(enum.IntEnum):
    """Which live id a full :class:`hbkernels.HashTable` frees for a new one."""

    NONE = 0  #: none: a full table raises :class:`hbkernels.CapacityError`
    LRU = 1  #: the id whose last use is oldest
    LFU = 2  #: the id used in the fewest calls (then the least recently used)


class IndexKey(enum.IntEnum):
    """The two keys a hash table's index reserves as markers (ids equal to them live in
    the table's two reserved entries instead)."""

    EMPTY = -(2**63)  #: a position never written since the index was (re)built
    TOMBSTONE = -(2**63) + 1  #: a position whose id was erased; probes walk past it
