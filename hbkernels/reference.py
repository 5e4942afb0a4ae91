"""Naive float64 references of every op, straight from the formulas of the contract.

Plain NumPy and Python loops, no Numba and nothing shared with the kernels:
the tests compare both backends against these, and a user can check a result
the same way. Inputs are NumPy arrays; under ``bounds="zero"`` an id outside
``[0, num_rows)`` adds nothing and counts in no denominator, any other
``bounds`` assumes every id is in range. Results are float64 (ids keep their meaning).
Slow by design: use them on test-sized data.
"""
import math
import zlib

import numpy as np

from . import _bits, _validate
from .types import Partitioned, SparseGrad

_SCALE = {"sum": lambda w: 1.0, "mean": lambda w: sum(w),
          "sqrtn": lambda w: math.sqrt(sum(x * x for x in w))}


def _bag_positions(values, offsets, b, num_rows, bounds):
    """The positions of bag ``b`` that are looked up."""
    return [j for j in range(int(offsets[b]), int(offsets[b + 1]))
            if bounds != "zero" or 0 <= values[j] < num_rows]


def _weights(psw, positions):
    return [1.0 if psw is None else float(psw[j]) for j in positions]


def _scale(combiner, weights):
    """The bag scale ``c``: 1 (sum), ``1/Σw`` (mean), ``1/sqrt(Σw²)`` (sqrtn); 0 where
    the denominator is 0."""
    denominator = _SCALE[combiner](weights)
    return 1.0 / denominator if denominator != 0 else 0.0


def embedding_bag(weights, values, offsets, combiner="sum", per_sample_weights=None,
                  bounds="raise"):
    """``[B, D]``: bag ``b`` is ``c_b·Σ_j w_j·weights[values[j]]``.

    >>> import numpy as np, hbkernels as hbk
    >>> w = np.arange(8, dtype=np.float32).reshape(4, 2)
    >>> v, o = np.array([0, 3, 1]), np.array([0, 2, 2, 3])
    >>> hbk.reference.embedding_bag(w, v, o, "mean").tolist()
    [[3.0, 4.0], [0.0, 0.0], [2.0, 3.0]]
    >>> np.array_equal(hbk.embedding_bag(w, v, o, combiner="mean"),
    ...                hbk.reference.embedding_bag(w, v, o, "mean"))
    True
    """
    table = np.asarray(weights, np.float64)
    out = np.zeros((len(offsets) - 1, table.shape[1]))
    for b in range(len(offsets) - 1):
        positions = _bag_positions(values, offsets, b, table.shape[0], bounds)
        w = _weights(per_sample_weights, positions)
        for j, wj in zip(positions, w):
            out[b] += wj * table[values[j]]
        out[b] *= _scale(combiner, w)
    return out


def embedding_bag_backward(grad_out, values, offsets, num_rows, combiner="sum",
                           per_sample_weights=None, bounds="raise"):
    """:class:`~hbkernels.SparseGrad` of :func:`embedding_bag` w.r.t. the table: the
    distinct looked-up ids, sorted (int64), and their summed rows
    ``Σ_j c_b·w_j·grad_out[b]``."""
    g = np.asarray(grad_out, np.float64)
    dense = np.zeros((num_rows, g.shape[1]))
    touched = set()
    for b in range(len(offsets) - 1):
        positions = _bag_positions(values, offsets, b, num_rows, bounds)
        w = _weights(per_sample_weights, positions)
        c = _scale(combiner, w)
        for j, wj in zip(positions, w):
            dense[values[j]] += c * wj * g[b]
            touched.add(int(values[j]))
    ids = np.array(sorted(touched), np.int64)
    return SparseGrad(ids, dense[ids])


def per_sample_weights_backward(grad_out, weights, values, offsets, per_sample_weights,
                                combiner="sum", bounds="raise"):
    """``[N]``: the derivative of ``Σ_b grad_out[b]·out[b]`` w.r.t. each weight, by the
    quotient rule on ``out[b] = Σ_j w_j·e_j / z_b(w)`` (``z`` = 1, ``Σw`` or
    ``sqrt(Σw²)``); 0 where ``z`` is 0 and for ids not looked up."""
    table = np.asarray(weights, np.float64)
    g = np.asarray(grad_out, np.float64)
    out = np.zeros(len(values))
    for b in range(len(offsets) - 1):
        positions = _bag_positions(values, offsets, b, table.shape[0], bounds)
        w = _weights(per_sample_weights, positions)
        z = _SCALE[combiner](w)  # out[b] = Σ w_j·e_j / z
        if z == 0:
            continue
        dots = [g[b] @ table[values[j]] for j in positions]
        total = sum(wj * dot for wj, dot in zip(w, dots))
        for j, wj, dot in zip(positions, w, dots):
            dz = {"sum": 0.0, "mean": 1.0, "sqrtn": wj / z}[combiner]  # d z / d w_j
            out[j] = dot / z - total * dz / (z * z)
    return out


