"""``hbkernels train --eval-bits`` and ``hbkernels quantize``: train -> quantize -> serve.

The quantized checkpoint holds exactly ``quantize_rows`` of the trained tables
(loaded independently), the subset option copies the other tables, and each
``--eval-bits`` evaluation is reported (int2's changes the predictions).
"""
import json

import numpy as np
import pytest

import hbkernels as hbk

pytest.importorskip("torch")

from hbkernels.cli import main  # noqa: E402
from helpers import TRAIN_SMALL  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(metrics, the trained collection's checkpoint directory): 8 steps, --eval-bits 8,4,2."""
    tmp = tmp_path_factory.mktemp("train")
    metrics = tmp / "m.json"
    assert main(["train", *TRAIN_SMALL, "--steps", "8", "--checkpoint", str(tmp / "ck"),
                 "--eval-bits", "8,4,2", "--metrics", str(metrics)]) == 0
    return json.loads(metrics.read_text()), tmp / "ck" / "step-00000008" / "embeddings"


def test_eval_bits_reports_each_width(trained):
    metrics, _ = trained
    final = metrics["final"]
    assert [q["bits"] for q in final["quantized"]] == [8, 4, 2]
    for q in final["quantized"]:
        assert q["samples"] == final["eval_samples"] and 0 <= q["auc"] <= 1 and q["logloss"] > 0
    # int8 keeps the model's ranking almost exactly (the main job's figures: docs/quantized.md);
    # int2 changes the predictions (the tables were quantized)
    assert abs(final["quantized"][0]["auc"] - final["eval_auc"]) < 0.01
    assert final["quantized"][2]["logloss"] != final["eval_logloss"]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_writes_quantize_rows_of_every_table(tmp_path, trained, bits, capsys):
    _, ckpt = trained
    assert main(["quantize", str(ckpt), "--bits", str(bits), "--out", str(tmp_path / "q")]) == 0
    assert "quantized checkpoint ->" in capsys.readouterr().out
    floats = hbk.EmbeddingCollection.load(ckpt, comm=hbk.dist.init("local"))
    served = hbk.EmbeddingCollection.load(tmp_path / "q", comm=hbk.dist.init("local"))
    assert served.quantize == {name: bits for name in floats.tables}
    for name in floats.tables:
        expected = hbk.quantize_rows(floats.full_weights(name), bits=bits).dequantize()
        assert np.array_equal(served.full_weights(name), expected), name


@pytest.mark.parametrize("command", ["quantize", "compact"])
def test_a_train_checkpoint_directory_is_read_at_its_newest_step(tmp_path, trained, command,
                                                                  capsys):
    _, ckpt = trained
    train_dir, step_dir = ckpt.parent.parent, ckpt.parent
    extra = ["--bits", "8"] if command == "quantize" else []
    for given, out in ((train_dir, "from-train-dir"), (step_dir, "from-step-dir")):
        assert main([command, str(given), *extra, "--out", str(tmp_path / out)]) == 0
    said = capsys.readouterr().out
    assert f"{train_dir}: its newest step, step-00000008 ({ckpt})" in said
    assert said.count("its newest step") == 1  # a step directory is read as given
    a = hbk.EmbeddingCollection.load(tmp_path / "from-train-dir", comm=hbk.dist.init("local"))
    b = hbk.EmbeddingCollection.load(tmp_path / "from-step-dir", comm=hbk.dist.init("local"))
    for name in a.tables:
        assert np.array_equal(a.full_weights(name), b.full_weights(name))
    # a directory holding none of these: one line naming what it takes
    (tmp_path / "empty").mkdir()
    assert main([command, str(tmp_path / "empty"), *extra, "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no checkpoint" in err[0] and "train --checkpoint" in err[0]


def test_quantize_a_subset(tmp_path, trained):
    _, ckpt = trained
    assert main(["quantize", str(ckpt), "--bits", "2", "--tables", "b", "--out",
                 str(tmp_path / "q")]) == 0
    floats = hbk.EmbeddingCollection.load(ckpt, comm=hbk.dist.init("local"))
    served = hbk.EmbeddingCollection.load(tmp_path / "q", comm=hbk.dist.init("local"))
    assert served.quantize == {"b": 2}
    for name in ("a", "c"):
        assert np.array_equal(served.full_weights(name), floats.full_weights(name))


def test_quantize_errors_are_one_line(tmp_path, trained, capsys):
    _, ckpt = trained
    assert main(["quantize", str(ckpt), "--bits", "8", "--tables", "nobody",
                 "--out", str(tmp_path / "q")]) == 1
    assert main(["quantize", str(ckpt), "--bits", "8", "--out", str(ckpt)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no tables ['nobody']" in err[0] and "must not be" in err[1], err
