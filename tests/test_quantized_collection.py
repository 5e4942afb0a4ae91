"""EmbeddingCollection.quantized: a forward-only collection of row-wise quantized
tables, against ``hbk.quantize_rows`` of the float tables and the float64 model of
tests/mpi/collection_reference.py on them.

* one process: every plan and bits, a subset of tables (the rest copied bit for
  bit), tables in a slow tier, the memory held, checkpoints (round trip, another
  plan, a tampered manifest), bad requests;
* across processes: tests/mpi/quantized.py, save at 2 ranks (a column_wise table
  among the mixed plan) -> load at 3, and a NaN row on one rank (no hang).
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import hbkernels as hbk
from hbkernels.quantize import row_bytes
from hbkernels.sharding.checkpoint import _manifest

sys.path.insert(0, str(Path(__file__).resolve().parent / "mpi"))
import collection_reference as cr  # noqa: E402
from mpirun import assert_ok, mpirun, needs_mpi  # noqa: E402

TABLES = cr.table_specs(hbk)


def local():
    return hbk.dist.init("local")


def trained(plan="mixed", tables=TABLES, **kw):
    opt = cr.make_optimizer(hbk, "Adagrad")
    coll = hbk.EmbeddingCollection(tables, comm=local(), optimizer=opt,
                                   plan=cr.plan_request(plan), seed=3, **kw)
    cr.check_training(hbk, coll, local(), tables, opt, key=f"q-{plan}", steps=1)
    return coll


def shards(coll):
    return {(s.table, s.slice, s.rank, s.row_start, s.row_step, s.num_rows, s.c0, s.c1)
            for t in coll.tables for s in coll.layout.shards[t]}


def expected_tables(coll, bits, names=None):
    """name -> the table ``coll.quantized(bits, names)`` should hold (float)."""
    out = {}
    for t in coll.tables.values():
        w = coll.full_weights(t.name)
        out[t.name] = w if names is not None and t.name not in names else \
            hbk.quantize_rows(w, bits=bits).dequantize()
    return out


def check_forward(q, tables, key):
    """``q``'s forward of a batch against the float64 model on ``tables``."""
    specs = [q.tables[t.name] for t in TABLES]
    ref = cr.Reference(specs, cr.make_optimizer(hbk, "SGD"), tables)
    gb = cr.global_batch(specs, key, 0, 40)
    feats, psw, _ = gb.local(0, 40)
    out = q.forward(feats, per_sample_weights=psw or None)
    for f, e in ref.forward(gb).items():
        t = specs[[s.name for s in specs].index(ref.feature_table[f])]
        assert out[f].dtype == np.dtype(t.dtype), (f, out[f].dtype)
        cr.assert_close(out[f], e, t.dtype, f"forward {f}")
    return out


@pytest.mark.parametrize("plan", cr.PLANS)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantized_is_quantize_rows_of_each_table_under_every_plan(plan, bits):
    coll = trained(plan)
    q = coll.quantized(bits=bits)
    assert q.quantize == {t.name: bits for t in TABLES}
    assert shards(q) == shards(coll)  # the same plan: the same rows and columns on each rank
    tables = expected_tables(coll, bits)
    for t in TABLES:
        got = q.full_weights(t.name)
        assert got.dtype == np.float32 and np.array_equal(got, tables[t.name]), t.name
    check_forward(q, tables, f"serve-{plan}-{bits}")
    for group, fused in q.arrays.items():  # exactly E * (ceil(D * bits / 8) + 4) bytes
        assert group.bits == bits and isinstance(fused.weights, hbk.QuantizedTable)
        rows = q.layout.rows[0, group]
        assert fused.weights.nbytes == rows * (row_bytes(group.width, bits) + 4)


