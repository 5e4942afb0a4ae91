"""The time model of a sparse step (hbkernels.sharding.cost) and the planner and collection
that use a machine profile."""
import dataclasses
import json

import numpy as np
import pytest
from helpers import raises

import hbkernels as hbk
from hbkernels.bench.common import LAYOUTS, zipf_ids
from hbkernels.sharding.cost import collectives, expected_distinct, per_id_ns
from hbkernels.sharding.plan import Plan, make_plan
from hbkernels.sharding.profile import ASSUMED, MEASURED, MachineProfile, Spread, as_profile

LOOKUP = {16: 10.0, 64: 22.0}     # ns per id by width
UPDATE = {16: 40.0, 64: 100.0}
LOOKUP_BAG = {16: 2.0, 64: 4.0}   # ns per bag by width
UPDATE_BAG = {16: 7.0, 64: 9.0}
UNIQUE = 9.0                      # ns per id
CALL = {"lookup": 3.0, "update": 5.0}
STEP = {"data_parallel": 150.0, "table_wise": 200.0, "row_wise": 210.0, "column_wise": 250.0}  # µs
TABLE = {"data_parallel": 10.0, "table_wise": 30.0, "row_wise": 35.0, "column_wise": 50.0}   # µs
HOST_ID = {"data_parallel": 3.0, "table_wise": 4.0, "row_wise": 5.0, "column_wise": 6.0}     # ns
HOST_BAG = {"data_parallel": 1.0, "table_wise": 2.0, "row_wise": 3.0, "column_wise": 4.0}    # ns


def profile(latency_us=20.0, bandwidth=2e9, alpha=1.05, layouts=LAYOUTS):
    """A measured-looking profile whose constants are round numbers."""
    def per(table, scale):
        return {(d, lay): Spread.exactly(v * scale[lay]) for d, v in table.items() for lay in layouts}

    scale = {"scattered": 1.0, "ranked": 0.5, "uniform": 2.0}
    return MachineProfile(MEASURED, {"cpu": "test CPU", "world_size": 2, "date": "2026-12-01",
                                     "alpha": alpha},
                          per(LOOKUP, scale), per(UPDATE, scale), per(LOOKUP_BAG, scale),
                          per(UPDATE_BAG, scale), {lay: Spread.exactly(UNIQUE) for lay in layouts},
                          *({k: Spread.exactly(v) for k, v in d.items()}
                            for d in (CALL, STEP, TABLE, HOST_ID, HOST_BAG)),
                          Spread.exactly(latency_us), Spread.exactly(bandwidth), True)


@pytest.mark.parametrize("rows, draws", [(1, 5), (7, 3), (1000, 50), (10**6, 10**5), (10**9, 10**6)])
def test_uniform_distinct_is_the_closed_form(rows, draws):
    assert expected_distinct(rows, draws) == pytest.approx(rows * (1 - (1 - 1 / rows) ** draws), rel=1e-7)
    assert expected_distinct(rows, 0) == 0


@pytest.mark.parametrize("rows, draws, alpha", [(500, 2000, 1.05), (200_000, 1024, 1.05),
                                                (100_000, 8192, 1.2), (3_000_000, 50_000, 0.8)])
def test_zipf_distinct_matches_drawn_ids(rows, draws, alpha):
    drawn = [np.unique(zipf_ids(draws, rows, alpha, seed=s)).size for s in range(3)]
    assert expected_distinct(rows, draws, alpha) == pytest.approx(np.mean(drawn), rel=0.03)
    assert expected_distinct(rows, draws, alpha) < expected_distinct(rows, draws)


def test_per_id_cost_is_linear_in_the_width_between_and_beyond_the_measured():
    assert per_id_ns(LOOKUP, 16) == 10.0 and per_id_ns(LOOKUP, 40) == pytest.approx(16.0)
    assert per_id_ns(LOOKUP, 128) == pytest.approx(38.0)       # beyond: the nearest two's line
    assert per_id_ns({16: 10.0, 64: 22.0, 128: 30.0}, 100) == pytest.approx(22 + 8 * 36 / 64)
    assert per_id_ns({16: 10.0, 64: 2.0}, 128) == 0.0           # never below 0
    assert per_id_ns({32: 7.0}, 3) == 7.0


def test_collectives_count_the_slice_widths_of_sharded_and_replicated_tables():
    specs = {name: hbk.TableSpec(name, num_rows=100, dim=d) for name, d in
             (("a", 16), ("b", 16), ("c", 8), ("d", 16), ("e", 8))}
    plan = make_plan(list(specs.values()), 3, {"a": "row_wise", "b": "table_wise",
                                                "c": "column_wise", "d": "column_wise",
                                                "e": "data_parallel"})
    # sharded widths: 16 (a, b), 3 and 2 (c's slices), 6 and 5 (d's); replicated: 8
    assert collectives(plan.tables, dict(plan)) == 3 * 5 + 1
    assert collectives(plan.tables, {}) == 0


