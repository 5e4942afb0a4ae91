"""A float64 NumPy model of ``hbk.EmbeddingCollection`` in one process, the
deterministic global batches the collection tests feed it, and the driver that
trains a collection beside the model and compares them.

Used by tests/mpi/collection.py and tests/mpi/checkpoint.py (under
``mpiexec``) and by tests/test_embedding_collection.py (one process).

The model (:class:`Reference`) is written from the formulas of API.md and of
``hbkernels/optim.py``'s docstring and calls no hbkernels kernel:

* forward, per feature and bag: ``s = Σ w_i·e_i``; ``sum``: s; ``mean``:
  ``s / Σ w_i``; ``sqrtn``: ``s / sqrt(Σ w_i²)`` (TF semantics, w = 1 without
  per-sample weights); an empty bag (or a zero denominator) gives zeros;
* the gradient of a table is the sum over every feature that looks it up and
  over the GLOBAL batch (the loss is a sum over all ranks' samples); a row is
  *touched* when its id occurs anywhere in the global batch, even when its
  gradient is zero (a zero per-sample weight);
* optimizers: SGD, Adagrad, RowWiseAdagrad, Adam (lazy, one step counter per
  table that counts the backwards whose global batch holds at least one of its ids,
  as torch's SparseAdam counts per parameter; the others' counters, which their
  updates do not use, count every backward), Ftrl (TF's sparse ApplyFtrl), applied to
  touched rows only; weights are stored rounded to the table's dtype after
  every step (the collection stores them so), state in float64.
"""
import math
import os
import zlib

import numpy as np

SEED = int(os.environ.get("HBK_TEST_SEED", "12345"))

SLOTS = {
    "SGD": (),
    "Adagrad": ("sum",),
    "RowWiseAdagrad": ("momentum",),
    "Adam": ("exp_avg", "exp_avg_sq"),
    "Ftrl": ("accum", "linear"),
}
PER_ROW_SLOTS = {"momentum"}

# The tables every collection test uses: mixed dims (1, odd), every combiner, a
# table shared by two features, a 1-hot feature given as a plain id array,
# per-sample weights, a float16 table, and a 5-row table (more ranks than rows
# per shard under row_wise).
TABLE_DEFS = (
    dict(name="user", num_rows=300, dim=8, combiner="sum", hotness=3.0),
    dict(name="item", num_rows=97, dim=5, combiner="mean", features=("item", "item_hist"),
         hotness=2.5),
    dict(name="tiny", num_rows=5, dim=1, combiner="sqrtn", hotness=2.0),
    dict(name="cat", num_rows=23, dim=3, combiner="sum"),
    dict(name="half", num_rows=40, dim=4, combiner="mean", dtype="float16", hotness=2.0),
)
ONE_HOT = ("cat",)                 # given to forward as a plain 1-D id array
WEIGHTED = ("item_hist", "tiny")   # given per-sample weights
MAX_LEN = {"user": 5, "item": 3, "item_hist": 6, "tiny": 3, "half": 4}
# a mixed per-table request: every placement kind once, plus "auto"; at 3 ranks item's
# last column slice (1 column) is as wide as the replicated tiny
MIXED_PLAN = {"user": "row_wise", "item": "column_wise", "tiny": "data_parallel",
              "cat": "table_wise", "half": "auto"}
# replicated tables whose width equals a column slice's (cat: 3 = item's first slice at
# 2 ranks) beside sharded ones
MIXED_PLAN2 = {"user": "data_parallel", "item": "column_wise", "tiny": "row_wise",
               "cat": "data_parallel", "half": "table_wise"}
PLANS = ("data_parallel", "table_wise", "row_wise", "column_wise", "auto", "mixed", "mixed2")
# the placements over a node's ranks, and a mix of them with the others
MIXED_NODES = {"user": "grid", "item": "table_column_wise", "tiny": "table_row_wise",
               "cat": "data_parallel", "half": "row_wise"}
