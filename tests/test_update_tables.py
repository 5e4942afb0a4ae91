"""The collection's backward on the CUDA path: the static tables of one dtype, whatever
their widths and combiners, updated in the launches of one table's fused step
(``hbkernels.cuda.update_tables``). Each table's weights and state against its own
``fused_step`` (bit for bit) and against the CPU collection; long runs of one id (the
partial sums); a gradient with NaN; the launches a backward makes."""
import numpy as np
import pytest
from helpers import forward_on, make_opt, mixed_width_features, mixed_width_tables
from helpers import raises, recorded_launches, state_names

import hbkernels as hbk
from hbkernels._dispatch import device_family, host

pytestmark = pytest.mark.cuda

WEIGHTED = ("t4b", "u16", "t128")


def collection(specs, opt, device="cuda", replicated="t64"):
    return hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"), device=device,
                                   optimizer=opt, plan={replicated: "data_parallel"})


def alone(specs):
    """The tables that are a fused array of their own with one feature (compared with their
    own ``fused_step``)."""
    shared = {"t16", "u16"}  # one fused array
    return [s for s in specs if len(s.features or [s.name]) == 1 and s.name not in shared]


def snapshot(coll, spec):
    state = coll.full_state(spec.name)
    return host(coll.full_weights(spec.name)).copy(), {
        k: (v if k == "step" else host(v).copy()) for k, v in state.items()}


def gradients(rng, out):
    return {f: rng.standard_normal(host(o.values if isinstance(o, hbk.JaggedRows) else o).shape)
            .astype(np.float32) for f, o in out.items()}


def own_step(opt_name, spec, weights, state, grad, values, offsets, psw, **options):
    """``fused_step`` of table ``spec`` alone, on the CUDA path, from ``weights`` and
    ``state`` (host copies taken before the collection's step)."""
    put = device_family("cuda").put
    opt = make_opt(opt_name, **options)
    w = put(weights.copy())
    s = opt.init_state(w)
    for slot in state_names(opt):
        s[slot][...] = put(state[slot])
    s["step"][0] = state["step"]
    if spec.combiner is None:  # a sequence table: one id per bag
        offsets = np.arange(values.size + 1, dtype=np.int64)
    opt.fused_step(w, s, put(grad), put(values), put(offsets), combiner=spec.combiner or "sum",
                   per_sample_weights=None if psw is None else put(psw))
    return host(w), {slot: host(s[slot]) for slot in state_names(opt)} | {"step": int(s["step"][0])}


def check_against_own_steps(coll, opt_name, specs, before, batch, psw, grads, **options):
    for spec in alone(specs):
        f = spec.name
        want_w, want_s = own_step(opt_name, spec, *before[f], grads[f], *batch[f], psw.get(f),
                                  **options)
        got_w, got_s = snapshot(coll, spec)
        np.testing.assert_array_equal(got_w, want_w, err_msg=f)
        if coll.step_per_table and not np.asarray(batch[f][0]).size:
            want_s["step"] -= 1  # a table's own count skips a batch with none of its ids
        assert got_s["step"] == want_s["step"]
        for slot in state_names(coll.optimizer):
            np.testing.assert_array_equal(got_s[slot].reshape(want_s[slot].shape), want_s[slot],
                                          err_msg=f"{f} {slot}")


# no state, a per-row slot, two per-element slots and a step size (test_optim holds each rule
# of the row update, which this step shares, to its reference); Adagrad: the CPU test below
@pytest.mark.parametrize("opt_name", ["SGD", "RowWiseAdagrad", "Adam"])
def test_each_table_as_its_own_fused_step(cuda_backend, rng, opt_name):
    specs = mixed_width_tables(("float32",))
    coll = collection(specs, make_opt(opt_name))
    batch, psw = mixed_width_features(rng, specs, 4, np.int64, weighted=WEIGHTED)
    out = forward_on(coll, batch, psw)
    grads = gradients(rng, out)
    before = {s.name: snapshot(coll, s) for s in specs}
    _, seen = recorded_launches(
        lambda: coll.backward({f: device_family("cuda").put(g) for f, g in grads.items()}))
    names = [k.built_by[1] if hasattr(k, "built_by") else k.__name__ for k in seen]
    assert names == ["prepare_tables_kernel", "update_tables_kernel"]  # one table's fused step
    hbk.synchronize()
    check_against_own_steps(coll, opt_name, specs, before, batch, psw, grads)


def test_stochastic_rounding_and_steps_per_array(cuda_backend, rng):
    """fp16 tables rounded stochastically, and fused arrays at different step counts (Adam's
    step size and the rounding key follow each array's own)."""
    specs = mixed_width_tables(("float16",))
    options = {"rounding": "stochastic", "seed": 7}
    coll = collection(specs, make_opt("Adam", **options))
    for k, fused in enumerate(coll.arrays.values()):
        fused.state["step"][0] = 3 * k
    for _ in range(2):
        batch, psw = mixed_width_features(rng, specs, 4, np.int32, weighted=WEIGHTED)
        out = forward_on(coll, batch, psw)
        grads = gradients(rng, out)
        before = {s.name: snapshot(coll, s) for s in specs}
        coll.backward({f: device_family("cuda").put(g) for f, g in grads.items()})
        check_against_own_steps(coll, "Adam", specs, before, batch, psw, grads, **options)


