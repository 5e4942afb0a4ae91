"""hash_strings against an independent pure-Python FNV-1a-64 and published vectors."""
import subprocess
import sys

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from hbkernels.data import hash_strings  # noqa: E402


def fnv1a64(text):
    """Reference FNV-1a 64 over the UTF-8 bytes, full 64 bits."""
    h = 14695981039346656037
    for byte in text.encode("utf-8"):
        h = ((h ^ byte) * 1099511628211) % 2**64
    return h


def reference_ids(strings, num_buckets=None):
    ids = [fnv1a64(s) & (2**63 - 1) for s in strings]
    return np.array(ids if num_buckets is None else [i % num_buckets for i in ids], np.int64)


# Published FNV-1a 64-bit test vectors (Landon Curt Noll's FNV test suite).
FNV1A64_VECTORS = {"": 0xCBF29CE484222325, "a": 0xAF63DC4C8601EC8C,
                   "foobar": 0x85944171F73967E8}

# ASCII, Latin-1, Greek, CJK and astral-plane (4-byte UTF-8) code points.
ALPHABET = [chr(c) for c in [*range(32, 127), *range(0xE0, 0x100), *range(0x3B1, 0x3CA),
                             *range(0x4E00, 0x4E40), *range(0x1F600, 0x1F610)]]


def random_strings(rng, n, max_len=12):
    strings = ["".join(rng.choice(ALPHABET, size=rng.integers(0, max_len + 1)))
               for _ in range(n)]
    return ["", *strings, ""]


@pytest.mark.parametrize("text, expected", FNV1A64_VECTORS.items())
def test_published_vectors(text, expected):
    assert fnv1a64(text) == expected
    assert hash_strings([text])[0] == expected & (2**63 - 1)
    assert hash_strings(pa.array([text]))[0] == expected & (2**63 - 1)


@pytest.mark.parametrize("arrow_type", ["python", "string", "large_string"])
@pytest.mark.parametrize("num_buckets", [None, 1, 1000, 2**40 + 7])
def test_matches_reference_on_random_strings(rng, arrow_type, num_buckets):
    strings = random_strings(rng, 300)
    data = strings if arrow_type == "python" else pa.array(strings, getattr(pa, arrow_type)())
    ids = hash_strings(data, num_buckets)
    assert ids.dtype == np.int64 and ids.shape == (len(strings),)
    np.testing.assert_array_equal(ids, reference_ids(strings, num_buckets))
    assert (ids >= 0).all()
    if num_buckets is not None:
        assert (ids < num_buckets).all()


def test_slices_and_chunks_hash_their_own_strings(rng):
    strings = random_strings(rng, 200)
    array = pa.array(strings)
    for start, stop in [(0, 0), (1, 50), (37, 201), (150, 202)]:
        np.testing.assert_array_equal(hash_strings(array[start:stop]),
                                      reference_ids(strings[start:stop]))
    chunked = pa.chunked_array([array[:70], array[70:71], array[71:]])
    np.testing.assert_array_equal(hash_strings(chunked, 977), reference_ids(strings, 977))
    assert hash_strings(pa.chunked_array([], pa.string())).shape == (0,)
    assert hash_strings([]).dtype == np.int64


def test_all_empty_strings_have_no_data_buffer_to_read():
    np.testing.assert_array_equal(hash_strings(pa.array(["", ""])),
                                  [FNV1A64_VECTORS[""] & (2**63 - 1)] * 2)


def test_nulls_need_null_id():
    with pytest.raises(ValueError, match=r"strings\[1\] is null"):
        hash_strings(["a", None])
    with pytest.raises(ValueError, match=r"strings\[2\] is null"):
        hash_strings(pa.chunked_array([["x"], ["y", None]]))
    ids = hash_strings(pa.array(["a", None, "b"])[1:], num_buckets=10, null_id=-1)
    np.testing.assert_array_equal(ids, [-1, reference_ids(["b"], 10)[0]])
    # null_id is used as given, not reduced modulo num_buckets
    np.testing.assert_array_equal(hash_strings([None, "a"], 10, null_id=12),
                                  [12, reference_ids(["a"], 10)[0]])


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_buckets"):
        hash_strings(["a"], 0)
    with pytest.raises(ValueError, match="num_buckets"):
        hash_strings(["a"], 2.5)
    with pytest.raises(TypeError, match="string or large_string"):
        hash_strings(pa.array([1, 2]))
    with pytest.raises(TypeError, match="str values, got int"):
        hash_strings(["a", 3])
def test_hbkernels_imports_without_pyarrow():
    """``import hbkernels`` and ``hbkernels.data`` work without pyarrow; using
    the data writers names the extra to install."""
    script = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "import hbkernels, hbkernels.data as d\n"
        "print(d.hash_strings(['a'])[0])\n"
        "try:\n"
        "    d.write_synthetic('never.parquet', 1, [('t', 2, 1)])\n"
        "except ImportError as e:\n"
        "    print(e)\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    hint = "hbkernels.data needs pyarrow: pip install 'hbkernels[data]'"
    assert res.stdout.splitlines() == [str(FNV1A64_VECTORS["a"] & (2**63 - 1)), hint]
