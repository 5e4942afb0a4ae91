"""The collection's joined inputs: several features' bags joined into one batch
(``join_bags``) and their CSR checks in one pass (``check_features``), on both
backends, against NumPy and against ``hbk.ops.check_ragged`` feature by feature."""
import contextlib

import numpy as np
import pytest

import hbkernels as hbk
from hbkernels._dispatch import device_family, host, kernels


def _features(rng, count, dtype, small):
    """``count`` features' (ids, offsets, rows), some with empty bags, an empty batch
    or no ids, ids at their table's edge and one id repeated."""
    out = []
    for k in range(count):
        rows = int(rng.integers(1, 50))
        batch = int(rng.integers(0, 6 if small else 40)) if k != 1 else 0
        lengths = rng.integers(0, 4, batch)
        ids = rng.integers(0, rows, int(lengths.sum()))
        if ids.size:
            ids[0], ids[-1] = rows - 1, 0  # the table's edges
        if k == 2 and ids.size > 2:
            ids[:] = ids[1]  # one id throughout
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        out.append((ids.astype(dtype), offsets.astype(dtype), rows))
    return out


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("count", [1, 2, 5])
def test_joined_bags_are_the_features_one_after_another(backend, rng, dtype, count):
    family = device_family("cuda" if backend.is_cuda else "cpu")
    feats = _features(rng, count, dtype, backend.small)
    starts = [int(rng.integers(0, 1000)) for _ in feats]
    values, offsets = kernels(family, "join_bags").join_bags(
        family, [family.put(i) for i, _, _ in feats], starts, [family.put(o) for _, o, _ in feats])
    want_values = np.concatenate([i.astype(np.int64) + s for (i, _, _), s in zip(feats, starts)])
    want_offsets, base = [np.zeros(1, np.int64)], 0
    for i, o, _ in feats:
        want_offsets.append(o[1:].astype(np.int64) + base)
        base += len(i)
    np.testing.assert_array_equal(host(values), want_values)
    np.testing.assert_array_equal(host(offsets), np.concatenate(want_offsets))
    assert host(values).dtype == host(offsets).dtype == np.int64


def _first_error(feats, limits, names, op):
    """The error NumPy's ``check_ragged`` raises for the first bad feature, named (and
    prefixed by ``op``, as a GPU check raised at a wait is), or None."""
    for (ids, offsets, _), limit, name in zip(feats, limits, names):
        try:
            hbk.ops.check_ragged(ids, offsets, limit or 0,
                                 bounds="zero" if limit is None else "raise")
        except (hbk.BoundsError, ValueError) as error:
            return type(error), f"{op}feature {name!r}: {error}"
    return None


@pytest.mark.parametrize("fault", ["none", "id above", "id below", "offset drops",
                                   "offset start", "offset end", "empty batch with ids",
                                   "unchecked ids", "two features"])
def test_checked_features_raise_what_check_ragged_raises(backend, rng, fault):
    family = device_family("cuda" if backend.is_cuda else "cpu")
    feats = _features(rng, 4, np.int64, backend.small)
    feats[0] = (np.array([0, 2, 1]), np.array([0, 2, 3]), 3)
    feats[3] = (np.array([4, 0, 4, 1]), np.array([0, 1, 1, 4]), 5)
    limits = [rows for _, _, rows in feats]
    names = [f"f{k}" for k in range(4)]
    ids, offsets, rows = feats[3]
    if fault == "id above":
        ids = np.array([4, 0, 5, 1])
    elif fault == "id below":
        ids = np.array([4, -1, 4, 1])
    elif fault == "offset drops":
        offsets = np.array([0, 2, 1, 4])
    elif fault == "offset start":
        offsets = np.array([1, 1, 1, 4])
    elif fault == "offset end":
        offsets = np.array([0, 1, 1, 3])
    elif fault == "unchecked ids":  # a dynamic table's ids: any value
        ids, limits[3] = np.array([4, -7, 99, 1]), None
    elif fault == "two features":  # the first bad feature's error
        ids = np.array([4, 0, 5, 1])
        feats[0] = (np.array([0, 3, 1]), np.array([0, 2, 3]), 3)
    feats[3] = (ids, offsets, rows)
    if fault == "empty batch with ids":
        feats[1] = (np.array([1]), np.array([0]), 3)
    want = _first_error(feats, limits, names,
                        "EmbeddingCollection.forward: " if backend.is_cuda else "")
    if fault in ("none", "unchecked ids"):
        assert want is None
    else:
        assert want is not None
    with pytest.raises(Exception) if want else contextlib.nullcontext() as caught:
        kernels(family, "ragged").check_features(
            family, names, [family.put(i) for i, _, _ in feats],
            [family.put(o) for _, o, _ in feats], limits)
        hbk.synchronize()
    if want:
        assert (caught.type, str(caught.value)) == want
