"""bfloat16 tables and data (arrays of ``ml_dtypes.bfloat16``) on both backends:
every op against the float64 reference of its float32 test, the rounding of
every bf16 value and of midpoints (as ml_dtypes), the optimizers' rounding
(nearest: the fp32 update rounded; stochastic: the spec's hash), and the torch,
JAX and TF adapters on the CPU."""
import math

import numpy as np
import pytest
from conftest import assert_close, random_offsets
from helpers import RULES, Table, bags, dense_backward, make_opt, raises, state_names, within_one_ulp

import hbkernels as hbk
from hbkernels import _bits, optim, reference

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16_table(rng, num_rows, dim):
    return rng.standard_normal((num_rows, dim)).astype(BF16)


def as64(a):
    return np.asarray(a).astype(np.float64)


def bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("bounds", ["raise", "zero"])
def test_lookup(backend, rng, bounds):
    w = bf16_table(rng, 30, 5)
    ids = rng.integers(0, 30, size=(4, 6))
    ids[0, 0] = 29
    if bounds == "zero":
        ids[1, 2] = 30
    out = backend.get(hbk.lookup(backend.put(w), backend.put(ids), bounds=bounds))
    expected = w[np.clip(ids, 0, 29)].copy()
    expected[ids == 30] = 0
    assert out.dtype == BF16 and out.shape == (4, 6, 5)
    np.testing.assert_array_equal(bits(out), bits(expected))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("dim", [1, 7, 64])
@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_bag(backend, rng, combiner, dim, weighted):
    num_rows, batch, max_len = (12, 6, 4) if backend.small else (50, 40, 12)
    w = bf16_table(rng, num_rows, dim)
    offsets = random_offsets(rng, batch, max_len)
    offsets[-1] = max(offsets[-1], 2)  # at least the two ids at the table's edges
    values = rng.integers(0, num_rows, size=int(offsets[-1]))
    values[[0, -1]] = [num_rows - 1, 0]
    psw = rng.uniform(0.1, 2, size=values.shape).astype(BF16) if weighted else None
    put = backend.put
    out = backend.get(hbk.embedding_bag(put(w), put(values), put(offsets), combiner=combiner,
                                        per_sample_weights=put(psw)))
    # fp32 accumulation, one rounding to bf16 at the end
    assert_close(out, reference.embedding_bag(w, values, offsets, combiner, psw), BF16)
    if backend.is_cuda and not weighted and combiner == "sum":
        # each bag summed in fp32 in input order, then rounded to nearest even: the
        # CPU's bits exactly
        cpu = hbk.embedding_bag(w, values, offsets, combiner="sum")
        np.testing.assert_array_equal(bits(out), bits(cpu))


def test_segment_sum_and_reduce(backend, rng):
    data = rng.standard_normal((40, 3)).astype(BF16)
    seg = rng.integers(0, 7, size=40)
    expected = np.zeros((7, 3))
    np.add.at(expected, seg, as64(data))
    put, get = backend.put, backend.get
    assert_close(get(hbk.segment_sum(put(data), put(seg), 7)), expected, BF16)
    offsets = np.array([0, 0, 15, 40])
    means = np.stack([np.zeros(3), as64(data[:15]).mean(0), as64(data[15:]).mean(0)])
    assert_close(get(hbk.segment_reduce(put(data), put(offsets), combiner="mean")), means, BF16)
    empty = get(hbk.segment_sum(put(data[:0]), put(seg[:0]), 3))
    assert empty.dtype == BF16 and np.all(bits(empty) == 0)


def segment_sums(backend, rows, segments, num_segments):
    """hbk.segment_sum of bf16 rows of width 1 on ``backend``, flattened."""
    out = hbk.segment_sum(backend.put(rows.reshape(-1, 1)), backend.put(segments), num_segments)
    return backend.get(out).reshape(-1)


