"""A checkpoint written by hbkernels 0.1.0 (tests/data/checkpoint-v1/, made by
tests/data/make_checkpoint_v1.py on 2 ranks: row-wise, column-wise, replicated, fp16 and
sequence tables, Adagrad state after three steps) still loads, whole and re-sharded, to
exactly the tables and state recorded beside it (checkpoint-v1-expected.npz); a chain of
incremental saves of format 4 (tests/data/chain-v4/, made by make_chain_v4.py) loads to
the full save of the same state written beside it."""
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import hbkernels as hbk
from hbkernels.sharding import checkpoint

DATA = Path(__file__).resolve().parent / "data"
FIXTURE = DATA / "checkpoint-v1"
CHAIN = DATA / "chain-v4"


@pytest.fixture(scope="module")
def expected():
    with np.load(DATA / "checkpoint-v1-expected.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("plan", [None, "table_wise", "row_wise"])
def test_the_fixture_loads_to_the_recorded_tables_and_state(expected, plan):
    overrides = {} if plan is None else {"plan": plan}
    coll = hbk.EmbeddingCollection.load(FIXTURE, hbk.dist.init("local"), **overrides)
    assert sorted(coll.tables) == ["geo", "history", "item", "user"]
    assert coll.tables["history"].combiner is None and coll.tables["geo"].dtype == "float16"
    assert isinstance(coll.optimizer, hbk.optim.Adagrad)
    for name in coll.tables:
        np.testing.assert_array_equal(coll.full_weights(name), expected[f"{name}.weights"])
        for slot, value in coll.full_state(name).items():
            np.testing.assert_array_equal(np.asarray(value), expected[f"{name}.{slot}"])
    out = coll.forward({"user": np.array([0, 22]), "history": hbk.Ragged(np.array([3, 18]), np.array([0, 2, 2]))})
    np.testing.assert_array_equal(out["user"], expected["user.weights"][[0, 22]])
    np.testing.assert_array_equal(out["history"].values, expected["history.weights"][[3, 18]])


def test_a_chain_of_format_4_loads_to_its_full_save(tmp_path):
    """Its saves between the newest and the full one are read through their files alone
    (their manifests moved away)."""
    from helpers import same_collections

    chain = shutil.copytree(CHAIN, tmp_path / "chain")
    assert checkpoint.read_manifest(chain / "3")["version"] == 4
    for k in (1, 2):
        os.rename(chain / str(k) / "manifest.json", chain / str(k) / "unread.json")
    assert len(checkpoint.Checkpoint(chain / "3").chain()) == 4
    whole = hbk.EmbeddingCollection.load(chain / "full", hbk.dist.init("local"))
    same_collections(whole, hbk.EmbeddingCollection.load(chain / "3", hbk.dist.init("local")))