def lookup(weights, ids, bounds="raise"):
    """``ids.shape + (D,)``: ``weights[ids]``, a zero row for a bad id under ``"zero"``."""
    table = np.asarray(weights, np.float64)
    flat = np.asarray(ids).reshape(-1)
    good = (flat >= 0) & (flat < table.shape[0])
    rows = np.zeros((flat.shape[0], table.shape[1]))
    rows[good] = table[flat[good]]
    return rows.reshape(np.shape(ids) + (table.shape[1],))


def lookup_backward(grad_out, ids, num_rows, bounds="raise"):
    """:func:`embedding_bag_backward` with one id per bag, summed."""
    flat = np.asarray(ids).reshape(-1)
    g = np.asarray(grad_out).reshape(flat.shape[0], -1)
    return embedding_bag_backward(g, flat, np.arange(flat.shape[0] + 1), num_rows, "sum",
                                  bounds=bounds)


def segment_reduce(data, offsets, combiner="sum"):
    """``[B, ...]``: segment ``b`` reduces ``data[offsets[b]:offsets[b+1]]`` (weights 1)."""
    rows = np.asarray(data, np.float64)
    out = np.zeros((len(offsets) - 1,) + rows.shape[1:])
    for b in range(len(offsets) - 1):
        segment = rows[offsets[b]:offsets[b + 1]]
        out[b] = segment.sum(0) * _scale(combiner, [1.0] * len(segment))
    return out


def segment_sum(data, segment_ids, num_segments, bounds="raise"):
    """``[num_segments, ...]``: ``Σ data[i]`` over ``segment_ids[i] == s``."""
    out = np.zeros((num_segments,) + np.shape(data)[1:])
    for i, s in enumerate(np.asarray(segment_ids).tolist()):
        if bounds == "zero" and not 0 <= s < num_segments:
            continue
        out[s] += np.asarray(data[i], np.float64)
    return out


