"""hbkernels.adapters.jax: forward and gradients against a pure-JAX reference,
under jit / grad / value_and_grad / vmap, and the error and path contracts."""
import doctest
import importlib.util
import re

import numpy as np
import pytest
from conftest import TOLERANCE, random_offsets
from helpers import raises

jax = pytest.importorskip("jax")
jnp = jax.numpy

import hbkernels as hbk  # noqa: E402
from hbkernels.adapters import jax as hbj  # noqa: E402

COMBINERS = ["sum", "mean", "sqrtn"]
HAS_BUFFER_CALLBACK = hbj._buffer_callback is not None
CPU_PATHS = ["buffer_callback", "pure_callback"] if HAS_BUFFER_CALLBACK else ["pure_callback"]


@pytest.fixture(params=CPU_PATHS)
def path(request, monkeypatch):
    """Run the test through each CPU path this JAX has (read at trace time)."""
    monkeypatch.setattr(hbj, "_CPU_PATH", request.param)
    assert hbj.paths()["cpu"] == request.param
    return request.param


# -- the pure-JAX reference -------------------------------------------------------

def reference(weight, values, offsets_np, combiner, psw=None):
    """``segment_sum(take(weight, values) * w, bag, B)`` scaled per combiner; empty -> 0.
    ``offsets_np`` is NumPy (the bag of each value is static)."""
    offsets_np = np.asarray(offsets_np)
    num_bags = offsets_np.shape[0] - 1
    bag = np.repeat(np.arange(num_bags), np.diff(offsets_np))
    w = jnp.ones(values.shape[0], weight.dtype) if psw is None else psw
    summed = jax.ops.segment_sum(jnp.take(weight, values, axis=0) * w[:, None], bag, num_bags)
    if combiner == "sum":
        return summed
    if combiner == "mean":
        z = jax.ops.segment_sum(w, bag, num_bags)
    else:
        sq = jax.ops.segment_sum(w * w, bag, num_bags)
        z = jnp.where(sq > 0, jnp.sqrt(jnp.where(sq > 0, sq, 1)), 0)
    safe = jnp.where(z != 0, z, 1)
    return jnp.where(z[:, None] != 0, summed / safe[:, None], 0).astype(weight.dtype)


def close(actual, expected, dtype):
    rtol, atol = TOLERANCE[np.dtype(dtype)]
    assert actual.dtype == np.dtype(dtype), f"dtype {actual.dtype}, expected {np.dtype(dtype)}"
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=rtol, atol=atol)


def make_case(rng, *, num_rows=13, dim=7, batch=9, max_len=6, dtype=np.float32,
              id_dtype=np.int32, weighted=False):
    """Random bags with empty ones, duplicate ids (num_rows is small) and both table edges."""
    offsets = random_offsets(rng, batch, max_len)
    n = int(offsets[-1])
    values = rng.integers(0, num_rows, size=n)
    if n >= 2:
        values[rng.choice(n, 2, replace=False)] = [0, num_rows - 1]
    weight = rng.standard_normal((num_rows, dim)).astype(dtype)
    psw = rng.uniform(0.25, 2.0, size=n).astype(dtype) if weighted else None
    return weight, values.astype(id_dtype), offsets.astype(id_dtype), psw


def check_against_reference(rng, weight_np, values_np, offsets_np, psw_np, combiner, *, jit=False):
    dtype = weight_np.dtype
    weight, values = jnp.asarray(weight_np), jnp.asarray(values_np)
    offsets = jnp.asarray(offsets_np)
    psw = None if psw_np is None else jnp.asarray(psw_np)
    assert values.dtype == values_np.dtype and weight.dtype == dtype  # x64 where needed
    cot_shape = (offsets_np.shape[0] - 1, weight_np.shape[1])
    cot = jnp.asarray(rng.standard_normal(cot_shape).astype(dtype))

    def loss_adapter(w, p):
        out = hbj.embedding_bag(w, values, offsets, combiner=combiner, per_sample_weights=p)
        return jnp.sum(out * cot)

    def loss_reference(w, p):
        return jnp.sum(reference(w, values, offsets_np, combiner, p) * cot)

    forward = lambda w, p: hbj.embedding_bag(w, values, offsets, combiner=combiner,  # noqa: E731
                                             per_sample_weights=p)
    argnums = 0 if psw is None else (0, 1)
    grad_adapter = jax.grad(loss_adapter, argnums=argnums)
    if jit:
        forward, grad_adapter = jax.jit(forward), jax.jit(grad_adapter)

    out = forward(weight, psw)
    assert out.shape == (offsets_np.shape[0] - 1, weight_np.shape[1])
    close(out, reference(weight, values, offsets_np, combiner, psw), dtype)

    got = grad_adapter(weight, psw)
    want = jax.grad(loss_reference, argnums=argnums)(weight, psw)
    if psw is None:
        got, want = (got,), (want,)
    for g, e in zip(got, want):
        close(g, e, dtype)
    return out, got


