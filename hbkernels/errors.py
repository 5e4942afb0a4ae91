"""Exceptions of the public contract."""


class BoundsError(IndexError):
    """An id outside ``[0, num_rows)``; the message names the first bad position and value."""

    def __init__(self, what, position, value, limit):
        self.position = int(position)
        self.value = int(value)
        self.limit = None if limit is None else int(limit)
        allowed = "[0, inf)" if limit is None else f"[0, {self.limit})"
        super().__init__(f"{what}[{self.position}] = {self.value} is out of range {allowed}")


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