def test_a_subset_of_tables_is_quantized_and_the_rest_copied():
    coll = trained("table_wise")
    q = coll.quantized(bits=4, tables=["user", "item"])
    assert q.quantize == {"user": 4, "item": 4}
    tables = expected_tables(coll, 4, names={"user", "item"})
    for t in TABLES:
        got = q.full_weights(t.name)
        assert got.dtype == np.dtype(q.tables[t.name].dtype)
        assert np.array_equal(got, tables[t.name]), t.name
    assert q.tables["half"].dtype == "float16" and q.tables["user"].dtype == "float32"
    out = check_forward(q, tables, "subset")
    gb = cr.global_batch(TABLES, "subset", 0, 40)
    feats, psw, _ = gb.local(0, 40)
    same = coll.forward(feats, per_sample_weights=psw or None)
    for f in ("tiny", "cat", "half"):  # the float tables pool exactly as before
        assert np.array_equal(out[f], same[f]), f


@pytest.mark.parametrize("storage", ["host", "mmap"])
def test_a_table_in_a_slow_tier_is_read_whole_and_held_quantized(tmp_path, storage):
    spec = hbk.TableSpec("t", num_rows=400, dim=6, storage=storage, cache_rows=32,
                         path=str(tmp_path / "t") if storage == "mmap" else None)
    coll = hbk.EmbeddingCollection([spec], comm=local(), seed=1)
    coll.forward({"t": np.array([0, 5, 399, 5])})
    coll.backward({"t": np.ones((4, 6), np.float32)})
    q = coll.quantized(bits=8)
    assert q.tables["t"].storage == "device" and not q.tiers
    assert np.array_equal(q.full_weights("t"),
                          hbk.quantize_rows(coll.full_weights("t"), bits=8).dequantize())


def test_round_trip_and_load_under_another_plan(tmp_path):
    coll = trained("mixed")
    q = coll.quantized(bits=2)
    tables = expected_tables(coll, 2)
    q.save(tmp_path / "q")
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert manifest["quantize"] == {t.name: 2 for t in TABLES}
    arrays = {(f["array"], f["dtype"]) for f in manifest["files"]}
    assert arrays == {("codes", "uint8"), ("scale", "float16"), ("bias", "float16")}, arrays
    assert all(f.get("bits") == 2 for f in manifest["files"] if f["array"] == "codes")
    for plan in (None, "row_wise", "column_wise"):
        kw = {} if plan is None else {"plan": plan}
        loaded = hbk.EmbeddingCollection.load(tmp_path / "q", comm=local(), **kw)
        assert loaded.quantize == q.quantize
        for t in TABLES:
            assert np.array_equal(loaded.full_weights(t.name), tables[t.name]), (plan, t.name)
        check_forward(loaded, tables, f"loaded-{plan}")
    served = hbk.EmbeddingCollection.load(tmp_path / "q", comm=local(), tables=[TABLES[0].name])
    assert served.quantize == {TABLES[0].name: 2}  # serving one table of the checkpoint
    assert np.array_equal(served.full_weights(TABLES[0].name), tables[TABLES[0].name])


def test_a_fresh_quantized_collection_holds_its_quantized_initial_weights():
    spec = hbk.TableSpec("t", num_rows=50, dim=5)
    fresh = hbk.EmbeddingCollection([spec], comm=local(), seed=4, plan="column_wise",
                                    quantize={"t": 4})
    ref = hbk.EmbeddingCollection([spec], comm=local(), seed=4)
    assert np.array_equal(fresh.full_weights("t"),
                          hbk.quantize_rows(ref.full_weights("t"), bits=4).dequantize())


def test_a_tampered_quantized_manifest_is_a_checkpoint_error(tmp_path):
    q = trained("table_wise").quantized(bits=8)
    q.save(tmp_path / "q")
    path = tmp_path / "q" / "manifest.json"
    original = json.loads(path.read_text())
    for edit in (lambda m: m["quantize"].update(user=3),
                 lambda m: m["quantize"].update(nobody=8),
                 lambda m: m.pop("quantize"),  # codes files of float tables
                 lambda m: next(f for f in m["files"] if f["array"] == "codes").update(dtype="int8")):
        m = json.loads(json.dumps(original))
        edit(m)
        path.write_text(json.dumps(_manifest.seal({k: v for k, v in m.items() if k != "crc32"})))
        with pytest.raises(hbk.CheckpointError):
            hbk.EmbeddingCollection.load(tmp_path / "q", comm=local())


