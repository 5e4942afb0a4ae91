"""The stable string -> id hash of categorical columns.

``id(s) = FNV-1a-64(utf8(s)) & (2**63 - 1)``, then ``% num_buckets`` when given:

    h = 0xcbf29ce484222325                    # FNV-1a 64-bit offset basis
    for byte in s.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001b3) % 2**64

The same string gets the same id on every machine, run and Python version
(unlike Python's ``hash``), so files converted separately share ids.
"""
import sys

import numpy as np

from .._numba_cache import cached_njit

FNV64_OFFSET_BASIS = np.uint64(0xCBF29CE484222325)
FNV64_PRIME = np.uint64(0x100000001B3)
LOW_63_BITS = np.uint64((1 << 63) - 1)


@cached_njit
def fnv1a64_ids(offsets, data, num_buckets, out):
    """out[i] = FNV-1a-64(data[offsets[i]:offsets[i + 1]]) & (2**63 - 1), then
    % num_buckets when num_buckets > 0."""
    for i in range(out.shape[0]):
        h = FNV64_OFFSET_BASIS
        for j in range(offsets[i], offsets[i + 1]):
            h = (h ^ np.uint64(data[j])) * FNV64_PRIME
        value = np.int64(h & LOW_63_BITS)
        out[i] = value % num_buckets if num_buckets > 0 else value


def hash_strings(strings, num_buckets=None, *, null_id=None):
    """Stable int64 ids of strings: ``FNV-1a-64(utf8(s)) & (2**63 - 1)``, then
    ``% num_buckets`` when given (ids in ``[0, num_buckets)``).

    ``strings``: a pyarrow ``string`` / ``large_string`` Array or ChunkedArray
    (hashed straight from its buffers, slices included), or any sequence of str.
    Nulls (``None``) raise ValueError unless ``null_id`` is given; they then
    map to ``null_id`` as is (not reduced by ``num_buckets``).

    >>> from hbkernels.data import hash_strings
    >>> hash_strings(["", "a", "Criteo"])
    array([5472609002491880229, 3414815163700866188, 1945332691056586069])
    >>> hash_strings(["a", None], num_buckets=1000, null_id=-1)
    array([188,  -1])
    """
    if num_buckets is not None and (int(num_buckets) != num_buckets or num_buckets < 1):
        raise ValueError(f"num_buckets must be a positive integer, got {num_buckets!r}")
    buckets = 0 if num_buckets is None else int(num_buckets)
    pa = sys.modules.get("pyarrow")  # an Arrow input means pyarrow is imported
    if pa is not None and isinstance(strings, (pa.Array, pa.ChunkedArray)):
        chunks = strings.chunks if isinstance(strings, pa.ChunkedArray) else [strings]
        ids = np.concatenate([np.empty(0, np.int64), *(_hash_arrow(c, buckets) for c in chunks)])
        is_null = np.asarray(strings.is_null()) if strings.null_count else None
    else:
        ids, is_null = _hash_python(strings, buckets)
    if is_null is not None and is_null.any():
        if null_id is None:
            raise ValueError(f"strings[{int(np.argmax(is_null))}] is null; "
                             "pass null_id= to give nulls an id")
        ids[is_null] = null_id
    return ids


def _hash_arrow(array, num_buckets):
    """Ids of every slot of a string Array (a null slot hashes whatever its offsets span)."""
    import pyarrow as pa

    if pa.types.is_string(array.type):
        offset_dtype = np.int32
    elif pa.types.is_large_string(array.type):
        offset_dtype = np.int64
    else:
        raise TypeError(f"hash_strings needs a string or large_string array, got {array.type}")
    _, offsets_buffer, data_buffer = array.buffers()
    n = len(array)
    out = np.empty(n, np.int64)
    if n == 0:
        return out
    offsets = np.frombuffer(offsets_buffer, offset_dtype, count=n + 1,
                            offset=array.offset * np.dtype(offset_dtype).itemsize)
    data = (np.frombuffer(data_buffer, np.uint8) if data_buffer is not None
            else np.empty(0, np.uint8))
    fnv1a64_ids(offsets, data, num_buckets, out)
    return out


def _hash_python(strings, num_buckets):
    """(ids, is_null) of a sequence of str or None."""
    strings = list(strings)
    is_null = np.array([s is None for s in strings], dtype=bool)
    try:
        encoded = [b"" if s is None else s.encode("utf-8") for s in strings]
    except AttributeError:
        bad = next(s for s in strings if s is not None and not isinstance(s, str))
        raise TypeError(f"hash_strings needs str values, got {type(bad).__name__}") from None
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = np.frombuffer(b"".join(encoded), np.uint8)
    out = np.empty(len(encoded), np.int64)
    fnv1a64_ids(offsets, data, num_buckets, out)
    return out, is_null
