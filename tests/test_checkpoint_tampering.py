"""Checkpoints fed by an attacker or a careless user: a save touches only what it named
inside its own directory, and a load refuses any manifest or file it did not write
(path traversal, device files, symlinks, every field edited, pickles, a full disk)
with hbk.CheckpointError naming the file, never a hang, a raw error or garbage."""
import errno
import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

import hbkernels as hbk
from hbkernels.sharding.checkpoint import _manifest, _save

TABLES = [hbk.TableSpec("user", num_rows=9, dim=4), hbk.TableSpec("item", num_rows=6, dim=3)]


def local():
    return hbk.dist.init("local")


def make(tables=TABLES, optimizer=None):
    coll = hbk.EmbeddingCollection(tables, comm=local(), seed=3,
                                   optimizer=optimizer or hbk.optim.Adagrad(lr=0.1))
    features = {t.name: hbk.Ragged(np.array([0, t.num_rows - 1, 1]), np.array([0, 2, 3]))
                for t in tables}
    out = coll.forward(features)
    coll.backward({name: np.ones_like(rows) for name, rows in out.items()})
    return coll


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    make().save(path)
    return path


def load(path):
    return hbk.EmbeddingCollection.load(path, comm=local())


def manifest_of(path):
    return json.loads((Path(path) / "manifest.json").read_text())


def write_manifest(path, manifest, reseal=True):
    """Write ``manifest``; with ``reseal`` its crc32 matches the edit (so the field
    checks, not the checksum, must catch it)."""
    if reseal:
        manifest = _manifest.seal(manifest)
    (Path(path) / "manifest.json").write_text(json.dumps(manifest))


def refused(path, *names):
    with pytest.raises(hbk.CheckpointError) as e:
        load(path)
    for name in names:
        assert name in str(e.value), f"{e.value} does not name {name}"
    return str(e.value)


# -- a save touches only its own files -----------------------------------------------------------
def test_save_keeps_a_users_directories_and_removes_only_its_own(tmp_path):
    path = tmp_path / "ckpt"
    coll = make()
    coll.save(path)
    first = manifest_of(path)["save"]
    (path / "save-my-thesis").mkdir()
    (path / "save-my-thesis" / "chapter1.tex").write_text("precious")
    looks_like_ours = path / "save-1234567890123456789-0badcafe"
    looks_like_ours.mkdir()
    (looks_like_ours / "notes.txt").write_text("not a checkpoint file")
    crashed = path / "save-1234567890123456780-deadbeef"  # a crashed save of ours
    crashed.mkdir()
    (crashed / "t0.0.0-1.weights.npy").write_bytes(b"partial")
    (path / "manifest.json.tmp-0123abcd").write_text("{")  # a kill during a manifest write
    coll.save(path)
    names = sorted(os.listdir(path))
    assert "save-my-thesis" in names and looks_like_ours.name in names
    assert (path / "save-my-thesis" / "chapter1.tex").read_text() == "precious"
    assert first not in names and crashed.name not in names
    assert not [n for n in names if n.startswith("manifest.json.tmp-")]
    load(path)


def test_a_table_name_never_forms_a_path(tmp_path):
    tables = [hbk.TableSpec("../../escape", num_rows=5, dim=2),
              hbk.TableSpec("/abs/olute", num_rows=4, dim=2)]
    path = tmp_path / "deep" / "ckpt"
    coll = make(tables)
    coll.save(path)
    outside = [p for p in tmp_path.rglob("*") if path not in p.parents and p != path
               and p not in path.parents]
    assert outside == [], outside
    back = load(path)
    for t in tables:
        np.testing.assert_array_equal(back.full_weights(t.name), coll.full_weights(t.name))


def test_a_full_disk_while_the_manifest_is_written(saved, monkeypatch):
    before = manifest_of(saved)

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_save, "write_manifest", full)
    with pytest.raises(hbk.CheckpointError, match="the previous checkpoint is kept: .*No space left"):
        make().save(saved)
    assert sorted(p.name for p in saved.iterdir()) == sorted(["manifest.json", before["save"]])
    assert manifest_of(saved) == before
    load(saved)


def test_a_first_save_that_fails_says_nothing_was_saved(tmp_path, monkeypatch):
    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_save, "write_manifest", full)
    with pytest.raises(hbk.CheckpointError, match="failed, nothing was saved: .*No space left"):
        make().save(tmp_path / "ck")
    assert not (tmp_path / "ck" / "manifest.json").exists()


