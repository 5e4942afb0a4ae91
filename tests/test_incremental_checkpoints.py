"""Incremental checkpoints that grow with what changed (``save(incremental=True)``).

* bytes: after a step touching 12 ids, an incremental save of a dynamic table of 4,000
  or 4,000,000 live ids (and of a static table) holds at most
  ``2 x touched x (row + state + 24 B) + 16 KB``, with and without evictions;
* a chain of 100 incremental saves (admission after two sightings, LFU eviction, a
  static table beside) loads to exactly the collection's state: ids, rows, optimizer
  state, scores, pending ids, the call counter;
* a chain past ``chain_limit`` x its full save starts again with a full save;
* a failed write (or a SIGKILL half way through one) of an incremental save leaves the
  chain before it loadable;
* an incremental save is one pack per rank, each array in it under its own crc32,
  appended to its parent's file (one file per rank for a chain, a hard link under each
  save's name) or, where it cannot be, a file of its own; a damaged pack or an edited
  offset is refused, and a chain format 2 wrote is still read (format 4:
  test_checkpoint_fixture.py);
* the saves between the newest and the full one are read through their packs alone (their
  manifests moved away, or their directories removed, the chain still loads), each pack
  checked against the bytes and crc32 its child names and its head (rows, link) against
  the newest save's layout; a pack of another layout is read through its manifest;
* ``hbkernels compact`` turns a chain into one full save of the same state.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from helpers import same_collections
from mpirun import ROOT

import hbkernels as hbk
from hbkernels.cli import main
from hbkernels.sharding import checkpoint
from hbkernels.sharding.checkpoint import _format

LOCAL = hbk.dist.init("local")


def files_bytes(path):
    """Bytes the save at ``path`` added to the files it names (its manifest left out): a
    file that is its parent's file with its pack appended (the same inode) counts from
    where the parent's pack ended."""
    manifest = json.loads((path / "manifest.json").read_text())
    parent, ends = manifest.get("parent") or {}, {}
    for name, size, _, *offset in parent.get("packs") or []:
        ends[(path / parent["path"] / name).stat().st_ino] = offset[0] + size
    sizes = [(path / name).stat() for name in {f["file"] for f in manifest["files"]}]
    return sum(st.st_size - ends.get(st.st_ino, 0) for st in sizes)


def save_bytes(path):
    """Bytes of the save at ``path``: its manifest and the files it names."""
    return (path / "manifest.json").stat().st_size + files_bytes(path)


def step(coll, feats):
    out = coll.forward(feats)
    coll.backward({f: np.ones(o.shape, np.float32) for f, o in out.items()})


@pytest.mark.parametrize("live", [4_000, 4_000_000])
@pytest.mark.parametrize("evicting", [False, True], ids=["no-eviction", "eviction"])
def test_an_incremental_save_holds_what_the_step_touched(tmp_path, live, evicting):
    dim = 4
    specs = [hbk.TableSpec("d", num_rows=None, dim=dim, capacity=live, evict="lru"),
             hbk.TableSpec("s", num_rows=live, dim=dim)]
    coll = hbk.EmbeddingCollection(specs, comm=LOCAL, optimizer=hbk.optim.Adagrad(lr=0.1))
    rng = np.random.default_rng(live)
    ids = rng.choice(2**62, live, replace=False).astype(np.int64)
    coll.forward({"d": ids, "s": np.arange(live)})  # every slot taken
    assert coll.dynamic_counts("d")["size"] == live
    assert coll.save(tmp_path / "full") == "full"
    touched = rng.choice(ids, 12, replace=False)
    if evicting:  # 4 ids never seen: 4 of the least recently used leave
        touched[:4] = rng.integers(2**62, 2**63 - 1, 4)
    step(coll, {"d": touched, "s": rng.integers(0, live, 12)})
    assert coll.save(tmp_path / "inc", incremental=True) == "incremental"
    row_and_state = 2 * dim * 4
    bound = 2 * 2 * 12 * (row_and_state + 24) + 16 * 1024  # two tables of 12 rows each
    assert save_bytes(tmp_path / "inc") <= bound, (save_bytes(tmp_path / "inc"), bound)
    manifest = json.loads((tmp_path / "inc" / "manifest.json").read_text())
    evicted = [f["num_rows"] for f in manifest["files"] if f["array"] == "evicted"]
    assert evicted == [4 if evicting else 0]
    same_collections(coll, hbk.EmbeddingCollection.load(tmp_path / "inc", comm=LOCAL))


