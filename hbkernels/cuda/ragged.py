"""CSR input checks on the GPU: the first bad offset, then the first id out of range,
left pending (:mod:`._pending`): one launch, nothing read back, for one input or for
several features' at once."""
from typing import NamedTuple

import numpy as np
from numba import cuda

from .._modes import Bounds
from .._validate import raise_feature, raise_ragged
from . import _pending
from ._launch import blocks_for, threads_per_block
from ._launcher import launch
from .embedding_bag import check_bag_offsets, check_bag_offsets_at, empty_batch_bad_offset
from .join_bags import feature_of


@cuda.jit
def _ragged_kernel(values, offsets, n_values, num_rows, record_ids, slots):
    num_bags = offsets.shape[0] - 1
    for i in range(cuda.grid(1), max(num_bags, n_values), cuda.gridsize(1)):
        if i < num_bags:
            check_bag_offsets(slots, i, offsets[i], offsets[i + 1], num_bags, n_values)
        if record_ids and i < n_values:
            v = values[i]
            if v < 0 or v >= num_rows:
                cuda.atomic.min(slots, 1, i)


def check_ragged(family, values, offsets, num_rows, bounds):
    """``(-1, -1)``, the check of CSR input left pending as the forward leaves its own:
    ``Bounds.RAISE`` checks offsets and ids, ``Bounds.ZERO`` offsets only,
    ``Bounds.UNCHECKED`` nothing (no launch). An empty batch's one offset is read
    back at once."""
    num_bags = offsets.shape[0] - 1
    n = values.shape[0]
    if bounds == Bounds.UNCHECKED:
        return -1, -1
    if num_bags == 0:
        return empty_batch_bad_offset(family, offsets, n), -1
    raise_ids = bounds == Bounds.RAISE

    def report(bad):
        raise_ragged(family, values, offsets, bad[0], bad[1] if raise_ids else -1, num_rows)

    tpb = threads_per_block()
    with _pending.checks(2, "check_ragged", report, (values, offsets)) as slots:
        launch(_ragged_kernel, blocks_for(max(num_bags, n), tpb), tpb, family.kernel_array(values),
               family.kernel_array(offsets), n, num_rows, raise_ids, slots)
    return -1, -1


@cuda.jit
def _features_kernel(values, offsets, table, features, slots):
    """Feature ``f``'s offset faults in slot ``2f``, its first id out of range in slot
    ``2f + 1``. ``table``: the features' first values and first bags (``features + 1``
    each, the totals last), their row limits (-1: ids not checked), their counts of
    values (a feature's values may end before the next one's first), then whether the
    values are padded (a feature's last offset at most its count, the ids past it not
    checked)."""
    n_values = values.shape[0]
    n_bags = table[2 * features + 1]
    counts = 3 * features + 2
    padded = table[4 * features + 2] != 0
    for i in range(cuda.grid(1), max(n_values, n_bags, features), cuda.gridsize(1)):
        if i < features and table[features + 1 + i] == table[features + 2 + i]:
            # no bags: the one offset must be 0 and there must be no values
            if offsets[table[features + 1 + i] + i] != 0 or table[counts + i] != 0:
                cuda.atomic.min(slots, 2 * i, 0)
        if i < n_bags:
            f = feature_of(table, features + 1, features, i)
            b = i - table[features + 1 + f]
            at = i + f  # feature f's offsets start at its first bag + f
            hi = offsets[at + 1]
            n_f = table[counts + f]
            check_bag_offsets_at(slots, 2 * f, b, offsets[at], hi,
                                 table[features + 2 + f] - table[features + 1 + f],
                                 min(hi, n_f) if padded else n_f)
        if i < n_values:
            f = feature_of(table, 0, features, i)
            limit = table[2 * features + 2 + f]
            j = i - table[f]
            used = table[counts + f]
            if padded:
                used = min(used, offsets[table[features + 2 + f] + f])
            v = values[i]
            if limit >= 0 and j < used and (v < 0 or v >= limit):
                cuda.atomic.min(slots, 2 * f + 1, j)


class Staged(NamedTuple):
    """Features' inputs already joined on the device, each in a region of its own:
    ``values`` and ``offsets`` (int64) and the check's ``table`` (int64, laid out as
    ``_features_kernel`` reads it, this call's counts in place)."""

    values: object
    offsets: object
    table: object


def features_table(first_values, first_bags, limits, counts, padded=False):
    """The host table of :class:`Staged` (``features + 1`` first values and first bags,
    the totals last; row limits, None: ids not checked; counts of values; whether they
    are padded)."""
    return np.array([*first_values, *first_bags, *(-1 if x is None else x for x in limits),
                     *counts, int(padded)], np.int64)


def table_positions(count):
    """``(first values, counts)``: where the table of :func:`features_table` of ``count``
    features holds each feature's first value after the first (the last: the total) and
    each one's count of values."""
    return np.arange(1, count + 1), np.arange(3 * count + 2, 4 * count + 2)


def join_arrays(family, values, offsets, table):
    """The :class:`Staged` of features' ``values`` and ``offsets`` joined on the device (int64,
    one feature's after another) with ``table``, their table as :func:`features_table` makes
    it."""
    xp = family.xp
    return Staged(xp.concatenate(values, dtype=np.int64), xp.concatenate(offsets, dtype=np.int64),
                  table)


def join_features(family, values, offsets, limits):
    """The :class:`Staged` of features' inputs (``values[k]``, ``offsets[k]``, ids checked
    against ``limits[k]`` rows, None: not checked) joined on the device, one feature's
    after another (:func:`join_arrays`), its ``table`` on the host (NumPy) for the caller to
    copy (it may copy more after it: the check reads the table's first entries only)."""
    value, bag, counts = [0], [0], []
    for k in range(len(values)):
        counts.append(values[k].shape[0])
        value.append(value[-1] + counts[k])
        bag.append(bag[-1] + offsets[k].shape[0] - 1)
    return join_arrays(family, values, offsets, features_table(value, bag, limits, counts))


def check_features(family, features, values, offsets, limits, staged=None, padded=False):
    """Check the CSR input of several features at once (``values[k]``, ``offsets[k]``
    of feature named ``features[k]``): offsets always, ids against ``limits[k]`` rows
    (None: not checked). One launch over the joined inputs (joined here, or ``staged``:
    a :class:`Staged` holding them, nothing allocated; ``padded``: its table says the
    values are padded), left pending: its error (the first feature's first, naming the
    feature) is raised by a later wait. Returns the :class:`Staged` it checked (its
    ``values`` and ``offsets``: each feature's in the order given, one after another)."""
    count = len(features)
    if staged is None:
        staged = join_features(family, values, offsets, limits)
        staged = staged._replace(table=family.put(staged.table))
    work = max(staged.values.shape[0], staged.offsets.shape[0] - count, count)

    def report(bad):
        for k in range(count):
            raise_feature(family, features[k], values[k], offsets[k], bad[2 * k],
                          bad[2 * k + 1], limits[k],
                          "at most len(values)" if padded else "len(values)")

    tpb = threads_per_block()
    with _pending.checks(2 * count, "EmbeddingCollection.forward", report,
                         (*values, *offsets)) as slots:
        launch(_features_kernel, blocks_for(work, tpb), tpb,
               family.kernel_array(staged.values), family.kernel_array(staged.offsets),
               family.kernel_array(staged.table), count, slots)
    return staged