# -- forward and gradients --------------------------------------------------------

@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("dim", [1, 7, 16])
def test_matches_reference_eager(rng, combiner, weighted, dim):
    case = make_case(rng, dim=dim, weighted=weighted)
    check_against_reference(rng, *case, combiner)


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_matches_reference_under_jit(rng, path, combiner, weighted):
    case = make_case(rng, dim=5, batch=20, weighted=weighted)
    check_against_reference(rng, *case, combiner, jit=True)


@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_int64_ids_and_offsets(rng, combiner, weighted):
    with jax.enable_x64(True):
        case = make_case(rng, dim=3, id_dtype=np.int64, weighted=weighted)
        check_against_reference(rng, *case, combiner, jit=True)


@pytest.mark.parametrize("combiner", COMBINERS)
def test_float64(rng, combiner):
    with jax.enable_x64(True):
        case = make_case(rng, dim=9, dtype=np.float64, id_dtype=np.int64, weighted=True)
        out, _ = check_against_reference(rng, *case, combiner, jit=True)
        assert out.dtype == jnp.float64


def test_float16_forward(rng):
    weight, values, offsets, _ = make_case(rng, dim=8, dtype=np.float16)
    out = hbj.embedding_bag(weight, values, offsets, combiner="mean")
    want = reference(jnp.asarray(weight, jnp.float32), jnp.asarray(values), offsets, "mean")
    close(out, want.astype(jnp.float16), np.float16)


def test_duplicate_ids_accumulate_in_the_gradient():
    weight = jnp.zeros((4, 2), jnp.float32)
    values, offsets = jnp.array([3, 3, 0, 3]), jnp.array([0, 3, 4])
    grad = jax.grad(lambda w: hbj.embedding_bag(w, values, offsets).sum())(weight)
    np.testing.assert_array_equal(np.asarray(grad), [[1, 1], [0, 0], [0, 0], [3, 3]])


def test_value_and_grad_of_a_nonlinear_loss(rng, path):
    weight, values, offsets, psw = make_case(rng, dim=4, weighted=True)

    def loss(fn, w, p):
        return jnp.sum(jnp.tanh(fn(w, p)) ** 2)

    adapter = lambda w, p: hbj.embedding_bag(w, values, offsets, combiner="sqrtn",  # noqa: E731
                                             per_sample_weights=p)
    ref = lambda w, p: reference(w, jnp.asarray(values), offsets, "sqrtn", p)  # noqa: E731
    val, (gw, gp) = jax.jit(jax.value_and_grad(lambda w, p: loss(adapter, w, p), argnums=(0, 1)))(
        weight, psw)
    rval, (rgw, rgp) = jax.value_and_grad(lambda w, p: loss(ref, w, p), argnums=(0, 1))(weight, psw)
    close(val, rval, np.float32)
    close(gw, rgw, np.float32)
    close(gp, rgp, np.float32)
    assert np.abs(np.asarray(gw)).sum() > 0  # a zero gradient would pass vacuously


def test_cotangents_of_the_integer_inputs_are_float0(rng):
    weight, values, offsets, _ = make_case(rng)
    grads = jax.grad(lambda w, v, o: hbj.embedding_bag(w, v, o).sum(), argnums=(0, 1, 2),
                     allow_int=True)(weight, values, offsets)
    assert grads[0].shape == weight.shape and grads[0].dtype == weight.dtype
    assert grads[1].dtype == jax.dtypes.float0 and grads[1].shape == values.shape
    assert grads[2].dtype == jax.dtypes.float0 and grads[2].shape == offsets.shape


