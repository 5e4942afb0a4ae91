"""Sparse optimizers: update only the rows of a table that a gradient touches.

Each optimizer has ``init_state(weights) -> dict`` and ``step(weights, state,
grad)``, which updates ``weights`` and ``state`` in place for the rows in
``grad.ids`` (duplicate ids are summed first; untouched rows keep their bits),
and ``fused_step(weights, state, grad_out, values, offsets, ...)``, which
applies ``embedding_bag``'s backward and the update in one pass per distinct
row without materialising the gradient rows (FBGEMM's fused backward): same
result as ``step(weights, state, embedding_bag_backward(...))``.

State arrays live beside the table (same family and device) in fp32 (fp64
for fp64 tables); ``state["step"]`` is a host int64 counter of steps taken.
Options of every optimizer:

* ``nonfinite="raise"`` (default): a gradient with NaN/Inf raises
  ``ValueError`` before anything is written; ``"skip"``: rows whose gradient
  is not finite are left untouched (weights and state), the others update.
* ``rounding="nearest"`` (default) or ``"stochastic"`` for fp16 and bf16
  tables: the fp32 update is rounded up or down with
  probability proportional to its distance to the two neighbouring fp16 (bf16)
  values, from a counter-based hash of ``(seed, step, row, column)`` (same
  bits on CPU and GPU, run to run).

Update rules (g is a row's summed gradient; all element-wise unless noted):

* ``SGD(lr)``: ``w -= lr·g``.
* ``Adagrad(lr, eps, initial_accumulator_value)`` (torch): ``s += g²;
  w -= lr·g / (sqrt(s) + eps)``.
* ``RowWiseAdagrad(lr, eps)`` (FBGEMM EXACT_ROWWISE_ADAGRAD): one accumulator
  per row, ``m += mean_d(g²); w -= lr·g / (sqrt(m) + eps)``.
* ``Adam(lr, betas, eps)`` (lazy, torch ``SparseAdam``): one step counter ``t``
  per table; touched rows: ``m += (1-β1)(g-m); v += (1-β2)(g²-v);
  w -= lr·sqrt(1-β2^t)/(1-β1^t) · m / (sqrt(v) + eps)``.
* ``Ftrl(lr, l1, l2, lr_power, initial_accumulator_value)`` (TF sparse FTRL):
  ``n' = n + g²; z += g - (n'^-p - n^-p)/lr · w; w = (sign(z)·l1 - z) /
  (n'^-p/lr + 2·l2)`` if ``|z| > l1`` else 0; ``n = n'`` (p = lr_power).

>>> import numpy as np, hbkernels as hbk
>>> w = np.ones((4, 2), np.float32)
>>> opt = hbk.optim.SGD(lr=0.5)
>>> state = opt.init_state(w)
>>> opt.step(w, state, hbk.SparseGrad(np.array([2]), np.ones((1, 2), np.float32)))
>>> w[:, 0].tolist()
[1.0, 1.0, 0.5, 1.0]
"""
import math

import numpy as np

from . import _bits
from . import _rules as rules
from . import _validate as check
from ._dispatch import cupy_family_of, in_place_ready, kernels, resolve
from .ops import unique, segment_sum
from .types import SparseGrad

ROUNDING = {"nearest": 0, "stochastic": 1}
NONFINITE = {"raise": 0, "skip": 1}


