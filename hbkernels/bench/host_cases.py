"""The calls whose host cost ``bench_launch`` measures: every public op, each optimizer's
fused step, a hash table's lookup, the main job's sparse step and a collection's forward
and training step over tables of seven widths, on CUDA arrays, at sizes where the device's own work is a
few microseconds.

Each :class:`HostCase` holds a call to repeat and, for the null device
(:mod:`.null_device`), the answers to the reads of kernels' results it makes: the values
the CPU ops give for the same inputs.
"""
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import hbkernels as hbk

B, D, E = 256, 16, 1000  # one-id bags of a width-16 table of 1000 rows
MAIN_BATCH = 1024
MIXED_DIMS = (1, 4, 16, 24, 64, 128, 200)  # the widths of mixed_widths_case's tables
NO_ERROR = np.iinfo(np.int64).max
OPTIMIZERS = ("SGD", "Adagrad", "RowWiseAdagrad", "Adam", "Ftrl")


@dataclass
class HostCase:
    op: str
    mode: str
    call: Callable[[], object]
    answers: dict = field(default_factory=dict)  # read site -> f(shape, dtype) -> value


def _constant(values):
    return lambda shape, dtype: np.asarray(values, dtype).reshape(shape)


def _backward_answers(ids, offsets):
    """The one read of ``embedding_bag_backward``: the distinct id count, the first
    (smallest) distinct id and its error slots (clean), as the CPU gives them."""
    grad = hbk.embedding_bag_backward(np.ones((len(offsets) - 1, 1), np.float32), ids, offsets,
                                      num_rows=int(ids.max()) + 1)
    info = [len(grad.ids), int(grad.ids.min()), NO_ERROR, NO_ERROR]
    return {"hbkernels.cuda.embedding_bag_backward.embedding_bag_backward": _constant(info)}


def op_cases(xp, answering, b=B, d=D, e=E, seed=0):
    """The public ops and fused steps on ``xp`` (CuPy, or a stand-in) arrays;
    ``answering(answers)``: a context in which the setup's reads are answered (the null
    device's :func:`~.null_device.answers`; nothing to do on a GPU)."""
    rng = np.random.default_rng(seed)
    host_table = rng.standard_normal((e, d)).astype(np.float32)
    host_ids = (rng.zipf(1.05, b) - 1) % e
    host_offsets = np.arange(b + 1, dtype=np.int64)
    table, ids, offsets = xp.asarray(host_table), xp.asarray(host_ids), xp.asarray(host_offsets)
    grad = xp.asarray(rng.standard_normal((b, d)).astype(np.float32))
    psw = xp.asarray(np.ones(b, np.float32))
    segments = xp.asarray(host_ids % 64)
    distinct = len(np.unique(host_ids))
    backward = _backward_answers(host_ids, host_offsets)
    quantized = hbk.quantize_rows(table, bits=8)
    out = [
        HostCase("embedding_bag", "raise", lambda: hbk.embedding_bag(table, ids, offsets)),
        HostCase("embedding_bag", "unchecked",
                 lambda: hbk.embedding_bag(table, ids, offsets, bounds="unchecked")),
        HostCase("embedding_bag", "weighted mean", lambda: hbk.embedding_bag(
            table, ids, offsets, combiner="mean", per_sample_weights=psw)),
        HostCase("embedding_bag", "int8 table", lambda: hbk.embedding_bag(quantized, ids, offsets)),
        HostCase("lookup", "raise", lambda: hbk.lookup(table, ids)),
        HostCase("embedding_bag_backward", "raise",
                 lambda: hbk.embedding_bag_backward(grad, ids, offsets, num_rows=e), backward),
        HostCase("embedding_bag_backward", "padded unchecked", lambda: hbk.embedding_bag_backward(
            grad, ids, offsets, num_rows=e, padded=True, bounds="unchecked")),
        HostCase("lookup_backward", "raise",
                 lambda: hbk.lookup_backward(grad, ids, num_rows=e), backward),
        HostCase("per_sample_weights_backward", "raise", lambda: hbk.per_sample_weights_backward(
            grad, table, ids, offsets, psw)),
        HostCase("segment_sum", "raise", lambda: hbk.segment_sum(grad, segments, 64)),
        HostCase("segment_reduce", "sum", lambda: hbk.segment_reduce(grad, offsets)),
        HostCase("unique", "inverse", lambda: hbk.unique(ids, return_inverse=True),
                 {"hbkernels.cuda.unique.unique": _constant([distinct])}),
        HostCase("partition", "mod 8", lambda: hbk.partition(ids, 8),
                 {"hbkernels.cuda._launch.read_error_slots": _constant([NO_ERROR])}),
        HostCase("check_ragged", "raise", lambda: hbk.ops.check_ragged(ids, offsets, e)),
    ]
    for name in OPTIMIZERS:
        for bounds in ("raise", "unchecked"):
            if bounds == "unchecked" and name != "RowWiseAdagrad":
                continue
            opt = getattr(hbk.optim, name)(lr=0.01)
            weights = table.copy()
            state = opt.init_state(weights)
            out.append(HostCase(
                f"{name}.fused_step", bounds,
                lambda o=opt, w=weights, s=state, bd=bounds: o.fused_step(
                    w, s, grad, ids, offsets, bounds=bd)))
    live = hbk.HashTable(4 * b, device="cuda")
    keys = np.unique(host_ids)  # every id of the profiled calls is live: a lookup and a use each
    with answering({"hbkernels.cuda.hash_table.insert": _constant([0])}):
        live.restore(keys, np.ones(len(keys), np.int64), np.ones(len(keys), np.int64), 1)
    out.append(HostCase("HashTable.slots", "all live", lambda: live.slots(ids),
                        {"hbkernels.hash_table._plan": _constant(False)}))
    return out


