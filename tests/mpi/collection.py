"""hbk.EmbeddingCollection across ranks against the float64 model of
collection_reference.py (run by tests/test_embedding_collection.py under
``mpiexec -n 2`` and ``-n 3``).

``collection.py train``: every plan ("data_parallel", "table_wise",
"row_wise", "column_wise", "auto", a mixed dict) with Adagrad, and SGD,
RowWiseAdagrad, Adam, Ftrl on some plans, ``dedup=False`` and
``wire_dtype="float16"``: the initial tables equal a world-of-one collection's
(same seed, plan "table_wise"); three steps of fresh global batches (each rank
its uneven slice, some rank empty), each rank's forward slice against the
model every step, full weights and state after.

``collection.py errors`` (run with a small HBK_COMM_TIMEOUT): an unknown
feature, a backward without a feature or with a wrong gradient shape raise
ValueError on every rank and change nothing; ranks passing different tables or seeds
to the constructor get the same CommError; a NaN gradient on rank 0 only raises
ValueError there and CommError on the others, and changes nothing; an out-of-range
id on rank 1 only raises BoundsError there and CommError on the others within the
timeout.

Every rank builds the same global batch from the seed and takes its slice.
Prints ``OK rank r`` at the end."""
import os
import sys

import numpy as np

import collection_reference as cr
import hbkernels as hbk
from harness import Timer, finish, log

MODE = sys.argv[1] if len(sys.argv) > 1 else "train"
comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
assert comm.backend == "mpi" and W > 1, comm
TABLES = cr.table_specs(hbk)
_LOCAL = {}


def local_init(seed):
    """The initial tables of a world-of-one collection (plan "table_wise")."""
    if seed not in _LOCAL:
        c = hbk.EmbeddingCollection(TABLES, comm=hbk.dist.init("local"),
                                    optimizer=cr.make_optimizer(hbk, "SGD"), plan="table_wise",
                                    seed=seed)
        _LOCAL[seed] = {t.name: c.full_weights(t.name) for t in TABLES}
    return _LOCAL[seed]


# (plan, optimizer, extra keyword arguments, loose tolerance)
CASES = [(plan, "Adagrad", {}, False) for plan in cr.PLANS] + [
    ("table_wise", "SGD", {}, False),
    ("data_parallel", "Adam", {}, False),
    ("row_wise", "Adam", {}, False),
    ("row_wise", "RowWiseAdagrad", {}, False),
    ("column_wise", "RowWiseAdagrad", {}, False),   # may be refused (one accumulator per whole row)
    ("mixed", "Ftrl", {}, False),
    ("row_wise", "Adagrad", {"dedup": False}, False),
    ("mixed", "Adagrad", {"dedup": False}, False),
    ("row_wise", "Adagrad", {"wire_dtype": "float16"}, True),
    ("column_wise", "Adam", {"wire_dtype": "float16"}, True),
]


def check_case(coll, request, opt, key, seed, loose, case):
    """The plan of ``request``, then 3 steps against the model from one rank's tables."""
    cr.check_plan(coll, TABLES, request, W)
    cr.check_training(hbk, coll, comm, TABLES, opt, key=key, steps=3, init_weights=local_init(seed),
                      loose=loose, empty_at=1, log=lambda m: log(comm, *case, m))


def train():
    for i, (plan, kind, kw, loose) in enumerate(CASES):
        seed = 11 + i % 2
        opt = cr.make_optimizer(hbk, kind)
        request = cr.plan_request(plan)
        with Timer() as t:
            try:
                coll = hbk.EmbeddingCollection(TABLES, comm=comm, optimizer=opt, plan=request,
                                               seed=seed, batch_size_hint=12, **kw)
            except ValueError as e:
                # a row-wise state cannot be split over column slices: refusing is fine,
                # a wrong result is not
                if not (kind == "RowWiseAdagrad" and plan == "column_wise"):
                    raise
                assert "column" in str(e), e
                if R == 0:
                    print(f"case {plan} {kind}: refused: {e}", flush=True)
                continue
            check_case(coll, request, opt, ("train", i), seed, loose, (plan, kind, kw))
        if R == 0:
            print(f"case {plan} {kind} {kw}: ok in {t.s:.2f} s", flush=True)


# the hierarchical exchange: (plan, optimizer, extra keyword arguments, loose tolerance)
RELAYED = [(plan, "Adagrad", {}, False) for plan in ("row_wise", "table_wise", "column_wise", "mixed")
           + cr.NODE_PLANS] + [
    ("row_wise", "Adam", {}, False),
    ("mixed", "Ftrl", {"dedup": False}, False),
    ("row_wise", "Adagrad", {"wire_dtype": "float16"}, True),
    ("grid", "Adam", {}, False),
    ("table_row_wise", "RowWiseAdagrad", {}, False),
    ("mixed_nodes", "SGD", {"exchange": "flat"}, False),
    ("grid", "Adagrad", {"exchange": "flat", "wire_dtype": "float16"}, True),
]