NODE_PLANS = ("table_row_wise", "table_column_wise", "grid", "mixed_nodes")


def rng_for(*key):
    return np.random.default_rng([SEED, *[zlib.crc32(str(k).encode()) for k in key]])


def features_of(spec):
    f = getattr(spec, "features", None)
    if f is None:
        return (spec.name,)
    return (f,) if isinstance(f, str) else tuple(f)


def table_specs(hbk, defs=TABLE_DEFS):
    return [hbk.TableSpec(**d) for d in defs]


def plan_request(plan):
    mixes = {"mixed": MIXED_PLAN, "mixed2": MIXED_PLAN2, "mixed_nodes": MIXED_NODES}
    return mixes[plan].copy() if plan in mixes else plan


def opt_kind(opt):
    return type(opt).__name__


def make_optimizer(hbk, kind):
    """Each optimizer with non-default hyper-parameters (so a mix-up shows), chosen
    so the update is a smooth function of the gradient near g = 0 (fp32 vs float64
    rounding cannot flip a result)."""
    o = hbk.optim
    if kind == "SGD":
        return o.SGD(lr=0.3)
    if kind == "Adagrad":
        return o.Adagrad(lr=0.2, eps=1e-3, initial_accumulator_value=0.1)
    if kind == "RowWiseAdagrad":
        return o.RowWiseAdagrad(lr=0.2, eps=1e-2)
    if kind == "Adam":
        return o.Adam(lr=0.05, betas=(0.8, 0.95), eps=1e-2)
    if kind == "Ftrl":
        return o.Ftrl(lr=0.4, l1=0.05, l2=0.1)
    raise AssertionError(kind)


# -- the model ----------------------------------------------------------------------------------
def pool_coefficients(values, offsets, combiner, psw=None):
    """Per id position i: (bag b, coefficient c_i) with out[b] = Σ c_i · W[values[i]]."""
    values = np.asarray(values)
    offsets = np.asarray(offsets)
    w = np.ones(len(values)) if psw is None else np.asarray(psw, np.float64)
    coef = np.zeros(len(values))
    bag = np.zeros(len(values), np.int64)
    for b in range(len(offsets) - 1):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        bag[lo:hi] = b
        if hi == lo:
            continue
        wb = w[lo:hi]
        if combiner == "sum":
            denom = 1.0
        elif combiner == "mean":
            denom = wb.sum()
        elif combiner == "sqrtn":
            denom = math.sqrt(float((wb * wb).sum()))
        else:
            raise AssertionError(combiner)
        coef[lo:hi] = wb / denom if denom != 0 else 0.0
    return bag, coef


def pool(weights, values, offsets, combiner, psw=None):
    """[B, D] float64 pooled lookup, bag by bag."""
    weights = np.asarray(weights, np.float64)
    bag, coef = pool_coefficients(values, offsets, combiner, psw)
    out = np.zeros((len(offsets) - 1, weights.shape[1]))
    for i, v in enumerate(np.asarray(values)):
        out[bag[i]] += coef[i] * weights[v]
    return out