def _number(name, value, *, positive=False):
    """``value`` as a finite float, ``> 0`` (``positive``) or ``>= 0``; else a ValueError
    saying what was expected and what came."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, "
                         f"got {value!r}")
    return x


def _betas(betas):
    """``betas`` as a pair of floats in ``[0, 1)``; else a ValueError saying what was
    expected and what came."""
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):  # not a pair, or not numbers
        b1 = b2 = math.nan
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must be a pair of floats in [0, 1), got {betas!r}")
    return b1, b2


class SparseOptimizer:
    """Base of the sparse optimizers: state handling, checks, dispatch."""

    rule = None
    # (name, per_row) of the state arrays handed to the kernels as state1, state2
    slots = ()

    def __init__(self, lr, *, rounding="nearest", seed=0, nonfinite="raise"):
        self.lr = _number("lr", lr, positive=True)
        check.choice("rounding", rounding, ROUNDING)
        check.choice("nonfinite", nonfinite, NONFINITE)
        self.rounding = rounding
        self.seed = check.seed(seed)
        self.nonfinite = nonfinite

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    # -- state ------------------------------------------------------------
    def _initial_value(self, name):
        return 0.0

    def init_state(self, weights, *, arrays=None):
        """The state of a fresh ``weights``: each slot's array, full of its initial value,
        and ``"step"``. ``arrays``: ``{slot: array}`` to fill and keep instead of new ones
        (each of the slot's shape and dtype, on the weights' device: views of a larger
        array, say)."""
        family, a = resolve(row_tables=("weights",), weights=weights)
        weights = a["weights"]
        check.table("weights", weights)
        dtype = check.accumulator_dtype(weights.dtype)
        state = {"step": np.zeros(1, np.int64)}
        for name, per_row in self.slots:
            shape = (weights.shape[0],) if per_row else tuple(weights.shape)
            if arrays is None:
                state[name] = family.full(shape, self._initial_value(name), dtype,
                                          aligned=not per_row)
                continue
            given = arrays[name]
            if tuple(given.shape) != shape or np.dtype(given.dtype) != dtype:
                raise ValueError(f"arrays[{name!r}] must be {shape} {dtype.name}, "
                                 f"got {tuple(given.shape)} {np.dtype(given.dtype).name}")
            given[...] = self._initial_value(name)
            state[name] = given
        return state

    def _state_arrays(self, family, weights, state, resolved=False):
        """The slot arrays of ``state`` for ``weights``, checked (and the step counter),
        before anything is updated: a step that fails changes nothing. ``resolved``: the
        slot arrays are known to be C-contiguous CuPy arrays on the weights' device."""
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError(f"state must be the dict made by {type(self).__name__}.init_state")
        counter = state["step"]
        if not (isinstance(counter, np.ndarray) and counter.shape == (1,)
                and counter.dtype == np.int64):
            raise ValueError(f"state['step'] must be the 1-element int64 NumPy array made by "
                             f"init_state, got {counter!r}")
        in_place_ready("state['step']", counter)
        arrays = []
        dtype = check.accumulator_dtype(weights.dtype)
        for name, per_row in self.slots:
            if name not in state:
                raise ValueError(f"state lacks {name!r}; make it with init_state")
            if resolved:
                s = state[name]
            else:
                key = f"state[{name!r}]"
                s = resolve(inplace=("weights", key), row_tables=("weights",), weights=weights,
                            **{key: state[name]})[1][key]
            shape = (weights.shape[0],) if per_row else tuple(weights.shape)
            if tuple(s.shape) != shape or np.dtype(s.dtype) != dtype:
                raise ValueError(
                    f"state[{name!r}] must be {shape} {dtype.name}, "
                    f"got {tuple(s.shape)} {np.dtype(s.dtype).name}"
                )
            arrays.append(s)
        return arrays + [None] * (2 - len(arrays))

    # -- hyper-parameters -------------------------------------------------
    def hyper(self, step):
        """float64 vector of the rule's parameters for step number ``step`` (1-based)."""
        hp = np.zeros(rules.NUM_HYPER, np.float64)
        hp[rules.LR] = self.lr
        return hp

    def step_constants(self, step):
        """``(hyper-parameters, stochastic-rounding key)`` of step number ``step``
        (1-based)."""
        key = _bits.seed_key(self.seed, step) if self.rounding == "stochastic" else 0
        return self.hyper(step), key

    # -- updates ------------------------------------------------------------
    def step(self, weights, state, grad):
        """Apply ``grad`` (a :class:`hbkernels.SparseGrad`) to the rows it names."""
        if not isinstance(grad, SparseGrad):
            raise TypeError(f"grad must be hbk.SparseGrad(ids, rows), got {type(grad).__name__}")
        family, a = resolve(inplace=("weights",), row_tables=("weights",), weights=weights,
                            ids=grad.ids, rows=grad.rows)
        weights, ids, rows = a["weights"], a["ids"], a["rows"]
        check.table("weights", weights)
        check.ids("grad.ids", ids, ndim=1)
        check.floating("grad.rows", rows)
        if tuple(rows.shape) != (ids.shape[0], weights.shape[1]):
            raise ValueError(
                f"grad.rows must be [len(ids), D] = [{ids.shape[0]}, {weights.shape[1]}], "
                f"got {tuple(rows.shape)}"
            )
        s1, s2 = self._state_arrays(family, weights, state)
        backend = kernels(family, "sparse_update")
        bad = backend.first_out_of_range(family, ids, weights.shape[0])
        if bad != -1:
            check.raise_bad_id(family, "grad.ids", ids, bad, weights.shape[0])
        if self.nonfinite == "raise":
            check.raise_nonfinite("grad.rows", backend.first_nonfinite_row(family, rows))
        uniq, inverse = unique(ids, return_inverse=True)
        if uniq.shape[0] != ids.shape[0]:  # sum duplicate ids first, as torch coalesces
            ids, rows = uniq, segment_sum(rows, inverse, uniq.shape[0])
        step = int(state["step"][0]) + 1
        hp, key = self.step_constants(step)
        backend.sparse_update(
            family, self.rule, weights, s1, s2, hp, ids, rows,
            self.nonfinite == "skip", self.rounding == "stochastic", key,
        )
        state["step"][0] = step

    def fused_step(self, weights, state, grad_out, values, offsets, *, combiner="sum",
                   per_sample_weights=None, bounds="raise"):
        """``step(weights, state, embedding_bag_backward(grad_out, values, offsets, ...))``
        in one pass per distinct row, without materialising the gradient rows. On the
        GPU the step never waits for the device: its input checks are read by the next
        wait (``hbk.synchronize()``, or a later hbkernels call that reads back), which
        raises their error. A step that fails writes nothing; its count in
        ``state["step"]`` is taken back when the error is raised (steps queued between
        the two counted it: Adam's bias correction and stochastic rounding's key of
        those steps are one step ahead)."""
        family = None
        if per_sample_weights is None and isinstance(state, dict):  # CuPy arrays as they are
            slots = [state.get(name) for name, _ in self.slots]
            if all(s is not None for s in slots):
                family = cupy_family_of(weights, grad_out, values, offsets, *slots,
                                        contiguous=True)
        psw, fast = None, family is not None
        if not fast:
            family, a = resolve(
                ("per_sample_weights",), ("weights",), ("weights",), weights=weights,
                grad_out=grad_out, values=values, offsets=offsets,
                per_sample_weights=per_sample_weights,
            )
            weights, grad_out, values, offsets, psw = (
                a["weights"], a["grad_out"], a["values"], a["offsets"], a["per_sample_weights"]
            )
        check.bag_gradient(weights, grad_out, values, offsets, psw)
        mode = check.choice("bounds", bounds, check.BOUNDS)
        comb = check.choice("combiner", combiner, check.COMBINERS)
        s1, s2 = self._state_arrays(family, weights, state, resolved=fast)
        step = int(state["step"][0]) + 1
        hp, key = self.step_constants(step)
        backend = kernels(family, "sparse_update")
        counter = state["step"]

        def undo_step():  # a check the GPU reports later: the step did not count
            counter[0] -= 1

        # the backend checks first and updates nothing when a check fails
        bad_grad, bad_psw, bad_offset, bad_id = backend.fused_sparse_update(
            family, self.rule, weights, s1, s2, hp, grad_out, values, offsets, psw, comb,
            mode, self.nonfinite == "raise", self.nonfinite == "skip",
            self.rounding == "stochastic", key, undo_step,
        )
        check.raise_nonfinite("grad_out", bad_grad)
        check.raise_nonfinite("per_sample_weights", bad_psw)
        check.raise_ragged(family, values, offsets, bad_offset, bad_id, weights.shape[0])
        state["step"][0] = step