def op(table, bag_table, bags, ids, width):
    return 1e-9 * (bags * bag_table[width] + ids * table[width])


def by_hand(spec, placement, n, batch):
    """The module docstring's sums for one table, written out: (lookup, update) per rank."""
    bags = batch * len(spec.features)
    ids = bags * spec.hotness
    u = expected_distinct(spec.rows, ids, 1.05)
    d = spec.dim
    if n == 1:
        return [op(LOOKUP, LOOKUP_BAG, bags, ids, d)], [op(UPDATE, UPDATE_BAG, bags, ids, d)]
    pooling = op(LOOKUP, LOOKUP_BAG, bags, ids, d)
    lookup, update = [pooling + 1e-9 * UNIQUE * ids] * n, [pooling] * n
    if placement.kind == "data_parallel":
        return lookup, [pooling + op(UPDATE, UPDATE_BAG, n * u, n * u, d)] * n
    owners = range(n) if placement.kind == "row_wise" else placement.ranks
    asked = u if placement.kind == "row_wise" else n * u
    for r in owners:
        lookup[r] += 1e-9 * UNIQUE * asked + op(LOOKUP, LOOKUP_BAG, asked, asked, d)
        update[r] += op(UPDATE, UPDATE_BAG, asked, asked, d)
    return lookup, update


def host_by_hand(plan, batch):
    kinds = {p.kind for p in plan.values()}
    seconds = 1e-6 * max(STEP[k] - TABLE[k] for k in kinds)
    for name, p in plan.items():
        spec = plan.tables[name]
        bags = batch * len(spec.features)
        seconds += 1e-6 * TABLE[p.kind] + 1e-9 * bags * (HOST_BAG[p.kind] + spec.hotness * HOST_ID[p.kind])
    return seconds