def test_vjp_gives_a_dense_table_cotangent(rng):
    weight, values, offsets, _ = make_case(rng, num_rows=50, dim=3)
    out, vjp = jax.vjp(lambda w: hbj.embedding_bag(w, values, offsets), jnp.asarray(weight))
    (d_weight,) = vjp(jnp.ones_like(out))
    assert d_weight.shape == (50, 3)
    counts = np.bincount(values, minlength=50).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(d_weight), np.repeat(counts[:, None], 3, axis=1))


# -- edge shapes -------------------------------------------------------------------

@pytest.mark.parametrize("combiner", COMBINERS)
def test_all_bags_empty(path, combiner):
    weight = jnp.ones((5, 3), jnp.float32)
    values, offsets = jnp.zeros((0,), jnp.int32), jnp.zeros((4,), jnp.int32)
    psw = jnp.zeros((0,), jnp.float32)
    out = jax.jit(lambda w: hbj.embedding_bag(w, values, offsets, combiner=combiner,
                                              per_sample_weights=psw))(weight)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((3, 3)))
    gw, gp = jax.grad(lambda w, p: hbj.embedding_bag(w, values, offsets, combiner=combiner,
                                                     per_sample_weights=p).sum(),
                      argnums=(0, 1))(weight, psw)
    np.testing.assert_array_equal(np.asarray(gw), np.zeros((5, 3)))
    assert gp.shape == (0,)


def test_zero_bags(path):
    weight = jnp.ones((5, 2), jnp.float32)
    values, offsets = jnp.zeros((0,), jnp.int32), jnp.zeros((1,), jnp.int32)
    out = jax.jit(lambda w: hbj.embedding_bag(w, values, offsets))(weight)
    assert out.shape == (0, 2) and out.dtype == jnp.float32
    grad = jax.grad(lambda w: hbj.embedding_bag(w, values, offsets).sum())(weight)
    np.testing.assert_array_equal(np.asarray(grad), np.zeros((5, 2)))


# -- transformations -------------------------------------------------------------------

def test_vmap_over_the_table(rng, path):
    weight, values, offsets, psw = make_case(rng, dim=3, weighted=True)
    tables = jnp.stack([jnp.asarray(weight), 2 * jnp.asarray(weight) + 1])
    f = lambda w: hbj.embedding_bag(w, values, offsets, combiner="mean",  # noqa: E731
                                    per_sample_weights=psw)
    batched = jax.jit(jax.vmap(f))(tables)
    assert batched.shape == (2, len(offsets) - 1, 3)
    for i in range(2):
        want = reference(tables[i], jnp.asarray(values), offsets, "mean", psw)
        close(batched[i], want, np.float32)


def test_two_lookups_in_one_jitted_program(rng, path):
    """Two independent callbacks in one XLA program (XLA may run them concurrently)."""
    a = make_case(rng, num_rows=200, dim=32, batch=300, max_len=20)
    b = make_case(rng, num_rows=100, dim=16, batch=200, max_len=20, weighted=True)

    @jax.jit
    def both(wa, wb):
        return (hbj.embedding_bag(wa, a[1], a[2], combiner="sum"),
                hbj.embedding_bag(wb, b[1], b[2], combiner="sqrtn", per_sample_weights=b[3]))

    out_a, out_b = both(a[0], b[0])
    close(out_a, reference(jnp.asarray(a[0]), jnp.asarray(a[1]), a[2], "sum"), np.float32)
    close(out_b, reference(jnp.asarray(b[0]), jnp.asarray(b[1]), b[2], "sqrtn", b[3]), np.float32)


# -- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("bad", [5, -1])
def test_bad_id_raises_jax_runtime_error(path, jit, bad):
    weight = jnp.ones((5, 2), jnp.float32)
    values, offsets = jnp.array([1, bad, 2]), jnp.array([0, 2, 3])
    f = lambda w: hbj.embedding_bag(w, values, offsets)  # noqa: E731
    f = jax.jit(f) if jit else f
    with raises(jax.errors.JaxRuntimeError,
                       match=rf"BoundsError: values\[1\] = {bad} is out of range \[0, 5\)"):
        f(weight).block_until_ready()
    assert issubclass(jax.errors.JaxRuntimeError, RuntimeError)