def test_every_bf16_value_round_trips_and_rounds_to_nearest_even(backend):
    """Every bf16 value is widened and rounded back to itself, and float32 sums of
    two or three bf16 values that land on, or just past, the midpoint between bf16
    neighbours round as ml_dtypes does (ties to even). A CUDA GPU runs the same
    integer logic as the CPU through libdevice bit casts; the simulator through
    NumPy views."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(BF16)
    every = every[bits(every) != 0x8000]  # a sum into +0.0 makes -0.0 +0.0
    if backend.small:
        every = every[::61]
    out = segment_sums(backend, every, np.arange(len(every)), len(every))
    nan = np.isnan(every.astype(np.float32))
    subnormal = ((bits(every) & 0x7F80) == 0) & ((bits(every) & 0x7F) != 0)
    exact = ~nan & ~subnormal
    np.testing.assert_array_equal(bits(out)[exact], bits(every)[exact])
    assert np.all(np.isnan(out.astype(np.float32)[nan]))  # a GPU's NaN arithmetic drops the sign
    # Subnormals (float32 subnormals too) come back exactly, or as zero where the CPU
    # threads flush denormals: seen on the CPU after the JAX adapter tests ran in the same
    # process (Numba's workers, likely started from an XLA callback thread, inherit its
    # flush-to-zero mode). A GPU's float32 atomic add flushes them too (PTX's
    # atom.add.f32 flushes subnormal inputs and results); the simulator keeps them.
    got, want = bits(out)[subnormal], bits(every)[subnormal]
    assert np.all((got == want) | ((got & 0x7FFF) == 0))
    if backend.small:
        np.testing.assert_array_equal(got, want)
    # x + half an ulp of x (a tie), and x + half an ulp + 2^-10 of it (just past): sums
    # exact in float32 whatever the order of the (atomic) adds
    x32 = every.astype(np.float32)
    scale = (x32.view(np.uint32) & np.uint32(0x7F800000)).view(np.float32)  # 2^exponent
    keep = np.isfinite(x32) & (scale >= 2.0**-100) & (scale <= 2.0**120)
    x, scale = every[keep], scale[keep]
    half_ulp = (scale * np.float32(2.0**-8)).astype(BF16)
    past = (scale * np.float32(2.0**-18)).astype(BF16)
    n = len(x)
    rows = np.concatenate([x, half_ulp, x, half_ulp, past])
    segments = np.concatenate([np.arange(n), np.arange(n), np.arange(n, 2 * n),
                               np.arange(n, 2 * n), np.arange(n, 2 * n)])
    sums32 = np.zeros(2 * n, np.float64)
    np.add.at(sums32, segments, as64(rows))
    expected = sums32.astype(np.float32).astype(BF16)
    assert np.array_equal(sums32, sums32.astype(np.float32))  # exact in float32
    np.testing.assert_array_equal(bits(segment_sums(backend, rows, segments, 2 * n)),
                                  bits(expected))


def test_backward(backend, rng):
    num_rows, dim = 20, 6
    grad_out = rng.standard_normal((30, dim)).astype(BF16)
    offsets = random_offsets(rng, 30, 6)
    values = rng.integers(0, num_rows, size=int(offsets[-1]))
    put = backend.put
    expected = np.zeros((num_rows, dim))
    for b in range(30):
        lo, hi = offsets[b], offsets[b + 1]
        for j in range(lo, hi):
            expected[values[j]] += as64(grad_out[b]) / (hi - lo)
    for deterministic in ([True, False] if backend.is_cuda else [True]):
        g = hbk.embedding_bag_backward(put(grad_out), put(values), put(offsets),
                                       num_rows=num_rows, combiner="mean",
                                       deterministic=deterministic)
        ids, rows = backend.get(g.ids), backend.get(g.rows)
        assert rows.dtype == BF16
        np.testing.assert_array_equal(np.sort(ids), np.unique(values))
        assert_close(rows, expected[ids], BF16)


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("fused", [False, True])
def test_optimizer_nearest_is_the_fp32_update_rounded(backend, rng, name, fused):
    num_rows, dim, batch, max_len = (10, 3, 4, 3) if backend.small else (50, 8, 40, 5)
    w16 = bf16_table(rng, num_rows, dim)
    opt = make_opt(name)
    half, single = Table(backend, opt, w16), Table(backend, opt, w16.astype(np.float32))
    grad_out, values, offsets = bags(rng, num_rows, dim, batch, max_len, num_rows - 2)
    half.bag_step(grad_out, values, offsets, fused, combiner="mean")
    single.bag_step(grad_out, values, offsets, fused, combiner="mean")
    within_one_ulp(half.weights(), single.weights().astype(BF16), BF16)
    untouched = [num_rows - 2, num_rows - 1]
    np.testing.assert_array_equal(bits(half.weights()[untouched]), bits(w16[untouched]))
    for key in state_names(opt):  # fp32 state for bf16 tables, as for fp16
        assert half.states()[key].dtype == np.float32
        assert_close(half.states()[key], single.states()[key].astype(np.float64), np.float32)


@pytest.mark.parametrize("fused", [False, True])
def test_stochastic_rounding_follows_the_spec_hash(backend, rng, fused):
    num_rows, dim = (8, 3) if backend.small else (64, 8)
    sign = rng.choice([-1.0, 1.0], size=(num_rows, dim))
    w16 = (sign * rng.uniform(0.25, 2, size=(num_rows, dim))).astype(BF16)
    g = (rng.integers(-4096, 4097, size=(num_rows, dim)) * 2.0**-20).astype(np.float32)
    x = as64(w16) - 0.5 * g.astype(np.float64)  # exact in fp32, rarely in bf16
    assert np.array_equal(x, x.astype(np.float32))
    w = backend.put(w16.copy())
    opt = optim.SGD(lr=0.5, rounding="stochastic", seed=99)
    state = opt.init_state(w)
    ids = np.arange(num_rows)
    put = backend.put
    if fused:  # one bag per row: the bag's gradient is the row's
        opt.fused_step(w, state, put(g), put(ids), put(np.arange(num_rows + 1)))
    else:
        opt.step(w, state, hbk.SparseGrad(put(ids), put(g)))
    key = _bits.seed_key(99, 1)
    expected = np.array([[reference.stochastic_round(x[r, d], key, r, d, "bf16")
                          for d in range(dim)]
                         for r in range(num_rows)])
    got = as64(backend.get(w))
    np.testing.assert_array_equal(got, expected)
    if not backend.small:
        nearest = x.astype(np.float32).astype(BF16)
        assert 0 < np.mean(got != as64(nearest)) < 1  # some went the other way than nearest


def test_stochastic_rounding_is_unbiased():
    num_rows, dim, ulp, frac = 2048, 16, 2.0**-7, 0.3
    w = np.ones((num_rows, dim), BF16)
    opt = optim.SGD(lr=1.0, rounding="stochastic", seed=5)
    g = np.full((num_rows, dim), -frac * ulp, np.float32)  # w - g = 1 + 0.3 ulp
    opt.step(w, opt.init_state(w), hbk.SparseGrad(np.arange(num_rows), g))
    r = as64(w)
    assert np.all((r == 1.0) | (r == 1.0 + ulp))
    share = np.mean(r > 1.0)
    assert abs(share - frac) < 5 * math.sqrt(frac * (1 - frac) / r.size)


def test_torch_adapter_bf16_cpu_tensors(rng):
    """bf16 CPU tensors cross as their bits (NumPy has no bf16 DLPack); forward and
    dense/sparse gradients against torch's float32 op on the same values."""
    torch = pytest.importorskip("torch")
    import hbkernels.adapters.torch as hbt

    w = torch.from_numpy(rng.standard_normal((20, 6)).astype(np.float32)).bfloat16()
    offsets = torch.from_numpy(random_offsets(rng, 8, 5))
    values = torch.from_numpy(rng.integers(0, 20, size=int(offsets[-1])))
    psw = torch.from_numpy(rng.uniform(0.5, 2, size=values.shape).astype(np.float32)).bfloat16()
    grad = torch.from_numpy(rng.standard_normal((8, 6)).astype(np.float32)).bfloat16()
    w32 = w.float().requires_grad_()
    ref = torch.nn.functional.embedding_bag(values, w32, offsets, mode="sum",
                                            per_sample_weights=psw.float(), include_last_offset=True)
    ref.backward(grad.float())
    for sparse in (False, True):
        wb = w.clone().requires_grad_()
        out = hbt.embedding_bag(wb, values, offsets, combiner="sum", per_sample_weights=psw,
                                sparse=sparse)
        assert out.dtype == torch.bfloat16
        assert_close(out.detach().float().numpy().astype(BF16), ref.detach().double().numpy(), BF16)
        out.backward(grad)
        g = wb.grad.to_dense() if wb.grad.is_sparse else wb.grad
        assert g.dtype == torch.bfloat16
        assert_close(g.float().numpy().astype(BF16), w32.grad.double().numpy(), BF16)


