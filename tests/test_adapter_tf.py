"""hbkernels.adapters.tf against TensorFlow's own ``tf.nn.embedding_lookup_sparse``:
forward, table gradients (``tf.IndexedSlices``) and per-sample-weight gradients,
eagerly and inside ``tf.function``; the Keras 3 ``EmbeddingBag`` layer trains."""
import doctest
import os

import numpy as np
import pytest
from helpers import raises

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import hbkernels as hbk  # noqa: E402
import hbkernels.adapters.tf as hbtf  # noqa: E402

COMBINERS = ["sum", "mean", "sqrtn"]
NUM_ROWS = 13
RTOL = ATOL = 1e-5


# -- data and the TF reference --------------------------------------------------------------------
def make_bags(rng, num_bags=9, max_len=5, id_dtype=np.int64, off_dtype=np.int64):
    """CSR bags with empty bags first, in the middle and last (where
    ``embedding_lookup_sparse`` drops rows), duplicate ids and both table edges."""
    lengths = rng.integers(1, max_len + 1, size=num_bags)
    lengths[[0, num_bags // 2, num_bags - 1]] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(off_dtype)
    n = int(offsets[-1])
    values = rng.integers(0, NUM_ROWS, size=n)
    values[:2] = [0, NUM_ROWS - 1]  # the table's edges
    values[-1] = values[-2]  # a duplicate inside a bag ...
    values[2] = values[-2]  # ... and across bags
    weights = rng.uniform(0.25, 2.0, size=n).astype(np.float32)
    return values.astype(id_dtype), offsets, weights


def sparse_ids(values, offsets, psw=None):
    """The ``tf.SparseTensor`` ``embedding_lookup_sparse`` takes for CSR bags."""
    offsets = np.asarray(offsets, np.int64)
    lengths = np.diff(offsets)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    cols = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)
    indices = np.stack([rows, cols], axis=1).astype(np.int64).reshape(-1, 2)
    shape = [len(lengths), max(int(lengths.max(initial=0)), 1)]
    sp_ids = tf.SparseTensor(indices, tf.constant(values), shape)
    sp_weights = None if psw is None else tf.SparseTensor(indices, psw, shape)
    return sp_ids, sp_weights


def reference(params, values, offsets, psw, combiner):
    """TF's pooled lookup, its trailing empty rows put back as zeros."""
    sp_ids, sp_weights = sparse_ids(values, offsets, psw)
    out = tf.nn.embedding_lookup_sparse(params, sp_ids, sp_weights, combiner=combiner)
    missing = len(offsets) - 1 - tf.shape(out)[0]
    padded = tf.concat([out, tf.zeros([missing, params.shape[1]], out.dtype)], axis=0)
    return tf.ensure_shape(padded, [len(offsets) - 1, params.shape[1]])


def run_both(fn_ours, fn_ref, mode):
    if mode == "graph":
        fn_ours, fn_ref = tf.function(fn_ours), tf.function(fn_ref)
    return fn_ours(), fn_ref()


def dense(grad):
    return tf.convert_to_tensor(grad).numpy()


# -- forward and gradients against embedding_lookup_sparse ----------------------------------------
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("dim", [1, 5])
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_matches_embedding_lookup_sparse(rng, combiner, weighted, id_dtype, dim, mode):
    values, offsets, weights = make_bags(rng, id_dtype=id_dtype, off_dtype=id_dtype)
    table = tf.Variable(rng.standard_normal((NUM_ROWS, dim)).astype(np.float32))
    psw = tf.constant(weights) if weighted else None
    probe = tf.constant(rng.standard_normal((len(offsets) - 1, dim)).astype(np.float32))
    v_t, o_t = tf.constant(values), tf.constant(offsets)

    def loss_and_grads(lookup):
        with tf.GradientTape() as tape:
            if weighted:
                tape.watch(psw)
            out = lookup()
            loss = tf.reduce_sum(out * probe)
        grads = tape.gradient(loss, [table, psw] if weighted else [table])
        return out, grads

    def ours():
        return loss_and_grads(lambda: hbtf.embedding_bag(
            table, v_t, o_t, combiner=combiner, per_sample_weights=psw))

    def ref():
        return loss_and_grads(lambda: reference(table, values, offsets, psw, combiner))

    (out, grads), (ref_out, ref_grads) = run_both(ours, ref, mode)
    assert out.shape == (len(offsets) - 1, dim) and out.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), ref_out.numpy(), rtol=RTOL, atol=ATOL)
    assert not np.all(out.numpy() == 0)

    g = grads[0]
    assert isinstance(g, tf.IndexedSlices), type(g)
    ids = g.indices.numpy()
    assert g.indices.dtype == tf.as_dtype(id_dtype)
    assert sorted(ids.tolist()) == sorted(set(values.tolist())), "one row per distinct id"
    assert tuple(tf.convert_to_tensor(g.dense_shape).numpy()) == (NUM_ROWS, dim)
    np.testing.assert_allclose(dense(g), dense(ref_grads[0]), rtol=RTOL, atol=ATOL)

    if weighted:
        assert grads[1] is not None and grads[1].shape == weights.shape
        np.testing.assert_allclose(grads[1].numpy(), ref_grads[1].numpy(), rtol=1e-4, atol=1e-5)


