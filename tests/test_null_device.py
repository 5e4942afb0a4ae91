"""The null device (hbkernels.bench.null_device): the CUDA path's host code with no kernel
run. ``bench_launch --device null`` profiles every host case and says that no kernel ran;
its counts per call (kernel launches, library calls, waits, device allocations) are the
ones docs/gpu.md's table states; a read of a kernel's result that no answer covers is
an error naming the function that read; a kernel's output is never computed. Each runs
in a process of its own, without the simulator (the null device takes the GPU branch)."""
import csv
import re
import subprocess
import sys
import textwrap

import pytest

from mpirun import ROOT, _env

pytest.importorskip("numba.cuda")
DOCS = ROOT / "docs" / "gpu.md"
ROW = re.compile(r"\| `([^`]+)` \(([^)]+)\) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|")


def run_python(*args, timeout=600):
    env = {**_env(), "NUMBA_ENABLE_CUDASIM": "0"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def documented_counts():
    """``{(op, mode): (launches, library, syncs, allocations)}`` from docs/gpu.md's table."""
    text = DOCS.read_text()
    table = text[text.index("<!-- null-device counts -->"):text.index("<!-- end of counts -->")]
    return {(m[1], m[2]): tuple(int(v) for v in m.groups()[2:]) for m in ROW.finditer(table)}


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("null") / "host.csv"
    res = run_python("-m", "hbkernels.bench.bench_launch", "--device", "null", "--smoke",
                     "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(out, newline="") as f:
        return res.stdout, list(csv.DictReader(f))


def test_the_profile_says_no_kernel_ran_and_covers_every_case(profile):
    stdout, rows = profile
    assert "NO KERNEL RAN" in stdout and "assumed" in stdout
    ops = {r["op"] for r in rows}
    public = {"embedding_bag", "embedding_bag_backward", "lookup", "lookup_backward",
              "per_sample_weights_backward", "segment_sum", "segment_reduce", "unique",
              "partition", "check_ragged", "HashTable.slots", "main job sparse step",
              "collection forward", "collection step"}
    optimizers = {f"{name}.fused_step" for name in ("SGD", "Adagrad", "RowWiseAdagrad", "Adam",
                                                     "Ftrl")}
    assert public | optimizers <= ops
    for r in rows:
        assert float(r["python_us_min"]) <= float(r["python_us"]) <= float(r["python_us_max"])
        events = sum(int(r[k]) * c for k, c in
                     {"launches": 2.5, "library": 6.0, "allocations": 1.0, "syncs": 4.0}.items())
        assert float(r["events_us"]) == pytest.approx(events, abs=0.01)
        assert float(r["us"]) == pytest.approx(float(r["python_us"]) + events, abs=0.02)
    assert any(line.startswith("target embedding_bag raise: <= 15 µs") for line in stdout.splitlines())


def test_the_counts_are_the_documented_ones(profile):
    _, rows = profile
    documented = documented_counts()
    measured = {(r["op"], r["mode"]): tuple(int(r[k]) for k in ("launches", "library", "syncs",
                                                                 "allocations")) for r in rows}
    assert documented, "docs/gpu.md has no table of counts"
    assert measured == documented


STAND_IN = textwrap.dedent("""
    import sys
    import numpy as np
    from hbkernels.bench import null_device as nd
    nd.install()
    import hbkernels as hbk
    cp = sys.modules["cupy"]
    table = cp.asarray(np.ones((10, 3), np.float32))
    ids, offsets = cp.asarray(np.array([1, 2, 2])), cp.asarray(np.array([0, 1, 3]))
    hbk.embedding_bag(table, ids, offsets)  # the first call also makes the checks' ledger
    before, _ = nd.snapshot()
    out = hbk.embedding_bag(table, ids, offsets)
    after, _ = nd.snapshot()
    print("counts", {k: after[k] - before[k] for k in nd.EVENTS})
    hbk.synchronize()  # the checks' slots read as clean (a default answer)
    try:
        out.get()  # the pooled rows are a kernel's, which never ran
    except LookupError as error:
        print("output is a kernel's", "__main__" in str(error))
    print("a host copy reads as it was", cp.asarray(np.array([1.0, 2.0])).get().tolist())
    try:
        hbk.unique(ids)
    except LookupError as error:
        print("unanswered:", error)
    with nd.answers({"hbkernels.cuda.unique.unique": lambda shape, dtype: np.array([2])}):
        print("unique size", hbk.unique(ids).shape)
""")


def test_the_stand_in_counts_and_runs_no_kernel():
    res = run_python("-c", STAND_IN, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert "counts {'launches': 1, 'library': 0, 'allocations': 1, 'syncs': 0}" in lines
    assert "output is a kernel's True" in lines
    assert "a host copy reads as it was [1.0, 2.0]" in lines
    unanswered = next(line for line in lines if line.startswith("unanswered:"))
    assert "hbkernels.cuda.unique.unique" in unanswered and "no answer" in unanswered
    assert "unique size (2,)" in lines


def agreeing(script, count):
    """``(rows, stdout)`` of ``script``, run in a new process: it ends well and prints
    ``count`` rows (``|``-separated fields), each ending with ``agrees``."""
    res = run_python("-c", script, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line.split("|") for line in res.stdout.splitlines()]
    assert len(rows) == count and all(verdict == "agrees" for *_, verdict in rows), res.stdout
    return rows, res.stdout


PLAIN = textwrap.dedent("""
    import sys
    import numpy as np
    from hbkernels.bench import null_device as nd
    nd.install()
    import hbkernels as hbk
    from hbkernels import _validate as check, ops
    from hbkernels._dispatch import resolve
    cp = sys.modules["cupy"]
    table = cp.asarray(np.ones((10, 4), np.float32))
    ids = cp.asarray(np.arange(6))
    hbk.lookup(table, ids, bounds="unchecked")  # CuPy's array type, seen once
    cases = {
        "plain": (table, ids), "int32 ids": (table, ids.astype(np.int32)),
        "2-D ids": (table, ids.reshape(2, 3)), "fp16": (table.astype(np.float16), ids),
        "strided ids": (table, ids[::2]), "column slice": (table[:, :2], ids),
        "every other row": (table[::2], ids), "int8 ids": (table, ids.astype(np.int8)),
        "float ids": (table, ids.astype(np.float32)), "1-D table": (table[0], ids),
        "int table": (table.astype(np.int32), ids), "D = 0": (table[:, :0], ids),
        "NumPy ids": (table, np.arange(6)), "two id arrays": (table, ids, ids[:3]),
    }
    for name, (w, *id_arrays) in cases.items():
        fast = ops._plain_inputs(w, *id_arrays)
        try:
            named = {f"ids{k}": a for k, a in enumerate(id_arrays)}
            family, a = resolve(row_tables=("weights",), weights=w, **named)
            check.table("weights", w)
            for k in named:
                check.ids(k, a[k])
            as_is = a["weights"] is w and all(a[k] is named[k] for k in named)
        except (TypeError, ValueError):
            family, as_is = None, False
        print(name, "fast" if fast is not None else "general",
              "agrees" if (fast is not None) == as_is and fast in (None, family) else "DIFFERS",
              sep="|")
""")


def test_plain_cupy_inputs_skip_only_what_resolve_and_the_checks_pass_as_they_are():
    rows, out = agreeing(PLAIN, 14)
    assert {name for name, path, _ in rows if path == "fast"} == {
        "plain", "int32 ids", "2-D ids", "fp16", "two id arrays"}, out


FUSED = textwrap.dedent("""
    import sys
    import numpy as np
    from hbkernels.bench import null_device as nd
    nd.install()
    import hbkernels as hbk
    from hbkernels import optim
    cp = sys.modules["cupy"]
    table = cp.asarray(np.ones((10, 4), np.float32))
    values, offsets = cp.asarray(np.array([1, 2, 2])), cp.asarray(np.array([0, 1, 3]))
    grad = cp.asarray(np.ones((2, 4), np.float32))
    hbk.lookup(table, values, bounds="unchecked")  # CuPy's array type, seen once
    general = optim.cupy_family_of
    resolved = []
    real_resolve = optim.resolve
    optim.resolve = lambda *a, **k: resolved.append(1) or real_resolve(*a, **k)

    def outcome(opt, state, g, psw, fast):
        optim.cupy_family_of = general if fast else (lambda *arrays, **kw: None)
        resolved.clear()
        try:
            opt.fused_step(table, state, g, values, offsets, per_sample_weights=psw,
                           bounds="unchecked")
            result = "ok"
        except (TypeError, ValueError) as error:
            result = f"{type(error).__name__}: {error}"
        return ("general" if resolved else "fast"), result

    for opt in (optim.SGD(lr=0.1), optim.RowWiseAdagrad(lr=0.1), optim.Adam(lr=0.1)):
        state = opt.init_state(table)
        slot = opt.slots[0][0] if opt.slots else None
        cases = {"plain": (state, grad, None),
                 "column slice of grad_out": (state, cp.asarray(np.ones((2, 8), np.float32))[:, ::2], None),
                 "weights": (state, grad, cp.asarray(np.ones(3, np.float32))),
                 "NumPy grad_out": (state, np.ones((2, 4), np.float32), None)}
        if slot is not None:
            s = state[slot]
            cases["state of another shape"] = ({**state, slot: s[:5]}, grad, None)
            cases["state of another dtype"] = ({**state, slot: s.astype(np.float64)}, grad, None)
            cases["strided state"] = ({**state, slot: cp.asarray(np.zeros((20,) + s.shape[1:], np.float32))[::2]}, grad, None)
            cases["NumPy state"] = ({**state, slot: np.zeros(s.shape, np.float32)}, grad, None)
            cases["state missing"] = ({"step": state["step"]}, grad, None)
        for name, (st, g, psw) in cases.items():
            path, got = outcome(opt, st, g, psw, True)
            _, want = outcome(opt, st, g, psw, False)
            print(type(opt).__name__, name, path, "agrees" if got == want else f"DIFFERS {got} {want}", sep="|")
""")


def test_fused_step_takes_cupy_arrays_as_they_are_only_where_resolve_would():
    rows, out = agreeing(FUSED, 4 + 2 * 9)
    assert {(opt, name) for opt, name, path, _ in rows if path == "fast"} == {
        ("SGD", "plain"), *((opt, name) for opt in ("RowWiseAdagrad", "Adam") for name in (
            "plain", "state of another shape", "state of another dtype"))}, out


def test_it_refuses_the_simulator_and_a_late_install():
    res = run_python("-c", "from hbkernels.bench import null_device as nd; nd.install()",
                     timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    env = {**_env(), "NUMBA_ENABLE_CUDASIM": "1"}
    res = subprocess.run([sys.executable, "-c", "from hbkernels.bench import null_device as nd; "
                          "nd.install()"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode != 0 and "unset NUMBA_ENABLE_CUDASIM" in res.stderr
    late = ("import hbkernels.cuda._launcher\nfrom hbkernels.bench import null_device as nd\n"
            "nd.install()")
    res = run_python("-c", late, timeout=120)
    assert res.returncode != 0 and "must be installed before" in res.stderr


COMPARE = textwrap.dedent("""
    import sys
    import numpy as np
    from hbkernels.bench import null_device as nd
    nd.install()
    import hbkernels as hbk
    cp = sys.modules["cupy"]
    ids = lambda *v: cp.asarray(np.array(v, np.int64))
    hbk.lookup(cp.asarray(np.ones((3, 2), np.float32)), ids(0), bounds="unchecked")  # CuPy seen

    def compare(module, fast_test, cases, call):
        \"\"\"For each case, the path ``call(*args)`` takes (``fast`` where ``module.resolve``
        is not called) and whether its outcome, an error included, is the general path's
        (``module.<fast_test>`` answering None).\"\"\"
        general, resolve, resolved = getattr(module, fast_test), module.resolve, []
        module.resolve = lambda *a, **k: resolved.append(1) or resolve(*a, **k)

        def outcome(args, fast):
            setattr(module, fast_test, general if fast else (lambda *arrays, **kw: None))
            resolved.clear()
            try:
                result = f"ok {call(*args)}"
            except (TypeError, ValueError) as error:
                result = f"{type(error).__name__}: {error}"
            return ("general" if resolved else "fast"), result

        for name, args in cases.items():
            path, got = outcome(args, True)
            _, want = outcome(args, False)
            print(name, path, "agrees" if got == want else f"DIFFERS {got} {want}", sep="|")
""")

COLLECTION = COMPARE + textwrap.dedent("""
    from hbkernels.sharding import collection as module
    specs = [hbk.TableSpec("a", num_rows=10, dim=4), hbk.TableSpec("b", num_rows=7, dim=4)]
    coll = hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"), device="cuda",
                                   optimizer=hbk.optim.Adagrad(lr=0.1))
    plain = {"a": hbk.Ragged(ids(1, 2, 2), ids(0, 1, 3)), "b": hbk.Ragged(ids(3), ids(0, 0, 1))}
    grads = {f: cp.asarray(np.ones((2, 4), np.float32)) for f in plain}

    def step(features, g):
        out = coll.forward(features)
        coll.backward(g)
        return sorted((f, tuple(o.shape)) for f, o in out.items())

    compare(module, "cupy_family_of", {
        "plain": (plain, grads),
        "NumPy values": ({**plain, "b": hbk.Ragged(np.array([3]), ids(0, 0, 1))}, grads),
        "strided values": ({**plain, "a": hbk.Ragged(ids(1, 0, 2, 0, 2, 0)[::2], ids(0, 1, 3))}, grads),
        "int32 values": ({**plain, "a": hbk.Ragged(cp.asarray(np.array([1, 2, 2], np.int32)), ids(0, 1, 3))}, grads),
        "2-D values": ({**plain, "a": hbk.Ragged(ids(1, 2, 2).reshape(3, 1), ids(0, 1, 3))}, grads),
        "one-hot ids": ({**plain, "b": ids(3, 4)}, grads),
        "NumPy grad": (plain, {**grads, "a": np.ones((2, 4), np.float32)}),
        "grad of another shape": (plain, {**grads, "a": cp.asarray(np.ones((3, 4), np.float32))}),
        "strided grad": (plain, {**grads, "a": cp.asarray(np.ones((2, 8), np.float32))[:, ::2]}),
    }, step)
""")


def test_the_collection_takes_cupy_inputs_as_they_are_only_where_resolve_would():
    rows, out = agreeing(COLLECTION, 9)
    assert {name for name, path, _ in rows if path == "fast"} == {
        "plain", "int32 values", "2-D values", "grad of another shape"}, out


BACKWARD = COMPARE + textwrap.dedent("""
    from hbkernels import ops
    values, offsets = ids(1, 2, 2), ids(0, 1, 3)
    grad = cp.asarray(np.ones((2, 4), np.float32))

    def backward(g, v, o, psw):  # padded and unchecked: nothing is read back
        out = hbk.embedding_bag_backward(g, v, o, num_rows=5, per_sample_weights=psw,
                                         padded=True, bounds="unchecked")
        return f"{tuple(out.ids.shape)} {tuple(out.rows.shape)} {out.rows.dtype}"

    compare(ops, "_plain_inputs", {
        "plain": (grad, values, offsets, None),
        "int32 values": (grad, values.astype(np.int32), offsets, None),
        "fp16 grad": (grad.astype(np.float16), values, offsets, None),
        "strided grad": (cp.asarray(np.ones((2, 8), np.float32))[:, ::2], values, offsets, None),
        "NumPy grad": (np.ones((2, 4), np.float32), values, offsets, None),
        "weights": (grad, values, offsets, cp.asarray(np.ones(3, np.float32))),
        "float values": (grad, values.astype(np.float32), offsets, None),
        "grad of 3 bags": (cp.asarray(np.ones((3, 4), np.float32)), values, offsets, None),
    }, backward)
""")


def test_the_backward_takes_cupy_inputs_as_they_are_only_where_resolve_would():
    rows, out = agreeing(BACKWARD, 8)
    assert {name for name, path, _ in rows if path == "fast"} == {
        "plain", "int32 values", "fp16 grad"}, out


EVENT_CASES = textwrap.dedent("""
    import sys
    from hbkernels.bench import null_device as nd
    nd.install()
    from hbkernels.bench.bench_launch import event_cases
    for name, call in event_cases(sys.modules["cupy"], 256, 16, 1000):
        call()  # (the arrays made once, outside the counted call)
        before = dict(nd.COUNTS)
        call()
        print(name, {k: nd.COUNTS[k] - before[k] for k in nd.EVENTS if nd.COUNTS[k] != before[k]})
""")


def test_each_event_case_makes_its_one_event():
    """``bench_launch``'s event cases, timed alone on a GPU beside the profile: the
    allocation makes one allocation; each library call one call and its result's
    allocation; nothing else, on the null device."""
    res = run_python("-c", EVENT_CASES, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 6
    for line in lines:
        want = ("{'allocations': 1}" if line.startswith("allocation ")
                else "{'library': 1, 'allocations': 1}")
        assert line.endswith(want), line