def test_bad_requests():
    coll = trained("table_wise")
    with pytest.raises(ValueError, match="bits must be one of"):
        coll.quantized(bits=3)
    with pytest.raises(ValueError, match="no tables"):
        coll.quantized(tables=["nobody"])
    q = coll.quantized(bits=8)
    with pytest.raises(ValueError, match="quantized already"):
        q.quantized(bits=4)
    with pytest.raises(TypeError, match="forward only"):
        q.backward({})
    dynamic = hbk.EmbeddingCollection([hbk.TableSpec("d", num_rows=None, dim=4, capacity=64),
                                       hbk.TableSpec("s", num_rows=10, dim=4)], comm=local())
    with pytest.raises(ValueError, match="dynamic"):
        dynamic.quantized(tables=["s"])
    bad = hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=10, dim=4)], comm=local())
    bad.arrays[next(iter(bad.arrays))].weights[7, 2] = np.inf
    with pytest.raises(ValueError, match="row 7 of the table holds NaN or Inf"):
        bad.quantized()
    with pytest.raises(ValueError, match="quantize must map static tables"):
        hbk.EmbeddingCollection(TABLES, comm=local(), quantize={"user": 5})


@pytest.mark.parametrize("bits", [8.0, np.float64(4), True])
def test_bits_that_are_not_integers_are_refused(bits):
    """coll.quantized checks bits as hbk.quantize_rows does: 8.0 is not 8."""
    coll = hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=10, dim=4)], comm=local())
    with pytest.raises(ValueError, match=r"bits must be one of \(8, 4, 2\) \(an integer\), got"):
        coll.quantized(bits=bits)
    assert coll.quantized(bits=np.int32(2)).quantize == {"t": 2}


def test_an_incremental_save_of_a_quantized_collection_is_refused(tmp_path):
    q = trained("table_wise").quantized(bits=8)
    q.save(tmp_path / "a")
    with pytest.raises(ValueError, match="save it whole"):
        q.save(tmp_path / "b", incremental=True)


@needs_mpi
def test_quantized_across_world_sizes(tmp_path):
    for n, mode in [(2, "save"), (3, "load"), (2, "bad")]:
        rc, out, _ = mpirun(n, "quantized.py", mode, str(tmp_path), timeout=150)
        assert_ok(rc, out, range(n))


@pytest.mark.cuda
def test_a_quantized_collection_on_the_cuda_path_gives_the_cpu_results():
    """device="cuda" (Numba's simulator in CI): the same tables and forward as on the
    CPU, the quantized tables held on the device."""
    pytest.importorskip("numba.cuda")
    from hbkernels._dispatch import device_family, host

    specs = [hbk.TableSpec("a", num_rows=30, dim=5), hbk.TableSpec("b", num_rows=9, dim=3,
                                                                    combiner="mean")]
    ids = {"a": (np.array([0, 29, 4, 4, 7]), np.array([0, 2, 2, 5])), "b": (np.array([8, 0, 1]),
                                                                           np.array([0, 1, 1, 3]))}
    out, weights = {}, {}
    for device in ("cpu", "cuda"):
        put = device_family(device).put
        q = hbk.EmbeddingCollection(specs, comm=local(), seed=5, device=device).quantized(bits=4)
        assert all(f.weights.family.device == device for f in q.arrays.values())
        out[device] = {f: host(v) for f, v in q.forward(
            {f: hbk.Ragged(put(v), put(o)) for f, (v, o) in ids.items()}).items()}
        weights[device] = {t.name: host(q.full_weights(t.name)) for t in specs}
    for name in ("a", "b"):
        np.testing.assert_allclose(out["cuda"][name], out["cpu"][name], rtol=1e-6, atol=1e-6)
        assert np.array_equal(weights["cuda"][name], weights["cpu"][name])