def test_jax_adapter_bf16_under_jit(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import hbkernels.adapters.jax as hbj

    w = jnp.asarray(bf16_table(rng, 20, 5))
    offsets = random_offsets(rng, 6, 4)
    values = rng.integers(0, 20, size=int(offsets[-1]))
    out = jax.jit(lambda w: hbj.embedding_bag(w, jnp.asarray(values), jnp.asarray(offsets),
                                              combiner="sum"))(w)
    assert out.dtype == jnp.bfloat16
    assert_close(np.asarray(out), reference.embedding_bag(np.asarray(w), values, offsets, "sum"),
                 BF16)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_tf_adapter_bf16_cpu_tensors(rng, mode):
    """tf.bfloat16 tensors cross as their bits (tf.bitcast: TF's DLPack gives NumPy
    no bf16) in eager mode, natively in tf.function; forward, per-sample weights
    and the IndexedSlices gradient against float64 references on the same values."""
    tf = pytest.importorskip("tensorflow")
    import hbkernels.adapters.tf as hbtf

    w = bf16_table(rng, 20, 5)
    offsets = random_offsets(rng, 8, 5)
    values = rng.integers(0, 20, size=int(offsets[-1]))
    psw = rng.uniform(0.5, 2, size=values.shape).astype(BF16)
    grad = rng.standard_normal((8, 5)).astype(BF16)
    table = tf.Variable(tf.constant(w))

    def step():
        with tf.GradientTape() as tape:
            out = hbtf.embedding_bag(table, values, offsets, combiner="mean",
                                     per_sample_weights=tf.constant(psw))
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * tf.cast(grad, tf.float32))
        return out, tape.gradient(loss, table)

    out, g = tf.function(step)() if mode == "graph" else step()
    assert out.dtype == tf.bfloat16 and g.values.dtype == tf.bfloat16
    assert_close(out.numpy(), reference.embedding_bag(w, values, offsets, "mean", psw), BF16)
    expected, touched = dense_backward(grad, values, offsets, 20, "mean", psw)
    np.testing.assert_array_equal(np.sort(g.indices.numpy()), touched)
    got = np.zeros((20, 5))
    got[g.indices.numpy()] = as64(g.values.numpy())
    assert_close(got.astype(BF16), expected, BF16)


def test_other_dtypes_are_still_refused():
    with raises(ValueError, match="float16, bfloat16, float32 or float64"):
        hbk.embedding_bag(np.zeros((3, 2), np.int16), np.array([0]), np.array([0, 1]))


def test_a_cupy_without_bfloat16_is_a_clear_error():
    """The torch and TF adapters view a bf16 GPU tensor's bits as CuPy bf16; a CuPy
    older than v14 cannot, and says what to install."""
    from hbkernels._dispatch import cupy_bfloat16

    class OldCupyArray:
        def view(self, dtype):
            raise TypeError(f"Unsupported dtype {dtype}")

    with raises(ValueError, match="CuPy >= 14 with ml_dtypes"):
        cupy_bfloat16(OldCupyArray())
    bits = np.array([0x3F80, 0xC000], np.uint16).view(np.int16)  # has bf16 views: 1.0, -2.0
    np.testing.assert_array_equal(cupy_bfloat16(bits).astype(np.float32), [1.0, -2.0])
