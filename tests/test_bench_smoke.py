"""The benchmarks run: every bench script's main with --smoke on the CPU (tiny
sizes, two repetitions, CSV in tmp_path), with and without the torch peer.
Each script verifies hbkernels against a peer before timing, so these runs
also check the kernels at tiny sizes."""
import csv
import importlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the bench package lives at the repository root
    sys.path.insert(0, str(ROOT))

from hbkernels.bench import anchors, bounds, common  # noqa: E402

SCRIPTS = ["embedding_bag", "embedding_bag_backward", "unique", "lookup", "segment_sum",
           "segment_reduce", "partition", "per_sample_weights_backward"]
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_TBE = anchors.fbgemm_tbe() is not None
HAVE_TORCHREC = HAVE_TBE and importlib.util.find_spec("torchrec") is not None


def read_rows(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == common.COLUMNS
        return list(reader)


def check_rows(rows, op):
    assert rows[0]["op"] == "copy"
    mine = [r for r in rows if r["op"] == op]
    assert any(r["provider"] == "hbkernels" for r in mine)
    for r in rows:
        assert float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"])
        assert float(r["median_ms"]) > 0 and float(r["gbps"]) > 0
        assert r["device"]
    return mine


def smoke(name, out):
    module = importlib.import_module(f"hbkernels.bench.bench_{name}")
    module.main(["--device", "cpu", "--smoke", "--out", str(out)])
    return read_rows(out)


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_script_smoke(name, tmp_path):
    rows = check_rows(smoke(name, tmp_path / "bench.csv"), name)
    providers = {r["provider"] for r in rows}
    assert {"hbkernels", "numpy"} <= providers
    if HAVE_TORCH:
        assert "torch" in providers


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_script_runs_without_torch(name, tmp_path, monkeypatch):
    monkeypatch.setenv(common.DISABLE_ENV, "torch,jax")
    rows = check_rows(smoke(name, tmp_path / "bench.csv"), name)
    assert not {"torch", "jax"} & {r["provider"] for r in rows}


def test_hash_table_bench_smoke(tmp_path):
    """Both modes at both loads, against the dict and, when installed, TorchRec's MCH."""
    rows = check_rows(smoke("hash_table", tmp_path / "bench.csv"), "hash_table")
    assert {(r["mode"], r["size"].split()[1]) for r in rows} == {
        (m, f"load={x}") for m in ("insert", "find") for x in (0.5, 0.9)}
    assert {r["provider"] for r in rows} == {"hbkernels", "dict"} | (
        {"torchrec-mch"} if HAVE_TORCHREC else set())


def test_hbkernels_alone_is_still_verified(tmp_path, capsys):
    module = importlib.import_module("hbkernels.bench.bench_lookup")
    out = tmp_path / "bench.csv"
    module.main(["--device", "cpu", "--smoke", "--out", str(out), "--providers", "hbkernels"])
    assert {r["provider"] for r in read_rows(out) if r["op"] == "lookup"} == {"hbkernels"}
    assert "verified hbkernels against numpy" in capsys.readouterr().out


def test_run_all_smoke(tmp_path):
    run_all = importlib.import_module("hbkernels.bench.run_all")
    out = tmp_path / "all.csv"
    assert run_all.main(["--device", "cpu", "--smoke", "--out", str(out), "--reps", "1"]) == 0
    rows = read_rows(out)
    anchored = ({"fused_step"} if HAVE_TBE else set()) | ({"train"} if HAVE_TORCHREC else set())
    assert {r["op"] for r in rows} == {"copy", "hash_table", "tiered", "host_per_call",
                                       "quantized_bag", "checkpoint_save", "checkpoint_load",
                                       *SCRIPTS} | anchored
    assert sum(r["op"] == "copy" for r in rows) == 1
    # --providers is checked against run_all.PROVIDERS: it names every provider timed
    assert {(r["op"], r["provider"]) for r in rows if r["op"] in run_all.PROVIDERS} <= {
        (op, name) for op in run_all.PROVIDERS for name in run_all.provider_names([op], "cpu")}


def test_tiered_bench_smoke(tmp_path):
    """Every provider: the table in RAM, in files with no cache, and the three caches,
    with their hit rates and peak anonymous memory."""
    rows = [r for r in smoke("tiered", tmp_path / "bench.csv") if r["op"] == "tiered"]
    assert [r["provider"] for r in rows] == ["hbkernels-cache-1%", "in-ram", "mmap-no-cache",
                                             "hbkernels-cache-5%", "hbkernels-cache-20%"]
    for r in rows:
        assert 0 < float(r["p20_ms"]) <= float(r["median_ms"]) <= float(r["p80_ms"])
        assert "anon_peak_MB=" in r["size"] and "mean_ms=" in r["size"]
        assert ("hit=" in r["size"]) == r["provider"].startswith("hbkernels-cache")


@pytest.mark.skipif(not HAVE_TBE, reason="FBGEMM's TBE (fbgemm-gpu-cpu) is not installed")
def test_the_anchors_are_peers(tmp_path):
    """TBE's forward is an embedding_bag peer; the fused step is checked and timed
    against TBE for every rule TBE runs on the CPU."""
    rows = check_rows(smoke("embedding_bag", tmp_path / "eb.csv"), "embedding_bag")
    assert "fbgemm-tbe" in {r["provider"] for r in rows}
    rows = check_rows(smoke("fused_step", tmp_path / "fs.csv"), "fused_step")
    parts = {"hbkernels-update", "hbkernels-backward", "hbkernels-checks", "hbkernels-grouping",
             "fbgemm-tbe-forward"}
    for rule in anchors.TBE_RULES:  # row-wise Adagrad's step also timed in its parts
        assert {r["provider"] for r in rows if r["mode"] == rule} == (
            {"hbkernels", "fbgemm-tbe", bounds.BOUND} | (parts if rule == "RowWiseAdagrad"
                                                         else set())), rule
    assert {r["mode"] for r in rows} == set(anchors.TBE_RULES)


def test_the_fused_step_needs_tbe(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(common.DISABLE_ENV, "fbgemm_gpu")
    module = importlib.import_module("hbkernels.bench.bench_fused_step")
    module.main(["--device", "cpu", "--smoke", "--out", str(tmp_path / "fs.csv")])
    assert not any(r["op"] == "fused_step" for r in read_rows(tmp_path / "fs.csv"))
    assert "needs FBGEMM's TBE" in capsys.readouterr().out


def test_a_wrong_kernel_is_never_timed(tmp_path):
    ctx = common.Context("cpu", tmp_path / "bench.csv", smoke=True)
    x = np.arange(6.0)
    providers = [common.Provider("hbkernels", lambda a: a["x"] + 1e-3),
                 common.Provider("numpy", lambda a: a["x"].copy())]
    with pytest.raises(AssertionError, match="hbkernels vs numpy"):
        ctx.compare("op", "m", "n=6", "float64", {"x": x}, providers, nbytes=48, rtol=1e-6)
    assert not (tmp_path / "bench.csv").exists()


def test_csv_refuses_another_header(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="header"):
        common.append_csv(path, dict.fromkeys(common.COLUMNS, "x"))


def test_zipf_ids_are_skewed_scattered_and_reproducible():
    ids = common.zipf_ids(200_000, 10_000, 1.1, seed=3)
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 10_000
    np.testing.assert_array_equal(ids, common.zipf_ids(200_000, 10_000, 1.1, seed=3))
    counts = np.bincount(ids, minlength=10_000)
    hottest = np.argsort(counts)[::-1]
    # rank 1 carries 1/H(10000, 1.1) ~ 15% of the draws and rank 2 2**-1.1 of that
    assert 0.13 < counts[hottest[0]] / ids.size < 0.17
    assert 0.4 < counts[hottest[1]] / counts[hottest[0]] < 0.53
    # the hot rows are spread over the table, not packed at its start
    assert np.median(hottest[:100]) > 1000


def test_zipf_ids_ranked_and_uniform():
    """Ranked: the same popularity law with rank k at row k - 1 (hot rows at the table's
    start); uniform: every row alike."""
    scattered = common.zipf_ids(200_000, 10_000, 1.1, seed=3)
    ranked = common.zipf_ids(200_000, 10_000, 1.1, seed=3, layout="ranked")
    np.testing.assert_array_equal(np.sort(np.bincount(ranked, minlength=10_000)),
                                  np.sort(np.bincount(scattered, minlength=10_000)))
    counts = np.bincount(ranked, minlength=10_000)
    assert (np.diff(counts[:20]) <= 0).all() and counts[0] / ranked.size > 0.13
    uniform = np.bincount(common.zipf_ids(200_000, 10_000, 1.1, seed=3, layout="uniform"),
                          minlength=10_000)
    assert uniform.max() < 60 and uniform.min() > 0  # 20 a row expected
    with pytest.raises(ValueError, match="layout must be one of"):
        common.zipf_ids(10, 10, 1.1, layout="sorted")


@pytest.mark.parametrize("name", ["embedding_bag", "embedding_bag_backward", "fused_step"])
def test_training_path_benchmarks_cover_the_id_layouts(name, tmp_path):
    """Every id layout, each case with its gather-scatter bound beside it."""
    if name == "fused_step" and not HAVE_TBE:
        pytest.skip("FBGEMM's TBE (fbgemm-gpu-cpu) is not installed")
    rows = [r for r in smoke(name, tmp_path / "bench.csv") if r["op"] == name]
    sizes = {r["size"] for r in rows}
    for layout in common.LAYOUTS:
        mine = {r["provider"] for r in rows if f"layout={layout}" in r["size"]}
        assert {"hbkernels", bounds.BOUND} <= mine, (layout, mine)
    assert all(any(r["provider"] == bounds.BOUND and r["size"] == size and r["mode"] == mode
                   for r in rows) for size, mode in {(r["size"], r["mode"]) for r in rows
                                                     if r["mode"] != "fwd+bwd+adagrad"}), sizes
    if name == "embedding_bag_backward":  # every rule's fused step beside the bound
        for size in {r["size"] for r in rows if r["mode"] == "bwd+adagrad"}:
            timed = {r["provider"] for r in rows
                     if r["size"] == size and r["mode"] == "bwd+adagrad"}
            assert {f"hbkernels-fused-{rule}" for rule in
                    ("SGD", "RowWiseAdagrad", "Adam", "Ftrl")} <= timed, (size, timed)


def test_gather_scatter_reads_each_row_once_and_keeps_the_table():
    w = np.arange(24, dtype=np.float32).reshape(6, 4)
    ids = np.array([5, 0, 5, 2, 0])
    reads = bounds.gather_scatter(step=False)
    a = reads.prepare({"w": w, "ids": ids})
    assert a["rows"].tolist() == [5, 0, 2]  # the order the ids first name them
    np.testing.assert_array_equal(reads.run(a), w[[5, 0, 2]].sum(axis=1))
    step = bounds.gather_scatter()
    step.run(step.prepare({"w": w, "ids": ids}))
    np.testing.assert_array_equal(w, np.arange(24, dtype=np.float32).reshape(6, 4))


def test_reduceat_peer_handles_empty_segments():
    from hbkernels.bench.bench_segment_reduce import csr_offsets, reduceat

    offsets = csr_offsets(200, 3, seed=1)
    lengths = np.diff(offsets)
    assert lengths[0] == 0 and lengths[-1] == 0 and (lengths == 0).sum() > 2
    data = np.random.default_rng(0).random((offsets[-1], 3)).astype(np.float32)
    for mode in ("sum", "mean"):
        want = np.zeros((200, 3), np.float32)
        for b in range(200):
            seg = data[offsets[b]:offsets[b + 1]]
            if len(seg):
                want[b] = seg.sum(0) if mode == "sum" else seg.mean(0)
        np.testing.assert_allclose(reduceat(data, offsets, mode), want, rtol=1e-6)


@pytest.mark.skipif(not HAVE_TORCHREC, reason="TorchRec with FBGEMM's CPU build is not installed")
def test_train_against_torchrec_smoke(tmp_path, capsys):
    module = importlib.import_module("hbkernels.bench.bench_train")
    module.main(["--device", "cpu", "--smoke", "--out", str(tmp_path / "train.csv")])
    rows = [r for r in read_rows(tmp_path / "train.csv") if r["op"] == "train"]
    assert {r["provider"] for r in rows} == {"hbkernels", "torchrec", "hbkernels-dynamic"}
    assert all(float(r["median_ms"]) > 0 for r in rows)
    out = capsys.readouterr().out
    assert "hbkernels / torchrec samples/s" in out and "mean loss" in out
    assert "dynamic / static step time" in out


def test_host_per_call_bench_smoke(tmp_path):
    """bench_launch: every op's wall time per call at a tiny size, torch's forward beside it."""
    rows = smoke("launch", tmp_path / "bench.csv")
    mine = [r for r in rows if r["op"] == "host_per_call"]
    assert {r["mode"] for r in mine} == {"embedding_bag", "lookup", "fused_step",
                                         "embedding_bag_backward"}
    assert {r["provider"] for r in mine} >= {"hbkernels", "hbkernels-unchecked"} | (
        {"torch"} if HAVE_TORCH else set())
    assert all(float(r["median_ms"]) > 0 for r in mine)


def test_quantized_bag_bench_smoke(tmp_path):
    """int8 and int4 tables: hbkernels, its float32 forward on the dequantized table, the
    NumPy gather, and FBGEMM's int-N TBE on the same codes where installed."""
    rows = [r for r in smoke("quantized_bag", tmp_path / "bench.csv") if r["op"] == "quantized_bag"]
    assert {r["dtype"] for r in rows} == {"int8", "int4"}
    providers = {r["provider"] for r in rows}
    assert {"hbkernels", "hbkernels-fp32", "numpy"} <= providers
    if HAVE_TBE:
        assert "fbgemm-intn-tbe" in providers
    assert all(float(r["median_ms"]) > 0 and float(r["gbps"]) > 0 for r in rows)


def test_checkpoint_bench_smoke(tmp_path):
    """Incremental and full saves, and the chain's load against the full save's, in rows
    of one CSV."""
    rows = smoke("checkpoint", tmp_path / "bench.csv")
    saves = {r["provider"]: r for r in rows if r["op"] == "checkpoint_save"}
    loads = {r["provider"] for r in rows if r["op"] == "checkpoint_load"}
    assert set(saves) == {"hbkernels-incremental", "hbkernels-full"}
    assert all("bytes=" in r["size"] and float(r["median_ms"]) > 0 for r in saves.values())
    assert loads == {"hbkernels-chain-5", "hbkernels-full", "hbkernels-chain-default"}