def test_bits_are_whole_numbers_and_saved_as_such(tmp_path):
    spec = hbk.TableSpec("t", num_rows=20, dim=3)
    with pytest.raises(ValueError, match="quantize must map"):
        hbk.EmbeddingCollection([spec], comm=local(), quantize={"t": 4.0})
    q = hbk.EmbeddingCollection([spec], comm=local(), quantize={"t": np.int64(4)})
    assert q.quantize == {"t": 4} and type(q.quantize["t"]) is int
    q.save(tmp_path / "q")
    assert np.array_equal(hbk.EmbeddingCollection.load(tmp_path / "q", comm=local())
                          .full_weights("t"), q.full_weights("t"))


def _rewrite(path, array, change, entry_change=None):
    """Apply ``change`` to each saved ``array`` file of checkpoint ``path`` (its data in,
    new data or None out) and ``entry_change`` to its manifest entry, with its size and
    crc32 in a resealed manifest (so only the values are wrong)."""
    import zlib

    manifest = json.loads((path / "manifest.json").read_text())
    for entry in (f for f in manifest["files"] if f["array"] == array):
        data = np.load(path / entry["file"])
        out = change(data)  # in place (None), or a new array
        data = data if out is None else out
        np.save(path / entry["file"], data)
        raw = (path / entry["file"]).read_bytes()
        entry.update(bytes=len(raw), crc32=zlib.crc32(raw), dtype=data.dtype.name,
                     shape=list(data.shape))
        if entry_change is not None:
            entry_change(entry)
    (path / "manifest.json").write_text(json.dumps(_manifest.seal(
        {k: v for k, v in manifest.items() if k != "crc32"})))


def _one_code_a_byte(path, bits):
    """Rewrite the quantized save at ``path`` as saves before packed codes were: one code
    a byte, float32 scales and biases."""
    manifest = json.loads((path / "manifest.json").read_text())
    for entry in (f for f in manifest["files"] if f["array"] == "codes"):
        width = entry["c1"] - entry["c0"]
        _rewrite(path, "codes", lambda a, w=width: hbk.quantize.unpack(np, a, bits, w).copy(),
                 lambda e: e.pop("bits", None))
        break
    for array in ("scale", "bias"):
        _rewrite(path, array, lambda a: a.astype(np.float32))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("plan", ["table_wise", "column_wise"])
def test_a_save_holds_the_codes_packed_and_saves_of_one_code_a_byte_still_load(
        tmp_path, bits, plan):
    spec = hbk.TableSpec("t", num_rows=37, dim=7)
    coll = hbk.EmbeddingCollection([spec], comm=local(), seed=2, plan=plan)
    q = coll.quantized(bits=bits)
    q.save(tmp_path / "q")
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    data = sum(f["bytes"] - 128 for f in manifest["files"])  # less each .npy's header
    slices = [f["c1"] - f["c0"] for f in manifest["files"] if f["array"] == "codes"]
    assert data == spec.num_rows * sum(row_bytes(w, bits) + 4 for w in slices) <= \
        spec.num_rows * (row_bytes(spec.dim, bits) + 4) + 4 * spec.num_rows * (len(slices) - 1)
    for plan_again in ("table_wise", "column_wise", "row_wise"):
        back = hbk.EmbeddingCollection.load(tmp_path / "q", comm=local(), plan=plan_again)
        assert np.array_equal(back.full_weights("t"), q.full_weights("t")), plan_again
    _one_code_a_byte(tmp_path / "q", bits)
    old = hbk.EmbeddingCollection.load(tmp_path / "q", comm=local())
    assert np.array_equal(old.full_weights("t"), q.full_weights("t"))