def partition(ids, num_shards, mode="mod", num_rows=None):
    """:class:`~hbkernels.Partitioned`: ids stably grouped by owner (``id % shards``,
    or blocks of ``ceil(num_rows / shards)`` under ``"div"``)."""
    ids = np.asarray(ids)
    block = max(1, -(-num_rows // num_shards)) if mode == "div" else None
    shard = ids % num_shards if mode == "mod" else ids // block
    order = np.argsort(shard, kind="stable").astype(np.int64)
    return Partitioned(ids[order], np.bincount(shard, minlength=num_shards).astype(np.int64), order)


def unique(ids):
    """``(sorted distinct ids, inverse, counts int64)``: ``uniq[inverse] == ids``."""
    uniq, inverse, counts = np.unique(np.asarray(ids), return_inverse=True, return_counts=True)
    return uniq, inverse.reshape(-1).astype(np.int64), counts.astype(np.int64)


# -- optimizers -----------------------------------------------------------------
def optimizer_state(opt, weights):
    """``(float64 weights, {slot: float64 state})`` before the first step of ``opt``."""
    w = np.asarray(weights, np.float64).copy()
    name = type(opt).__name__
    if name == "Ftrl":
        return w, {"accum": np.full(w.shape, opt.initial_accumulator_value),
                   "linear": np.zeros(w.shape)}
    if name == "Adagrad":
        return w, {"sum": np.full(w.shape, opt.initial_accumulator_value)}
    if name == "RowWiseAdagrad":
        return w, {"momentum": np.zeros(w.shape[0])}
    if name == "Adam":
        return w, {"exp_avg": np.zeros(w.shape), "exp_avg_sq": np.zeros(w.shape)}
    return w, {}


def optimizer_step(opt, w, s, ids, rows, step):
    """Step number ``step`` (1-based) of ``opt`` on the float64 copies ``w`` and ``s``
    (changed in place): duplicate ids summed, then the rule row by row."""
    name = type(opt).__name__
    uniq, inverse = np.unique(ids, return_inverse=True)
    grads = np.zeros((len(uniq), w.shape[1]))
    np.add.at(grads, inverse.reshape(-1), np.asarray(rows, np.float64))
    for i, g in zip(uniq, grads):
        if name == "SGD":
            w[i] = w[i] - opt.lr * g
        elif name == "Adagrad":
            s["sum"][i] += g * g
            w[i] = w[i] - opt.lr * g / (np.sqrt(s["sum"][i]) + opt.eps)
        elif name == "RowWiseAdagrad":
            s["momentum"][i] += np.mean(g * g)
            w[i] = w[i] - opt.lr * g / (np.sqrt(s["momentum"][i]) + opt.eps)
        elif name == "Adam":
            b1, b2 = opt.betas
            s["exp_avg"][i] = b1 * s["exp_avg"][i] + (1 - b1) * g
            s["exp_avg_sq"][i] = b2 * s["exp_avg_sq"][i] + (1 - b2) * g * g
            bias = np.sqrt(1 - b2**step) / (1 - b1**step)
            w[i] = w[i] - opt.lr * bias * s["exp_avg"][i] / (np.sqrt(s["exp_avg_sq"][i]) + opt.eps)
        elif name == "Ftrl":  # TF's ApplyFtrl
            p, lr = opt.lr_power, opt.lr
            n, n_new = s["accum"][i], s["accum"][i] + g * g
            z = s["linear"][i] + g - (n_new ** -p - n ** -p) / lr * w[i]
            quadratic = n_new ** -p / lr + 2 * opt.l2
            w[i] = np.where(np.abs(z) > opt.l1, (np.sign(z) * opt.l1 - z) / quadratic, 0.0)
            s["linear"][i] = z
            s["accum"][i] = n_new
        else:
            raise ValueError(f"no reference for optimizer {name}")


def stochastic_round(x, key, row, column, fmt="fp16"):
    """``x`` rounded to ``fmt`` (``"fp16"`` or ``"bf16"``) by the contract's stochastic
    rounding, as a float64: down or up to a neighbour, up with probability
    (distance to the lower one) / ulp, the uniform draw being
    ``fmix32(fmix32(fmix32(key_lo ^ row_lo) ^ row_hi ^ key_hi) ^ column) / 2³²``;
    zero, non-finite values and values at or beyond the largest finite one round
    to nearest (the caller's cast)."""
    min_exp, bits, max_value = _FORMATS[fmt]
    x = float(x)
    if not math.isfinite(x) or abs(x) >= max_value or x == 0:
        return np.float64(x)
    a = abs(x)
    ulp = 2.0 ** (max(math.frexp(a)[1] - 1, min_exp) - bits)
    lo = math.floor(a / ulp) * ulp
    m = 0xFFFFFFFF
    u = _mix(_mix(_mix((key & m) ^ (row & m)) ^ (row >> 32) ^ (key >> 32)) ^ column) * 2.0**-32
    return np.float64(math.copysign(lo + ulp if u < (a - lo) / ulp else lo, x))


# (smallest normal exponent, stored significand bits, largest finite value)
_FORMATS = {"fp16": (-14, 10, 65504.0), "bf16": (-126, 7, (2 - 2.0**-7) * 2.0**127)}


def _mix(v):
    return int(_bits.fmix32(np.uint64(v)))


_M64 = (1 << 64) - 1


def _splitmix64(x):
    """splitmix64 of the int ``x`` (< 2**64) in Python ints: add the golden-ratio
    increment, then the two multiply-xorshift rounds and a final xorshift (mod 2**64)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def initial_weights(spec, seed, rows=None, c0=0, c1=None):
    """Initial values (float64, before the table's dtype rounds them) of rows ``rows``
    (ids of any sign; default ``range(num_rows)``) and columns ``[c0, c1)`` of table
    ``spec`` under the integer ``seed`` in ``[-2**63, 2**64)``: with
    ``k = splitmix64((seed mod 2**32) << 32 | crc32(name))``, then, for a seed outside
    ``[0, 2**32)``, ``k = splitmix64(k ^ (seed >> 32 mod 2**64))``, row ``r`` has the
    state ``s = splitmix64((r mod 2**64) ^ k)`` and element ``c`` is
    ``(2·(top 24 bits of splitmix64(s + c·0x9E3779B97F4A7C15 mod 2**64)) / 2^24 - 1)·scale``.

    >>> import numpy as np, hbkernels as hbk
    >>> spec = hbk.TableSpec("t", num_rows=3, dim=2)
    >>> np.array_equal(hbk.reference.initial_weights(spec, 7).astype(np.float32),
    ...                hbk.sharding.initial_weights(spec, 7))
    True
    """
    seed = _validate.seed(seed)
    key = _splitmix64(((seed % 2**32) << 32) | zlib.crc32(spec.name.encode()))
    if not 0 <= seed < 2**32:
        key = _splitmix64(key ^ ((seed >> 32) % 2**64))
    rows = range(spec.num_rows) if rows is None else [int(r) for r in np.ravel(rows)]
    c1 = spec.dim if c1 is None else c1
    out = np.empty((len(rows), c1 - c0))
    for i, r in enumerate(rows):
        state = _splitmix64((r % 2**64) ^ key)
        for c in range(c0, c1):
            u = (_splitmix64((state + c * 0x9E3779B97F4A7C15) % 2**64) >> 40) / 2.0**24
            out[i, c - c0] = (2.0 * u - 1.0) * spec.scale
    return out


class DictTable:
    """The contract of :class:`hbkernels.HashTable` as Python dicts, eviction by sorting.

    ``slots(ids, insert)`` returns a list of each id's slot (-1 absent); slot numbers
    are this model's own, everything else (which ids are live, their scores, the
    victims, admission) is what the contract says. Pending ids live in a dict with
    the same LRU rule (``(last sighting, id)``) and the same cap.
    """

    def __init__(self, capacity, evict="lru", admit_count=1, pending_capacity=None):
        self.capacity, self.evict, self.admit_count = capacity, evict, admit_count
        self.pending_capacity = pending_capacity or capacity
        self.slot, self.last, self.count = {}, {}, {}
        self.free = list(range(capacity))
        self.pending = {}  # id -> [calls that saw it, its last such call]
        self.step = 0
        self.admitted = self.evicted = 0

    def _key(self, i):
        return ((self.count[i],) if self.evict == "lfu" else ()) + (self.last[i], i)

    def slots(self, ids, insert=True):
        from .errors import CapacityError

        ids = [int(i) for i in np.ravel(ids)]
        if insert and ids:
            distinct = list(dict.fromkeys(ids))
            hits = {i for i in distinct if i in self.slot}
            new = [i for i in distinct if i not in self.slot]
            admitted = [i for i in new
                        if self.pending.get(i, [0])[0] + 1 >= self.admit_count]
            waiting = [i for i in new if i not in set(admitted)]
            needed = len(admitted) - len(self.free)
            victims = []
            if needed > 0:
                if self.evict == "none":
                    raise CapacityError("full")
                candidates = [i for i in self.slot if i not in hits]
                if len(candidates) < needed:
                    raise CapacityError("too many new ids")
                victims = sorted(candidates, key=self._key)[:needed]
            self.step += 1
            for i in hits:
                self.last[i] = self.step
                self.count[i] += 1
            for v in victims:
                self.free.append(self.slot.pop(v))
                del self.last[v], self.count[v]
            self.evicted += len(victims)
            for i in admitted:
                self.slot[i] = self.free.pop()
                self.last[i], self.count[i] = self.step, 1
                self.pending.pop(i, None)
            self.admitted += len(admitted)
            if self.admit_count > 1:
                self._see(waiting)
        elif insert:  # a call without ids is a call
            self.step += 1
        return [self.slot.get(i, -1) for i in ids]

    def _see(self, ids):
        if not ids:
            return
        known = [i for i in ids if i in self.pending]
        new = [i for i in ids if i not in self.pending]
        new = sorted(new)[:self.pending_capacity - len(known)] if (
            len(new) > self.pending_capacity - len(known)) else new
        for i in known:
            self.pending[i][0] += 1
            self.pending[i][1] = self.step
        overflow = len(self.pending) + len(new) - self.pending_capacity
        if overflow > 0:
            candidates = sorted((v[1], i) for i, v in self.pending.items() if i not in set(known))
            for _, i in candidates[:overflow]:
                del self.pending[i]
        for i in new:
            self.pending[i] = [1, self.step]

    def erase(self, ids):
        gone = 0
        for i in dict.fromkeys(int(i) for i in np.ravel(ids)):
            self.pending.pop(i, None)
            if i in self.slot:
                self.free.append(self.slot.pop(i))
                del self.last[i], self.count[i]
                gone += 1
        return gone

    def ids(self):
        return sorted(self.slot)

    def scores(self, ids):
        score = self.count if self.evict == "lfu" else self.last
        return [score.get(int(i), -1) for i in np.ravel(ids)]
