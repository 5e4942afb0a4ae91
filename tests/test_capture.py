"""EmbeddingCollection.capture: the host's part of a training step captured into a CUDA
graph. Under the simulator nothing is captured (the step inside the context runs, and
is not counted); what each ``replay`` does on the host is checked: step counts, the next
step's step sizes on the device, the checks of the replay raised at the next wait (and
only once), the id counts restored after an uncaptured step. A GPU test captures a real
graph with torch and replays it against uncaptured steps."""
import numpy as np
import pytest

import hbkernels as hbk
from hbkernels import _rules
from hbkernels._dispatch import device_family
from helpers import RESERVE_BATCH as BATCH, RESERVE_CAP as CAP, RESERVE_SPECS as SPECS
from helpers import cuda_host as host, forward_on, reserve_batches as batches
from helpers import reserve_collection as collection

pytestmark = pytest.mark.cuda


def padded_batches(rng):
    """``batches`` padded to the reserved counts (the fixed sizes a captured step reads)."""
    return [pad for _, _, pad in batches(rng) if pad] + [
        ({f: (np.concatenate([v, np.full(CAP - v.size, -7, v.dtype)]), o) for f, (v, o) in b.items()},
         {f: np.concatenate([w, np.full(CAP - w.size, np.nan, w.dtype)]) for f, w in psw.items()})
        for b, psw, pad in batches(rng)[:2]]


def grads_of(rng, outs):
    put = device_family("cuda").put
    return {f: put(rng.standard_normal(out.shape).astype(np.float32)) for f, out in outs.items()}


def warmed(rng, optimizer):
    """A reserved collection after one uncaptured step, and padded batches to go on with."""
    coll = collection(optimizer)
    coll.reserve(BATCH, CAP, weighted=["b"])
    steps = padded_batches(rng)
    coll.backward(grads_of(rng, forward_on(coll, *steps[0])))
    return coll, steps[1:]


def step_counts(coll):
    return [int(coll.full_state(t)["step"]) for t in ("a", "b", "c", "d")]


def test_replays_count_steps_and_bring_their_step_sizes(rng):
    opt = hbk.optim.Adam(lr=0.1)
    coll, steps = warmed(rng, opt)
    with coll.capture() as step:
        coll.backward(grads_of(rng, forward_on(coll, *steps[0])))
    assert step_counts(coll) == [1] * 4  # captured, not counted
    for k in range(2, 5):
        step.replay(lambda: None)
        plans = [host(f.step.plan) for f in coll._reserved.flats.values()]
        bits = {n: np.float64(opt.step_constants(n)[0][_rules.STEP_SIZE]).view(np.int64)
                for n in (k - 1, k)}
        assert step_counts(coll) == [k] * 4
        # the replay that made step k ran with step k's step size, put there before it
        assert all(bits[k] in plan and bits[k - 1] not in plan for plan in plans)


def test_a_replays_bad_ids_raise_at_the_next_wait_once(rng):
    coll, steps = warmed(rng, hbk.optim.Adagrad(lr=0.1))
    batch, psw = steps[0]
    values, offsets = batch["c"]
    bad = dict(batch, c=(np.where(np.arange(values.size) == 0, 30, values), offsets))
    with coll.capture() as step:  # the simulator runs it: the ids' check finds the 30
        coll.backward(grads_of(rng, forward_on(coll, bad, psw)))
    hbk.synchronize()  # the capture itself is no step: nothing to raise
    step.replay(lambda: None)
    with pytest.raises(hbk.BoundsError, match="'c'"):
        hbk.synchronize()
    hbk.synchronize()  # raised once
    batch, psw = steps[1]
    values, offsets = batch["a"]
    bad = dict(batch, a=(np.where(np.arange(values.size) == 0, 60, values), offsets))
    coll.backward(grads_of(rng, forward_on(coll, bad, psw)))
    step.replay(lambda: None)  # (the simulator ran no kernel: this replay found nothing)
    with pytest.raises(hbk.BoundsError, match="'a'"):
        hbk.synchronize()
    hbk.synchronize()  # the uncaptured step's checks took other slots than the replay's


def test_a_replays_nonfinite_gradient_does_not_count(rng):
    coll, steps = warmed(rng, hbk.optim.Adam(lr=0.1))
    with coll.capture() as step:
        grads = grads_of(rng, forward_on(coll, *steps[0]))
        grads["b"][1, 2] = np.nan
        coll.backward(grads)
    step.replay(lambda: None)
    assert step_counts(coll) == [2] * 4
    with pytest.raises(ValueError, match="grad of 'b'"):
        hbk.synchronize()
    assert step_counts(coll) == [1] * 4