class Reference:
    """The collection in float64: ``w[name]`` [num_rows, dim] (rounded to the table
    dtype after each step), ``state[name][slot]``, ``step[name]``."""

    def __init__(self, tables, optimizer, weights, state=None, step=None):
        self.tables = {t.name: t for t in tables}
        self.feature_table = {f: t.name for t in tables for f in features_of(t)}
        self.opt = optimizer
        self.kind = opt_kind(optimizer)
        assert self.kind in SLOTS, self.kind
        self.w = {n: np.array(weights[n], np.float64) for n in self.tables}
        self.state = {}
        for n, t in self.tables.items():
            if state is not None:
                self.state[n] = {k: np.array(state[n][k], np.float64) for k in SLOTS[self.kind]}
            else:
                self.state[n] = self.init_state(t)
        self.step = {n: int(step[n]) if step is not None else 0 for n in self.tables}
        self.touched_ever = {n: np.zeros(t.num_rows, bool) for n, t in self.tables.items()}

    def init_state(self, t):
        shape = (t.num_rows, t.dim)
        if self.kind == "Adagrad":
            return {"sum": np.full(shape, self.opt.initial_accumulator_value)}
        if self.kind == "RowWiseAdagrad":
            return {"momentum": np.zeros(t.num_rows)}
        if self.kind == "Adam":
            return {"exp_avg": np.zeros(shape), "exp_avg_sq": np.zeros(shape)}
        if self.kind == "Ftrl":
            return {"accum": np.full(shape, self.opt.initial_accumulator_value),
                    "linear": np.zeros(shape)}
        return {}

    def dtype(self, name):
        return np.dtype(self.tables[name].dtype)

    def forward(self, batch):
        """dict feature -> [B, D] float64 for a :class:`GlobalBatch`."""
        out = {}
        for f, (values, offsets) in batch.bags.items():
            t = self.tables[self.feature_table[f]]
            out[f] = pool(self.w[t.name], values, offsets, t.combiner, batch.psw.get(f))
        return out

    def gradients(self, batch):
        """dict table -> (touched ids sorted, their summed gradient rows [n, D] float64)."""
        dense = {n: np.zeros((t.num_rows, t.dim)) for n, t in self.tables.items()}
        touched = {n: np.zeros(t.num_rows, bool) for n, t in self.tables.items()}
        for f, (values, offsets) in batch.bags.items():
            name = self.feature_table[f]
            t = self.tables[name]
            bag, coef = pool_coefficients(values, offsets, t.combiner, batch.psw.get(f))
            g = np.asarray(batch.grads[f], np.float64)
            for i, v in enumerate(np.asarray(values)):
                dense[name][v] += coef[i] * g[bag[i]]
                touched[name][v] = True
        return {n: (np.flatnonzero(touched[n]), dense[n][touched[n]]) for n in self.tables}

    def backward(self, batch):
        """One step of every table; returns dict table -> the touched ids."""
        touched = {}
        for name, (ids, rows) in self.gradients(batch).items():
            self.apply(name, ids, rows)
            touched[name] = ids
        return touched

    def apply(self, name, ids, rows):
        """One optimizer step of table ``name``; Adam's (or, with stochastic rounding,
        any optimizer's) counts only with ids, the others' always."""
        if len(ids) == 0 and (self.kind == "Adam" or getattr(self.opt, "rounding", "") == "stochastic"):
            return
        self.step[name] += 1
        t = self.step[name]
        w, s, o = self.w[name], self.state[name], self.opt
        for i, g in zip(ids, rows):
            if self.kind == "SGD":
                w[i] = w[i] - o.lr * g
            elif self.kind == "Adagrad":
                s["sum"][i] += g * g
                w[i] = w[i] - o.lr * g / (np.sqrt(s["sum"][i]) + o.eps)
            elif self.kind == "RowWiseAdagrad":
                s["momentum"][i] += np.mean(g * g)
                w[i] = w[i] - o.lr * g / (np.sqrt(s["momentum"][i]) + o.eps)
            elif self.kind == "Adam":
                b1, b2 = o.betas
                s["exp_avg"][i] += (1 - b1) * (g - s["exp_avg"][i])
                s["exp_avg_sq"][i] += (1 - b2) * (g * g - s["exp_avg_sq"][i])
                step_size = o.lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                w[i] = w[i] - step_size * s["exp_avg"][i] / (np.sqrt(s["exp_avg_sq"][i]) + o.eps)
            elif self.kind == "Ftrl":
                p = o.lr_power
                n, n_new = s["accum"][i], s["accum"][i] + g * g
                z = s["linear"][i] + g - (n_new ** -p - n ** -p) / o.lr * w[i]
                quadratic = n_new ** -p / o.lr + 2 * o.l2
                w[i] = np.where(np.abs(z) > o.l1, (np.sign(z) * o.l1 - z) / quadratic, 0.0)
                s["linear"][i] = z
                s["accum"][i] = n_new
            else:
                raise AssertionError(self.kind)
        if len(ids):
            # stored in the table's dtype
            w[ids] = w[ids].astype(self.dtype(name)).astype(np.float64)
            self.touched_ever[name][ids] = True