def counts_steps(optimizer):
    """Whether ``optimizer``'s update depends on its step count: Adam's bias correction,
    stochastic rounding's key."""
    return optimizer.rule == rules.ADAM or optimizer.rounding == "stochastic"


class SGD(SparseOptimizer):
    """Plain sparse SGD: ``w -= lr·g`` on the touched rows."""

    rule = rules.SGD


class Adagrad(SparseOptimizer):
    """Adagrad as ``torch.optim.Adagrad`` on a sparse gradient (eps outside the root)."""

    rule = rules.ADAGRAD
    slots = (("sum", False),)

    def __init__(self, lr, eps=1e-10, initial_accumulator_value=0.0, **options):
        super().__init__(lr, **options)
        self.eps = _number("eps", eps)
        self.initial_accumulator_value = _number("initial_accumulator_value",
                                                 initial_accumulator_value)

    def _initial_value(self, name):
        return self.initial_accumulator_value

    def hyper(self, step):
        hp = super().hyper(step)
        hp[rules.EPS] = self.eps
        return hp


class RowWiseAdagrad(Adagrad):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one fp32 accumulator per row (mean of g² over D)."""

    rule = rules.ROWWISE_ADAGRAD
    slots = (("momentum", True),)

    def __init__(self, lr, eps=1e-10, initial_accumulator_value=0.0, **options):
        super().__init__(lr, eps=eps, initial_accumulator_value=initial_accumulator_value, **options)


class Adam(SparseOptimizer):
    """Lazy Adam as ``torch.optim.SparseAdam``: only touched rows' moments move; one
    step counter per table drives the bias correction."""

    rule = rules.ADAM
    slots = (("exp_avg", False), ("exp_avg_sq", False))

    def __init__(self, lr, betas=(0.9, 0.999), eps=1e-8, **options):
        super().__init__(lr, **options)
        self.betas = _betas(betas)
        self.eps = _number("eps", eps)

    def hyper(self, step):
        hp = super().hyper(step)
        b1, b2 = self.betas
        hp[rules.EPS], hp[rules.BETA1], hp[rules.BETA2] = self.eps, b1, b2
        hp[rules.STEP_SIZE] = self.lr * np.sqrt(1.0 - b2**step) / (1.0 - b1**step)
        return hp


class Ftrl(SparseOptimizer):
    """FTRL-proximal as TF's sparse ``ApplyFtrl``: untouched rows do not move."""

    rule = rules.FTRL
    slots = (("accum", False), ("linear", False))

    def __init__(self, lr, l1=0.0, l2=0.0, lr_power=-0.5, initial_accumulator_value=0.1,
                 **options):
        super().__init__(lr, **options)
        try:
            self.lr_power = float(lr_power)
        except (TypeError, ValueError):
            self.lr_power = math.nan
        if not (math.isfinite(self.lr_power) and self.lr_power <= 0):
            raise ValueError(f"lr_power must be a finite number <= 0, got {lr_power!r}")
        self.initial_accumulator_value = _number("initial_accumulator_value",
                                                 initial_accumulator_value,
                                                 positive=self.lr_power != 0)
        self.l1, self.l2 = _number("l1", l1), _number("l2", l2)

    def _initial_value(self, name):
        return self.initial_accumulator_value if name == "accum" else 0.0

    def hyper(self, step):
        hp = super().hyper(step)
        hp[rules.L1], hp[rules.L2], hp[rules.LR_POWER] = self.l1, self.l2, self.lr_power
        return hp
