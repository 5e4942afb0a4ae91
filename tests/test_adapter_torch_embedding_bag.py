"""hbkernels.adapters.torch.EmbeddingBag against torch.nn.EmbeddingBag (the reference):
the same weights and inputs give the same output and the same weight (and
per_sample_weights) gradients, dense and sparse, in every supported mode and input
convention, with empty bags and batches, D=1 and odd D, int32/int64 ids and offsets,
an id repeated thousands of times, ids at the table's edges and padding_idx; errors
for what is not supported and for bad input."""
import numpy as np
import pytest
from conftest import random_offsets
from helpers import raises

torch = pytest.importorskip("torch")

import hbkernels as hbk  # noqa: E402
from hbkernels.adapters import torch as hbt  # noqa: E402

ID_DTYPES = {"int32": torch.int32, "int64": torch.int64}
MODES = ("sum", "mean")


def pair(num_rows, dim, rng, dtype=torch.float32, **kwargs):
    """(ours, torch's) with the same random weights (padding row as given)."""
    w = torch.from_numpy(rng.standard_normal((num_rows, dim))).to(dtype)
    ours = hbt.EmbeddingBag(num_rows, dim, _weight=w.clone(), **kwargs)
    ref = torch.nn.EmbeddingBag(num_rows, dim, _weight=w.clone(), **kwargs)
    return ours, ref


def random_bags(rng, num_rows, batch=20, max_len=6, ids="int64", offs="int64", padding_idx=None):
    """1-D ids and CSR offsets (B + 1 entries) with empty bags, both table edges
    and duplicates; some ids are ``padding_idx`` when given."""
    offsets = random_offsets(rng, batch, max_len)
    n = int(offsets[-1])
    values = rng.integers(0, num_rows, size=n)
    if n >= 4:
        values[:4] = [0, num_rows - 1, num_rows - 1, 0]
    if padding_idx is not None and n:
        values[rng.random(n) < 0.3] = padding_idx
    return (torch.from_numpy(values).to(ID_DTYPES[ids]),
            torch.from_numpy(offsets).to(ID_DTYPES[offs]))


def run(module, *args, grad_out=None, **kwargs):
    """Output, weight gradient (dense) and per_sample_weights gradient of one backward."""
    module.weight.grad = None
    out = module(*args, **kwargs)
    if grad_out is None:
        grad_out = torch.ones_like(out)
    out.backward(grad_out)
    g = module.weight.grad
    psw = kwargs.get("per_sample_weights")
    return (out.detach(), None if g is None else (g.to_dense() if g.is_sparse else g),
            None if psw is None or psw.grad is None else psw.grad.clone())


def assert_same(ours, ref, rtol=1e-5, atol=1e-5):
    for a, b in zip(ours, ref):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