# -- data -----------------------------------------------------------------------------------------
class GlobalBatch:
    """One global batch of ``B`` samples: ``bags[f] = (values, offsets)`` (CSR, int64),
    ``psw[f]`` float32 per id, ``grads[f]`` float32 [B, D]; ``one_hot`` features are
    given to the collection as a plain id array."""

    def __init__(self, B, bags, psw, grads, one_hot):
        self.B, self.bags, self.psw, self.grads, self.one_hot = B, bags, psw, grads, one_hot

    def local(self, lo, hi):
        """This rank's samples [lo, hi): (features, per_sample_weights, grads) as the
        collection takes them (plain NumPy; Ragged built by the caller's hbk)."""
        import hbkernels as hbk

        feats, psw, grads = {}, {}, {}
        for f, (values, offsets) in self.bags.items():
            a, b = int(offsets[lo]), int(offsets[hi])
            v = values[a:b].copy()
            if f in self.one_hot:
                assert b - a == hi - lo
                feats[f] = v
            else:
                feats[f] = hbk.Ragged(v, (offsets[lo:hi + 1] - offsets[lo]).copy())
            if f in self.psw:
                psw[f] = self.psw[f][a:b].copy()
            grads[f] = self.grads[f][lo:hi].copy()
        return feats, psw, grads