def test_bad_id_raises_in_the_backward_alone(path):
    """jax.grad of a loss without per_sample_weights drops the forward callback (it is
    pure and unused); the backward kernel still checks the ids."""
    weight = jnp.ones((5, 2), jnp.float32)
    values, offsets = jnp.array([1, 9]), jnp.array([0, 2])
    with raises(jax.errors.JaxRuntimeError, match=r"BoundsError: values\[1\] = 9"):
        jax.jit(jax.grad(lambda w: hbj.embedding_bag(w, values, offsets).sum()))(
            weight).block_until_ready()


def test_malformed_offsets_raise_jax_runtime_error(path):
    weight = jnp.ones((5, 2), jnp.float32)
    values, offsets = jnp.array([1, 2, 3]), jnp.array([0, 2, 1, 3])
    with raises(jax.errors.JaxRuntimeError, match="malformed offsets"):
        hbj.embedding_bag(weight, values, offsets).block_until_ready()


@pytest.mark.parametrize("kwargs, match", [
    (dict(weight=jnp.ones(4)), "2-D table"),
    (dict(weight=jnp.ones((4, 2), jnp.int32)), "float16, bfloat16, float32 or float64"),
    (dict(values=jnp.array([0.0, 1.0])), "int32 or int64"),
    (dict(offsets=jnp.zeros((0,), jnp.int32)), "B \\+ 1 >= 1"),
    (dict(per_sample_weights=jnp.ones(3)), "shape of values"),
    (dict(combiner="max"), "combiner must be one of"),
])
def test_static_errors_are_value_errors_even_under_jit(kwargs, match):
    args = dict(weight=jnp.ones((4, 2)), values=jnp.array([0, 1]), offsets=jnp.array([0, 2]),
                combiner="sum", per_sample_weights=None)
    args.update(kwargs)
    with raises(ValueError, match=match):
        hbj.embedding_bag(args["weight"], args["values"], args["offsets"],
                          combiner=args["combiner"], per_sample_weights=args["per_sample_weights"])
    with raises(ValueError, match=match):
        jax.jit(lambda w, v, o: hbj.embedding_bag(
            w, v, o, combiner=args["combiner"], per_sample_weights=args["per_sample_weights"]))(
                args["weight"], args["values"], args["offsets"])


# -- execution paths -------------------------------------------------------------------------

def _custom_calls(fn, *args, platform):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return set(re.findall(r"custom_call @(\w+)", text))


CPU_TARGET = {"buffer_callback": "xla_buffer_python_cpu_callback",
              "pure_callback": "xla_ffi_python_cpu_callback"}


def test_cpu_lowering_uses_the_selected_callback(path):
    w, v, o = jnp.ones((4, 2)), jnp.array([0, 3]), jnp.array([0, 2])
    p = jnp.ones(2)
    fwd_and_grad = jax.value_and_grad(
        lambda w, p: hbj.embedding_bag(w, v, o, combiner="mean", per_sample_weights=p).sum(),
        argnums=(0, 1))
    assert _custom_calls(fwd_and_grad, w, p, platform="cpu") == {CPU_TARGET[path]}


def test_default_cpu_path():
    assert hbj.paths()["cpu"] == ("buffer_callback" if HAS_BUFFER_CALLBACK else "pure_callback")


@pytest.mark.skipif(not HAS_BUFFER_CALLBACK, reason="this JAX has no buffer_callback")
def test_cuda_lowering_uses_buffer_callback_when_cupy_is_there(monkeypatch):
    """Lowered for CUDA (no GPU needed to lower), both passes are zero-copy buffer
    callbacks and nothing of the host path is left in the program."""
    monkeypatch.setattr(hbj, "_has_cupy", lambda: True)
    monkeypatch.setattr(hbj, "_CPU_PATH", "pure_callback")  # so the branches differ
    assert hbj.paths() == {"cpu": "pure_callback", "cuda": "buffer_callback"}
    w, v, o = jnp.ones((4, 2)), jnp.array([0, 3]), jnp.array([0, 2])
    p = jnp.ones(2)
    fwd_and_grad = jax.value_and_grad(
        lambda w, p: hbj.embedding_bag(w, v, o, combiner="mean", per_sample_weights=p).sum(),
        argnums=(0, 1))
    assert _custom_calls(fwd_and_grad, w, p, platform="cuda") == {"xla_buffer_python_gpu_callback"}
    assert _custom_calls(fwd_and_grad, w, p, platform="cpu") == {"xla_ffi_python_cpu_callback"}