def main_job_case(xp, batch=MAIN_BATCH, seed=0, reserved=False, captured=False):
    """``hbkernels train``'s sparse step on one rank: the collection of its 8 default
    tables (Adagrad, sum, D = 16), forward then backward (which updates); ``reserved``:
    after ``reserve`` for the batch's sizes (no allocation, no wait); ``captured``: that
    step captured into a CUDA graph (CuPy's stream capture) once, over inputs that are
    views of one device buffer, then each call copies a batch from the host into that
    buffer (one copy, as ``hbkernels train --cuda-graph`` does) and replays the graph."""
    from hbkernels.cli.train import DEFAULT_TABLES
    from hbkernels.data.__main__ import parse_table

    rng = np.random.default_rng(seed)
    specs, features, grads = [], {}, {}
    for text in DEFAULT_TABLES:
        t = parse_table(text)
        specs.append(hbk.TableSpec(t.name, num_rows=t.num_rows, dim=16, combiner="sum"))
        lengths = (rng.integers(0, 2 * t.hotness + 1, batch) if t.variable
                   else np.full(batch, t.hotness))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        values = (rng.zipf(1.05, int(offsets[-1])) - 1) % t.num_rows
        features[t.name] = hbk.Ragged(xp.asarray(values), xp.asarray(offsets))
        grads[t.name] = xp.asarray(rng.standard_normal((batch, 16)).astype(np.float32))
    coll = hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"),
                                   optimizer=hbk.optim.Adagrad(lr=0.05), device="cuda", seed=seed)
    if reserved or captured:
        coll.reserve(batch, {f: int(x.values.shape[0]) for f, x in features.items()})

    def step():
        coll.forward(features)
        coll.backward(grads)

    if not captured:
        return HostCase("main job sparse step",
                        f"8 tables, batch {batch}{', reserved' if reserved else ''}", step)
    on_host = np.concatenate([xp.asnumpy(a) for x in features.values() for a in x])
    inputs, at = xp.asarray(on_host), 0  # every feature's values and offsets, one buffer
    for f, x in features.items():
        n, m = x.values.shape[0], x.offsets.shape[0]
        features[f] = hbk.Ragged(inputs[at:at + n], inputs[at + n:at + n + m])
        at += n + m
    step()  # a step of the same sizes before the capture
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        with coll.capture() as captured_step:
            stream.begin_capture()
            step()
            graph = stream.end_capture()

    def replay():
        with stream:
            inputs.set(on_host)
            captured_step.replay(lambda: graph.launch(stream))

    return HostCase("main job sparse step", f"8 tables, batch {batch}, captured", replay)


def mixed_widths_case(xp, batch=B, seed=0, step=False):
    """A collection's forward over one table of each width of :data:`MIXED_DIMS` (E rows
    each, combiners sum, mean and sqrtn in turn), ``batch`` bags of 0 to 4 ids each; with
    ``step``, its forward then backward (Adagrad, which updates)."""
    rng = np.random.default_rng(seed)
    combiners = ("sum", "mean", "sqrtn")
    specs = [hbk.TableSpec(f"d{d}", num_rows=E, dim=d, combiner=combiners[i % 3])
             for i, d in enumerate(MIXED_DIMS)]
    features = {}
    for spec in specs:
        offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 5, batch))]).astype(np.int64)
        values = (rng.zipf(1.05, int(offsets[-1])) - 1) % E
        features[spec.name] = hbk.Ragged(xp.asarray(values), xp.asarray(offsets))
    coll = hbk.EmbeddingCollection(specs, comm=hbk.dist.init("local"), device="cuda", seed=seed)
    if not step:
        return HostCase("collection forward", f"{len(specs)} widths, batch {batch}",
                        lambda: coll.forward(features))
    grads = {spec.name: xp.asarray(rng.standard_normal((batch, spec.dim)).astype(np.float32))
             for spec in specs}

    def forward_backward():
        coll.forward(features)
        coll.backward(grads)

    return HostCase("collection step", f"{len(specs)} widths, batch {batch}", forward_backward)


def collection_cases(xp):
    """The collection's cases: :func:`main_job_case` (plain, reserved and captured) and
    :func:`mixed_widths_case`'s forward and step."""
    return [main_job_case(xp), main_job_case(xp, reserved=True), main_job_case(xp, captured=True),
            mixed_widths_case(xp), mixed_widths_case(xp, step=True)]
