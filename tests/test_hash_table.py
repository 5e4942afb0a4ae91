"""hbk.HashTable against the dict model (hbkernels.reference.DictTable) on both backends."""
import numpy as np
import pytest
from helpers import raises

import hbkernels as hbk
from hbkernels import reference
from hbkernels.hash_table import smallest

I64 = np.iinfo(np.int64)
EDGES = [I64.min, I64.min + 1, I64.min + 2, -1, 0, 1, I64.max - 1, I64.max]  # markers included


def make(backend, capacity, **kw):
    return hbk.HashTable(capacity, device="cuda" if backend.is_cuda else "cpu", **kw)


class Pair:
    """A table and its model, called together and compared after every call."""

    def __init__(self, backend, capacity, **kw):
        self.backend = backend
        self.table = make(backend, capacity, **kw)
        self.model = reference.DictTable(capacity, kw.get("evict", "lru"),
                                         kw.get("admit_count", 1), kw.get("pending_capacity"))
        self.where = {}  # live id -> the slot the table gave it

    def slots(self, ids, insert=True):
        raised = []
        for call in (lambda: self.backend.get(self.table.slots(self.backend.put(ids),
                                                               insert=insert)),
                     lambda: self.model.slots(ids, insert)):
            try:
                raised.append(call())
            except hbk.CapacityError:
                raised.append(None)
        got, want = raised
        assert (got is None) == (want is None), f"table raised: {got is None}, model: {want is None}"
        self.check()
        if got is None:
            return None
        assert got.shape == np.shape(ids) and got.dtype == np.int64
        got, want, flat = got.ravel(), np.array(want), np.ravel(ids).astype(np.int64)
        np.testing.assert_array_equal(got >= 0, want >= 0)
        for i, s in zip(flat.tolist(), got.tolist()):
            if s >= 0:
                assert self.where.setdefault(i, s) == s, f"id {i} moved or shares a slot"
        return got

    def erase(self, ids):
        assert self.table.erase(self.backend.put(ids)) == self.model.erase(ids)
        self.check()

    def check(self):
        t, m = self.table, self.model
        ids, slots = (self.backend.get(a) for a in t.items())
        assert ids.tolist() == m.ids()
        assert len(set(slots.tolist())) == len(slots) and ((0 <= slots) & (slots < t.capacity)).all()
        self.where = {i: s for i, s in self.where.items() if i in m.slot}
        for i, s in zip(ids.tolist(), slots.tolist()):
            assert self.where.setdefault(i, s) == s, f"id {i} moved"
        probe = np.array(ids.tolist() + list(m.pending)[:5] + EDGES, np.int64)
        assert self.backend.get(t.scores(self.backend.put(probe))).tolist() == m.scores(probe)
        assert (t.size, t.step, t.admitted, t.evicted) == (len(m.slot), m.step, m.admitted, m.evicted)


def zipf_ids(rng, n, pool):
    ranks = np.minimum(rng.zipf(1.3, n) - 1, len(pool) - 1)
    return pool[ranks]


