"""Ascending NumPy arrays of keys: making them, finding keys in them."""
import numpy as np


def find_sorted(sorted_keys, keys):
    """``(at, hit)``: for each of ``keys``, a position in ``sorted_keys`` (ascending) and
    whether the key is there (``sorted_keys[at] == key``); ``at`` is 0 where
    ``sorted_keys`` is empty."""
    if not sorted_keys.shape[0]:
        return np.zeros(keys.shape[0], np.int64), np.zeros(keys.shape[0], bool)
    at = np.minimum(np.searchsorted(sorted_keys, keys), sorted_keys.shape[0] - 1)
    return at, sorted_keys[at] == keys


def distinct(keys):
    """The distinct values of the 1-D NumPy array ``keys``, ascending: ``np.unique(keys)``
    by one sort (NumPy's own, without ``return_*``, hashes them: many times slower on
    distinct ids)."""
    keys = np.sort(keys)
    keep = np.ones(keys.shape[0], bool)
    keep[1:] = keys[1:] != keys[:-1]
    return keys[keep]