@pytest.mark.parametrize("array, change, bits, layout", [
    ("codes", lambda a: a.__setitem__((3, 1), 16), 4, "one a byte"),    # 16 needs 5 bits
    ("codes", lambda a: a.__setitem__((0, 0), 4), 2, "one a byte"),
    ("scale", lambda a: a.__setitem__(2, np.nan), 8, "packed"),
    ("scale", lambda a: a.__setitem__(2, -1.0), 4, "packed"),
    ("bias", lambda a: a.__setitem__(5, np.inf), 2, "packed"),
    ("bias", lambda a: a.__setitem__(5, 1e30), 8, "one a byte"),         # not a float16
    ("bias", lambda a: a.__setitem__(5, 0.1), 8, "one a byte"),          # not exactly a float16
])
def test_saved_codes_scales_and_biases_are_checked(tmp_path, array, change, bits, layout):
    q = hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=20, dim=3)], comm=local(),
                                quantize={"t": bits})
    q.save(tmp_path / "q")
    if layout == "one a byte":
        _one_code_a_byte(tmp_path / "q", bits)
    hbk.EmbeddingCollection.load(tmp_path / "q", comm=local())  # as saved: fine
    _rewrite(tmp_path / "q", array, change)
    with pytest.raises(hbk.CheckpointError, match="table 't', row"):
        hbk.EmbeddingCollection.load(tmp_path / "q", comm=local())


@pytest.mark.parametrize("edit", ["bits of an 8-bit table", "bits unlike the table's",
                                  "bits on scales", "packed shape without bits"])
def test_a_tampered_packed_codes_entry_is_a_checkpoint_error(tmp_path, edit):
    bits = 8 if edit == "bits of an 8-bit table" else 4
    q = hbk.EmbeddingCollection([hbk.TableSpec("t", num_rows=20, dim=3)], comm=local(),
                                quantize={"t": bits})
    q.save(tmp_path / "q")
    array = "scale" if edit == "bits on scales" else "codes"
    change = {"bits of an 8-bit table": lambda e: e.update(bits=8),
              "bits unlike the table's": lambda e: e.update(bits=2),
              "bits on scales": lambda e: e.update(bits=4),
              "packed shape without bits": lambda e: e.pop("bits")}[edit]
    _rewrite(tmp_path / "q", array, lambda a: None, change)
    with pytest.raises(hbk.CheckpointError):
        hbk.EmbeddingCollection.load(tmp_path / "q", comm=local())


def test_load_overrides(tmp_path):
    coll = trained("table_wise")
    q = coll.quantized(bits=8)
    q.save(tmp_path / "q")
    coll.save(tmp_path / "f")
    with pytest.raises(ValueError, match="call .quantized"):
        hbk.EmbeddingCollection.load(tmp_path / "f", comm=local(), quantize={"user": 8})
    other = hbk.EmbeddingCollection.load(tmp_path / "q", comm=local(),
                                         optimizer=cr.make_optimizer(hbk, "Adagrad"))
    for t in TABLES:
        assert np.array_equal(other.full_weights(t.name), q.full_weights(t.name))
        assert set(other.full_state(t.name)) == {"step"}


def test_a_plan_for_other_tables_is_refused():
    coll = trained("table_wise")
    wider = [t._replace(dim=t.dim + 1) for t in TABLES]
    with pytest.raises(ValueError, match="not of these tables"):
        hbk.EmbeddingCollection(wider, comm=local(), plan=coll.plan)


def test_the_torch_module_serves_a_quantized_collection():
    torch = pytest.importorskip("torch")
    from hbkernels.adapters.torch import EmbeddingCollectionModule

    coll = trained("table_wise")
    module = EmbeddingCollectionModule(coll.quantized(bits=8))
    state = module.state_dict()
    assert not any(".optimizer." in k and not k.endswith(".step") for k in state)
    for t in TABLES:
        assert torch.equal(state[f"tables.{t.name}.weight"],
                           torch.from_numpy(module.collection.full_weights(t.name)))
    with torch.no_grad():
        out = module({"cat": torch.tensor([0, 22]), "user": (torch.tensor([1, 2]),
                                                             torch.tensor([0, 1, 2]))})
    assert out["cat"].dtype == torch.float32 and out["cat"].shape == (2, 3)
    with pytest.raises(TypeError, match="quantized"):
        module.load_state_dict(state)