# -- forward and gradients against torch -----------------------------------------------------------
@pytest.mark.parametrize("dim", [1, 7, 16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("ids,offs", [("int64", "int64"), ("int32", "int32"), ("int32", "int64")])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_1d_matches_torch(rng, dim, mode, sparse, ids, offs, include_last_offset):
    ours, ref = pair(40, dim, rng, mode=mode, sparse=sparse, include_last_offset=include_last_offset)
    values, offsets = random_bags(rng, 40, ids=ids, offs=offs)
    if not include_last_offset:
        offsets = offsets[:-1]
    grad_out = torch.from_numpy(rng.standard_normal((20, dim)).astype(np.float32))
    got = run(ours, values, offsets, grad_out=grad_out)
    assert got[0].shape == (20, dim)
    assert ours.weight.grad.is_sparse == sparse
    assert_same(got, run(ref, values, offsets, grad_out=grad_out))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("length", [0, 1, 5])
def test_2d_matches_torch(rng, mode, sparse, length):
    ours, ref = pair(30, 5, rng, mode=mode, sparse=sparse)
    ids = torch.from_numpy(rng.integers(0, 30, size=(12, length)))
    got = run(ours, ids)
    assert got[0].shape == (12, 5)
    if length == 0:  # torch itself fails here ("step must be nonzero"): empty bags are zeros
        assert (got[0] == 0).all() and (got[1] == 0).all()
    else:
        assert_same(got, run(ref, ids))


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("shape", ["1d", "2d"])
def test_per_sample_weights(rng, sparse, shape):
    ours, ref = pair(25, 3, rng, mode="sum", sparse=sparse)
    if shape == "1d":
        values, offsets = random_bags(rng, 25)
        args = (values, offsets[:-1])
        n = values.shape[0]
        psw = torch.from_numpy(rng.uniform(-1.5, 1.5, n).astype(np.float32))
    else:
        args = (torch.from_numpy(rng.integers(0, 25, size=(9, 4))),)
        psw = torch.from_numpy(rng.uniform(-1.5, 1.5, (9, 4)).astype(np.float32))
    got = run(ours, *args, per_sample_weights=leaf(psw))
    assert got[2] is not None
    assert_same(got, run(ref, *args, per_sample_weights=leaf(psw)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("padding_idx", [0, 7, -1])
def test_padding_idx(rng, mode, sparse, padding_idx):
    ours, ref = pair(12, 4, rng, mode=mode, sparse=sparse, padding_idx=padding_idx)
    assert ours.padding_idx == ref.padding_idx
    values, offsets = random_bags(rng, 12, batch=30, padding_idx=ref.padding_idx)
    values[offsets[2]:offsets[3]] = ref.padding_idx  # a bag of padding only
    grad_out = torch.from_numpy(rng.standard_normal((30, 4)).astype(np.float32))
    got = run(ours, values, offsets[:-1], grad_out=grad_out)
    assert_same(got, run(ref, values, offsets[:-1], grad_out=grad_out))
    assert (got[1][ref.padding_idx] == 0).all()
    if offsets[3] > offsets[2]:
        assert (got[0][2] == 0).all()


@pytest.mark.parametrize("sparse", [False, True])
def test_padding_idx_with_per_sample_weights(rng, sparse):
    ours, ref = pair(10, 3, rng, mode="sum", sparse=sparse, padding_idx=2)
    values, offsets = random_bags(rng, 10, padding_idx=2)
    psw = torch.from_numpy(rng.uniform(0.5, 1.5, values.shape[0]).astype(np.float32))
    got = run(ours, values, offsets[:-1], per_sample_weights=leaf(psw))
    assert_same(got, run(ref, values, offsets[:-1], per_sample_weights=leaf(psw)))


def test_default_init_zeroes_the_padding_row():
    torch.manual_seed(0)
    ours = hbt.EmbeddingBag(200, 30, padding_idx=3)
    assert isinstance(ours.weight, torch.nn.Parameter) and ours.weight.requires_grad
    assert (ours.weight[3] == 0).all()
    rest = torch.cat([ours.weight[:3], ours.weight[4:]]).detach()
    assert abs(float(rest.mean())) < 0.05 and abs(float(rest.std()) - 1.0) < 0.05  # N(0, 1)
    torch.manual_seed(1)
    a = hbt.EmbeddingBag(6, 2, device="cpu", dtype=torch.float64)
    torch.manual_seed(1)
    b = torch.nn.EmbeddingBag(6, 2, device="cpu", dtype=torch.float64)
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)  # torch's own init, same draws


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sparse", [False, True])
def test_one_id_repeated_thousands_of_times(rng, mode, sparse):
    """Small-integer weights and output gradients keep the float32 sums exact, so
    thousands of terms in one bag and one row compare tightly with a float64 run."""
    w = torch.from_numpy(rng.integers(-4, 5, size=(8, 5)).astype(np.float32))
    ours = hbt.EmbeddingBag(8, 5, mode=mode, sparse=sparse, _weight=w.clone())
    ref = torch.nn.EmbeddingBag(8, 5, mode=mode, _weight=w.double())
    values = torch.full((5000,), 7, dtype=torch.int64)
    values[::97] = 0
    offsets = torch.tensor([0, 10, 10, 4999])
    grad_out = torch.from_numpy(rng.integers(-3, 4, size=(4, 5)).astype(np.float32))
    out, grad, _ = run(ours, values, offsets, grad_out=grad_out)
    exact_out, exact_grad, _ = run(ref, values, offsets, grad_out=grad_out.double())
    torch.testing.assert_close(out.double(), exact_out, rtol=1e-6, atol=0)
    # sum: every term an integer (exact); mean: ~5000 terms g / len, float32 rounding
    tol = 1e-6 if mode == "sum" else 5e-4
    torch.testing.assert_close(grad.double(), exact_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_empty_batch_and_empty_bags(rng, sparse, include_last_offset):
    ours, ref = pair(6, 3, rng, mode="mean", sparse=sparse, include_last_offset=include_last_offset)
    empty = torch.zeros(0, dtype=torch.int64)
    offsets = torch.zeros(1 if include_last_offset else 0, dtype=torch.int64)
    out = ours(empty, offsets)
    assert out.shape == (0, 3) and out.dtype == torch.float32
    assert out.shape == ref(empty, offsets).shape
    offsets = torch.zeros(5 if include_last_offset else 4, dtype=torch.int64)  # 4 empty bags
    assert_same(run(ours, empty, offsets), run(ref, empty, offsets))
    assert (ours(empty, offsets) == 0).all()
    out = ours(torch.zeros((0, 3), dtype=torch.int64))  # 2-D, no bags
    assert out.shape == (0, 3)


def test_include_last_offset_ignores_trailing_ids(rng):
    ours, ref = pair(9, 2, rng, mode="sum", include_last_offset=True)
    values = torch.tensor([1, 2, 3, 4, 5, 8])
    offsets = torch.tensor([0, 2, 4])
    with torch.no_grad():
        torch.testing.assert_close(ours(values, offsets), ref(values, offsets))
    # torch's own weight gradient of the ignored ids is uninitialised memory (torch 2.13):
    # the gradient is checked against torch given only the ids it pools
    assert_same(run(ours, values, offsets), run(ref, values[:4], offsets))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_table_dtypes(rng, dtype):
    ours, ref = pair(15, 3, rng, dtype=dtype, mode="sum")
    values, offsets = random_bags(rng, 15)
    tol = 1e-2 if dtype == torch.float16 else 1e-10
    out = ours(values, offsets[:-1])
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref(values, offsets[:-1]), rtol=tol, atol=tol)


def test_trains_with_torch_optimizers(rng):
    ours, ref = pair(20, 4, rng, mode="mean", sparse=True)
    opts = [torch.optim.SparseAdam(m.parameters(), lr=0.05) for m in (ours, ref)]
    for _ in range(3):
        values, offsets = random_bags(rng, 20)
        for m, opt in zip((ours, ref), opts):
            opt.zero_grad()
            m(values, offsets[:-1]).square().sum().backward()
            opt.step()
    torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-5, atol=1e-5)


def test_from_pretrained(rng):
    w = torch.from_numpy(rng.standard_normal((7, 3)).astype(np.float32))
    for freeze in (True, False):
        ours = hbt.EmbeddingBag.from_pretrained(w, freeze=freeze, mode="sum", padding_idx=1)
        ref = torch.nn.EmbeddingBag.from_pretrained(w, freeze=freeze, mode="sum", padding_idx=1)
        assert ours.weight.requires_grad == ref.weight.requires_grad == (not freeze)
        assert ours.weight.data_ptr() == w.data_ptr()  # shares the memory, as torch
        ids = torch.tensor([[1, 2, 6], [0, 1, 1]])
        torch.testing.assert_close(ours(ids), ref(ids))
    with raises(ValueError, match="2-D"):
        hbt.EmbeddingBag.from_pretrained(torch.ones(3))


def test_repr_and_attributes():
    ours = hbt.EmbeddingBag(5, 2, padding_idx=1)
    assert repr(ours) == repr(torch.nn.EmbeddingBag(5, 2, padding_idx=1))
    assert (ours.num_embeddings, ours.embedding_dim, ours.mode) == (5, 2, "mean")
    assert (ours.include_last_offset, ours.sparse, ours.max_norm) == (False, False, None)


# -- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [5, -1, 1000])
def test_out_of_range_ids(rng, bad):
    ours, ref = pair(5, 2, rng, mode="sum", padding_idx=0)
    values, offsets = torch.tensor([1, 2, bad, 4]), torch.tensor([0, 2])
    with raises((IndexError, RuntimeError)):
        ref(values, offsets)
    with raises(hbk.BoundsError, match=str(bad)) as info:
        ours(values, offsets)
    assert isinstance(info.value, IndexError)


def test_unsupported_options():
    with raises(NotImplementedError, match="'sum', 'mean'"):
        hbt.EmbeddingBag(5, 2, mode="max")
    with raises(ValueError, match="mode"):
        hbt.EmbeddingBag(5, 2, mode="median")
    with raises(NotImplementedError, match="max_norm"):
        hbt.EmbeddingBag(5, 2, max_norm=1.0)
    with raises(NotImplementedError, match="scale_grad_by_freq"):
        hbt.EmbeddingBag(5, 2, scale_grad_by_freq=True)


def test_bad_arguments():
    with raises(ValueError, match="padding_idx"):
        hbt.EmbeddingBag(5, 2, padding_idx=5)
    with raises(ValueError, match="padding_idx"):
        hbt.EmbeddingBag(5, 2, padding_idx=-6)
    with raises(ValueError, match="_weight"):
        hbt.EmbeddingBag(5, 2, _weight=torch.zeros(4, 2))
    bag, ref = hbt.EmbeddingBag(5, 2, mode="mean"), torch.nn.EmbeddingBag(5, 2, mode="mean")
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    for m in (bag, ref):  # torch's error types
        with raises(NotImplementedError, match="per_sample_weights"):
            m(ids, offsets, per_sample_weights=torch.ones(3))
        with raises(ValueError, match="offsets"):
            m(ids.view(1, 3), offsets)
        with raises(ValueError, match="offsets"):
            m(ids)
        with raises(ValueError, match="1-?D"):
            m(ids.view(1, 1, 3))
    summed = hbt.EmbeddingBag(5, 2, mode="sum")
    with raises(ValueError, match="shape"):
        summed(ids, offsets, per_sample_weights=torch.ones(2))
    with raises(ValueError, match="int32 or int64"):
        summed(ids.float(), offsets)
    with raises(ValueError):
        summed(ids, torch.tensor([1, 2]))  # offsets[0] must be 0
    with raises(ValueError):
        summed(ids, torch.tensor([0, 5]))  # past the end
    with raises(TypeError):
        summed([1, 2], offsets)


# -- quantized (inference) -----------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_bag_is_torchs_bag_on_the_dequantized_rows(rng, bits, mode):
    ours, _ = pair(30, 5, rng, mode=mode, padding_idx=2)
    served = ours.quantized(bits)
    assert served.weight is None and served.rows.dtype == torch.uint8
    assert served.rows.shape == (30, -(-5 * bits // 8) + 4)
    rows = hbk.quantize_rows(ours.weight.detach().numpy(), bits=bits).dequantize()
    ref = torch.nn.EmbeddingBag(30, 5, mode=mode, padding_idx=2,
                                _weight=torch.from_numpy(rows))
    values, offsets = random_bags(rng, 30, padding_idx=2)
    with torch.no_grad():
        out = served(values, offsets[:-1])
        expected = ref(values, offsets[:-1])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    again = hbt.EmbeddingBag.from_quantized(hbk.quantize_rows(rows, bits=bits), mode=mode,
                                            padding_idx=2)
    again.load_state_dict(served.state_dict())  # the rows buffer round-trips
    with torch.no_grad():
        assert torch.equal(again(values, offsets[:-1]), out)


def test_the_functional_op_takes_a_quantized_table(rng):
    w = rng.standard_normal((9, 4)).astype(np.float32)
    q = hbk.quantize_rows(w, bits=4)
    values, offsets = torch.tensor([0, 8, 8, 3]), torch.tensor([0, 1, 1, 4])
    out = hbt.embedding_bag(q, values, offsets, combiner="sqrtn")
    expected = hbk.embedding_bag(q.dequantize(), values.numpy(), offsets.numpy(),
                                 combiner="sqrtn")
    torch.testing.assert_close(out, torch.from_numpy(expected), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="QuantizedTable"):
        hbt.EmbeddingBag.from_quantized(w)
