import math
import re

import numpy as np
import pytest
from conftest import assert_close
from helpers import RULES, Table, bags, make_opt, raises, state_names, within_one_ulp

import hbkernels as hbk
from hbkernels import _bits, optim, reference

torch = pytest.importorskip("torch")

# torch's sparse Adagrad warns that it skips the sparse invariant checks
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")


def sparse_grads(rng, num_rows, dim, count, steps, scale=1.0):
    """``steps`` random (ids, rows) with repeated ids, touching only ids < num_rows - 3."""
    out = []
    for _ in range(steps):
        ids = rng.integers(0, num_rows - 3, size=count)
        ids[: count // 3] = ids[0]
        out.append((ids, (scale * rng.standard_normal((count, dim))).astype(np.float32)))
    return out


def away_from_cancelling(ids, rows, least=1e-3):
    """``rows`` with the first occurrence of each id nudged by ``2·least`` where that id's
    summed gradient element lies within ``least`` of 0. A sum of repeated ids that cancels
    to near 0 carries float32's rounding of its terms as a large relative error, which
    Adam's m / (sqrt(v) + eps) turns into an absolute one when |sum| is near eps: the
    formulas are checked on gradients away from that."""
    sums = np.zeros((int(ids.max()) + 1, rows.shape[1]))
    np.add.at(sums, ids, rows.astype(np.float64))
    _, first = np.unique(ids, return_index=True)
    rows = rows.copy()
    for k in first:
        small = np.abs(sums[ids[k]]) < least
        rows[k, small] += 2 * least
    return rows


def assert_rows_equal(a, b, rows):
    np.testing.assert_array_equal(a[rows], b[rows])


# -- against torch ------------------------------------------------------------------
TORCH = {
    "SGD": lambda p, o: torch.optim.SGD(p, lr=o.lr),
    "Adagrad": lambda p, o: torch.optim.Adagrad(
        p, lr=o.lr, eps=o.eps, initial_accumulator_value=o.initial_accumulator_value),
    "Adam": lambda p, o: torch.optim.SparseAdam(p, lr=o.lr, betas=o.betas, eps=o.eps),
}
TORCH_STATE = {"SGD": {}, "Adagrad": {"sum": "sum"},
               "Adam": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}}
# Adam's step m / (sqrt(v) + eps) magnifies the rounding of a gradient summed to near zero
# by up to lr / eps, and torch sums in another order: with eps = 1e-6 about 1 case in 450
# differs by more than the tolerance; eps = 1e-3 bounds it (and still shows where eps goes)
AGAINST_TORCH = {"Adam": {"eps": 1e-3}}