def test_long_runs_of_one_id(cuda_backend, rng):
    """Ids repeated past the partial sums' chunk (256), in two narrow tables (one of them
    not first in the sort: its windows start inside the first window of the whole)."""
    specs = [hbk.TableSpec("a", num_rows=7, dim=3, combiner="mean"),
             hbk.TableSpec("b", num_rows=5, dim=130, combiner="sum"),
             hbk.TableSpec("c", num_rows=9, dim=2, combiner="sqrtn")]
    coll = hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"), device="cuda",
                                   optimizer=make_opt("RowWiseAdagrad"))
    batch = {}
    for spec, n in zip(specs, (270, 6, 262)):
        offsets = np.sort(np.concatenate([[0, n], rng.integers(0, n, 30)])).astype(np.int64)
        values = np.full(n, spec.num_rows - 1, np.int64)  # more than 256 times in a and c
        values[rng.integers(0, n, 5)] = rng.integers(0, spec.num_rows, 5)
        batch[spec.name] = (values, offsets)
    psw = {"a": rng.random(270).astype(np.float32)}
    out = forward_on(coll, batch, psw)
    grads = gradients(rng, out)
    before = {s.name: snapshot(coll, s) for s in specs}
    _, seen = recorded_launches(
        lambda: coll.backward({f: device_family("cuda").put(g) for f, g in grads.items()}))
    assert sum(getattr(k, "built_by", ("", ""))[1] == "partial_tables_kernel" for k in seen) == 1
    check_against_own_steps(coll, "RowWiseAdagrad", specs, before, batch, psw, grads)


def test_equals_the_cpu_collection(cuda_backend, rng):
    specs = [s for s in mixed_width_tables(("float32",)) if s.dim <= 24]  # each CPU width compiles
    colls = {device: collection(specs, make_opt("Adagrad"), device, replicated="t24")
             for device in ("cpu", "cuda")}
    for _ in range(2):  # the second forward reads what the first step wrote
        batch, psw = mixed_width_features(rng, specs, 3, np.int64, weighted=WEIGHTED)
        grads, outs = None, {}
        for device, coll in colls.items():
            out = forward_on(coll, batch, psw)
            outs[device] = {f: host(o.values if isinstance(o, hbk.JaggedRows) else o)
                            for f, o in out.items()}
            grads = grads or gradients(rng, out)
            coll.backward({f: device_family(device).put(g) for f, g in grads.items()})
        for f in outs["cpu"]:
            np.testing.assert_allclose(outs["cuda"][f], outs["cpu"][f], rtol=1e-5, atol=1e-6,
                                       err_msg=f)
    for spec in specs:
        for slot, want in colls["cpu"].full_state(spec.name).items():
            got = colls["cuda"].full_state(spec.name)[slot]
            if slot == "step":
                assert got == want == 2
                continue
            np.testing.assert_allclose(np.asarray(host(got)), np.asarray(host(want)), rtol=1e-5,
                                       atol=1e-6, err_msg=f"{spec.name} {slot}")
        np.testing.assert_allclose(host(colls["cuda"].full_weights(spec.name)),
                                   host(colls["cpu"].full_weights(spec.name)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_a_gradient_with_nan(cuda_backend, rng, nonfinite):
    specs = mixed_width_tables(("float32",))
    coll = collection(specs, make_opt("RowWiseAdagrad", nonfinite=nonfinite))
    batch, psw = mixed_width_features(rng, specs, 4, np.int64)
    batch["t24"] = (np.array([3, 0, 3, 1], np.int64), np.array([0, 2, 4], np.int64))
    out = forward_on(coll, batch, psw)
    grads = gradients(rng, out)
    grads["t24"][2, 5] = np.nan  # the sequence table: id 2 of its batch, row 3
    before = {s.name: snapshot(coll, s) for s in specs}
    put = device_family("cuda").put
    if nonfinite == "raise":
        with raises(ValueError, match="fused_step: grad of 't24' has NaN or Inf in row 2; nothing"):
            coll.backward({f: put(g) for f, g in grads.items()})
        for spec in specs:
            got_w, got_s = snapshot(coll, spec)
            np.testing.assert_array_equal(got_w, before[spec.name][0], err_msg=spec.name)
            assert got_s["step"] == before[spec.name][1]["step"]
        return
    coll.backward({f: put(g) for f, g in grads.items()})
    hbk.synchronize()
    row = batch["t24"][0][2]
    got_w, _ = snapshot(coll, coll.tables["t24"])
    untouched = ~np.isin(np.arange(got_w.shape[0]), batch["t24"][0]) | (np.arange(got_w.shape[0]) == row)
    np.testing.assert_array_equal(got_w[untouched], before["t24"][0][untouched])
    check_against_own_steps(coll, "RowWiseAdagrad", [s for s in specs if s.name != "t24"], before,
                            batch, psw, grads, nonfinite=nonfinite)