def hierarchical(g):
    """Ranks in nodes of ``g``, the exchange hierarchical (flat in the cases that say so),
    the placements over a node's ranks among the plans: each case trains as one rank
    does; its forward equals the flat exchange's and one rank's bit for bit, with fewer
    bytes across nodes where the ranks of a node ask for the same ids."""
    for i, (plan, kind, kw, loose) in enumerate(RELAYED):
        seed = 21 + i % 2
        opt = cr.make_optimizer(hbk, kind)
        request = cr.plan_request(plan)
        with Timer() as t:
            kw = {"exchange": "hierarchical", **kw}
            coll = hbk.EmbeddingCollection(TABLES, comm=comm, optimizer=opt, plan=request, seed=seed,
                                           batch_size_hint=12, ranks_per_node=g, **kw)
            assert coll.exchange == kw["exchange"] and coll.ranks_per_node == g
            check_case(coll, request, opt, ("relayed", i), seed, loose, (plan, kind, kw))
        if R == 0:
            print(f"hierarchical case {plan} {kind} {kw}: ok in {t.s:.2f} s", flush=True)
    # the same forward through the flat and the hierarchical exchange
    made = {how: hbk.EmbeddingCollection(TABLES, comm=comm, optimizer=cr.make_optimizer(hbk, "SGD"),
                                         plan="row_wise", seed=3, ranks_per_node=g, exchange=how)
            for how in ("flat", "hierarchical")}
    B = 64
    gb = cr.global_batch(TABLES, "relayed-bytes", 0, B)
    bounds = cr.split(B, W, 0)
    feats, psw, grads = gb.local(int(bounds[R]), int(bounds[R + 1]))
    outs, sent = {}, {}
    for how, coll in made.items():
        outs[how] = coll.forward(feats, per_sample_weights=psw or None)
        coll.backward(grads)
        sent[how] = comm.allreduce(np.array([coll.stats[k] for k in
                                             ("across_node_bytes", "within_node_bytes")], np.int64))
    # one rank given the whole batch
    one = hbk.EmbeddingCollection(TABLES, comm=hbk.dist.init("local"),
                                  optimizer=cr.make_optimizer(hbk, "SGD"), plan="table_wise", seed=3)
    whole, whole_psw, whole_grads = gb.local(0, B)
    outs["one rank"] = {f: o[int(bounds[R]):int(bounds[R + 1])]
                        for f, o in one.forward(whole, per_sample_weights=whole_psw or None).items()}
    one.backward(whole_grads)
    for f, out in outs["hierarchical"].items():
        for other in ("flat", "one rank"):
            assert out.dtype == outs[other][f].dtype
            np.testing.assert_array_equal(out, outs[other][f], err_msg=f"forward {f} against {other}")
    for t_ in TABLES:
        for other in (made["flat"], one):
            cr.assert_close(made["hierarchical"].full_weights(t_.name), other.full_weights(t_.name),
                            t_.dtype, f"{t_.name} after a step")
    if R == 0:
        print(f"bytes across nodes, within nodes (all ranks, one step of {B} samples, nodes of {g}): "
              f"flat {sent['flat'].tolist()}, hierarchical {sent['hierarchical'].tolist()}", flush=True)
    assert sent["hierarchical"][0] < sent["flat"][0], sent


def expect(exc, fn, what, match=()):
    try:
        fn()
    except exc as e:
        for m in match:
            assert m in str(e), f"{what}: {type(e).__name__} does not mention {m!r}: {e}"
        return e
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"rank {R}: {what}: expected {exc.__name__}, got {e!r}") from e
    raise AssertionError(f"rank {R}: {what}: expected {exc.__name__}, nothing raised")