@pytest.mark.parametrize("evict", ["lru", "lfu", "none"])
@pytest.mark.parametrize("admit_count", [1, 3])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_matches_the_model(backend, rng, evict, admit_count, dtype):
    """Random calls (Zipf ids over a pool with the int64 edges and the index's marker
    ids, erasures, lookups without insert): the same live ids, scores, admissions,
    evictions and CapacityErrors as the model, and slots that never move or collide."""
    info = np.iinfo(dtype)
    pool = rng.integers(info.min, info.max, 200, dtype=dtype, endpoint=True)
    pool[:len(EDGES)] = np.array(EDGES, np.int64).astype(dtype)  # wraps to int32 edges there
    pool = pool[rng.permutation(len(pool))]
    capacity = 12 if backend.small else 40
    pair = Pair(backend, capacity, evict=evict, admit_count=admit_count,
                pending_capacity=capacity // 2)
    for call in range(12 if backend.small else 40):
        n = int(rng.integers(0, 8 if backend.small else 30))
        ids = zipf_ids(rng, n, pool)
        if call % 7 == 6:
            pair.erase(ids[: n // 2])
        elif call % 5 == 4:
            pair.slots(ids.reshape(-1, 1) if n % 2 == 0 else ids, insert=False)
        elif pair.slots(ids) is None and evict == "none":
            pair.erase(pool[rng.integers(0, len(pool), 20)])


def test_many_calls_and_a_rebuild_match_the_model(rng):
    """CPU, larger: erasures leave tombstones until the index is rebuilt; every id keeps
    its slot across the rebuilds."""
    pair = Pair(_cpu(), 300, evict="lfu", admit_count=2)
    pool = rng.integers(I64.min, I64.max, 3000, dtype=np.int64)
    for call in range(60):
        ids = zipf_ids(rng, 400, pool)
        if call % 3 == 2:
            pair.erase(rng.choice(pool, 500))
        pair.slots(ids)


def _cpu():
    from conftest import Backend

    return Backend("cpu")


def test_admission_on_exactly_the_kth_call(backend):
    t = make(backend, 8, admit_count=3)
    get = lambda ids: backend.get(t.slots(backend.put(np.array(ids, np.int64)))).tolist()
    assert get([5, 5, 5, 6]) == [-1, -1, -1, -1]  # one call, however many times
    assert get([5]) == [-1]
    five = get([6, 5])
    assert five[0] == -1 and five[1] >= 0
    assert get([6, 5, 5]) == [1 - five[1], five[1], five[1]]
    assert t.size == 2 and t.admitted == 2
    get([7, 9, 7])
    pending = t.pending_state()  # the ids seen, not yet admitted: 7 and 9, once each
    assert pending["ids"].tolist() == [7, 9] and pending["count"].tolist() == [1, 1]
    assert pending["last"].tolist() == [5, 5] and t.step == 5  # numbered by the table's calls
    for key, value in t.state()["pending"].items():
        np.testing.assert_array_equal(pending[key], value)
    assert make(backend, 8).pending_state() is None
    t.clear()  # forgets 7's sighting too: two more calls do not admit it
    assert t.size == 0 and t.step == 0 and t.pending_state()["ids"].shape == (0,)
    get([7])
    assert get([7]) == [-1] and t.admitted == 2


def test_lru_victims(backend):
    t = make(backend, 3, evict="lru")
    put = lambda ids: backend.get(t.slots(backend.put(np.array(ids, np.int64)))).tolist()
    put([10, 20])  # call 1
    put([30])  # call 2
    put([10])  # call 3: 20 is now the least recently used
    put([40])  # evicts 20
    assert backend.get(t.ids()).tolist() == [10, 30, 40]
    put([50, 60])  # evicts 30 (call 2) and 10 (call 3)
    assert backend.get(t.ids()).tolist() == [40, 50, 60]
    put([1, 2])  # 50 and 60 tie at call 5, 40 is older: evicts 40, then the smaller id, 50
    assert backend.get(t.ids()).tolist() == [1, 2, 60]
    assert t.evicted == 5


def test_lfu_victims(backend):
    t = make(backend, 3, evict="lfu")
    put = lambda ids: backend.get(t.slots(backend.put(np.array(ids, np.int64)))).tolist()
    put([1, 2, 3])
    put([1, 1, 1, 3])  # uses: 1 -> 2, 2 -> 1, 3 -> 2 (repeats in one call count once)
    put([3])  # 3 -> 3
    assert backend.get(t.scores(backend.put(np.array([1, 2, 3, 4])))).tolist() == [2, 1, 3, -1]
    put([4])  # evicts 2 (one use)
    put([5])  # 4 and 1... 4 has one use: evicted before 1
    assert backend.get(t.ids()).tolist() == [1, 3, 5]
    put([6, 7])  # 5 and 6..: 5 has one use (call 5), 1 has two: evicts 5, then 1
    assert backend.get(t.ids()).tolist() == [3, 6, 7]


def test_capacity_error_changes_nothing(backend):
    t = make(backend, 4, evict="none", name="item")
    first = backend.get(t.slots(backend.put(np.array([1, 2, 3], np.int64)))).tolist()
    before = [backend.get(a).tolist() for a in t.items()] + [t.step, t.size]
    with raises(hbk.CapacityError, match=r"item is full: capacity 4") as err:
        t.slots(backend.put(np.array([1, 4, 5], np.int64)))
    assert isinstance(err.value, RuntimeError)
    assert [backend.get(a).tolist() for a in t.items()] + [t.step, t.size] == before
    assert backend.get(t.slots(backend.put(np.array([4, 1], np.int64)))).tolist() == [3, first[0]]


def test_a_call_never_evicts_an_id_it_uses(backend):
    t = make(backend, 4, evict="lru", name="user")
    first = backend.get(t.slots(backend.put(np.array([1, 2, 3, 4], np.int64)))).tolist()
    with raises(hbk.CapacityError, match=r"user: .*need 3 more slots.*capacity 4"):
        t.slots(backend.put(np.array([1, 2, 5, 6, 7], np.int64)))
    assert backend.get(t.ids()).tolist() == [1, 2, 3, 4] and t.step == 1
    got = backend.get(t.slots(backend.put(np.array([1, 2, 5, 6], np.int64)))).tolist()
    assert got[:2] == first[:2] and sorted(got[2:]) == sorted(first[2:])


def test_empty_calls_and_shapes(backend):
    t = make(backend, 4)
    out = t.slots(backend.put(np.zeros((0, 3), np.int64)))
    assert backend.get(out).shape == (0, 3) and t.step == 1  # a call without ids is a call
    t.slots(backend.put(np.zeros(0, np.int64)), insert=False)
    assert t.step == 1  # a lookup is not
    out = backend.get(t.slots(backend.put(np.array([[7, 8], [8, 9]], np.int32))))
    assert out.shape == (2, 2) and out[0, 1] == out[1, 0] and len(set(out.ravel())) == 3
    assert t.erase(backend.put(np.zeros(0, np.int64))) == 0


def test_pending_ids_beyond_the_pending_capacity_are_counted_as_forgotten(backend):
    t = make(backend, 8, admit_count=3, pending_capacity=2)
    t.slots(backend.put(np.array([5, 4, 3, 2, 1])))  # 5 new ids, room for 2: the smallest kept
    assert t.forgotten == 3 and t.pending_state()["ids"].tolist() == [1, 2]
    t.slots(backend.put(np.array([9, 8])))  # the pending table full: its LRU ids go
    assert t.forgotten == 5 and t.pending_state()["ids"].tolist() == [8, 9]
    for _ in range(2):
        t.slots(backend.put(np.array([8, 9])))
    assert t.forgotten == 5 and backend.get(t.ids()).tolist() == [8, 9]  # their third sighting
    assert make(backend, 8).forgotten == 0


def test_bad_input(backend):
    t = make(backend, 4)
    with raises(ValueError, match="ids must hold int32 or int64 ids"):
        t.slots(backend.put(np.array([1.0])))
    other = "cuda" if not backend.is_cuda else "cpu"
    if other == "cpu":
        with raises(TypeError, match="pass CUDA ids"):
            t.slots(np.array([1]))
    for kw, match in [({"capacity": 0}, "capacity"), ({"capacity": 4, "evict": "fifo"}, "evict"),
                      ({"capacity": 4, "admit_count": 0}, "admit_count"),
                      ({"capacity": 4, "device": "tpu"}, "device")]:
        with raises(ValueError, match=match):
            hbk.HashTable(**kw)


@pytest.mark.parametrize("dtype", [">i8", ">i4"])
def test_ids_of_either_byte_order_are_taken_as_every_op_takes_them(dtype):
    """Big-endian ids are converted (a copy), as the kernel ops convert them: the same
    slots, scores and erasures as of native ids."""
    ids = np.array([[5, -3], [2**31 - 1, 5]])
    native, swapped = hbk.HashTable(8), hbk.HashTable(8)
    want = native.slots(ids)
    got = swapped.slots(ids.astype(dtype))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(swapped.scores(ids.astype(dtype)), native.scores(ids))
    assert swapped.erase(np.array([5], dtype)) == 1


def test_smallest_is_a_lexicographic_selection(rng):
    n = 500
    keys = [rng.integers(0, 3, n), rng.integers(0, 4, n), rng.permutation(n)]
    order = np.lexsort(keys[::-1])
    for k in (1, 7, 250, n):
        assert sorted(smallest(np, keys, k).tolist()) == sorted(order[:k].tolist())


def test_evict_lowest_takes_the_policys_first_ids_outside_keep():
    """LRU: the oldest calls first, then the smaller id; ``keep`` is never evicted; the
    slots come back free; more than the evictable ones is a CapacityError."""
    t = hbk.HashTable(6, evict="lru")
    t.slots(np.array([10, 11]))
    t.slots(np.array([12, 13]))
    t.slots(np.array([14, 15]))
    ids, slots = t.evict_lowest(3, keep=np.array([10]))
    assert sorted(ids.tolist()) == [11, 12, 13] and t.size == 3 and t.evicted == 3
    assert sorted(t.slots(np.array([20, 21, 22])).tolist()) == sorted(slots.tolist())
    with raises(hbk.CapacityError):
        t.evict_lowest(7)  # one more than it holds
    assert t.evict_lowest(0)[0].shape == (0,)


def _by_id(s):
    """``{id: (slot, last, count)}`` of a ``state()`` (or its ``pending``)."""
    rows = zip(*(np.asarray(s[k]).tolist() for k in ("ids", "slots", "last", "count")))
    return {i: tuple(rest) for i, *rest in rows}


def _assert_changes(got, before, after, step):
    """``got`` (of ``changes``) is what tells ``before`` and ``after`` (:func:`_by_id`)
    apart: the ids with a ``last`` past ``step``, and the ids gone."""
    used = sorted(i for i, (_, last, _) in after.items() if last > step)
    assert got["ids"].tolist() == used and got["ids"].dtype == np.int64
    assert list(zip(got["slots"].tolist(), got["last"].tolist(), got["count"].tolist())) == [
        after[i] for i in used]
    assert got["evicted"].tolist() == sorted(set(before) - set(after))


@pytest.mark.parametrize("evict", ["lru", "lfu"])
@pytest.mark.parametrize("admit_count", [1, 3])
def test_changes_since_a_mark_are_the_difference_of_two_states(backend, rng, evict, admit_count):
    """Zipf calls that evict, erasures and evict_lowest between a mark and ``changes``:
    the ids used since (their slots and scores) and the ids gone (evicted, erased; an id
    evicted and admitted again is used, not gone), and the same of the pending ids (seen
    since; admitted, forgotten or erased), as two ``state()``s tell them apart."""
    pool = rng.integers(I64.min, I64.max, 120, dtype=np.int64, endpoint=True)
    pool[:len(EDGES)] = EDGES
    capacity = 10 if backend.small else 30
    t = make(backend, capacity, evict=evict, admit_count=admit_count,
             pending_capacity=capacity // 2)
    for rounds in range(3 if backend.small else 8):
        before = t.state()
        mark = t.mark()
        for call in range(int(rng.integers(0, 4 if backend.small else 10))):
            ids = zipf_ids(rng, int(rng.integers(0, 8 if backend.small else 25)), pool)
            if call % 4 == 3:
                t.erase(backend.put(ids[:3]))
            elif call % 5 == 4 and t.size > 2:
                t.evict_lowest(2)
            else:
                t.slots(backend.put(ids))
        after, got = t.state(), t.changes(mark)
        _assert_changes(got, _by_id(before), _by_id(after), before["step"])
        if admit_count == 1:
            assert got["pending"] is None
        else:
            _assert_changes(got["pending"], _by_id(before["pending"]), _by_id(after["pending"]),
                            before["step"])


def test_an_id_evicted_and_admitted_again_is_used_not_gone():
    """Capacity 2: 1 evicted by 3, then admitted again in 2's slot; 2 is gone."""
    t = hbk.HashTable(2, evict="lru")
    t.slots(np.array([1, 2]))
    mark = t.mark()
    t.slots(np.array([3]))  # evicts 1 (the older call ties: the smaller id)
    t.slots(np.array([1]))  # evicts 2, which 1 replaces in its slot
    got = t.changes(mark)
    assert got["ids"].tolist() == [1, 3] and got["evicted"].tolist() == [2]
    assert t.changes(t.mark())["ids"].shape == (0,) == t.changes(t.mark())["evicted"].shape


def test_live_at_names_the_live_ids_of_slots(backend, rng):
    """Slots given back by erase are left out; ids ascending, with their slots."""
    t = make(backend, 16)
    ids = rng.permutation(np.array(EDGES[:6] + [5, 6, 7], np.int64))
    t.slots(backend.put(ids))
    t.erase(backend.put(ids[:2]))
    asked = rng.permutation(16)[:10]
    got_ids, got_slots = t.live_at(asked)
    want = sorted((i, s) for i, (s, _, _) in _by_id(t.state()).items() if s in set(asked.tolist()))
    assert list(zip(got_ids.tolist(), got_slots.tolist())) == want
    assert t.live_at(np.zeros(0, np.int64))[0].shape == (0,)


def _snapshot(t):
    state = t.state()
    flat = {k: np.asarray(v) for k, v in state.items() if k != "pending"}
    pending = state.get("pending") or {}
    flat.update({f"pending_{k}": np.asarray(v) for k, v in pending.items()})
    return flat, t.size, t.step, t.admitted, t.evicted


def _same(a, b):
    assert a[1:] == b[1:]
    assert a[0].keys() == b[0].keys()
    for k in a[0]:
        np.testing.assert_array_equal(a[0][k], b[0][k], err_msg=k)


@pytest.mark.parametrize("evict", ["none", "lru", "lfu"])
@pytest.mark.parametrize("admit_count", [1, 2])
def test_check_fits_raises_where_slots_raises(backend, rng, evict, admit_count):
    """On tables of random fill, for calls of up to twice the capacity: check_fits
    raises exactly where slots would (its shortcut, that a call of at most capacity ids
    fits, or of at most the free slots under evict="none", hides no failure)."""
    outcomes, least = set(), 10 if backend.small else 30  # the simulator: a few seconds a call
    for trial in range(300):  # that many calls, more until both outcomes were seen
        if trial >= least and len(outcomes) == 2:
            break
        calls = [rng.integers(0, 24, int(rng.integers(0, 17))) for _ in range(int(rng.integers(1, 5)))]
        if rng.random() < 0.5:  # its ids seen once before the call: due where admit_count=2
            calls.insert(-1, calls[-1])
        checked, called = make(backend, 8, evict=evict, admit_count=admit_count), \
            make(backend, 8, evict=evict, admit_count=admit_count)
        for ids in calls[:-1]:  # the two tables alike
            for t in (checked, called):
                try:
                    t.slots(backend.put(ids))
                except hbk.CapacityError:
                    pass
        last = backend.put(calls[-1])
        try:
            checked.check_fits(last)
            fits = True
        except hbk.CapacityError:
            fits = False
        try:
            called.slots(last)
            assert fits, (evict, admit_count, calls)
        except hbk.CapacityError:
            assert not fits, (evict, admit_count, calls)
        outcomes.add(fits)
    assert outcomes == {True, False}  # both seen: the test checks something


def test_check_fits_looks_up_only_calls_that_may_not_fit(backend, monkeypatch):
    for evict, n in [("lru", 8), ("none", 5)]:
        t = make(backend, 8, evict=evict)
        t.slots(backend.put(np.arange(3)))  # 5 slots free
        monkeypatch.setattr(t, "_plan", lambda *a: pytest.fail("looked up"))
        t.check_fits(backend.put(np.arange(100, 100 + n)))
        with pytest.raises(pytest.fail.Exception, match="looked up"):
            t.check_fits(backend.put(np.arange(100, 101 + n)))


@pytest.mark.parametrize("evict", ["none", "lru"])
def test_check_fits_raises_what_slots_would_and_changes_nothing(backend, evict):
    t = make(backend, 4, evict=evict, admit_count=2)
    for ids in ([1, 2, 3], [1, 2, 3], [4]):  # 1, 2, 3 live; 4 waiting
        t.slots(backend.put(np.array(ids)))
    before = _snapshot(t)
    t.check_fits(backend.put(np.array([4, 5, 6, 1])))  # only 4 is due: 1 free slot takes it
    t.check_fits(backend.put(np.array([], np.int64)))
    _same(before, _snapshot(t))
    too_many = backend.put(np.array([4, 4, 5, 5, 6, 6, 1, 2, 3]))
    t.slots(backend.put(np.array([5, 6])))  # 5 and 6 now wait too
    before = _snapshot(t)
    with raises(hbk.CapacityError) as checked:
        t.check_fits(too_many)  # 3 due, 1 free, and the call uses every live id
    _same(before, _snapshot(t))
    with raises(hbk.CapacityError) as called:
        t.slots(too_many)
    assert str(checked.value) == str(called.value)
    _same(before, _snapshot(t))