def test_a_chain_of_100_saves_replays_exactly(tmp_path):
    rng = np.random.default_rng(0)
    specs = [hbk.TableSpec("d", num_rows=None, dim=3, capacity=24, evict="lfu", admit_count=2),
             hbk.TableSpec("s", num_rows=200, dim=5)]
    coll = hbk.EmbeddingCollection(specs, comm=LOCAL, optimizer=hbk.optim.Adam(lr=0.05))
    pool = rng.integers(-2**63, 2**63 - 1, 60, dtype=np.int64)

    def feats():
        n = int(rng.integers(0, 9))
        return {"d": hbk.Ragged(rng.choice(pool, n), np.array([0, n // 2, n])),
                "s": rng.integers(0, 200, 3)}

    step(coll, feats())
    coll.save(tmp_path / "0")
    for k in range(1, 101):
        if k % 7 == 0:  # a look-up only: scores move, rows do not
            coll.forward(feats())
        elif k % 11:  # (and every 11th save follows no call at all)
            step(coll, feats())
        assert coll.save(tmp_path / str(k), incremental=True, chain_limit=np.inf) == "incremental"
    assert coll.dynamic_counts("d")["evicted"] > 0
    assert coll.hash_tables["d"].pending_state()["ids"].shape[0] > 0
    back = hbk.EmbeddingCollection.load(tmp_path / "100", comm=LOCAL)
    same_collections(coll, back)
    step(coll, {"d": hbk.Ragged(pool[:6], np.array([0, 6])), "s": np.arange(3)})
    step(back, {"d": hbk.Ragged(pool[:6], np.array([0, 6])), "s": np.arange(3)})
    same_collections(coll, back)  # and they go on alike


def test_a_chain_past_its_limit_starts_again(tmp_path):
    specs = [hbk.TableSpec("s", num_rows=4000, dim=8)]
    coll = hbk.EmbeddingCollection(specs, comm=LOCAL)
    coll.save(tmp_path / "0")
    full, chain, kinds, expected = files_bytes(tmp_path / "0"), 0, [], []
    for k in range(1, 6):
        step(coll, {"s": np.arange(400 * k, 400 * k + 600)})  # 15% of the rows a save
        expected.append("full" if chain >= 0.5 * full else "incremental")
        kinds.append(coll.save(tmp_path / str(k), incremental=True))
        chain = 0 if kinds[-1] == "full" else chain + max(files_bytes(tmp_path / str(k)),
                                                          checkpoint.CHAIN_SAVE_BYTES)
        assert ("parent" in json.loads((tmp_path / str(k) / "manifest.json").read_text())) == \
            (kinds[-1] == "incremental")
        same_collections(coll, hbk.EmbeddingCollection.load(tmp_path / str(k), comm=LOCAL))
    assert kinds == expected and "full" in kinds and kinds[-1] == "incremental", kinds


def test_a_crash_during_an_incremental_save_leaves_the_chain(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    specs = [hbk.TableSpec("d", num_rows=None, dim=2, capacity=8, admit_count=2),
             hbk.TableSpec("s", num_rows=50, dim=2)]
    coll = hbk.EmbeddingCollection(specs, comm=LOCAL)
    pool = rng.integers(0, 2**62, 20)
    step(coll, {"d": rng.choice(pool, 6), "s": np.arange(6)})
    coll.save(tmp_path / "a")
    step(coll, {"d": rng.choice(pool, 6), "s": np.arange(6)})
    coll.save(tmp_path / "b", incremental=True, chain_limit=np.inf)
    before = hbk.EmbeddingCollection.load(tmp_path / "b", comm=LOCAL)
    same_collections(coll, before)
    step(coll, {"d": rng.choice(pool, 6), "s": np.arange(3, 9)})
    pack = tmp_path / "b" / json.loads((tmp_path / "b" / "manifest.json").read_text())["files"][0]["file"]
    size = pack.stat().st_size
    writes = []
    real = {"write_atomic": _format.write_atomic,  # the manifest
            "append_linked": _format.append_linked}  # the pack, appended to b's file

    def crashing(name, k):
        def write(*args, **kwargs):
            writes.append(name)
            if len(writes) == k:
                raise OSError(28, "No space left on device (simulated)")
            return real[name](*args, **kwargs)
        return write

    k = 1
    while True:
        writes.clear()
        for name in real:
            monkeypatch.setattr(_format, name, crashing(name, k))
        target = tmp_path / f"c{k}"
        try:
            coll.save(target, incremental=True, chain_limit=np.inf)
        except hbk.CheckpointError:
            assert not (target / "manifest.json").exists()
            assert pack.stat().st_size == size  # b's file as it was
            same_collections(before, hbk.EmbeddingCollection.load(tmp_path / "b", comm=LOCAL))
            k += 1
            continue
        break
    assert k == 3 and writes == ["append_linked", "write_atomic"], f"the save wrote {writes}"
    assert pack.stat().st_size > size
    monkeypatch.undo()
    same_collections(coll, hbk.EmbeddingCollection.load(target, comm=LOCAL))


KILLED = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import hbkernels as hbk
    from hbkernels.sharding.checkpoint import _format

    where, fatal = sys.argv[1], int(sys.argv[2])
    specs = [hbk.TableSpec("d", num_rows=None, dim=3, capacity=8, admit_count=2),
             hbk.TableSpec("s", num_rows=50, dim=3)]
    coll = hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"), device="cpu")
    rng = np.random.default_rng(4)

    def step():
        out = coll.forward({"d": rng.integers(0, 20, 6), "s": rng.integers(0, 50, 6)})
        coll.backward({f: np.ones(o.shape, np.float32) for f, o in out.items()})

    step()
    coll.save(os.path.join(where, "a"))
    step()
    coll.save(os.path.join(where, "b"), incremental=True, chain_limit=np.inf)
    hbk.EmbeddingCollection.load(os.path.join(where, "b"), comm=hbk.dist.init("local")).save(
        os.path.join(where, "same-as-b"))  # (coll's next save chains to b)
    real, real_append, calls = _format.write_atomic, _format.append_linked, []

    class Dying:  # half of what the fatal write writes reaches the file, then SIGKILL
        def __init__(self, f):
            self.f = f
        def write(self, data):
            view = memoryview(data).cast("B")
            self.f.write(view[:max(1, view.nbytes // 2)])
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def dying(path, write):
        calls.append(path)
        return real(path, (lambda f: write(Dying(f))) if len(calls) == fatal else write)

    def dying_append(source, path, end, align, write):  # c's pack, appended to b's file
        calls.append(path)
        return real_append(source, path, end, align,
                           (lambda f: write(Dying(f))) if len(calls) == fatal else write)

    _format.write_atomic, _format.append_linked = dying, dying_append
    step()
    coll.save(os.path.join(where, "c"), incremental=True, chain_limit=np.inf)
    print("not killed")
""")


@pytest.mark.parametrize("fatal", [1, 2], ids=["in-its-file", "in-its-manifest"])
def test_a_kill_during_an_incremental_save_leaves_the_chain(tmp_path, fatal):
    """SIGKILL half way through appending an incremental save's pack to its parent's
    file (or through writing its manifest): the chain before it loads as saved, and a
    save into the same directory goes on."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path), str(fatal)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert list((tmp_path / "c").glob("save-*/*.tmp-*")) or list((tmp_path / "c").glob("*.tmp-*"))
    with pytest.raises(hbk.CheckpointError, match="no checkpoint manifest"):
        hbk.EmbeddingCollection.load(tmp_path / "c", comm=LOCAL)
    files = json.loads((tmp_path / "b" / "manifest.json").read_text())["files"]
    grown = (tmp_path / "b" / files[0]["file"]).stat().st_size > max(f["offset"] + f["bytes"] for f in files)
    assert grown  # c's pack (half of it, or all, its manifest unwritten) past b's, in b's file
    back = hbk.EmbeddingCollection.load(tmp_path / "b", comm=LOCAL)
    same_collections(hbk.EmbeddingCollection.load(tmp_path / "same-as-b", comm=LOCAL), back)
    back.save(tmp_path / "c")  # what the killed save left is removed
    assert [p.name for p in (tmp_path / "c").iterdir() if p.name != "manifest.json"] == \
        [json.loads((tmp_path / "c" / "manifest.json").read_text())["save"]]
    same_collections(back, hbk.EmbeddingCollection.load(tmp_path / "c", comm=LOCAL))


def test_compact_turns_a_chain_into_one_full_save(tmp_path, capsys):
    rng = np.random.default_rng(2)
    specs = [hbk.TableSpec("d", num_rows=None, dim=3, capacity=16, evict="lfu"),
             hbk.TableSpec("s", num_rows=40, dim=3)]
    coll = hbk.EmbeddingCollection(specs, comm=LOCAL)
    pool = rng.integers(0, 2**62, 30)
    step(coll, {"d": rng.choice(pool, 10), "s": np.arange(5)})
    coll.save(tmp_path / "0")
    for k in range(1, 4):
        step(coll, {"d": rng.choice(pool, 10), "s": np.arange(5 * k, 5 * k + 5)})
        coll.save(tmp_path / str(k), incremental=True, chain_limit=np.inf)
    assert main(["compact", str(tmp_path / "3"), "--out", str(tmp_path / "whole")]) == 0
    assert "a full save and 3 incremental saves" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    assert "parent" not in manifest
    for k in range(4):  # the chain is no longer needed
        os.rename(tmp_path / str(k), tmp_path / f"gone{k}")
    same_collections(coll, hbk.EmbeddingCollection.load(tmp_path / "whole", comm=LOCAL))
    assert main(["compact", str(tmp_path / "whole"), "--out", str(tmp_path / "whole")]) == 1


def _chain(tmp_path):
    """A full save and an incremental one of a dynamic table with pending ids and
    evictions: the incremental save's directory."""
    rng = np.random.default_rng(3)
    specs = [hbk.TableSpec("d", num_rows=None, dim=2, capacity=6, admit_count=2, evict="lru")]
    coll = hbk.EmbeddingCollection(specs, comm=LOCAL)
    pool = rng.integers(0, 2**62, 12)
    for ids in (pool[:5], pool[:5], pool[5:8]):  # 5 admitted, 3 pending
        step(coll, {"d": ids})
    coll.save(tmp_path / "a")
    for ids in (pool[5:10], pool[5:10], pool[10:12]):  # 5 admitted (4 evicted), 2 pending
        step(coll, {"d": ids})
    coll.save(tmp_path / "b", incremental=True, chain_limit=np.inf)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert all(f["num_rows"] for f in manifest["files"]
               if f["array"] in ("evicted", "pending_removed")), manifest["files"]
    same_collections(coll, hbk.EmbeddingCollection.load(tmp_path / "b", comm=LOCAL))
    return tmp_path / "b"


CHANGE_EDITS = [("evicted", "dtype", "float32"), ("evicted", "shape", [3, 1]),
                ("evicted", "array", "weights"), ("pending_removed", "array", "nothing"),
                ("ids", "num_rows", 10**9), ("last", "shape", [0])]


@pytest.mark.parametrize("array, key, value", CHANGE_EDITS,
                         ids=[f"{a}.{k}={v!r}" for a, k, v in CHANGE_EDITS])
def test_a_tampered_incremental_save_is_refused(tmp_path, array, key, value):
    from hbkernels.sharding.checkpoint import _manifest

    path = _chain(tmp_path)
    hbk.EmbeddingCollection.load(path, comm=LOCAL)  # as saved: fine
    manifest = json.loads((path / "manifest.json").read_text())
    next(f for f in manifest["files"] if f["array"] == array)[key] = value
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    (path / "manifest.json").write_text(json.dumps(_manifest.seal(body)))
    with pytest.raises(hbk.CheckpointError, match="manifest.json"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)


@pytest.mark.parametrize("array", ["evicted", "pending_removed"])
def test_an_incremental_save_without_its_removals_is_refused(tmp_path, array):
    from hbkernels.sharding.checkpoint import _manifest

    path = _chain(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = [f for f in manifest["files"] if f["array"] != array]
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    (path / "manifest.json").write_text(json.dumps(_manifest.seal(body)))
    with pytest.raises(hbk.CheckpointError, match=f"lack \\['{array}'\\]"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)


def test_a_chain_stops_at_max_chain_and_a_restore_starts_a_new_one(tmp_path):
    specs = [hbk.TableSpec("d", num_rows=None, dim=2, capacity=8),
             hbk.TableSpec("s", num_rows=8, dim=2)]
    coll = hbk.EmbeddingCollection(specs, comm=LOCAL, optimizer=hbk.optim.SGD(lr=0.1))
    coll.save(tmp_path / "0")
    kinds = []
    for k in range(1, checkpoint.MAX_CHAIN + 3):
        step(coll, {"d": np.array([k % 5]), "s": np.array([k % 8])})
        kinds.append(coll.save(tmp_path / str(k), incremental=True, chain_limit=np.inf))
        if k == checkpoint.MAX_CHAIN:  # the longest chain loads
            same_collections(coll, hbk.EmbeddingCollection.load(tmp_path / str(k), comm=LOCAL))
    assert kinds.index("full") == checkpoint.MAX_CHAIN, kinds.index("full")
    same_collections(coll, hbk.EmbeddingCollection.load(tmp_path / str(len(kinds)), comm=LOCAL))
    ids, last, count = coll.dynamic_scores("d")
    coll.restore_dynamic("d", ids, last, count, {"weights": coll.full_weights("d")[1] + 1})
    assert coll.save(tmp_path / "after", incremental=True) == "full"
    same_collections(coll, hbk.EmbeddingCollection.load(tmp_path / "after", comm=LOCAL))


def _reseal(path, edit):
    from hbkernels.sharding.checkpoint import _manifest

    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    body = {k: v for k, v in manifest.items() if k != "crc32"}
    (path / "manifest.json").write_text(json.dumps(_manifest.seal(body)))


def _reseal_parent(path, edit):
    """``edit`` the manifest of the save the one at ``path`` chains to, and relink."""
    parent = (path / json.loads((path / "manifest.json").read_text())["parent"]["path"]).resolve()
    _reseal(parent, edit)
    crc = json.loads((parent / "manifest.json").read_text())["crc32"]
    _reseal(path, lambda m: m["parent"].update(crc32=crc))


def _unpack(path):
    """Rewrite the incremental save at ``path`` as format 2 wrote it: each array in a
    ``.npy`` file of its own."""
    manifest = json.loads((path / "manifest.json").read_text())
    packs = {f["file"] for f in manifest["files"]}
    for f in manifest["files"]:
        raw = (path / f["file"]).read_bytes()[f.pop("offset"):][:f["bytes"]]
        f["file"] = f"{manifest['save']}/t0.{f['slice']}.{f['row_start']}-{f['row_step']}.{f['array']}.npy"
        np.save(path / f["file"], np.frombuffer(raw, f["dtype"]).reshape(f["shape"]))
        raw = (path / f["file"]).read_bytes()
        f.update(bytes=len(raw), crc32=zlib.crc32(raw))
    for name in packs:
        os.remove(path / name)
    _reseal(path, lambda m: m.update(files=manifest["files"], version=2))


def test_formats_and_removal_lists_are_checked(tmp_path):
    path = _chain(tmp_path)
    full = tmp_path / "a"
    saved = hbk.EmbeddingCollection.load(path, comm=LOCAL)
    _reseal(path, lambda m: m.update(version=2))  # offsets in a format-2 save
    with pytest.raises(hbk.CheckpointError, match="only an incremental save of format 3 has"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)
    _reseal_parent(path, lambda m: m.update(version=2))
    _unpack(path)  # a chain format 2 wrote: still read
    same_collections(saved, hbk.EmbeddingCollection.load(path, comm=LOCAL))
    entry = next(f for f in json.loads((path / "manifest.json").read_text())["files"]
                 if f["array"] == "evicted")
    _reseal(path, lambda m: m.update(version=1))  # as format 1, with its removals listed
    with pytest.raises(hbk.CheckpointError, match="only an incremental save of format 2 or later"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)
    _reseal(path, lambda m: m.update(files=[f for f in m["files"] if f["array"] not in
                                            ("evicted", "pending_removed")]))
    with pytest.raises(hbk.CheckpointError, match="version 1 chained to a save of version 2"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)  # (read as format 1 it keeps evicted ids)
    _reseal(full, lambda m: m["files"].append(dict(entry, file=m["save"] + "/extra.npy")))
    with pytest.raises(hbk.CheckpointError, match="only an incremental save of format 2 or later"):
        hbk.EmbeddingCollection.load(full, comm=LOCAL)


PACK_EDITS = {
    "a byte of its weights": lambda f, pack: pack.__setitem__(f["offset"] + 1,
                                                              pack[f["offset"] + 1] ^ 1),
    "the pack cut short": lambda f, pack: pack.__delitem__(slice(f["offset"] + 4, None)),
    "its offset moved": lambda f, pack: f.__setitem__("offset", f["offset"] + 64),
    "its offset past the end": lambda f, pack: f.__setitem__("offset", 10**9),
}


@pytest.mark.parametrize("edit", list(PACK_EDITS))
def test_a_damaged_incremental_file_is_refused(tmp_path, edit):
    """An incremental save writes one file per rank; each array in it has its own crc32."""
    path = _chain(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    entry = next(f for f in manifest["files"] if f["array"] == "weights")
    assert {f["file"] for f in manifest["files"]} == {entry["file"]}  # one file
    assert all(f["offset"] % checkpoint.PACK_ALIGN == 0 for f in manifest["files"])
    pack = bytearray((path / entry["file"]).read_bytes())
    PACK_EDITS[edit](entry, pack)
    (path / entry["file"]).write_bytes(pack)
    _reseal(path, lambda m: m.update(files=manifest["files"]))
    with pytest.raises(hbk.CheckpointError, match=r"r0\.pack\.npy: checkpoint file is corrupt"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)


@pytest.mark.parametrize("key, value", [("offset", -64), ("offset", "0"), ("bytes", 1),
                                        ("file", "save-1-00000000/r0.pack.npy")])
def test_pack_fields_are_checked(tmp_path, key, value):
    path = _chain(tmp_path)
    _reseal(path, lambda m: next(f for f in m["files"] if f["array"] == "weights")
            .__setitem__(key, value))
    with pytest.raises(hbk.CheckpointError, match="manifest.json"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)


def test_an_incremental_file_is_a_npy_of_bytes(tmp_path):
    path = _chain(tmp_path)
    entry = next(f for f in json.loads((path / "manifest.json").read_text())["files"]
                 if f["array"] == "weights")
    pack = np.load(path / entry["file"])
    assert pack.dtype == np.uint8
    got = pack[entry["offset"] - (path / entry["file"]).stat().st_size + pack.shape[0]:][:entry["bytes"]]
    np.testing.assert_array_equal(got.view(np.float32).reshape(entry["shape"]),
                                  checkpoint.Checkpoint(path)._reader.all_rows("d", "weights"))


def test_pending_ids_are_required_where_the_table_admits_late(tmp_path):
    path = _chain(tmp_path)
    _reseal(path, lambda m: m.update(files=[f for f in m["files"] if f["array"] != "pending_ids"]))
    with pytest.raises(hbk.CheckpointError, match="pending_ids"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)


def _packed_chain(tmp_path):
    """A full save and three incremental ones of a dynamic and a static table (0 to 3):
    the newest's directory and the collection."""
    rng = np.random.default_rng(4)
    specs = [hbk.TableSpec("d", num_rows=None, dim=3, capacity=10, admit_count=2, evict="lfu"),
             hbk.TableSpec("s", num_rows=30, dim=2)]
    coll = hbk.EmbeddingCollection(specs, comm=LOCAL, optimizer=hbk.optim.Adagrad(lr=0.1))
    pool = rng.integers(0, 2**62, 16)
    step(coll, {"d": rng.choice(pool, 8), "s": rng.integers(0, 30, 4)})
    coll.save(tmp_path / "0")
    for k in range(1, 4):
        step(coll, {"d": rng.choice(pool, 8), "s": rng.integers(0, 30, 4)})
        assert coll.save(tmp_path / str(k), incremental=True, chain_limit=np.inf) == "incremental"
    return tmp_path / "3", coll


def _edit_parent_pack(path, edit):
    """``edit(bytearray)`` the pack of the save the one at ``path`` chains to (its
    parent, an incremental save: one rank's pack, in its file), and relink: the crc32
    the manifest at ``path`` names for it."""
    manifest = json.loads((path / "manifest.json").read_text())
    name, size, _, offset = manifest["parent"]["packs"][0]
    file = (path / manifest["parent"]["path"] / name).resolve()
    whole = bytearray(file.read_bytes())
    raw = whole[offset:offset + size]
    edit(raw)
    whole[offset:offset + size] = raw
    file.write_bytes(whole)
    _reseal(path, lambda m: m["parent"].update(packs=[[name, size, zlib.crc32(raw), offset]]))


def _head(raw):
    """Where the head of a pack's bytes ``raw`` begins (after its ``.npy`` header)."""
    return 10 + int.from_bytes(raw[8:10], "little")


def _no_hard_links(monkeypatch):
    """A file system that makes no hard links, from here on."""
    def link(*args, **kwargs):
        raise OSError(1, "Operation not permitted (simulated: no hard links)")
    monkeypatch.setattr(os, "link", link)


def _pack_file(path):
    """The file of rank 0's pack of the incremental save at ``path``."""
    manifest = json.loads((path / "manifest.json").read_text())
    return path / next(f["file"] for f in manifest["files"] if f["row_start"] == 0)


def test_a_chain_appends_to_one_file_per_rank(tmp_path):
    """Each incremental save appends its pack to its parent's file (a hard link under its
    own name), so the saves of a chain make one file, read once by a load; each save
    still loads, and the newest loads with the directories of the saves between it and
    the full save gone."""
    path, coll = _packed_chain(tmp_path)
    files = [_pack_file(tmp_path / str(k)) for k in (1, 2, 3)]
    assert len({f.stat().st_ino for f in files}) == 1 and files[0].stat().st_nlink == 3
    packs = [json.loads((tmp_path / str(k) / "manifest.json").read_text())["parent"]["packs"][0]
             for k in (2, 3)]  # [file, bytes, crc32, offset] of saves 1 and 2
    assert packs[0][3] == 0 and packs[1][3] == -(-packs[0][1] // checkpoint.PACK_ALIGN) * 64
    assert files_bytes(tmp_path / "3") < files[0].stat().st_size // 2
    for k in (1, 2):
        shutil.rmtree(tmp_path / str(k))
    same_collections(coll, hbk.EmbeddingCollection.load(path, comm=LOCAL))


def test_a_file_whose_end_is_not_the_parents_pack_starts_again(tmp_path, monkeypatch):
    """Where the parent's file holds more than its pack (what a killed append left) or
    the file system makes no hard links, an incremental save writes a file of its own."""
    path, coll = _packed_chain(tmp_path)
    with open(_pack_file(path), "ab") as f:
        f.write(b"half a pack")
    step(coll, {"d": np.arange(4), "s": np.arange(4)})
    coll.save(tmp_path / "4", incremental=True, chain_limit=np.inf)
    assert _pack_file(tmp_path / "4").stat().st_nlink == 1
    _no_hard_links(monkeypatch)
    step(coll, {"d": np.arange(4, 8), "s": np.arange(4)})
    coll.save(tmp_path / "5", incremental=True, chain_limit=np.inf)
    assert _pack_file(tmp_path / "5").stat().st_nlink == 1
    same_collections(coll, hbk.EmbeddingCollection.load(tmp_path / "5", comm=LOCAL))
    assert len(checkpoint.Checkpoint(tmp_path / "5").chain()) == 6


@pytest.mark.parametrize("links", [True, False], ids=["one-file", "a-file-each"])
def test_the_saves_below_the_newest_are_read_through_their_packs(tmp_path, monkeypatch, links):
    if not links:
        _no_hard_links(monkeypatch)
    path, coll = _packed_chain(tmp_path)
    monkeypatch.undo()
    for k in (1, 2):  # their manifests are not read
        os.rename(tmp_path / str(k) / "manifest.json", tmp_path / str(k) / "unread.json")
    same_collections(coll, hbk.EmbeddingCollection.load(path, comm=LOCAL))
    assert len(checkpoint.Checkpoint(path).chain()) == 4
    name, size, _, offset = json.loads((tmp_path / "2" / "unread.json").read_text())["parent"]["packs"][0]
    assert (json.loads((path / "manifest.json").read_text())["parent"]["packs"][0][3] > 0) == links
    if links:  # save 1's pack, through save 3's name for the file: its crc32 in save 2's pack
        raw = bytearray(_pack_file(path).read_bytes())
        raw[offset + size - 1] ^= 1
        _pack_file(path).write_bytes(raw)
        with pytest.raises(hbk.CheckpointError, match=r"1/save-\d+-[0-9a-f]+/r0\.pack\.npy: "
                                                      r"checkpoint file is corrupt"):
            hbk.EmbeddingCollection.load(path, comm=LOCAL)
        shutil.rmtree(tmp_path / "1")
        with pytest.raises(hbk.CheckpointError, match="missing; .* was overwritten or removed"):
            hbk.EmbeddingCollection.load(path, comm=LOCAL)
        return
    raw = bytearray((tmp_path / "1" / name).read_bytes())
    os.rename(tmp_path / "1" / name, tmp_path / "copy")
    os.symlink(tmp_path / "copy", tmp_path / "1" / name)  # the same bytes, through a link
    with pytest.raises(hbk.CheckpointError, match="is a symbolic link"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)
    os.remove(tmp_path / "1" / name)
    raw[-1] ^= 1  # a byte of save 1, named with its crc32 in save 2's file
    (tmp_path / "1" / name).write_bytes(raw)
    with pytest.raises(hbk.CheckpointError, match=r"r0\.pack\.npy: checkpoint file is corrupt"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)
    os.rename(tmp_path / "1" / name.split("/")[0], tmp_path / "1" / "elsewhere")
    with pytest.raises(hbk.CheckpointError, match="missing; .* was overwritten or removed"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)


def test_a_file_not_of_the_newest_saves_layout_is_read_through_its_manifest(tmp_path):
    path, coll = _packed_chain(tmp_path)

    def layout(raw):  # the crc32 of its layout, in its head
        raw[_head(raw) + 12] ^= 1

    _edit_parent_pack(path, layout)
    same_collections(coll, hbk.EmbeddingCollection.load(path, comm=LOCAL))
    os.rename(tmp_path / "2" / "manifest.json", tmp_path / "2" / "unread.json")
    with pytest.raises(hbk.CheckpointError, match="2/manifest.json: no checkpoint manifest here"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)


def _link(raw):
    """Where the link in the head of a pack's bytes ``raw`` begins."""
    at = _head(raw)
    return at + 24 + 8 * int.from_bytes(raw[at + 8:at + 12], "little")


HEAD_EDITS = {
    "a row count": (lambda raw: raw.__setitem__(slice(_head(raw) + 24, _head(raw) + 32),
                                                (10**6).to_bytes(8, "little")),
                    "do not hold the rows their heads name"),
    "its link's lengths": (lambda raw: raw.__setitem__(slice(_link(raw) + 8, _link(raw) + 10),
                                                       b"\xff\xff"),
                           "unreadable link in its head"),
    "its link's directory": (lambda raw: raw.__setitem__(_link(raw) + 12 + 24, ord("x")),
                             "unreadable link in its head"),
    "its .npy header": (lambda raw: raw.__setitem__(8, 7), "not a pack"),
}


@pytest.mark.parametrize("edit", list(HEAD_EDITS))
def test_a_damaged_head_is_refused(tmp_path, edit):
    """A file's head (its rows and its link) is checked as a manifest would be, though
    its crc32 is the one its child names."""
    path, _ = _packed_chain(tmp_path)
    fix, message = HEAD_EDITS[edit]
    _edit_parent_pack(path, fix)
    with pytest.raises(hbk.CheckpointError, match=message):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)


def test_append_linked_appends_under_a_second_name_or_changes_nothing(tmp_path, monkeypatch):
    from hbkernels._files import append_linked

    source, path = tmp_path / "a", tmp_path / "b"
    source.write_bytes(b"x" * 70)
    assert append_linked(source, path, 69, 64, lambda f: f.write(b"y")) is None  # not its end
    assert append_linked(source, path, 70, 64, lambda f: f.write(b"yz")) == (2, 128)
    assert path.read_bytes() == b"x" * 70 + bytes(58) + b"yz" and path.stat().st_ino == source.stat().st_ino

    def failing(f):
        f.write(b"half")
        raise OSError(28, "No space left on device (simulated)")

    with pytest.raises(OSError, match="simulated"):
        append_linked(source, tmp_path / "c", 130, 64, failing)
    assert source.stat().st_size == 130 and sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    source.chmod(0o444)
    if not os.access(source, os.W_OK):  # (root writes anyway)
        assert append_linked(source, tmp_path / "c", 130, 64, lambda f: f.write(b"y")) is None
    source.chmod(0o644)
    _no_hard_links(monkeypatch)
    assert append_linked(source, tmp_path / "c", 130, 64, lambda f: f.write(b"y")) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


LINK_EDITS = {"its offset negative": lambda p: p[0].__setitem__(3, -64),
              "its offset a string": lambda p: p[0].__setitem__(3, "0"),
              "its crc32 past 32 bits": lambda p: p[0].__setitem__(2, 1 << 32),
              "its bytes past 63 bits": lambda p: p[0].__setitem__(1, 1 << 63),
              "another save's directory": lambda p: p[0].__setitem__(0, "save-1-00000000/r0.pack"),
              "of two formats": lambda p: p.append(p[0][:3]),
              "of format 4 in a save of format 5": lambda p: p.__setitem__(0, p[0][:3]),
              "empty": lambda p: p.clear()}


@pytest.mark.parametrize("edit", list(LINK_EDITS))
def test_a_links_packs_are_checked(tmp_path, edit):
    path, _ = _packed_chain(tmp_path)
    _reseal(path, lambda m: LINK_EDITS[edit](m["parent"]["packs"]))
    with pytest.raises(hbk.CheckpointError, match="3/manifest.json: .*parent packs? "):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)


@pytest.mark.parametrize("value", ["", "../2\0x"], ids=["empty", "a NUL"])
def test_a_links_path_is_checked(tmp_path, value):
    path, _ = _packed_chain(tmp_path)
    _reseal(path, lambda m: m["parent"].update(path=value))
    with pytest.raises(hbk.CheckpointError, match="3/manifest.json: parent path .* empty or holds a NUL"):
        hbk.EmbeddingCollection.load(path, comm=LOCAL)


def test_a_symlinked_parent_file_is_not_appended_to(tmp_path):
    path, coll = _packed_chain(tmp_path)
    real = _pack_file(path)
    os.rename(real, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", real)
    step(coll, {"d": np.arange(4), "s": np.arange(4)})
    coll.save(tmp_path / "4", incremental=True, chain_limit=np.inf)
    assert _pack_file(tmp_path / "4").stat().st_nlink == 1  # a file of its own
    assert (tmp_path / "elsewhere").stat().st_nlink == 3  # saves 1 and 2, and "elsewhere"


@pytest.mark.parametrize("path, to", [("/a/b/5", "../4"), ("b", "../c"), ("/x", "../y"), (".", "../b"),
                                      ("/", "../a"), ("a/b", "../.."), ("a/b", "../c/d"),
                                      ("../../a", "../b"), ("a/b", "./c"), ("a/b", "/abs"),
                                      ("a/b", "../.hidden"), ("a/b", "../")])
def test_a_links_path_resolves_as_normpath_join(path, to):
    from hbkernels.sharding.checkpoint._packs import _resolve

    assert _resolve(path, to) == os.path.normpath(os.path.join(path, to))
