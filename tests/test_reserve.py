"""EmbeddingCollection.reserve: a training step in memory sized once (under the simulator,
or on a GPU). Reserved steps give the bits of unreserved ones (outputs, weights, optimizer
state) whatever the batch's id counts, allocate nothing and wait for nothing; a batch
outside the reservation is refused naming the feature; bad ids still raise at the wait."""
import numpy as np
import pytest

import hbkernels as hbk
from hbkernels._dispatch import device_family
from hbkernels.cuda import _device
from helpers import RESERVE_BATCH as BATCH, RESERVE_CAP as CAP, RESERVE_SPECS as SPECS
from helpers import cuda_host as host, forward_on, mixed_width_features, reserve_batches as batches
from helpers import reserve_collection as collection

pytestmark = pytest.mark.cuda
@pytest.mark.parametrize("make", [lambda: hbk.optim.Adam(lr=0.1),
                                  lambda: hbk.optim.RowWiseAdagrad(lr=0.2)],
                         ids=["Adam", "RowWiseAdagrad"])
def test_reserved_steps_equal_unreserved_ones(rng, make):
    plain, reserved = collection(make()), collection(make())
    reserved.reserve(BATCH, CAP, weighted=["b"])
    for batch, psw, pad in batches(rng):
        outs = [forward_on(plain, batch, psw), forward_on(reserved, *(pad or (batch, psw)))]
        for f in outs[0]:
            np.testing.assert_array_equal(host(outs[1][f]), host(outs[0][f]), err_msg=f)
        put = device_family("cuda").put
        grads = {f: put(rng.standard_normal(out.shape).astype(np.float32))
                 for f, out in outs[0].items()}
        for c in (plain, reserved):
            c.backward(grads)
        for t in ("a", "b", "c", "d"):
            np.testing.assert_array_equal(host(reserved.full_weights(t)), host(plain.full_weights(t)),
                                          err_msg=t)
            for name, value in plain.full_state(t).items():
                np.testing.assert_array_equal(host(reserved.full_state(t)[name]), host(value), err_msg=name)


def test_a_reserved_step_allocates_and_waits_for_nothing(rng, monkeypatch):
    coll = collection(hbk.optim.Adagrad(lr=0.1))
    coll.reserve(BATCH, CAP, weighted=["b"])
    (batch, psw, _), *_ = batches(rng)
    put = device_family("cuda").put
    features = {f: hbk.Ragged(put(v), put(o)) for f, (v, o) in batch.items()}
    weights = {f: put(w) for f, w in psw.items()}
    grads = {f: put(rng.standard_normal((BATCH, s.dim)).astype(np.float32))
             for s in SPECS for f in s.features or [s.name]}
    coll.forward(features, per_sample_weights=weights)
    coll.backward(grads)  # warm-up: the checks' ledger, the kernels

    def refused(*args, **kwargs):
        raise AssertionError("a reserved step allocated or read the device")

    empty = _device.scratch  # (a zero-sized array is made once, then kept)
    for name in ("zeros", "full", "read", "to_host", "wait"):
        monkeypatch.setattr(_device, name, refused)
    monkeypatch.setattr(_device, "scratch", lambda shape, dtype: empty(shape, dtype) if shape == 0
                        else refused())
    syncs = _device.HOST_SYNCS[0]
    for _ in range(2):
        coll.forward(features, per_sample_weights=weights)
        coll.backward(grads)
    assert _device.HOST_SYNCS[0] == syncs


def test_bad_ids_still_raise_at_the_wait(rng):
    coll = collection(hbk.optim.Adagrad(lr=0.1))
    coll.reserve(BATCH, CAP, weighted=["b"])
    (batch, psw, _), *_ = batches(rng)
    values, offsets = batch["c"]
    batch["c"] = (np.where(np.arange(values.size) == values.size - 1, 30, values), offsets)
    forward_on(coll, batch, psw)
    with pytest.raises(hbk.BoundsError, match="'c'"):
        hbk.synchronize()


def test_a_last_offset_past_the_values_is_an_error(rng):
    coll = collection(hbk.optim.Adagrad(lr=0.1))
    coll.reserve(BATCH, CAP, weighted=["b"])
    (batch, psw, _), *_ = batches(rng)
    values, offsets = batch["c"]
    batch["c"] = (values, offsets + (np.arange(BATCH + 1) == BATCH))  # one past the values
    forward_on(coll, batch, psw)
    with pytest.raises(ValueError, match=r"feature 'c': malformed offsets: offsets\[5\] = "
                                         r"\d+, expected at most len\(values\)"):
        hbk.synchronize()


def test_batches_outside_the_reservation_are_refused(rng):
    coll = collection(hbk.optim.Adagrad(lr=0.1))
    coll.reserve(BATCH, {"a": CAP, "a2": CAP, "b": CAP, "c": 3, "d": CAP}, weighted=["b"])
    (batch, psw, _), *_ = batches(rng)
    batch["c"] = (np.zeros(4, np.int64), np.array([0, 4, 4, 4, 4, 4]))
    with pytest.raises(ValueError, match="feature 'c': 4 ids, more than the 3 reserved"):
        forward_on(coll, batch, psw)
    coll.reserve(BATCH, CAP, weighted=["b"])  # (a new reservation replaces the last)
    (batch, psw, _), *_ = batches(rng)
    with pytest.raises(ValueError, match="feature 'b': per-sample weights missing"):
        forward_on(coll, batch, {})
    large, _ = mixed_width_features(rng, SPECS, BATCH + 1, np.int64, weighted=["b"])
    with pytest.raises(ValueError, match="feature 'a': 6 bags, more than the 5 reserved"):
        forward_on(coll, large, {"b": np.ones(large["b"][0].size, np.float32)})
    del batch["d"]
    with pytest.raises(ValueError, match="every feature"):
        forward_on(coll, batch, psw)


@pytest.mark.parametrize("args, message", [
    ((0, 4), "batch_size must be >= 1"),
    ((4, 0), "max_ids of 'a' must be >= 1"),
    ((4, 2**30), "max_ids of 'a' must be < 2\\*\\*30"),
    ((4.0, 3), "batch_size must be an integer"),
    ((4, {"a": 3}), "max_ids must name every feature"),
    ((4, 3, ["zz"]), "unknown features"),
])
def test_bad_reservations_are_refused(args, message):
    coll = collection(hbk.optim.Adagrad(lr=0.1))
    with pytest.raises(ValueError, match=message):
        coll.reserve(*args[:2], weighted=args[2] if len(args) > 2 else ())


def test_what_reserve_does_not_cover():
    with pytest.raises(ValueError, match="lives on cpu"):
        collection(hbk.optim.Adagrad(lr=0.1), device="cpu").reserve(4, 8)
    sequence = SPECS + [hbk.TableSpec("s", num_rows=9, dim=4, combiner=None)]
    with pytest.raises(ValueError, match=r"not \['s'\]"):
        collection(hbk.optim.Adagrad(lr=0.1), sequence).reserve(4, 8)