# -- a load reads only files the checkpoint named ---------------------------------------------------
@pytest.mark.parametrize("target", ["../outside.npy", "/etc/passwd", "/dev/zero",
                                    "SAVE/../../outside.npy", "SAVE/sub/t0.npy", "SAVE/.npy"])
def test_file_entries_outside_the_save_directory(saved, target):
    m = manifest_of(saved)
    shutil.copy(saved / m["files"][0]["file"], saved.parent / "outside.npy")
    m["files"][0]["file"] = target.replace("SAVE", m["save"])
    write_manifest(saved, m)
    refused(saved, "manifest.json", "is not a file of save directory")


def test_symlinks_and_device_files(saved, tmp_path):
    m = manifest_of(saved)
    victim = saved / m["files"][0]["file"]
    elsewhere = tmp_path / "elsewhere.npy"
    shutil.copy(victim, elsewhere)
    victim.unlink()
    victim.symlink_to(elsewhere)  # a saved file pointing out
    refused(saved, victim.name, "symbolic link")
    victim.unlink()
    victim.symlink_to("/dev/zero")
    refused(saved, victim.name)
    shutil.copy(elsewhere, victim.parent / "x")
    victim.unlink()
    os.replace(victim.parent / "x", victim)
    load(saved)
    save_dir = saved / m["save"]  # the save directory itself a link to elsewhere
    moved = tmp_path / "moved"
    os.replace(save_dir, moved)
    save_dir.symlink_to(moved, target_is_directory=True)
    refused(saved, m["save"], "not a directory")
    save_dir.unlink()
    os.replace(moved, save_dir)
    manifest = saved / "manifest.json"  # the manifest a link to a device that never ends
    manifest.unlink()
    manifest.symlink_to("/dev/zero")
    refused(saved, "manifest.json")


def test_a_pickled_object_array(saved):
    m = manifest_of(saved)
    entry = m["files"][0]
    target = saved / entry["file"]
    np.save(target, np.array([{"evil": 1}] * entry["shape"][0], dtype=object), allow_pickle=True)
    data = target.read_bytes()
    entry["bytes"], entry["crc32"] = len(data), zlib.crc32(data)
    entry["bytes"] = max(entry["bytes"], 0)
    write_manifest(saved, m)
    refused(saved, target.name)


def test_an_edited_manifest_fails_its_checksum(saved):
    m = manifest_of(saved)
    m["seed"] += 1
    write_manifest(saved, m, reseal=False)
    refused(saved, "manifest.json", "crc32")


def test_an_edited_manifest_as_written_fails_its_checksum(saved):
    """A save writes its crc32 first, then the canonical JSON it is the crc32 of; a load
    checks it on the text as read, and an edit of that text is caught."""
    text = (saved / "manifest.json").read_bytes()
    assert text.startswith(b'{"crc32":%d,' % manifest_of(saved)["crc32"])
    assert _manifest.is_sealed_text(text, manifest_of(saved))
    load(saved)
    edited = text.replace(b'"seed":3', b'"seed":4')
    assert edited != text
    (saved / "manifest.json").write_bytes(edited)
    refused(saved, "manifest.json", "crc32")
    (saved / "manifest.json").write_bytes(text.replace(b'"seed":3', b'"seed": 3'))
    load(saved)  # the same content, not as written: checked on its parsed content


def test_a_file_with_another_npy_header_loads(saved):
    """A shard written with another ``.npy`` header (format 2.0) is read through NumPy's
    parser, its shape and dtype held to the manifest's."""
    m = manifest_of(saved)
    entry = next(f for f in m["files"] if f["array"] == "weights" and f["table"] == "user")
    target = saved / entry["file"]
    data = np.load(target)
    with open(target, "wb") as f:
        np.lib.format.write_array(f, data, version=(2, 0))
    raw = target.read_bytes()
    entry["bytes"], entry["crc32"] = len(raw), zlib.crc32(raw)
    write_manifest(saved, m)
    np.testing.assert_array_equal(load(saved).full_weights("user"), make().full_weights("user"))
    with open(target, "wb") as f:  # a header of another shape
        np.lib.format.write_array(f, data[:, :2].copy(), version=(2, 0))
    raw = target.read_bytes() + bytes(entry["bytes"] - len(target.read_bytes()))
    target.write_bytes(raw)
    entry["crc32"] = zlib.crc32(raw)
    write_manifest(saved, m)
    refused(saved, target.name, "the manifest says")


