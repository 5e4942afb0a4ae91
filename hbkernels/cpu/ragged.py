"""CSR input checks on the CPU: the first bad offset, then the first id out of range."""
from .._modes import Bounds
from .._validate import raise_feature
from ._common import first_bad_offset, first_out_of_range


def check_ragged(family, values, offsets, num_rows, bounds):
    """``(first bad offset, first bad id)`` of CSR input (-1: none), as the forward
    reports them: ``Bounds.RAISE`` checks offsets and ids, ``Bounds.ZERO`` offsets
    only, ``Bounds.UNCHECKED`` nothing."""
    if bounds == Bounds.UNCHECKED:
        return -1, -1
    bad_offset = first_bad_offset(offsets, values.shape[0])
    if bad_offset != -1:
        return int(bad_offset), -1
    if bounds == Bounds.RAISE:
        return -1, int(first_out_of_range(values, num_rows))
    return -1, -1


def check_features(family, features, values, offsets, limits):
    """Check the CSR input of several features at once (``values[k]``, ``offsets[k]``
    of feature named ``features[k]``): offsets always, ids against ``limits[k]`` rows
    (None: not checked). Raises the first feature's first error, naming the feature."""
    for name, v, o, limit in zip(features, values, offsets, limits):
        bounds = Bounds.ZERO if limit is None else Bounds.RAISE
        bad_offset, bad_id = check_ragged(family, v, o, limit or 0, bounds)
        raise_feature(family, name, v, o, bad_offset, bad_id, limit)