@pytest.mark.parametrize("kind", ["row_wise", "table_wise", "data_parallel"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_step_is_its_parts_by_hand(kind, n):
    spec = hbk.TableSpec("t", num_rows=50_000, dim=16, hotness=4, features=("a", "b"))
    other = hbk.TableSpec("o", num_rows=300, dim=64)
    request = {"t": kind, "o": "table_wise"} if n > 1 else "table_wise"
    plan = make_plan([spec, other], n, request, batch_size_hint=512, profile=profile())
    est = plan.predict()
    lookup, update = [0.0] * n, [0.0] * n
    for s in plan.tables.values():
        lk, up = by_hand(s, plan[s.name], n, 512)
        lookup = [a + b for a, b in zip(lookup, lk)]
        update = [a + b for a, b in zip(update, up)]
    assert est.lookup == pytest.approx(lookup, rel=1e-9)
    assert est.update == pytest.approx(update, rel=1e-9)
    assert est.host == pytest.approx([host_by_hand(plan, 512)] * n, rel=1e-9)
    wire = [sum(e.wire_bytes[r] for e in plan.estimates.values()) / 2e9 for r in range(n)]
    # beyond the collectives of one width, which the steps of STEP hold
    kinds = {p.kind for p in plan.values()}
    k = collectives(plan.tables, dict(plan)) - 3 * bool(kinds - {"data_parallel"}) - ("data_parallel" in kinds)
    assert est.exchange == pytest.approx([0.0] if n == 1 else [w + 20e-6 * k for w in wire], rel=1e-9)
    assert est.seconds == max(est.per_rank) and plan.step_seconds == est.seconds
    assert est.source == MEASURED and "test CPU" in est.label() and "2 rank(s)" in est.label()


def test_column_wise_slices_cost_at_their_own_width():
    spec = hbk.TableSpec("t", num_rows=10_000, dim=64, hotness=2)
    plan = make_plan([spec], 2, "column_wise", batch_size_hint=256, profile=profile())
    est = plan.predict()
    bags, ids = 256, 512
    u = expected_distinct(10_000, ids, 1.05)
    lk32, ub32 = (per_id_ns(LOOKUP, 32), per_id_ns(LOOKUP_BAG, 32)), (per_id_ns(UPDATE, 32), per_id_ns(UPDATE_BAG, 32))
    pooling = 2 * (bags * lk32[1] + ids * lk32[0])  # each slice pooled apart
    assert est.host == pytest.approx([1e-6 * 250 + 1e-9 * 256 * (4 + 2 * 6)] * 2)
    for r in range(2):  # each rank owns one 32-column slice, asked by both ranks
        assert est.lookup[r] == pytest.approx(1e-9 * (pooling + UNIQUE * (ids + 2 * u) + 2 * u * sum(lk32)))
        assert est.update[r] == pytest.approx(1e-9 * (pooling + 2 * u * sum(ub32)))


def test_the_id_layout_picks_its_figures_and_its_distinct_ids():
    spec = hbk.TableSpec("t", num_rows=10**6, dim=16, hotness=8)
    steps = {lay: make_plan([spec], 2, "row_wise", batch_size_hint=1024, profile=profile(),
                            id_layout=lay).predict() for lay in LAYOUTS}
    ids = 1024 * 8
    assert steps["ranked"].lookup[0] < steps["scattered"].lookup[0] < steps["uniform"].lookup[0]
    zipf, uniform = expected_distinct(10**6, ids, 1.05), expected_distinct(10**6, ids)
    assert steps["scattered"].update[0] == pytest.approx(1e-9 * (1024 * 2 + ids * 10 + zipf * (40 + 7)))
    assert steps["uniform"].update[0] == pytest.approx(2e-9 * (1024 * 2 + ids * 10 + uniform * (40 + 7)))
    with raises(ValueError, match="no figures for id layout 'uniform'"):
        make_plan([spec], 2, "row_wise", profile=profile(layouts=("scattered",)), id_layout="uniform")
    with raises(ValueError, match="id_layout must be one of"):
        make_plan([spec], 1, profile=profile(), id_layout="sorted")


def test_the_profile_ranks_the_placements():
    """A costly update shards what the built-in constants replicate (each rank updates its
    half of the rows, not every rank all of them); a costly sharded step (its exchanges)
    replicates it again."""
    tables = [hbk.TableSpec("mid", num_rows=200_000, dim=16, hotness=4)]
    assumed = make_plan(tables, 2, batch_size_hint=1024)
    costly = profile()
    costly = dataclasses.replace(costly, update_ns_per_id={k: Spread.exactly(1e4) for k in costly.update_ns_per_id})
    sharded = make_plan(tables, 2, batch_size_hint=1024, profile=costly)
    assert assumed["mid"].kind == "data_parallel" and sharded["mid"].kind == "row_wise"
    slow = dataclasses.replace(costly, step_us={k: Spread.exactly(1e3 if k == "data_parallel" else 1e6)
                                                for k in costly.step_us})
    assert make_plan(tables, 2, batch_size_hint=1024, profile=slow)["mid"].kind == "data_parallel"
    assert sharded.step_seconds == sharded.predict().seconds
    with raises(ValueError, match="a profile or cost constants, not both"):
        make_plan(tables, 2, profile=profile(), cost={"network_bytes_per_s": 1e9})


def test_a_plan_keeps_its_profile_through_json_and_prints_what_it_predicts():
    tables = [hbk.TableSpec("t", num_rows=1000, dim=16)]
    plan = make_plan(tables, 2, batch_size_hint=64, profile=profile(), id_layout="ranked")
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.profile == plan.profile and again.id_layout == "ranked"
    assert again.predict() == plan.predict()
    text = str(plan)
    assert "predicted sparse step:" in text and "profile measured on test CPU" in text
    assert "ids ranked" in text
    bare = make_plan(tables, 2, batch_size_hint=64)
    assert bare.profile is None and "built-in rates, not measured" in str(bare)
    assert bare.predict().source == ASSUMED and "not measured" in bare.predict().label()
    old = bare.to_json()  # a plan saved before profiles: the byte model, scattered ids
    del old["profile"], old["id_layout"]
    assert Plan.from_json(old) == bare


def test_as_profile_takes_a_profile_its_file_or_its_dict(tmp_path):
    p = profile()
    p.save(tmp_path / "p.json")
    assert as_profile(p) is p and as_profile(None) is None
    assert as_profile(str(tmp_path / "p.json")) == p == as_profile(tmp_path / "p.json")
    assert as_profile(p.to_json()) == p
    with raises(ValueError, match="plan_profile: cannot read"):
        as_profile(tmp_path / "missing.json")
    with raises(ValueError, match="plan_profile must be a MachineProfile"):
        as_profile(3)
    with raises(ValueError, match="field 'call_us'"):
        as_profile({k: v for k, v in p.to_json().items() if k != "call_us"})


def test_a_collection_estimates_its_step_by_its_profile(tmp_path):
    p = profile()
    p.save(tmp_path / "p.json")
    tables = [hbk.TableSpec("a", num_rows=100, dim=16), hbk.TableSpec("b", num_rows=50, dim=64)]
    local = hbk.dist.init("local")
    coll = hbk.EmbeddingCollection(tables, comm=local, device="cpu", batch_size_hint=32,
                                   plan_profile=tmp_path / "p.json", id_layout="uniform")
    est = coll.estimate()
    assert coll.plan.profile == p and est == coll.plan.predict() and est.source == MEASURED
    ids = 32
    assert est.update[0] == pytest.approx(1e-9 * 2 * ids * (40 + 7 + 100 + 9))
    plain = hbk.EmbeddingCollection(tables, comm=local, device="cpu", batch_size_hint=32)
    assert plain.estimate().source == ASSUMED
    coll.save(tmp_path / "ckpt")
    assert hbk.EmbeddingCollection.load(tmp_path / "ckpt", comm=local).plan.profile is None
    again = hbk.EmbeddingCollection.load(tmp_path / "ckpt", comm=local, plan_profile=p)
    assert again.estimate().source == MEASURED