FILE_EDITS = [
    ("table", "nobody"), ("table", 3), ("array", "momentum"), ("array", None),
    ("slice", -1), ("slice", "0"), ("row_start", -1), ("row_start", 10**6), ("row_step", 0),
    ("row_step", -2), ("num_rows", 10**6), ("num_rows", 2.5), ("c0", 4), ("c1", 99),
    ("c1", 0), ("dtype", "object"), ("dtype", "float64"), ("shape", [1]), ("shape", None),
    ("bytes", -5), ("bytes", 1 << 40), ("crc32", -1), ("crc32", "x"), ("file", None),
]


@pytest.mark.parametrize("key, value", FILE_EDITS, ids=[f"{k}={v!r}" for k, v in FILE_EDITS])
def test_every_file_field_edited(saved, key, value):
    m = manifest_of(saved)
    weights = next(f for f in m["files"] if f["array"] == "weights" and f["table"] == "user")
    weights[key] = value
    write_manifest(saved, m)
    refused(saved, "manifest.json")


TOP_EDITS = [
    ("save", "../elsewhere"), ("save", None), ("world_size", 0), ("seed", "3"), ("seed", 2**64),
    ("dedup", "yes"), ("batch_size_hint", "big"), ("optimizer", None), ("tables", {}),
    ("files", None), ("wire_dtype", 5), ("plan_request", 7),
]


@pytest.mark.parametrize("key, value", TOP_EDITS, ids=[f"{k}={v!r}" for k, v in TOP_EDITS])
def test_every_top_level_field_edited_or_missing(saved, key, value):
    m = manifest_of(saved)
    m[key] = value
    write_manifest(saved, m)
    refused(saved, "manifest.json")
    del m[key]
    write_manifest(saved, m)
    refused(saved, "manifest.json")


TABLE_EDITS = [("dim", 5), ("dim", 3), ("num_rows", 4), ("num_rows", 0), ("dtype", "int8"),
               ("combiner", "max"), ("step", -1), ("name", None), ("hotness", -1.0),
               ("features", []), ("colour", "red")]


@pytest.mark.parametrize("key, value", TABLE_EDITS, ids=[f"{k}={v!r}" for k, v in TABLE_EDITS])
def test_every_table_field_edited(saved, key, value):
    m = manifest_of(saved)
    m["tables"][0][key] = value
    write_manifest(saved, m)
    refused(saved, "manifest.json")


@pytest.mark.parametrize("options", [{"lr": -5}, {"lr": "fast"}, {"eps": -1.0}, {"rounding": "up"}])
def test_optimizer_options_go_through_the_constructor(saved, options):
    m = manifest_of(saved)
    m["optimizer"]["options"].update(options)
    write_manifest(saved, m)
    refused(saved, "manifest.json", "Adagrad")


def test_unknown_optimizer(saved):
    m = manifest_of(saved)
    m["optimizer"]["type"] = "os.system"
    write_manifest(saved, m)
    refused(saved, "manifest.json", "unknown optimizer")


def test_a_file_missing_from_the_manifest_is_a_gap_not_garbage(saved):
    m = manifest_of(saved)
    m["files"] = [f for f in m["files"] if not (f["table"] == "user" and f["array"] == "weights")]
    write_manifest(saved, m)
    refused(saved, "no saved weights for row", "'user'")


def test_a_dynamic_tables_id_saved_twice(tmp_path):
    """A full save whose ids of a dynamic table list one id twice (the file and its
    manifest entry rewritten to match) is refused, naming the table."""
    spec = hbk.TableSpec("d", num_rows=None, dim=3, capacity=16)
    coll = hbk.EmbeddingCollection([spec], comm=local(), optimizer=hbk.optim.Adagrad(lr=0.1))
    coll.forward({"d": np.array([5, -2**63, 2**63 - 1, 7])})
    coll.save(tmp_path / "ckpt")
    load(tmp_path / "ckpt")
    m = manifest_of(tmp_path / "ckpt")
    entry = next(f for f in m["files"] if f["table"] == "d" and f["array"] == "ids")
    target = tmp_path / "ckpt" / entry["file"]
    ids = np.load(target)
    ids[-1] = ids[0]
    np.save(target, ids)
    raw = target.read_bytes()
    entry["bytes"], entry["crc32"] = len(raw), zlib.crc32(raw)
    write_manifest(tmp_path / "ckpt", m)
    refused(tmp_path / "ckpt", "table 'd' has an id saved twice")