def global_batch(tables, key, step, B, *, empty_features=(), bad=None):
    """A deterministic global batch of ``B`` samples of every feature of ``tables``:
    ids at both table edges, duplicates within and across bags, ~25% empty bags,
    per-sample weights in [0.25, 1.5] with a zero on the first id of each bag of two
    or more ids (a touched row whose gradient may be zero); ``empty_features``: every
    bag empty this step. ``bad``: (feature, position, value) written into the ids."""
    bags, psw, grads = {}, {}, {}
    one_hot = set()
    for t in tables:
        for f in features_of(t):
            rng = rng_for("batch", key, step, f)
            R = t.num_rows
            if f in ONE_HOT:
                values = rng.integers(0, R, size=B)
                offsets = np.arange(B + 1)
                one_hot.add(f)
                if B >= 3:
                    values[0], values[1], values[-1] = 0, 0, R - 1   # both edges, a duplicate
            else:
                lengths = rng.integers(0, MAX_LEN.get(f, 3) + 1, size=B)
                lengths[rng.random(B) < 0.25] = 0
                if f in empty_features:
                    lengths[:] = 0
                offsets = np.concatenate([[0], np.cumsum(lengths)])
                n = int(offsets[-1])
                values = rng.integers(0, R, size=n)
                if n >= 3:
                    values[0], values[-1] = 0, R - 1               # both edges
                    dup = rng.integers(1, n - 1, size=max(1, n // 4))
                    values[dup] = values[1]                       # duplicates across bags
                    for b in range(B):                             # and within a bag
                        lo, hi = offsets[b], offsets[b + 1]
                        if hi - lo >= 2 and lo >= 1 and hi <= n - 1:
                            values[hi - 1] = values[lo]
                            break
            if f in WEIGHTED:
                w = rng.uniform(0.25, 1.5, size=len(values))
                for b in range(B):
                    lo, hi = offsets[b], offsets[b + 1]
                    if hi - lo >= 2:
                        w[lo] = 0.0
                psw[f] = w.astype(np.float32)
            bags[f] = (values.astype(np.int64), offsets.astype(np.int64))
            grads[f] = rng.standard_normal((B, t.dim)).astype(np.float32)
    if bad is not None:
        f, pos, value = bad
        bags[f][0][pos] = value
    return GlobalBatch(B, bags, psw, grads, one_hot)


def split(B, W, step):
    """Sample boundaries of each rank's slice: uneven, with an empty rank on
    steps 0 (rank 0) and 2 (the last rank)."""
    if W == 1:
        return [0, B]
    pattern = step % 3
    if pattern == 1:
        sizes = [len(a) for a in np.array_split(np.arange(B), W)]
    elif pattern == 0:
        sizes = [0] + [len(a) for a in np.array_split(np.arange(B), W - 1)]
    else:
        first = (2 * B) // 3 if W > 2 else B
        rest = [len(a) for a in np.array_split(np.arange(B - first), W - 2)] if W > 2 else []
        sizes = [first] + rest + [0]
    assert sum(sizes) == B and len(sizes) == W
    return [0] + list(np.cumsum(sizes))


# -- comparing ------------------------------------------------------------------------------------
TOL = {"float32": (2e-5, 2e-5), "float16": (1e-2, 1e-2)}
LOOSE = (3e-2, 3e-2)   # fp16 on the wire


def tol_for(dtype, loose=False):
    rtol, atol = TOL[np.dtype(dtype).name]
    if loose:
        rtol, atol = max(rtol, LOOSE[0]), max(atol, LOOSE[1])
    return rtol, atol


def assert_close(actual, expected, dtype, what, loose=False):
    rtol, atol = tol_for(dtype, loose)
    actual = np.asarray(actual)
    assert actual.shape == np.shape(expected), \
        f"{what}: shape {actual.shape}, expected {np.shape(expected)}"
    np.testing.assert_allclose(actual.astype(np.float64), expected, rtol=rtol, atol=atol, err_msg=what)


def check_full_state(coll, ref, name, loose=False, what=""):
    """``coll.full_state(name)`` against the model: the optimizer's slots, shapes,
    dtypes (fp32 state) and the step counter."""
    st = coll.full_state(name)
    t = ref.tables[name]
    slots = SLOTS[ref.kind]
    assert set(st) == set(slots) | {"step"}, f"{what}{name}: full_state keys {sorted(st)}"
    assert int(np.asarray(st["step"]).reshape(-1)[0]) == ref.step[name], \
        f"{what}{name}: step {st['step']}, expected {ref.step[name]}"
    for k in slots:
        a = np.asarray(st[k])
        shape = (t.num_rows,) if k in PER_ROW_SLOTS else (t.num_rows, t.dim)
        assert a.shape == shape and a.dtype == np.float32, f"{what}{name}.{k}: {a.shape} {a.dtype}"
        assert_close(a, ref.state[name][k], "float32", f"{what}{name}.{k}", loose=loose)
    return st


def same_on_every_rank(comm, x, what):
    x = np.ascontiguousarray(x)
    g = comm.allgather(x)
    for r in range(comm.world_size):
        assert np.array_equal(g[r].view(np.uint8), x.view(np.uint8)), f"{what}: rank {r} differs"


def check_plan(coll, tables, request, W):
    """coll.plan: every table, a known kind, the requested kind where one was asked for."""
    placements = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise",
                  "table_column_wise", "grid")
    g = coll.ranks_per_node
    names = {t.name for t in tables}
    assert set(coll.plan) == names, f"plan tables {set(coll.plan)}"
    text = str(coll.plan)
    for n in names:
        p = coll.plan[n]
        assert p.kind in placements, p
        ranks = tuple(p.ranks)
        assert ranks and all(0 <= int(r) < W for r in ranks), p
        want = request.get(n, "auto") if isinstance(request, dict) else request
        if want != "auto":
            assert p.kind == want, f"{n}: asked for {want}, planned {p}"
        if p.kind == "table_wise":
            assert len(set(ranks)) == 1, p
        if p.kind == "data_parallel":
            assert sorted(set(int(r) for r in ranks)) == list(range(W)), p
        if p.kind in ("table_row_wise", "table_column_wise"):  # the ranks of one node
            assert len({int(r) // g for r in ranks}) == 1, p
        if p.kind == "grid":  # each column slice on the ranks of one node, a node each
            per_slice = len(ranks) // (len(p.columns) - 1)
            nodes = [{int(r) // g for r in ranks[k:k + per_slice]} for k in range(0, len(ranks), per_slice)]
            assert all(len(x) == 1 for x in nodes) and len(set.union(*nodes)) == len(nodes), p
        assert n in text, f"str(plan) does not name {n}:\n{text}"


def check_training(hbk, coll, comm, tables, optimizer, *, key, steps=3, batch=24, loose=False,
                   init_weights=None, ref=None, first_step=0, empty_at=None, log=None):
    """Train ``coll`` ``steps`` steps on fresh global batches beside the model and
    compare each rank's forward slice every step and full weights and state at the
    end. ``init_weights``: the expected initial table (e.g. from a world-of-one
    collection). Returns the model."""
    R, W = comm.rank, comm.world_size
    names = [t.name for t in tables]
    if ref is None:
        w0 = {}
        for t in tables:
            w = coll.full_weights(t.name)
            assert isinstance(w, np.ndarray), type(w)
            assert w.shape == (t.num_rows, t.dim) and w.dtype == np.dtype(t.dtype), \
                f"{t.name}: full_weights {w.shape} {w.dtype}"
            assert np.all(np.isfinite(w)), t.name
            assert np.ptp(w.astype(np.float64)) > 0, f"{t.name}: initial weights are constant"
            if W > 1:
                same_on_every_rank(comm, w, f"full_weights({t.name})")
            if init_weights is not None:
                np.testing.assert_array_equal(
                    w, init_weights[t.name],
                    err_msg=f"{t.name}: initial weights depend on the world size or plan")
            w0[t.name] = w
        ref = Reference(tables, optimizer, w0)
        for n in names:  # the initial state is optimizer.init_state's
            check_full_state(coll, ref, n, what="initial ")
    # the collection's own tables now (the model's may differ in the last bit)
    start = {n: np.asarray(coll.full_weights(n), np.float64).copy() for n in names}
    touched = {t.name: np.zeros(t.num_rows, bool) for t in tables}
    for step in range(first_step, first_step + steps):
        B = batch + 3 * step
        gb = global_batch(tables, key, step, B,
                          empty_features=("tiny",) if step == empty_at else ())
        bounds = split(B, W, step)
        lo, hi = int(bounds[R]), int(bounds[R + 1])
        feats, psw, grads = gb.local(lo, hi)
        out = coll.forward(feats, per_sample_weights=psw or None)
        expect = ref.forward(gb)
        assert set(out) == set(expect), f"forward returned {sorted(out)}"
        for f, e in expect.items():
            t = ref.tables[ref.feature_table[f]]
            o = out[f]
            assert isinstance(o, np.ndarray), f"{f}: {type(o)}"
            assert o.dtype == np.dtype(t.dtype), f"step {step} {f}: output dtype {o.dtype}"
            assert o.shape == (hi - lo, t.dim), \
                f"step {step} {f}: output {o.shape}, rank {R} has {hi - lo} samples"
            assert_close(o, e[lo:hi], t.dtype, f"step {step} rank {R} forward {f}", loose)
        coll.backward(grads)
        for n, ids in ref.backward(gb).items():
            touched[n][ids] = True
        if log:
            log(f"step {step} ok")
    for t in tables:
        w = coll.full_weights(t.name)
        assert w.shape == (t.num_rows, t.dim) and w.dtype == np.dtype(t.dtype)
        assert_close(w, ref.w[t.name], t.dtype, f"{t.name} weights after training", loose)
        if W > 1:
            same_on_every_rank(comm, w, f"full_weights({t.name})")
        untouched = ~touched[t.name]
        assert touched[t.name].any(), t.name
        # rows nobody looked up keep their bits
        np.testing.assert_array_equal(w[untouched].astype(np.float64), start[t.name][untouched],
                                      err_msg=f"{t.name}: an untouched row moved")
        check_full_state(coll, ref, t.name, loose=loose, what="trained ")
    return ref
