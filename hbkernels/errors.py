"""Exceptions of the public contract."""
import numpy as np


class BoundsError(IndexError):
    """An id outside ``[0, num_rows)``; the message names the first bad position and value.

    ``position`` is the flat (C-order) position of the id in its array, ``value`` the id
    and ``limit`` ``num_rows`` (None: no upper limit). ``shape`` is the shape of the ids
    array: when it has more than one dimension the message names the id by its index
    (``ids[1, 0] = 9``), else by ``position`` (``ids[2] = 9``)."""

    def __init__(self, what, position, value, limit, shape=None):
        self.position = int(position)
        self.value = int(value)
        self.limit = None if limit is None else int(limit)
        allowed = "[0, inf)" if limit is None else f"[0, {self.limit})"
        where = str(self.position)
        if shape is not None and len(shape) > 1:
            index = np.unravel_index(self.position, tuple(int(n) for n in shape))
            where = ", ".join(str(int(i)) for i in index)
        super().__init__(f"{what}[{where}] = {self.value} is out of range {allowed}")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: missing, truncated or corrupt file, or a
    bad manifest; the message names the file."""


class DataError(ValueError):
    """Data that cannot be used as asked: an unreadable or malformed file, a missing
    or mistyped column, files that disagree; the message names the file or column."""


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message names the extra that
    installs it."""


class CapacityError(RuntimeError):
    """A :class:`hbkernels.HashTable` cannot give every new id of a call a slot (it is
    full and evicts nothing, or the call's distinct new ids outnumber the slots it
    may free); the call changed nothing. The message names the table and its capacity."""