def test_id_counts_changed_between_replays_are_restored(rng):
    coll, steps = warmed(rng, hbk.optim.Adagrad(lr=0.1))
    with coll.capture() as step:
        coll.backward(grads_of(rng, forward_on(coll, *steps[0])))
    captured = host(coll._reserved.staged.table).copy()
    (batch, psw, _), *_ = batches(rng)
    coll.backward(grads_of(rng, forward_on(coll, batch, psw)))  # unpadded: other counts
    assert not np.array_equal(host(coll._reserved.staged.table), captured)
    step.replay(lambda: None)
    np.testing.assert_array_equal(host(coll._reserved.staged.table), captured)


def test_what_capture_refuses(rng):
    with pytest.raises(RuntimeError, match="capture needs reserve first"):
        with collection(hbk.optim.Adagrad(lr=0.1)).capture():
            pass
    coll, steps = warmed(rng, hbk.optim.Adagrad(lr=0.1))
    with pytest.raises(RuntimeError, match="being captured already"):
        with coll.capture(), coll.capture():
            pass
    (batch, psw, _), *_ = batches(rng)
    with pytest.raises(RuntimeError, match="id counts of the step before it"):
        with coll.capture():
            forward_on(coll, batch, psw)
    coll.backward(grads_of(rng, forward_on(coll, *steps[0])))  # usable after
    hbk.synchronize()


@pytest.mark.gpu
def test_a_torch_graph_replays_the_uncaptured_steps():
    """On a GPU: the step captured with ``torch.cuda.graph`` and replayed over new inputs
    gives the bits of uncaptured reserved steps (outputs, weights, Adam's state)."""
    torch = pytest.importorskip("torch")
    from hbkernels.adapters.torch import cuda_stream_of, kernel_array

    rng = np.random.default_rng(5)
    data = padded_batches(rng)
    grads = [{f: rng.standard_normal((BATCH, s.dim)).astype(np.float32)
              for s in SPECS for f in s.features or [s.name]} for _ in data]
    plain, graphed = collection(hbk.optim.Adam(lr=0.1)), collection(hbk.optim.Adam(lr=0.1))
    for c in (plain, graphed):
        c.reserve(BATCH, CAP, weighted=["b"])
    static = [{f: (torch.tensor(v, device="cuda"), torch.tensor(o, device="cuda"))
               for f, (v, o) in data[0][0].items()},
              {f: torch.tensor(w, device="cuda") for f, w in data[0][1].items()},
              {f: torch.tensor(g, device="cuda") for f, g in grads[0].items()}]

    def load(k):
        for f, (v, o) in data[k][0].items():
            static[0][f][0].copy_(torch.from_numpy(v))
            static[0][f][1].copy_(torch.from_numpy(o))
        for f, w in data[k][1].items():
            static[1][f].copy_(torch.from_numpy(w))
        for f, g in grads[k].items():
            static[2][f].copy_(torch.from_numpy(g))

    def run(coll):
        with cuda_stream_of(*static[2].values()):
            out = coll.forward({f: hbk.Ragged(kernel_array(v), kernel_array(o))
                                for f, (v, o) in static[0].items()},
                               per_sample_weights={f: kernel_array(w) for f, w in static[1].items()})
            coll.backward({f: kernel_array(g) for f, g in static[2].items()})
        return out

    outs = []
    for k in range(len(data)):
        load(k)
        outs.append({f: host(o).copy() for f, o in run(plain).items()})
    load(0)
    first = run(graphed)  # uncaptured
    graph = torch.cuda.CUDAGraph()
    with graphed.capture() as step, torch.cuda.graph(graph):
        captured = run(graphed)
    for k in range(1, len(data)):
        load(k)
        with cuda_stream_of(*static[2].values()):
            step.replay(graph.replay)
        for f, o in captured.items():
            np.testing.assert_array_equal(host(o), outs[k][f], err_msg=f)
    del first
    for t in ("a", "b", "c", "d"):
        np.testing.assert_array_equal(host(graphed.full_weights(t)), host(plain.full_weights(t)),
                                      err_msg=t)
        for name, value in plain.full_state(t).items():
            np.testing.assert_array_equal(host(graphed.full_state(t)[name]), host(value), err_msg=name)