def test_cuda_without_cupy_falls_back_to_pure_callback(monkeypatch):
    monkeypatch.setattr(hbj, "_has_cupy", lambda: False)
    assert hbj.paths()["cuda"] == "pure_callback"


def test_module_docstring_examples():
    result = doctest.testmod(hbj, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- real GPU ----------------------------------------------------------------------------------

def _jax_gpu():
    try:
        return jax.devices("cuda")[0]
    except RuntimeError:
        return None


@pytest.mark.gpu
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_gpu_matches_cpu(rng, combiner, weighted):
    gpu = _jax_gpu()
    if gpu is None:
        pytest.skip("JAX has no CUDA backend here (pip install 'jax[cuda12]')")
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed: the GPU path would be the host fallback")
    assert hbj.paths()["cuda"] == "buffer_callback"
    weight, values, offsets, psw = make_case(rng, num_rows=5000, dim=33, batch=2000, max_len=30,
                                             weighted=weighted)
    cot = rng.standard_normal((2000, 33)).astype(np.float32)

    def fwd_grad(w, p):
        def loss(w, p):
            out = hbj.embedding_bag(w, values, offsets, combiner=combiner, per_sample_weights=p)
            return jnp.sum(out * cot), out
        return jax.value_and_grad(loss, argnums=(0, 1) if p is not None else 0, has_aux=True)(w, p)

    cpu = jax.devices("cpu")[0]
    put = lambda a, dev: None if a is None else jax.device_put(a, dev)  # noqa: E731
    (_, out_gpu), g_gpu = jax.jit(fwd_grad)(put(weight, gpu), put(psw, gpu))
    (_, out_cpu), g_cpu = jax.jit(fwd_grad)(put(weight, cpu), put(psw, cpu))
    assert next(iter(out_gpu.devices())).platform == "gpu"
    close(np.asarray(out_gpu), np.asarray(out_cpu), np.float32)
    for a, b in zip(jax.tree_util.tree_leaves(g_gpu), jax.tree_util.tree_leaves(g_cpu)):
        close(np.asarray(a), np.asarray(b), np.float32)


@pytest.mark.gpu
def test_gpu_bad_id_raises():
    gpu = _jax_gpu()
    if gpu is None or importlib.util.find_spec("cupy") is None:
        pytest.skip("needs JAX's CUDA backend and CuPy")
    weight = jax.device_put(jnp.ones((5, 2), jnp.float32), gpu)
    values, offsets = jax.device_put(jnp.array([1, 7]), gpu), jax.device_put(jnp.array([0, 2]), gpu)
    with raises(jax.errors.JaxRuntimeError, match="BoundsError"):
        jax.jit(hbj.embedding_bag)(weight, values, offsets).block_until_ready()


# -- quantized tables (inference) ----------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("combiner", COMBINERS)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_quantized_table_matches_the_reference_on_its_dequantized_rows(rng, path, bits,
                                                                          combiner, jit):
    weight, values, offsets, psw = make_case(rng, dim=5, weighted=combiner != "sum")
    q = hbk.quantize_rows(weight, bits=bits)

    def f(v, o, p):
        return hbj.embedding_bag(q, v, o, combiner=combiner, per_sample_weights=p)

    out = (jax.jit(f) if jit else f)(jnp.asarray(values), jnp.asarray(offsets),
                                     None if psw is None else jnp.asarray(psw))
    expected = reference(jnp.asarray(q.dequantize()), jnp.asarray(values), offsets, combiner,
                         None if psw is None else jnp.asarray(psw))
    close(out, expected, np.float32)


def test_a_quantized_table_checks_ids(rng):
    q = hbk.quantize_rows(rng.standard_normal((4, 3)).astype(np.float32), bits=8)
    with pytest.raises(Exception, match="out of range"):
        hbj.embedding_bag(q, jnp.array([0, 4]), jnp.array([0, 2])).block_until_ready()