@pytest.mark.parametrize("name", sorted(TORCH))
@pytest.mark.parametrize("mode, weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("dim", [1, 8, 33])
def test_against_torch(backend, rng, name, mode, weighted, dim):
    if backend.small and dim != 8:
        pytest.skip("one (small) D under the CUDA simulator")
    num_rows, dim, batch, max_len, steps = (12, 3, 4, 3, 3) if backend.small else (60, dim, 64, 6, 4)
    w0 = rng.standard_normal((num_rows, dim)).astype(np.float32)
    opt = make_opt(name, **AGAINST_TORCH.get(name, {}))
    plain, fused = Table(backend, opt, w0), Table(backend, opt, w0)
    emb = torch.nn.EmbeddingBag(num_rows, dim, mode=mode, sparse=True, include_last_offset=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(w0))
    topt = TORCH[name](list(emb.parameters()), opt)
    touchable = num_rows - 4  # rows >= touchable are never looked up
    for _ in range(steps):
        grad_out, values, offsets = bags(rng, num_rows, dim, batch, max_len, touchable)
        psw = rng.uniform(0.2, 1.5, size=values.shape).astype(np.float32) if weighted else None
        topt.zero_grad()
        out = emb(torch.from_numpy(values), torch.from_numpy(offsets),
                  per_sample_weights=None if psw is None else torch.from_numpy(psw))
        out.backward(torch.from_numpy(grad_out))
        topt.step()
        plain.bag_step(grad_out, values, offsets, False, psw, combiner=mode)
        fused.bag_step(grad_out, values, offsets, True, psw, combiner=mode)
    expected = emb.weight.detach().numpy().astype(np.float64)
    tstate = topt.state[emb.weight]
    for table in (plain, fused):
        w = table.weights()
        assert_close(w, expected, np.float32)
        assert_rows_equal(w, w0, np.arange(touchable, num_rows))  # untouched: same bits
        states = table.states()
        assert states["step"][0] == steps
        for ours, theirs in TORCH_STATE[name].items():
            assert states[ours].dtype == np.float32
            assert_close(states[ours], tstate[theirs].numpy().astype(np.float64), np.float32)


# -- against the formulas -------------------------------------------------------------
@pytest.mark.parametrize("name", RULES + ["Ftrl-p0.7", "Ftrl-p0"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dim", [5, 168])  # 168: on CUDA 4 columns per lane, 2 passes, columns 1-3 ragged
def test_against_formula(backend, rng, name, dtype, dim):
    num_rows, count, steps = (10, 6, 3) if backend.small else (40, 60, 4)
    w0 = rng.standard_normal((num_rows, dim)).astype(dtype)
    opt = make_opt(name)
    table = Table(backend, opt, w0)
    ref_w, ref_s = reference.optimizer_state(opt, w0)
    init_states = {k: v.copy() for k, v in table.states().items()}
    for t, (ids, rows) in enumerate(sparse_grads(rng, num_rows, dim, count, steps), start=1):
        rows = away_from_cancelling(ids, rows)
        table.step(ids, rows.astype(dtype))
        reference.optimizer_step(opt, ref_w, ref_s, ids, rows.astype(dtype), t)
    w, states = table.weights(), table.states()
    rtol, atol = {np.float32: (1e-4, 1e-5), np.float64: (1e-11, 1e-12)}[dtype]
    assert w.dtype == np.dtype(dtype)
    np.testing.assert_allclose(w, ref_w, rtol=rtol, atol=atol)
    for key, ref in ref_s.items():
        assert states[key].dtype == np.dtype(dtype)  # fp32 state (fp64 for fp64 tables)
        np.testing.assert_allclose(states[key], ref, rtol=rtol, atol=atol)
    untouched = np.arange(num_rows - 3, num_rows)
    assert_rows_equal(w, w0, untouched)
    for key in ref_s:
        assert_rows_equal(states[key], init_states[key], untouched)


def test_ftrl_single_step_by_hand(backend):
    opt = optim.Ftrl(lr=0.1, l1=0.01, l2=0.02)  # lr_power -0.5, accumulator 0.1
    w0 = np.array([[1.0, -2.0, 0.5], [3.0, 3.0, 3.0]], np.float32)
    table = Table(backend, opt, w0)
    table.step(np.array([0]), np.array([[0.5, 0.0, -0.001]], np.float32))
    # column 0: n' = 0.35, z = 0.5 - (sqrt(.35) - sqrt(.1)) / 0.1 * 1
    z0 = 0.5 - (math.sqrt(0.35) - math.sqrt(0.1)) / 0.1
    w_col0 = (-0.01 - z0) / (math.sqrt(0.35) / 0.1 + 0.04)
    # column 1: g = 0 -> z = 0 -> |z| <= l1 -> 0; column 2: z = -0.001 + tiny -> |z| <= l1 -> 0
    w = table.weights()
    np.testing.assert_allclose(w[0], [w_col0, 0.0, 0.0], rtol=1e-5, atol=1e-7)
    assert w_col0 == pytest.approx(0.376726, abs=1e-5)
    np.testing.assert_array_equal(w[1], w0[1])
    states = table.states()
    np.testing.assert_allclose(states["accum"][0], [0.35, 0.1, 0.1 + 1e-6], rtol=1e-6)
    np.testing.assert_allclose(states["linear"][0, 0], z0, rtol=1e-5)


def test_adam_bias_correction_uses_the_table_step(backend, rng):
    opt = optim.Adam(lr=0.1, betas=(0.9, 0.99), eps=1e-8)
    w0 = rng.standard_normal((8, 2)).astype(np.float32)
    table = Table(backend, opt, w0)
    g = np.array([[0.3, -0.7]], np.float32)
    table.step(np.array([0]), g)
    table.step(np.array([0]), g)
    table.step(np.array([5]), g)  # row 5 first touched at step 3
    w, states = table.weights(), table.states()
    assert states["step"][0] == 3
    b1, b2 = 0.9, 0.99
    m, v = (1 - b1) * g[0].astype(np.float64), (1 - b2) * g[0].astype(np.float64) ** 2
    expected = w0[5] - 0.1 * math.sqrt(1 - b2**3) / (1 - b1**3) * m / (np.sqrt(v) + 1e-8)
    assert_close(w[5], expected, np.float32)
    assert_close(states["exp_avg"][5], m, np.float32)
    first = w0[5] - 0.1 * math.sqrt(1 - b2) / (1 - b1) * m / (np.sqrt(v) + 1e-8)
    assert not np.allclose(w[5], first, rtol=1e-3)  # step-1 correction would differ


# -- fused == backward + step ---------------------------------------------------------
@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("dim", [3, 168])  # 168: on CUDA 4 columns per lane, 2 passes, columns 1-3 ragged
def test_fused_equals_backward_plus_step(backend, rng, name, combiner, dim):
    if backend.small and dim == 168 and (name != "RowWiseAdagrad" or combiner != "sqrtn"):
        pytest.skip("D = 168 under the CUDA simulator: the rule that sums all columns' squares, "
                    "one combiner (the combiners differ in the bag scale alone, tested at D = 3)")
    num_rows, batch, max_len = (12, 4, 3) if backend.small else (80, 100, 8)
    w0 = rng.standard_normal((num_rows, dim)).astype(np.float32)
    opt = make_opt(name)
    plain, fused = Table(backend, opt, w0), Table(backend, opt, w0)
    for _ in range(2):
        grad_out, values, offsets = bags(rng, num_rows, dim, batch, max_len)
        psw = rng.uniform(0.2, 1.5, size=values.shape).astype(np.float32)
        plain.bag_step(grad_out, values, offsets, False, psw, combiner=combiner)
        fused.bag_step(grad_out, values, offsets, True, psw, combiner=combiner)
    wp, wf = plain.weights(), fused.weights()
    assert_close(wf, wp.astype(np.float64), np.float32)
    np.testing.assert_array_equal(np.any(wp != w0, axis=1), np.any(wf != w0, axis=1))
    sp, sf = plain.states(), fused.states()
    for key in state_names(opt):
        assert_close(sf[key], sp[key].astype(np.float64), np.float32)
    assert sp["step"][0] == sf["step"][0] == 2


@pytest.mark.parametrize("name", ["RowWiseAdagrad", "Adam"])
def test_fused_on_the_cpu_is_backward_plus_step_bit_for_bit_on_any_thread_count(rng, name):
    """A Zipf batch spread over many partitions of the CPU fused step, with several
    distinct ids in each: the fused step sums every row's gradient in input order, as
    the backward does, so its rows and state equal backward + step exactly, at one
    thread and at all of them."""
    numba = pytest.importorskip("numba")
    num_rows, dim, batch = 3000, 5, 600
    lengths = rng.integers(0, 40, size=batch)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    values = (rng.zipf(1.2, size=int(offsets[-1])) - 1) % num_rows
    values[:50] = num_rows - 1  # the last row, many times
    grad_out = rng.standard_normal((batch, dim)).astype(np.float32)
    w0 = rng.standard_normal((num_rows, dim)).astype(np.float32)
    opt = make_opt(name)
    plain = w0.copy()
    plain_state = opt.init_state(plain)
    opt.step(plain, plain_state, hbk.embedding_bag_backward(
        grad_out, values, offsets, num_rows=num_rows, combiner="mean"))
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            fused = w0.copy()
            state = opt.init_state(fused)
            opt.fused_step(fused, state, grad_out, values, offsets, combiner="mean")
            np.testing.assert_array_equal(fused, plain)
            for key in state_names(opt):
                np.testing.assert_array_equal(state[key], plain_state[key])
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("grad_dtype, table_dtype", [(np.float16, np.float32),
                                                     (np.float32, np.float64)])
def test_fused_sums_in_the_tables_precision(backend, rng, grad_dtype, table_dtype):
    """The fused path sums a row's gradient in the table's accumulator type and never
    rounds it to grad_out's dtype: it equals backward + step on grad_out widened first."""
    num_rows, dim, batch, max_len = (10, 3, 4, 3) if backend.small else (60, 5, 80, 8)
    w0 = rng.standard_normal((num_rows, dim)).astype(table_dtype)
    grad_out, values, offsets = bags(rng, num_rows, dim, batch, max_len)
    grad_out = grad_out.astype(grad_dtype)
    opt = make_opt("Adagrad")
    fused, widened = Table(backend, opt, w0), Table(backend, opt, w0)
    fused.bag_step(grad_out, values, offsets, True, combiner="mean")
    widened.bag_step(grad_out.astype(table_dtype), values, offsets, False, combiner="mean")
    assert_close(fused.weights(), widened.weights().astype(np.float64), table_dtype)


@pytest.mark.parametrize("fused", [False, True])
def test_fused_and_plain_with_bounds_zero(backend, rng, fused):
    opt = make_opt("Adagrad")
    w0 = rng.standard_normal((6, 3)).astype(np.float32)
    grad_out = rng.standard_normal((3, 3)).astype(np.float32)
    values = np.array([0, 6, 5, -3, 2, 99, 5], np.int64)
    offsets = np.array([0, 3, 4, 7], np.int64)
    table = Table(backend, opt, w0)
    table.bag_step(grad_out, values, offsets, fused, combiner="mean", bounds="zero")
    # the same step without the bad ids: bag 0 -> [0, 5], bag 1 -> [], bag 2 -> [2, 5]
    ref = Table(backend, opt, w0)
    ref.bag_step(grad_out, np.array([0, 5, 2, 5]), np.array([0, 2, 2, 4]), False, combiner="mean")
    assert_close(table.weights(), ref.weights().astype(np.float64), np.float32)
    assert_rows_equal(table.weights(), w0, [1, 3, 4])


# -- fp16 tables ------------------------------------------------------------------------
@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("fused", [False, True])
def test_fp16_nearest_is_the_fp32_update_rounded(backend, rng, name, fused):
    # the CPU case spans several distinct ids per partition of the fused step
    num_rows, dim, batch, max_len = (10, 3, 4, 3) if backend.small else (800, 8, 400, 5)
    w16 = rng.standard_normal((num_rows, dim)).astype(np.float16)
    opt = make_opt(name)
    half, single = Table(backend, opt, w16), Table(backend, opt, w16.astype(np.float32))
    for key in state_names(opt):
        assert half.states()[key].dtype == np.float32  # fp32 state for fp16 tables
    grad_out, values, offsets = bags(rng, num_rows, dim, batch, max_len, num_rows - 2)
    half.bag_step(grad_out, values, offsets, fused, combiner="mean")
    single.bag_step(grad_out, values, offsets, fused, combiner="mean")
    within_one_ulp(half.weights(), single.weights().astype(np.float16), np.float16)
    assert_rows_equal(half.weights(), w16, [num_rows - 2, num_rows - 1])
    for key in state_names(opt):
        s16, s32 = half.states()[key], single.states()[key]
        assert s16.dtype == np.float32
        assert_close(s16, s32.astype(np.float64), np.float32)


def exact_sgd_case(rng, num_rows, dim):
    """fp16 weights and fp32 gradients whose SGD update (lr 0.5) is exact in fp32."""
    sign = rng.choice([-1.0, 1.0], size=(num_rows, dim))
    w16 = (sign * rng.uniform(0.25, 2, size=(num_rows, dim))).astype(np.float16)
    g = (rng.integers(-4096, 4097, size=(num_rows, dim)) * 2.0**-20).astype(np.float32)
    x = w16.astype(np.float64) - 0.5 * g.astype(np.float64)
    assert np.array_equal(x, x.astype(np.float32))
    return w16, g, x


def test_stochastic_rounding_follows_the_spec_hash(backend, rng):
    num_rows, dim = (6, 3) if backend.small else (64, 8)
    w16, g, x = exact_sgd_case(rng, num_rows, dim)
    opt = optim.SGD(lr=0.5, rounding="stochastic", seed=1234)
    table = Table(backend, opt, w16)
    ids = rng.permutation(num_rows)
    table.step(ids, g[ids])
    table.step(np.zeros(0, np.int64), np.zeros((0, dim), np.float32))  # step 2: no rows
    key = _bits.seed_key(1234, 1)
    expected = np.array([[reference.stochastic_round(x[r, d], key, r, d) for d in range(dim)]
                         for r in range(num_rows)]).astype(np.float16)
    np.testing.assert_array_equal(table.weights().view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("fused", [False, True])
def test_stochastic_rounding_is_seeded_and_picks_a_neighbour(backend, rng, fused):
    num_rows, dim = (8, 4) if backend.small else (256, 16)
    w16, g, x = exact_sgd_case(rng, num_rows, dim)
    ids = np.arange(num_rows)
    results = {}
    for seed in (7, 7, 8, 7 + 2**32):  # every bit of the seed counts
        table = Table(backend, optim.SGD(lr=0.5, rounding="stochastic", seed=seed), w16)
        if fused:  # one bag per row, sum: the bag's gradient is the row's
            table.bag_step(g, ids, np.arange(num_rows + 1), True)
        else:
            table.step(ids, g)
        results.setdefault(seed, []).append(table.weights())
    np.testing.assert_array_equal(results[7][0].view(np.uint16), results[7][1].view(np.uint16))
    assert not np.array_equal(results[7][0], results[8][0])
    assert not np.array_equal(results[7][0], results[7 + 2**32][0])
    near = x.astype(np.float16)
    below = np.where(near > x, np.nextafter(near, np.float16(-np.inf)), near)
    above = np.where(near < x, np.nextafter(near, np.float16(np.inf)), near)
    for r in (results[7][0], results[8][0]):
        assert np.all((r == below) | (r == above))
        assert 0 < np.mean(r != near) < 1  # some rounded the other way than nearest


@pytest.mark.parametrize("start, frac", [(1.0, 0.3), (-1.0, 0.7), (0.0, 0.6)])
def test_stochastic_rounding_is_unbiased(backend, start, frac):
    num_rows, dim = (64, 8) if backend.small else (2048, 16)
    ulp = 2.0**-24 if start == 0 else 2.0**-10  # the subnormal spacing at 0
    x = start + math.copysign(frac * ulp, start or 1.0)
    w16 = np.full((num_rows, dim), start, np.float16)
    g = np.full((num_rows, dim), np.float32(start - x), np.float32)  # lr = 1: w - g = x
    x32 = np.float64(np.float32(start) - g[0, 0])
    table = Table(backend, optim.SGD(lr=1.0, rounding="stochastic", seed=3), w16)
    table.step(np.arange(num_rows), g)
    r = table.weights().astype(np.float64)
    lo, hi = (start, start + math.copysign(ulp, start or 1.0))
    assert np.all((r == lo) | (r == hi))
    n = r.size
    p_up = abs(x32 - start) / ulp
    share = np.mean(r == hi)
    assert abs(share - p_up) < 5 * math.sqrt(p_up * (1 - p_up) / n)
    assert abs(r.mean() - x32) < 5 * ulp * math.sqrt(p_up * (1 - p_up) / n)


# -- non-finite gradients ------------------------------------------------------------
@pytest.mark.parametrize("name", ["Adagrad", "Ftrl"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_raises_and_leaves_everything(backend, rng, name, bad):
    w0 = rng.standard_normal((10, 3)).astype(np.float32)
    opt = make_opt(name)
    table = Table(backend, opt, w0)
    before = table.states()
    rows = rng.standard_normal((4, 3)).astype(np.float32)
    rows[2, 1] = bad
    with raises(ValueError, match=r"grad.rows has NaN or Inf in row 2"):
        table.step(np.array([1, 4, 5, 7]), rows)
    grad_out = rng.standard_normal((2, 3)).astype(np.float32)
    grad_out[1, 0] = bad
    values, offsets = np.array([1, 2, 3]), np.array([0, 1, 3])
    with raises(ValueError, match=r"grad_out has NaN or Inf in row 1"):
        table.bag_step(grad_out, values, offsets, True)
    grad_out[1, 0] = 1.0
    psw = np.array([1.0, bad, 1.0], np.float32)
    with raises(ValueError, match=r"per_sample_weights has NaN or Inf in row 1"):
        table.bag_step(grad_out, values, offsets, True, psw)
    np.testing.assert_array_equal(table.weights(), w0)
    after = table.states()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key])  # the step counter too


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "RowWiseAdagrad", "Adam", "Ftrl"])
def test_nonfinite_skip_step(backend, rng, name):
    w0 = rng.standard_normal((10, 3)).astype(np.float32)
    ids = np.array([1, 4, 5, 7, 4])
    rows = rng.standard_normal((5, 3)).astype(np.float32)
    rows[1, 2] = np.nan  # id 4 (duplicate: summed first, still NaN)
    rows[3, 0] = -np.inf  # id 7
    skip = Table(backend, make_opt(name, nonfinite="skip"), w0)
    skip.step(ids, rows)
    ref = Table(backend, make_opt(name), w0)
    ref.step(np.array([1, 5]), rows[[0, 2]])
    w, wr = skip.weights(), ref.weights()
    assert_rows_equal(w, w0, [0, 2, 3, 4, 6, 7, 8, 9])
    assert_close(w[[1, 5]], wr[[1, 5]].astype(np.float64), np.float32)
    s, sr = skip.states(), ref.states()
    for key in state_names(skip.opt):
        np.testing.assert_array_equal(s[key][[4, 7]], sr[key][[4, 7]])  # untouched: initial
        assert_close(s[key], sr[key].astype(np.float64), np.float32)


@pytest.mark.parametrize("name", ["Adagrad", "Adam"])
def test_nonfinite_skip_fused(backend, rng, name):
    w0 = rng.standard_normal((10, 3)).astype(np.float32)
    grad_out = rng.standard_normal((3, 3)).astype(np.float32)
    grad_out[1, 1] = np.inf
    values = np.array([0, 2, 2, 5, 6, 2, 8])  # bag 1 = [5, 6] -> rows 5 and 6 skipped
    offsets = np.array([0, 3, 5, 7])
    skip = Table(backend, make_opt(name, nonfinite="skip"), w0)
    skip.bag_step(grad_out, values, offsets, True, combiner="mean")
    g = hbk.embedding_bag_backward(grad_out, values, offsets, num_rows=10, combiner="mean")
    finite = np.all(np.isfinite(g.rows), axis=1)
    assert sorted(g.ids[~finite].tolist()) == [5, 6]
    ref = Table(backend, make_opt(name), w0)
    ref.step(g.ids[finite], g.rows[finite])
    w = skip.weights()
    assert_rows_equal(w, w0, [1, 3, 4, 5, 6, 7, 9])
    assert_close(w, ref.weights().astype(np.float64), np.float32)
    skip_plain = Table(backend, make_opt(name, nonfinite="skip"), w0)
    skip_plain.bag_step(grad_out, values, offsets, False, combiner="mean")
    assert_close(skip_plain.weights(), w.astype(np.float64), np.float32)


# -- SparseGrad handling and argument checks -----------------------------------------
def test_duplicate_ids_are_summed_first(backend, rng):
    w0 = rng.standard_normal((6, 2)).astype(np.float32)
    rows = rng.standard_normal((4, 2)).astype(np.float32)
    dup = Table(backend, make_opt("Adagrad"), w0)
    dup.step(np.array([3, 1, 3, 3]), rows)
    summed = Table(backend, make_opt("Adagrad"), w0)
    summed.step(np.array([3, 1]), np.stack([rows[0] + rows[2] + rows[3], rows[1]]))
    assert_close(dup.weights(), summed.weights().astype(np.float64), np.float32)
    assert_close(dup.states()["sum"], summed.states()["sum"].astype(np.float64), np.float32)


def test_empty_grad_only_counts_the_step(backend):
    w0 = np.ones((4, 2), np.float32)
    table = Table(backend, make_opt("Adam"), w0)
    table.step(np.zeros(0, np.int64), np.zeros((0, 2), np.float32))
    table.bag_step(np.zeros((2, 2), np.float32), np.zeros(0, np.int64), np.zeros(3, np.int64), True)
    np.testing.assert_array_equal(table.weights(), w0)
    assert table.states()["step"][0] == 2


def test_rows_in_another_float_dtype(backend, rng):
    w0 = rng.standard_normal((6, 3)).astype(np.float32)
    rows = rng.standard_normal((2, 3))
    a, b = Table(backend, make_opt("Adagrad"), w0), Table(backend, make_opt("Adagrad"), w0)
    a.step(np.array([1, 4], np.int32), rows)  # float64 rows on an fp32 table
    b.step(np.array([1, 4]), rows.astype(np.float32))
    assert_close(a.weights(), b.weights().astype(np.float64), np.float32)


def test_bad_ids_raise(backend):
    w0 = np.ones((5, 2), np.float32)
    table = Table(backend, make_opt("SGD"), w0)
    rows = np.ones((3, 2), np.float32)
    with raises(hbk.BoundsError, match=r"grad.ids\[1\] = 5 .*\[0, 5\)") as info:
        table.step(np.array([0, 5, 1]), rows)
    assert info.value.position == 1
    with raises(hbk.BoundsError, match=r"grad.ids\[2\] = -1 "):
        table.step(np.array([0, 1, -1], np.int32), rows)
    with raises(hbk.BoundsError, match=r"values\[1\] = 7 "):
        table.bag_step(np.ones((1, 2), np.float32), np.array([0, 7]), np.array([0, 2]), True)
    with raises(ValueError, match=r"offsets\[1\] = 3, expected len\(values\) = 2"):
        table.bag_step(np.ones((1, 2), np.float32), np.array([0, 1]), np.array([0, 3]), True,
                       bounds="zero")
    np.testing.assert_array_equal(table.weights(), w0)
    assert table.states()["step"][0] == 0


@pytest.mark.parametrize("fused", [True, False])
def test_the_first_of_many_bad_ids_is_named(backend, rng, fused):
    """Bad ids in several parts of a batch (the CPU groups a batch's bags in chunks, in
    parallel): the first in input order is named and nothing changes."""
    bags, length = (8, 2) if backend.small else (4096, 4)
    n = bags * length
    values = rng.integers(0, 5, n)
    first = n // 40
    for position, bad in ((n - 3, -2), (first, 9), (n // 2, 5)):
        values[position] = bad
    w0 = np.ones((5, 2), np.float32)
    table = Table(backend, make_opt("Adagrad"), w0)
    with raises(hbk.BoundsError, match=rf"values\[{first}\] = 9 is out of range \[0, 5\)"):
        table.bag_step(np.ones((bags, 2), np.float32), values,
                       np.arange(bags + 1, dtype=np.int64) * length, fused)
        hbk.synchronize()
    np.testing.assert_array_equal(table.weights(), w0)
    assert table.states()["step"][0] == 0


BAD_ID = (hbk.BoundsError, r"values\[1\] = 7 is out of range \[0, 5\)")
DECREASING = (ValueError, r"offsets\[2\] = 2 < offsets\[1\] = 3")
NOT_ZERO = (ValueError, r"offsets\[0\] = 1, expected 0")


@pytest.mark.parametrize("bounds, expected", [
    ("raise", [BAD_ID, DECREASING, None, NOT_ZERO]),
    ("zero", [None, DECREASING, None, NOT_ZERO]),
    ("unchecked", [None, None, None, None])])
def test_check_ragged(backend, bounds, expected):
    """The CSR check (EmbeddingCollection's, before its kernels): the first bad offset,
    else (bounds="raise") the first id outside [0, num_rows)."""
    cases = [([0, 7, -1, 2], [0, 2, 4]), ([0, 1, 2, 3], [0, 3, 2, 4]), ([], [0]), ([], [1])]
    for (values, offsets), want in zip(cases, expected):
        call = lambda: hbk.ops.check_ragged(  # noqa: E731
            backend.put(np.array(values, np.int64)), backend.put(np.array(offsets, np.int64)),
            5, bounds=bounds)
        if want is None:
            call()
            hbk.synchronize()
        else:
            with raises(want[0], match=want[1]):
                call()


def test_bad_arguments(backend):
    put = backend.put
    w = put(np.ones((5, 2), np.float32))
    opt = make_opt("Adagrad")
    state = opt.init_state(w)
    ids = put(np.array([0, 1]))
    with raises(ValueError, match=r"grad.rows must be \[len\(ids\), D\] = \[2, 2\]"):
        opt.step(w, state, hbk.SparseGrad(ids, put(np.ones((2, 3), np.float32))))
    with raises(ValueError, match=r"grad.rows must be \[len\(ids\), D\]"):
        opt.step(w, state, hbk.SparseGrad(ids, put(np.ones((3, 2), np.float32))))
    with raises(ValueError, match="grad.rows must be float16, bfloat16, float32 or float64"):
        opt.step(w, state, hbk.SparseGrad(ids, put(np.ones((2, 2), np.int32))))
    with raises(ValueError, match="grad.ids must hold int32 or int64"):
        opt.step(w, state, hbk.SparseGrad(put(np.array([0.0, 1.0])),
                                          put(np.ones((2, 2), np.float32))))
    with raises(TypeError, match="SparseGrad"):
        opt.step(w, state, (ids, put(np.ones((2, 2), np.float32))))
    grad = hbk.SparseGrad(ids, put(np.ones((2, 2), np.float32)))
    with raises(ValueError, match="state must be the dict"):
        opt.step(w, {}, grad)
    with raises(ValueError, match="state lacks 'sum'"):
        opt.step(w, {"step": np.zeros(1, np.int64)}, grad)
    with raises(ValueError, match=r"state\['sum'\] must be \(5, 2\) float32"):
        opt.step(w, dict(state, sum=put(np.zeros((5, 2), np.float64))), grad)
    with raises(ValueError, match=r"state\['sum'\] must be \(5, 2\) float32"):
        opt.step(w, dict(state, sum=put(np.zeros((4, 2), np.float32))), grad)
    with raises(ValueError, match=r"state\['momentum'\] must be \(5,\) float32"):
        optim.RowWiseAdagrad(lr=0.1).step(
            w, {"step": np.zeros(1, np.int64), "momentum": put(np.zeros((5, 2), np.float32))}, grad)
    with raises(ValueError, match="grad_out has D = 3 columns but the table has 2"):
        opt.fused_step(w, state, put(np.ones((1, 3), np.float32)), ids, put(np.array([0, 2])))
    with raises(ValueError, match=r"grad_out must be \[B, D\] = \[1"):
        opt.fused_step(w, state, put(np.ones((2, 2), np.float32)), ids, put(np.array([0, 2])))
    with raises(ValueError, match="2-D table"):
        opt.init_state(put(np.ones(5, np.float32)))
    np.testing.assert_array_equal(backend.get(w), 1.0)
    assert state["step"][0] == 0


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("fused", [False, True])
def test_a_failed_step_changes_nothing(backend, name, fused):
    """Bad ids, NaN gradients, a read-only table or state, a bad step counter: a clear
    error, and the weights, the state and its step counter are as before."""
    put = backend.put
    opt = make_opt(name)
    table = Table(backend, opt, np.linspace(-1, 1, 10, dtype=np.float32).reshape(5, 2))
    table.step(np.array([1]), np.ones((1, 2), np.float32))
    before_w, before_s = table.weights(), table.states()

    def attempt(ids, rows, state=None):
        state = table.state if state is None else state
        if fused:
            opt.fused_step(table.w, state, put(rows), put(ids), put(np.array([0, len(ids)])))
        else:
            opt.step(table.w, state, hbk.SparseGrad(put(ids), put(rows)))

    good_ids, good_rows = np.array([0, 4]), np.ones((2, 2), np.float32)
    with raises(hbk.BoundsError):
        attempt(np.array([0, 5]), good_rows if not fused else good_rows[:1])
    with raises(ValueError, match="NaN or Inf"):
        attempt(good_ids, np.full((2 if not fused else 1, 2), np.nan, np.float32))
    for bad_step in (3, np.zeros(1, np.int32), np.zeros(2, np.int64), np.zeros((), np.int64)):
        with raises(ValueError, match=r"state\['step'\] must be the 1-element int64"):
            attempt(good_ids, good_rows if not fused else good_rows[:1],
                    dict(table.state, step=bad_step))
    if not backend.is_cuda:  # read-only NumPy arrays (CUDA arrays are always writable)
        frozen = table.state["step"].copy()
        frozen.flags.writeable = False
        with raises(ValueError, match=r"state\['step'\] is read-only"):
            attempt(good_ids, good_rows if not fused else good_rows[:1],
                    dict(table.state, step=frozen))
        table.w.flags.writeable = False
        with raises(ValueError, match="weights is read-only"):
            attempt(good_ids, good_rows if not fused else good_rows[:1])
        table.w.flags.writeable = True
        for slot in state_names(opt):
            ro = table.state[slot].copy()
            ro.flags.writeable = False
            with raises(ValueError, match=f"state\\['{slot}'\\] is read-only"):
                attempt(good_ids, good_rows if not fused else good_rows[:1],
                        dict(table.state, **{slot: ro}))
    np.testing.assert_array_equal(table.weights(), before_w)
    for key, value in table.states().items():
        np.testing.assert_array_equal(value, before_s[key], err_msg=key)


def test_constructor_checks():
    for lr in (0.0, -5, float("nan"), float("inf"), "fast", None):
        with raises(ValueError, match=r"lr must be a finite number > 0, got"):
            optim.SGD(lr=lr)
    with raises(ValueError, match="rounding must be one of"):
        optim.SGD(lr=0.1, rounding="up")
    with raises(ValueError, match="nonfinite must be one of"):
        optim.SGD(lr=0.1, nonfinite="ignore")
    with raises(ValueError, match="betas"):
        optim.Adam(lr=0.1, betas=(1.0, 0.9))
    for opt in (optim.Adam, optim.Adagrad, optim.RowWiseAdagrad):
        with raises(ValueError, match="eps must be a finite number >= 0, got -1"):
            opt(lr=0.1, eps=-1)
    with raises(ValueError, match="initial_accumulator_value must be a finite number >= 0"):
        optim.Adagrad(lr=0.1, initial_accumulator_value=-0.5)
    with raises(ValueError, match="lr_power must be a finite number <= 0"):
        optim.Ftrl(lr=0.1, lr_power=0.5)
    with raises(ValueError, match="l1 must be a finite number >= 0"):
        optim.Ftrl(lr=0.1, l1=-1.0)
    with raises(ValueError, match="l2 must be a finite number >= 0"):
        optim.Ftrl(lr=0.1, l2=float("inf"))
    with raises(ValueError, match="initial_accumulator_value must be a finite number > 0"):
        optim.Ftrl(lr=0.1, initial_accumulator_value=0.0)
    optim.Ftrl(lr=0.1, lr_power=0.0, initial_accumulator_value=0.0)  # fixed rate: 0 allowed


@pytest.mark.parametrize("betas", [(0.9, 0.9, 0.9), 0.9, (0.9,), ("a", 0.9), None, (1.0, 0.9),
                                   (0.9, float("nan"))])
def test_betas_must_be_a_pair_of_floats_in_0_1(betas):
    with raises(ValueError, match=re.escape(f"betas must be a pair of floats in [0, 1), "
                                            f"got {betas!r}")):
        optim.Adam(lr=0.1, betas=betas)


@pytest.mark.parametrize("seed", [1.5, "7", None, True, 2**64, -2**63 - 1])
def test_seed_must_be_an_integer(seed):
    with raises(ValueError, match=re.escape(f"seed must be an integer in [-2**63, 2**64), got {seed!r}")):
        optim.SGD(lr=0.1, rounding="stochastic", seed=seed)
    assert optim.SGD(lr=0.1, seed=np.int64(7)).seed == 7


@pytest.mark.parametrize("dtype, state_dtype", [(np.float16, np.float32), (np.float32, np.float32),
                                                (np.float64, np.float64)])
def test_init_state(backend, dtype, state_dtype):
    w = backend.put(np.zeros((7, 3), dtype))
    s = make_opt("Adagrad").init_state(w)
    assert s["step"].tolist() == [0]
    got = backend.get(s["sum"])
    assert got.dtype == state_dtype and got.shape == (7, 3)
    np.testing.assert_array_equal(got, state_dtype(0.1))
    s = optim.RowWiseAdagrad(lr=0.1).init_state(w)
    assert backend.get(s["momentum"]).shape == (7,)
    s = make_opt("Ftrl").init_state(w)
    np.testing.assert_array_equal(backend.get(s["accum"]), state_dtype(0.1))
    np.testing.assert_array_equal(backend.get(s["linear"]), 0.0)
    assert set(make_opt("Adam").init_state(w)) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(make_opt("SGD").init_state(w)) == {"step"}


# -- extremely repeated ids: the chunked sums of the fused step ------------------------
@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("dim", [5, 168])  # 168: on CUDA 2 passes, the row kept between them
def test_fused_with_an_extremely_repeated_id(backend, rng, monkeypatch, name, dim):
    """One id thousands of times (hundreds under the simulator, cut into chunks of 4 so
    the partial-row levels run) among a few others: the fused step equals the formula on
    the float64 gradient, and gives the same bits on two runs."""
    if backend.small and dim == 168 and name not in ("RowWiseAdagrad", "Adam"):
        pytest.skip("D = 168 under the CUDA simulator: the rules with row-wide or two states")
    if backend.is_cuda:
        from hbkernels.cuda import _segments

        monkeypatch.setattr(_segments, "CHUNK", 4)
    num_rows = 20
    n = (60 if dim < 100 else 30) if backend.small else 4000  # 30: still 3 levels of chunks
    values = np.where(rng.random(n) < 0.9, 11, rng.choice([0, 2, num_rows - 1], n))
    offsets = np.concatenate([[0], np.sort(rng.choice(np.arange(1, n), n // 6, replace=False)),
                              [n]])
    grad_out = rng.standard_normal((len(offsets) - 1, dim)).astype(np.float32)
    w0 = rng.standard_normal((num_rows, dim)).astype(np.float32)
    opt = make_opt(name)
    first, second = Table(backend, opt, w0), Table(backend, opt, w0)
    first.bag_step(grad_out, values, offsets, True, combiner="mean")
    second.bag_step(grad_out, values, offsets, True, combiner="mean")
    np.testing.assert_array_equal(first.weights(), second.weights())
    g = hbk.embedding_bag_backward(grad_out.astype(np.float64), values, offsets,
                                   num_rows=num_rows, combiner="mean")
    # the hot row's gradient is a sum of thousands of fp32 terms, each element within
    # `slack` of the float64 sum; a rule's step may amplify that (Adam's first step near a
    # zero gradient): the fused step lies among the reference's steps on gradients moved by
    # it, to a tolerance
    magnitude = hbk.embedding_bag_backward(np.abs(grad_out).astype(np.float64), values, offsets,
                                           num_rows=num_rows, combiner="mean")
    assert np.array_equal(magnitude.ids, g.ids)
    slack = 2.0 ** -22 * np.ceil(np.log2(n)) * magnitude.rows
    steps = []
    for moved in (g.rows - slack, g.rows, g.rows + slack):
        w, s = reference.optimizer_state(opt, w0)
        reference.optimizer_step(opt, w, s, g.ids, moved, 1)
        steps.append(w)
    got = first.weights().astype(np.float64)
    low, high = np.minimum.reduce(steps), np.maximum.reduce(steps)
    tol = 3e-4 * (1 + np.abs(steps[1]))
    outside = (got < low - tol) | (got > high + tol)
    assert not outside.any(), (f"{int(outside.sum())} elements outside the reference's steps, "
                               f"first at {np.argwhere(outside)[0]}: {got[outside][0]} not in "
                               f"[{low[outside][0]}, {high[outside][0]}]")