def test_graph_mode_sets_static_shapes(rng):
    values, offsets, weights = make_bags(rng)
    table = tf.Variable(rng.standard_normal((NUM_ROWS, 5)).astype(np.float32))

    @tf.function
    def f(v, o):
        return hbtf.embedding_bag(table, v, o, combiner="mean")

    ids_spec = tf.TensorSpec([None], tf.int64)
    concrete = f.get_concrete_function(ids_spec, tf.TensorSpec([10], tf.int64))
    assert concrete.structured_outputs.shape.as_list() == [9, 5]
    dynamic = f.get_concrete_function(ids_spec, tf.TensorSpec([None], tf.int64))
    assert dynamic.structured_outputs.shape.as_list() == [None, 5]
    out = dynamic(tf.constant(values), tf.constant(offsets))
    np.testing.assert_allclose(out.numpy(), hbk.embedding_bag(table.numpy(), values, offsets,
                                                             combiner="mean"), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_gradient_of_a_plain_tensor_and_two_lookups(rng, mode):
    """A tensor (not a variable) table; one table in two lookups sums both gradients."""
    values, offsets, _ = make_bags(rng)
    w = tf.constant(rng.standard_normal((NUM_ROWS, 5)).astype(np.float32))

    def grads(lookup):
        def f():
            with tf.GradientTape() as tape:
                tape.watch(w)
                loss = tf.reduce_sum(lookup(combiner="sum")) + 3 * tf.reduce_sum(
                    lookup(combiner="mean"))
            return tape.gradient(loss, w)
        return f

    ours = grads(lambda combiner: hbtf.embedding_bag(w, values, offsets, combiner=combiner))
    ref = grads(lambda combiner: reference(w, values, offsets, None, combiner))
    g, g_ref = run_both(ours, ref, mode)
    assert isinstance(g, tf.IndexedSlices)
    np.testing.assert_allclose(dense(g), dense(g_ref), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_constant_per_sample_weights(rng, mode):
    """Weights nobody watches: the table's gradient as with watched ones, none for them."""
    values, offsets, weights = make_bags(rng)
    table = tf.Variable(rng.standard_normal((NUM_ROWS, 5)).astype(np.float32))
    psw = tf.constant(weights)

    def grads(lookup):
        def f():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(lookup() ** 2)
            return tape.gradient(loss, [table, psw])
        return f

    ours = grads(lambda: hbtf.embedding_bag(table, values, offsets, combiner="sqrtn",
                                            per_sample_weights=psw))
    ref = grads(lambda: reference(table, values, offsets, psw, "sqrtn"))
    (g, g_psw), (g_ref, _) = run_both(ours, ref, mode)
    assert isinstance(g, tf.IndexedSlices) and g_psw is None
    np.testing.assert_allclose(dense(g), dense(g_ref), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_empty_batch_and_all_empty_bags(mode):
    table = tf.Variable(np.ones((4, 5), np.float32))
    for offsets in (np.array([0], np.int64), np.array([0, 0, 0], np.int64)):
        values = np.zeros(0, np.int64)

        def f():
            with tf.GradientTape() as tape:
                out = hbtf.embedding_bag(table, values, offsets, combiner="sqrtn")
                loss = tf.reduce_sum(out)
            return out, tape.gradient(loss, table)

        out, g = tf.function(f)() if mode == "graph" else f()
        assert out.shape == (len(offsets) - 1, 5)
        assert np.all(out.numpy() == 0)
        assert isinstance(g, tf.IndexedSlices) and g.indices.shape[0] == 0
        assert np.all(dense(g) == 0)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_table_dtypes(rng, dtype):
    values, offsets, weights = make_bags(rng)
    w32 = rng.standard_normal((NUM_ROWS, 5)).astype(np.float32)
    table = tf.Variable(w32.astype(dtype))
    with tf.GradientTape() as tape:
        out = hbtf.embedding_bag(table, values, offsets, combiner="mean")
        loss = tf.reduce_sum(out)
    g = tape.gradient(loss, table)
    assert out.dtype == tf.as_dtype(dtype) and g.values.dtype == tf.as_dtype(dtype)
    rounded = tf.constant(w32.astype(dtype).astype(np.float32))
    ref = reference(rounded, values, offsets, None, "mean")
    tol = 1e-2 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(out.numpy().astype(np.float64), ref.numpy(), rtol=tol, atol=tol)


def test_ragged_input_and_numpy_arguments(rng):
    values, offsets, _ = make_bags(rng)
    table = tf.Variable(rng.standard_normal((NUM_ROWS, 5)).astype(np.float32))
    ragged = tf.RaggedTensor.from_row_splits(values, offsets)
    expected = hbk.embedding_bag(table.numpy(), values, offsets, combiner="sqrtn")
    np.testing.assert_allclose(hbtf.embedding_bag(table, ragged, combiner="sqrtn").numpy(),
                               expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        tf.function(lambda r: hbtf.embedding_bag(table, r, combiner="sqrtn"))(ragged).numpy(),
        expected, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(hbtf.embedding_bag(table.numpy(), values, offsets,
                                                  combiner="sqrtn").numpy(),
                               expected, rtol=RTOL, atol=ATOL)
    with raises(ValueError, match="either"):
        hbtf.embedding_bag(table, ragged, offsets)


def test_bounds_zero_drops_bad_ids(rng):
    table = tf.Variable(rng.standard_normal((NUM_ROWS, 5)).astype(np.float32))
    values = np.array([1, NUM_ROWS, 4, -1, 4], np.int64)
    offsets = np.array([0, 2, 5], np.int64)
    psw = tf.constant([0.5, 2.0, 1.5, 3.0, 1.0])
    with tf.GradientTape() as tape:
        tape.watch(psw)
        out = hbtf.embedding_bag(table, values, offsets, combiner="mean",
                                 per_sample_weights=psw, bounds="zero")
        loss = tf.reduce_sum(out)
    g_w, g_p = tape.gradient(loss, [table, psw])
    good = np.array([0, 2, 4])
    with tf.GradientTape() as tape:
        tape.watch(psw)
        kept = tf.gather(psw, good)
        ref = reference(table, values[good], np.array([0, 1, 3]), kept, "mean")
        ref_loss = tf.reduce_sum(ref)
    r_w, r_p = tape.gradient(ref_loss, [table, psw])
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=RTOL, atol=ATOL)
    assert sorted(g_w.indices.numpy().tolist()) == [1, 4]
    np.testing.assert_allclose(dense(g_w), dense(r_w), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(g_p.numpy(), dense(r_p), rtol=RTOL, atol=ATOL)
    assert g_p.numpy()[1] == 0 and g_p.numpy()[3] == 0


def test_errors_eager_and_graph():
    table = tf.Variable(np.ones((4, 5), np.float32))
    bad = np.array([0, 4]), np.array([0, 2])
    with raises(hbk.BoundsError, match="4"):
        hbtf.embedding_bag(table, *bad)
    message = r"BoundsError: values\[1\] = 4 is out of range"
    with raises(tf.errors.InvalidArgumentError, match=message):
        tf.function(lambda: hbtf.embedding_bag(table, *bad))()
    with raises(ValueError, match="combiner"):
        hbtf.embedding_bag(table, np.array([0]), np.array([0, 1]), combiner="max")
    with raises(ValueError, match="int32 or int64"):
        hbtf.embedding_bag(table, np.array([0.0]), np.array([0, 1]))
    with raises(ValueError, match="float16, bfloat16, float32 or float64"):
        hbtf.embedding_bag(tf.ones((4, 2), tf.int32), np.array([0]), np.array([0, 1]))
    with raises(ValueError, match="offsets"):
        hbtf.embedding_bag(table, np.array([0, 1]), np.array([1, 2]))


def test_cpu_views_share_memory():
    """Eager CPU tensors reach the kernels as read-only NumPy views, no copy."""
    t = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
    a, b = hbtf.kernel_array(t), hbtf.kernel_array(t)
    assert a.ctypes.data == b.ctypes.data and not a.flags.writeable
    buf = np.zeros(64 + 16, np.float32)
    start = (-buf.ctypes.data % hbtf._TF_ALIGN) // 4
    out = buf[start:start + 64].reshape(16, 4)  # aligned: TF gets a view
    back = hbtf.from_kernel_array(out)
    out[0, 0] = 7.0
    assert back.numpy()[0, 0] == 7.0
    odd = np.arange(17, dtype=np.float32)[1:]  # misaligned: TF would abort on a view of it
    assert odd.ctypes.data % hbtf._TF_ALIGN != 0
    copied = hbtf.from_kernel_array(odd)
    assert tf.reduce_sum(copied).numpy() == odd.sum()
    np.testing.assert_array_equal(copied.numpy(), odd)


def test_module_docstring_examples():
    result = doctest.testmod(hbtf, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# -- the Keras layer ------------------------------------------------------------------------------
def test_layer_builds_and_matches_the_kernel(rng):
    values, offsets, weights = make_bags(rng)
    layer = hbtf.EmbeddingBag(NUM_ROWS, 5, combiner="sqrtn")
    out = layer(values, offsets, weights)
    assert layer.built and layer.embeddings.shape == (NUM_ROWS, 5)
    assert len(layer.trainable_weights) == 1 and layer.supports_jit is False
    expected = hbk.embedding_bag(np.asarray(layer.embeddings.numpy()), values, offsets,
                                 combiner="sqrtn", per_sample_weights=weights)
    np.testing.assert_allclose(out.numpy(), expected, rtol=RTOL, atol=ATOL)
    v_in = keras.Input(shape=(), dtype="int64")  # functional use: CSR inputs, [B, dim] out
    o_in = keras.Input(shape=(), dtype="int64")
    model = keras.Model([v_in, o_in], layer(v_in, o_in, None))
    assert model.output.shape == (None, 5)
    np.testing.assert_allclose(model([values, offsets]).numpy(),
                               hbk.embedding_bag(layer.embeddings.numpy(), values, offsets,
                                                 combiner="sqrtn"), rtol=RTOL, atol=ATOL)
    clone = hbtf.EmbeddingBag.from_config(layer.get_config())
    assert (clone.num_rows, clone.dim, clone.combiner) == (NUM_ROWS, 5, "sqrtn")


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_layer_sgd_step_moves_only_touched_rows(rng, mode):
    values, offsets, _ = make_bags(rng)
    spare = rng.integers(NUM_ROWS)  # one row no bag reads, so some row must stay put
    values[values == spare] = (spare + 1) % NUM_ROWS
    layer = hbtf.EmbeddingBag(NUM_ROWS, 5, combiner="mean")
    layer.build()
    before = layer.embeddings.numpy().copy()
    opt = keras.optimizers.SGD(learning_rate=0.5)
    target = tf.constant(rng.standard_normal((len(offsets) - 1, 5)).astype(np.float32))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((layer(values, offsets) - target) ** 2)
        grads = tape.gradient(loss, layer.trainable_variables)
        opt.apply(grads, layer.trainable_variables)
        return grads[0]

    grad = tf.function(step)() if mode == "graph" else step()
    assert isinstance(grad, tf.IndexedSlices)
    after = layer.embeddings.numpy()
    out_before = hbk.embedding_bag(before, values, offsets, combiner="mean")
    g_ref = hbk.embedding_bag_backward(2 * (out_before - target.numpy()), values, offsets,
                                       num_rows=NUM_ROWS, combiner="mean")
    expected = before.copy()
    expected[g_ref.ids] -= 0.5 * g_ref.rows
    np.testing.assert_allclose(after, expected, rtol=RTOL, atol=ATOL)
    untouched = np.setdiff1d(np.arange(NUM_ROWS), values)
    assert spare in untouched
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert not np.allclose(after[values], before[values])


def test_layer_trains_with_model_fit(rng):
    values, offsets, _ = make_bags(rng, num_bags=16)
    teacher = rng.standard_normal((NUM_ROWS, 5)).astype(np.float32)  # y is learnable exactly
    y = hbk.embedding_bag(teacher, values, offsets, combiner="mean") @ rng.standard_normal((5, 1))
    y = y.astype(np.float32)

    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.bag = hbtf.EmbeddingBag(NUM_ROWS, 5, combiner="mean")
            self.head = keras.layers.Dense(1)

        def call(self, inputs):
            return self.head(self.bag(*inputs))

    model = Model()
    model.compile(optimizer=keras.optimizers.Adagrad(learning_rate=0.3), loss="mse")
    data = tf.data.Dataset.from_tensors(((values, offsets), y)).repeat()
    model(  # build eagerly so the table's first values can be kept
        (tf.constant(values), tf.constant(offsets)))
    before = model.bag.embeddings.numpy().copy()
    hist = model.fit(data, epochs=4, steps_per_epoch=10, verbose=0, shuffle=False)
    assert model.jit_compile is False
    losses = hist.history["loss"]
    # the loss falls (near its floor it may rise a little from one epoch to the next)
    assert losses[-1] < 0.2 * losses[0] and max(losses[1:]) < 0.5 * losses[0], losses
    after = model.bag.embeddings.numpy()
    untouched = np.setdiff1d(np.arange(NUM_ROWS), values)
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert not np.allclose(after[np.unique(values)], before[np.unique(values)])


# -- GPU: eager DLPack path -----------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_eager_matches_cpu(rng):
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("TensorFlow sees no GPU")
    values, offsets, weights = make_bags(rng)
    w = rng.standard_normal((NUM_ROWS, 5)).astype(np.float32)
    results = {}
    for device in ("/CPU:0", "/GPU:0"):
        with tf.device(device):
            table = tf.Variable(w)
            with tf.GradientTape() as tape:
                out = hbtf.embedding_bag(table, values, offsets, combiner="mean",
                                         per_sample_weights=weights)
                loss = tf.reduce_sum(out * out)
            g = tape.gradient(loss, table)
        results[device] = out.numpy(), dense(g), out.device
    assert "GPU" in results["/GPU:0"][2]
    np.testing.assert_allclose(results["/GPU:0"][0], results["/CPU:0"][0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(results["/GPU:0"][1], results["/CPU:0"][1], rtol=RTOL, atol=ATOL)


# -- quantized tables (inference) ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_a_quantized_table_matches_embedding_lookup_sparse_on_its_rows(rng, mode, bits, combiner):
    values, offsets, weights = make_bags(rng)
    q = hbk.quantize_rows(rng.standard_normal((NUM_ROWS, 5)).astype(np.float32), bits=bits)
    psw = tf.constant(weights)
    ours, ref = run_both(
        lambda: hbtf.embedding_bag(q, tf.constant(values), tf.constant(offsets),
                                   combiner=combiner, per_sample_weights=psw),
        lambda: reference(tf.constant(q.dequantize()), values, offsets, psw, combiner), mode)
    assert ours.dtype == tf.float32 and ours.shape == (len(offsets) - 1, 5)
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=RTOL, atol=ATOL)


def test_a_quantized_table_checks_ids(rng):
    q = hbk.quantize_rows(rng.standard_normal((4, 3)).astype(np.float32), bits=8)
    with raises(hbk.BoundsError):
        hbtf.embedding_bag(q, tf.constant([0, 4]), tf.constant([0, 2]))