def errors():
    timeout = float(os.environ["HBK_COMM_TIMEOUT"])
    assert comm.timeout == timeout <= 30, (comm.timeout, timeout)
    opt = cr.make_optimizer(hbk, "Adagrad")
    coll = hbk.EmbeddingCollection(TABLES, comm=comm, optimizer=opt, plan="row_wise", seed=5)
    ref = cr.check_training(hbk, coll, comm, TABLES, opt, key="errors", steps=1)  # also warms up
    B = 24
    gb = cr.global_batch(TABLES, "errors", 1, B)
    bounds = cr.split(B, W, 1)
    lo, hi = int(bounds[R]), int(bounds[R + 1])
    feats, psw, grads = gb.local(lo, hi)
    with Timer() as t:
        expect(ValueError, lambda: coll.forward({**feats, "nope": np.zeros(hi - lo, np.int64)},
                                                per_sample_weights=psw),
               "forward with an unknown feature", ["nope"])
        expect(ValueError, lambda: coll.forward(
            feats, per_sample_weights={**psw, "nope": np.ones(3, np.float32)}),
            "per_sample_weights of an unknown feature", ["nope"])
        out = coll.forward(feats, per_sample_weights=psw)
        expect(ValueError, lambda: coll.backward({k: g for k, g in grads.items() if k != "user"}),
               "backward without a feature", ["user"])
        expect(ValueError, lambda: coll.backward({**grads, "user": np.zeros((hi - lo, 9), np.float32)}),
               "backward with a gradient of the wrong width", ["user"])
        expect(ValueError, lambda: coll.backward(
            {**grads, "item": np.zeros((hi - lo + 1, 5), np.float32)}),
            "backward with a gradient of the wrong batch size", ["item"])
        expect(hbk.dist.CommError, lambda: hbk.EmbeddingCollection(
            [hbk.TableSpec("x", num_rows=10 + (R == 1), dim=4)], comm=comm),
            "ranks passing different tables", ["rank 1 and rank 0 disagree on its tables"])
        expect(hbk.dist.CommError, lambda: hbk.EmbeddingCollection(
            [hbk.TableSpec("x", num_rows=10, dim=4)], comm=comm, seed=R),
            "ranks passing different seeds", ["disagree on its seed"])
        nan = {**grads, "item": grads["item"].copy()}
        if R == 0:
            nan["item"][0, 1] = np.nan
        expect(ValueError if R == 0 else hbk.dist.CommError, lambda: coll.backward(nan),
               "backward with a NaN gradient on rank 0", ["'item'", "row 0"] if R == 0 else [])
    assert t.s < timeout / 2, f"the rejected calls took {t.s:.1f} s"
    expect_out = ref.forward(gb)
    for f, o in out.items():
        t_ = ref.tables[ref.feature_table[f]]
        cr.assert_close(o, expect_out[f][lo:hi], t_.dtype, f"forward {f} after a rejected call")
    coll.backward(grads)   # the pending forward survives the rejected backward calls
    ref.backward(gb)
    for t_ in TABLES:
        cr.assert_close(coll.full_weights(t_.name), ref.w[t_.name], t_.dtype,
                        f"{t_.name} after rejected calls")
        cr.check_full_state(coll, ref, t_.name, what="after rejected calls ")
    log(comm, "ValueErrors ok")

    # an out-of-range id on rank 1 only
    gb = cr.global_batch(TABLES, "errors", 2, B)
    bounds = cr.split(B, W, 1)
    lo, hi = int(bounds[R]), int(bounds[R + 1])
    feats, psw, grads = gb.local(lo, hi)
    bad_value = TABLES[0].num_rows
    if R == 1:
        v, o = feats["user"]
        if len(v) == 0:
            v, o = np.zeros(1, np.int64), np.concatenate([[0], np.ones(len(o) - 1, np.int64)])
        v = v.copy()
        v[len(v) // 2] = bad_value
        feats["user"] = hbk.Ragged(v, o)
    with Timer() as t:
        if R == 1:
            e = expect(hbk.BoundsError, lambda: coll.forward(feats, per_sample_weights=psw),
                       "forward with an out-of-range id", [str(bad_value)])
        else:
            e = expect(hbk.dist.CommError, lambda: coll.forward(feats, per_sample_weights=psw),
                       "forward while rank 1 has an out-of-range id")
    print(f"rank {R}: {type(e).__name__} after {t.s:.2f} s: {e}", flush=True)
    assert t.s < timeout + 10, f"{type(e).__name__} after {t.s:.1f} s, timeout {timeout}"
    if R == 1:
        assert t.s < timeout / 2, f"BoundsError after {t.s:.1f} s"
    # both errors were agreed on through the metadata exchange: no request was
    # abandoned, so MPI_Finalize has nothing to wait for and every rank leaves
    # normally (a hard exit of one rank makes mpiexec kill the others: exit 9)
    assert not comm._orphans, f"rank {R}: abandoned requests after an agreed error"


if MODE == "train":
    train()
    finish(comm)
elif MODE == "hierarchical":
    hierarchical(int(sys.argv[2]))
    finish(comm)
elif MODE == "errors":
    errors()
    finish(comm)
else:
    raise SystemExit(f"unknown mode {MODE!r}")
