"""Sequence tables (``TableSpec(combiner=None)``): the collection returns the row of every
id (``hbk.JaggedRows``: values and the input's offsets), against torch.nn.Embedding's
forward and autograd with torch's SGD, and against a pooled "sum" twin fed one id per bag
(Adagrad, every placement); beside pooled tables, with empty bags and an empty batch,
int32 ids, save/load, the torch front end, and 2 ranks under mpiexec for every placement
(tests/mpi/sequence.py)."""
import numpy as np
import pytest
from helpers import raises

import hbkernels as hbk
from mpirun import mpirun, needs_mpi

torch = pytest.importorskip("torch")

PLANS = ("data_parallel", "table_wise", "row_wise", "column_wise")
ROWS, DIM = 37, 5


def make(combiner="none", optimizer=None, plan="table_wise", seed=4):
    tables = [hbk.TableSpec("hist", num_rows=ROWS, dim=DIM, combiner=None if combiner == "none" else combiner),
              hbk.TableSpec("user", num_rows=11, dim=3, combiner="sum")]
    return hbk.EmbeddingCollection(tables, comm=hbk.dist.init("local"),
                                   optimizer=optimizer or hbk.optim.SGD(lr=0.5), plan=plan,
                                   seed=seed, device="cpu")


def history(rng, B, id_dtype=np.int64):
    lengths = rng.integers(0, 6, size=B)
    if B:
        lengths[0] = 0                       # an empty bag
    values = rng.integers(0, ROWS, size=int(lengths.sum())).astype(id_dtype)
    if values.size >= 3:
        values[:3] = [0, ROWS - 1, 0]        # both edges, a duplicate
    return values, np.concatenate([[0], np.cumsum(lengths)]).astype(id_dtype)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_rows_and_sgd_match_torch_embedding(rng, plan, id_dtype):
    coll = make(plan=plan)
    emb = torch.nn.Embedding(ROWS, DIM)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(coll.full_weights("hist")))
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    for _ in range(3):
        values, offsets = history(rng, 6, id_dtype)
        user = rng.integers(0, 11, size=6)
        out = coll.forward({"hist": hbk.Ragged(values, offsets), "user": user})
        rows = out["hist"]
        assert isinstance(rows, hbk.JaggedRows) and rows.values.shape == (values.size, DIM)
        np.testing.assert_array_equal(rows.offsets, offsets)
        expected = emb(torch.from_numpy(values.astype(np.int64)))
        np.testing.assert_allclose(rows.values, expected.detach().numpy(), rtol=1e-6, atol=1e-6)
        assert out["user"].shape == (6, 3)
        g = rng.standard_normal((values.size, DIM)).astype(np.float32)
        coll.backward({"hist": g, "user": np.zeros((6, 3), np.float32)})
        opt.zero_grad()
        expected.backward(torch.from_numpy(g))
        opt.step()
        np.testing.assert_allclose(coll.full_weights("hist"), emb.weight.detach().numpy(),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("plan", PLANS)
def test_adagrad_matches_a_pooled_table_of_one_id_bags(rng, plan):
    seq = make(optimizer=hbk.optim.Adagrad(lr=0.2), plan=plan)
    twin = make("sum", optimizer=hbk.optim.Adagrad(lr=0.2), plan=plan)
    for B in (5, 0, 4):                                  # an empty batch in between
        values, offsets = history(rng, B)
        values[: min(values.size, 40)] = values[0] if values.size else 0   # one id many times
        user = rng.integers(0, 11, size=B)
        out = seq.forward({"hist": hbk.Ragged(values, offsets), "user": user})
        ref = twin.forward({"hist": hbk.Ragged(values, np.arange(values.size + 1)), "user": user})
        np.testing.assert_array_equal(out["hist"].values, ref["hist"])
        g = rng.standard_normal((values.size, DIM)).astype(np.float32)
        gu = rng.standard_normal((B, 3)).astype(np.float32)
        seq.backward({"hist": hbk.JaggedRows(g, offsets), "user": gu})
        twin.backward({"hist": g, "user": gu})
    for name in ("hist", "user"):
        np.testing.assert_array_equal(seq.full_weights(name), twin.full_weights(name))
        np.testing.assert_array_equal(seq.full_state(name)["sum"], twin.full_state(name)["sum"])


def test_gradient_shape_is_checked(rng):
    coll = make()
    values, offsets = history(rng, 4)
    coll.forward({"hist": hbk.Ragged(values, offsets), "user": np.arange(4)})
    with raises(ValueError, match=r"grad of 'hist' must be \[N, dim\]"):
        coll.backward({"hist": np.zeros((values.size + 1, DIM), np.float32),  # one row too many
                       "user": np.zeros((4, 3), np.float32)})


def test_save_and_load_keep_the_sequence_table(rng, tmp_path):
    coll = make()
    values, offsets = history(rng, 5)
    coll.save(tmp_path / "ckpt")
    back = hbk.EmbeddingCollection.load(tmp_path / "ckpt", hbk.dist.init("local"))
    assert back.tables["hist"].combiner is None
    out = back.forward({"hist": hbk.Ragged(values, offsets), "user": np.arange(5)})
    np.testing.assert_array_equal(out["hist"].values, coll.full_weights("hist")[values])


def test_torch_module_returns_rows_that_train_like_nn_embedding(rng):
    from hbkernels.adapters.torch import EmbeddingCollectionModule

    module = EmbeddingCollectionModule(make())
    emb = torch.nn.Embedding(ROWS, DIM)
    with torch.no_grad():
        emb.weight.copy_(module.full_weights("hist"))
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    values, offsets = history(rng, 6)
    v, o = torch.from_numpy(values), torch.from_numpy(offsets)
    out = module({"hist": (v, o), "user": torch.arange(6) % 11})
    assert out["hist"].shape == (values.size, DIM) and out["hist"].requires_grad
    weights = torch.from_numpy(rng.standard_normal((values.size, DIM)).astype(np.float32))
    ((out["hist"] * weights).sum() + out["user"].sum() * 0).backward()
    ref = emb(v)
    (ref * weights).sum().backward()
    opt.step()
    torch.testing.assert_close(module.full_weights("hist"), emb.weight.detach(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():                                     # evaluation: the same rows
        torch.testing.assert_close(module({"hist": (v, o), "user": torch.arange(6) % 11})["hist"],
                                   emb(v), rtol=1e-6, atol=1e-6)


@needs_mpi
def test_two_ranks_every_placement():
    rc, out, _ = mpirun(2, "sequence.py", timeout=300)
    assert rc == 0, out
    for plan in PLANS:
        assert f"plan {plan}: ok" in out
    assert "OK rank 0" in out and "OK rank 1" in out
