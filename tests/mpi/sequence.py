"""Sequence tables (TableSpec(combiner=None)) across ranks, every placement (run by
tests/test_sequence_embeddings.py under ``mpiexec -n 2``).

For each plan, a collection with a sequence table beside a pooled one, and its twin
where the sequence table is a "sum" table fed one id per bag: the same seed gives the
same tables; each rank feeds its own batches (some bags empty, one rank's batch of one
feature empty at a step), and every step the sequence rows equal the twin's pooled
rows and the gathered table's rows of those ids, the offsets are the input's, and
after each backward (Adagrad) the full tables of the two collections are equal.
Prints ``OK rank r`` at the end."""
import numpy as np

import hbkernels as hbk
from harness import finish, rng_for

comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
assert W > 1, comm
PLANS = ("data_parallel", "table_wise", "row_wise", "column_wise")


def specs(combiner):
    return [hbk.TableSpec("hist", num_rows=41, dim=5, combiner=combiner, hotness=4),
            hbk.TableSpec("user", num_rows=29, dim=4, combiner="mean")]


def batch(step):
    rng = rng_for("sequence", step, R)
    B = 0 if (step == 1 and R == 1) else int(rng.integers(3, 7))
    lengths = rng.integers(0, 5, size=B)
    values = rng.integers(0, 41, size=int(lengths.sum()))
    if values.size >= 2:
        values[:2] = [0, 40]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    user = rng.integers(0, 29, size=B)
    return values, offsets, user


for plan in PLANS:
    seq = hbk.EmbeddingCollection(specs(None), comm=comm, optimizer=hbk.optim.Adagrad(lr=0.3),
                                  plan=plan, seed=5, batch_size_hint=6)
    twin = hbk.EmbeddingCollection(specs("sum"), comm=comm, optimizer=hbk.optim.Adagrad(lr=0.3),
                                   plan=plan, seed=5, batch_size_hint=6)
    for step in range(3):
        values, offsets, user = batch(step)
        table = seq.full_weights("hist")
        out = seq.forward({"hist": hbk.Ragged(values, offsets), "user": user})
        ref = twin.forward({"hist": hbk.Ragged(values, np.arange(values.size + 1)), "user": user})
        rows = out["hist"]
        assert isinstance(rows, hbk.JaggedRows), type(rows)
        np.testing.assert_array_equal(rows.offsets, offsets)
        np.testing.assert_array_equal(rows.values, ref["hist"])
        np.testing.assert_array_equal(rows.values, table[values])
        np.testing.assert_array_equal(out["user"], ref["user"])
        g = rng_for("grad", step, R).standard_normal((values.size, 5)).astype(np.float32)
        gu = np.ones((user.size, 4), np.float32)
        seq.backward({"hist": hbk.JaggedRows(g, offsets), "user": gu})
        twin.backward({"hist": g, "user": gu})
        for name in ("hist", "user"):
            np.testing.assert_array_equal(seq.full_weights(name), twin.full_weights(name))
    assert not np.array_equal(seq.full_weights("hist"), table), "the steps changed nothing"
    if R == 0:
        print(f"plan {plan}: ok", flush=True)
finish(comm)
