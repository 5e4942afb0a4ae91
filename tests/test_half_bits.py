"""The CPU kernels' 2-byte float conversions (``hbkernels.cpu._common``): ``widen``
(fp16 and bf16 bits to float32) and ``narrow`` (float32 to fp16/bf16, nearest
even) against NumPy's and ml_dtypes' casts, bit for bit over every fp16/bf16
bit pattern; the integer path that CPUs without F16C use, in a process whose
Numba target has no F16C."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import njit

from hbkernels.cpu import _common
from hbkernels.cpu._common import half_to_float_by_integers, kernel_table, narrow, widen

ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@njit
def widen_all(bits, out):
    for i in range(bits.shape[0]):
        out[i] = widen(bits[i])


@njit
def widen_all_by_integers(bits, out):
    for i in range(bits.shape[0]):
        out[i] = half_to_float_by_integers(bits[i])


def assert_same_floats(got, expected):
    """Equal bits, except that any NaN matches any NaN (conversions may quiet a NaN)."""
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


@pytest.mark.parametrize("path", ["widen", "integers"])
def test_fp16_widening_is_exact_for_every_bit_pattern(path):
    out = np.empty(ALL_BITS.shape, np.float32)
    (widen_all if path == "widen" else widen_all_by_integers)(kernel_table(ALL_BITS.view(np.float16)), out)
    assert_same_floats(out, ALL_BITS.view(np.float16).astype(np.float32))


def test_bf16_widening_is_exact_for_every_bit_pattern():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bits = kernel_table(ALL_BITS.view(ml_dtypes.bfloat16))
    assert bits.dtype == np.int16
    out = np.empty(ALL_BITS.shape, np.float32)
    widen_all(bits, out)
    np.testing.assert_array_equal(out.view(np.uint32), ALL_BITS.astype(np.uint32) << 16)


def float32_cases(rng):
    """Every fp16 value, every midpoint between neighbours (ties), their neighbours
    one float32 ulp away, and random float32 bit patterns (Inf, NaN, subnormals)."""
    halves = ALL_BITS.view(np.float16).astype(np.float32)
    finite = np.sort(halves[np.isfinite(halves)])
    mid = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))])
    beyond = np.array([65504, 65519.996, 65520, 1e6, -65520, 2.0**-25, -(2.0**-25), 2.0**-26], np.float32)
    noise = rng.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([halves, mid, near, beyond, noise])


def test_fp16_narrowing_rounds_like_numpy(rng):
    x = float32_cases(rng)
    got = narrow(x, np.float16)
    assert got.dtype == np.float16
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    assert_same_floats(got.astype(np.float32), expected.astype(np.float32))
    two_d = x[: 3 * 1001].reshape(3, 1001)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(narrow(two_d, np.float16).view(np.uint16),
                                      two_d.astype(np.float16).view(np.uint16))
    assert narrow(x, np.float32) is x


def test_bf16_narrowing_rounds_like_ml_dtypes(rng):
    """Bit for bit, NaNs included: every bf16 value, the midpoints between neighbours
    (ties go to even), one float32 step either side of them, and the fp16 cases."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = (ALL_BITS.astype(np.uint32) << 16).view(np.float32)
    finite = np.sort(bf16[np.isfinite(bf16)])
    mid = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))])
    x = np.concatenate([bf16, mid, near, float32_cases(rng)])
    with np.errstate(invalid="ignore"):  # ml_dtypes warns on NaN inputs
        got = narrow(x, ml_dtypes.bfloat16)
        expected = x.astype(ml_dtypes.bfloat16)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


def test_fp16_tables_through_the_kernels_keep_every_value(rng):
    """Each finite fp16 value as a one-row bag: the fast-math pooling kernel widens and
    narrows it back to the same bits (-0.0 to +0.0: sums start at +0.0); a weighted
    mean of two rows matches NumPy."""
    import hbkernels as hbk

    values = ALL_BITS.view(np.float16)
    table = values[np.isfinite(values)].reshape(-1, 1).copy()
    n = table.shape[0]
    out = hbk.embedding_bag(table, np.arange(n), np.arange(n + 1))
    np.testing.assert_array_equal(out.view(np.uint16), (table + np.float16(0)).view(np.uint16))
    wide = rng.standard_normal((n // 64, 64)).astype(np.float16)
    ids = rng.integers(0, wide.shape[0], size=2 * 500)
    weights = rng.random(ids.shape[0]).astype(np.float32)
    got = hbk.embedding_bag(wide, ids, np.arange(501) * 2, combiner="mean", per_sample_weights=weights)
    rows = wide[ids].astype(np.float64) * weights[:, None]
    expected = (rows.reshape(500, 2, 64).sum(1) / weights.reshape(500, 2).sum(1)[:, None]).astype(np.float16)
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=2e-3, atol=1e-3)


def test_targets_without_f16c_use_the_integer_path(tmp_path):
    """NUMBA_CPU_NAME=generic (no F16C): LLVM's fp16 instructions would call a helper
    Numba does not link (a crash); the kernels must take the integer path."""
    script = textwrap.dedent("""
        import numpy as np
        import hbkernels as hbk
        from hbkernels.cpu import _common
        assert not _common.NATIVE_HALF
        rng = np.random.default_rng(0)
        w = rng.standard_normal((100, 9)).astype(np.float16)
        ids = rng.integers(0, 100, size=40)
        out = hbk.embedding_bag(w, ids, np.arange(11) * 4)
        expected = w[ids].astype(np.float32).reshape(10, 4, 9).sum(1).astype(np.float16)
        np.testing.assert_allclose(out.astype(np.float32), expected.astype(np.float32), rtol=2e-3, atol=2e-3)
        print("OK")
    """)
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_CPU_FEATURES", None)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip() == "OK", res.stderr[-2000:]


def test_native_conversion_follows_numbas_cpu_features(monkeypatch):
    monkeypatch.setattr(_common.config, "CPU_FEATURES", "+avx2,-f16c")
    assert not _common.native_half_conversion()
    monkeypatch.setattr(_common.config, "CPU_FEATURES", "+avx2,+f16c")
    assert _common.native_half_conversion() == (_common.platform.machine().lower() in ("x86_64", "amd64"))
