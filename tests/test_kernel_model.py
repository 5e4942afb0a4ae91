"""The H100 kernel model (``tests/kernel_model.py``) recomputed in CI against its record.

Every case of :data:`kernel_model.CASES` is recomputed from ptxas and the SASS and
compared with ``bench/results/h100-model.csv``: a case whose bytes in flight per SM,
blocks per SM or modelled fraction of copy fell below the record (beyond
:data:`kernel_model.TOLERANCE`), or whose most serial items per warp rose above it,
fails, as does a case missing from the CSV or a CSV row the model no longer computes.
After a kernel change that improves a figure, rewrite the record::

    python3 tests/kernel_model.py --write bench/results/h100-model.csv

conftest starts the computation in a process of its own when the session begins, so it
runs beside the other tests. The issue's modelled targets are tests of their own. The SASS parser is tested on
hand-written listings. The model needs numba-cuda (skipped without it), and NVVM,
NVRTC, nvJitLink and nvdisasm: the ``test`` extra installs them on Linux, where their
absence fails; elsewhere it skips.
"""
import json
import os
import sys

import pytest

import kernel_model as km
from conftest import SESSION

CSV = km.REPO / "bench" / "results" / "h100-model.csv"


# -- the SASS parser, on hand-written listings ------------------------------------------
def listing(body, name="_Z6kernel"):
    """An nvdisasm-style listing of one kernel whose instructions are ``body``'s lines
    (``LABEL:`` lines are labels; the others get addresses 0x0, 0x10, ...)."""
    lines = [f"\t.global\t{name}", f"\t.section\t.text.{name},\"ax\",@progbits", f"{name}:"]
    address = 0
    for line in body.strip().splitlines():
        line = line.strip()
        if line.endswith(":"):
            lines.append(line)
        else:
            lines.append(f"        /*{address:04x}*/                   {line} ;")
            address += 16
    return "\n".join(lines) + "\n"


LOOP_TWO_128 = """
S2R R0, SR_TID.X
.L_x_1:
IMAD.WIDE R2, R0, 0x10, R8
LDG.E.128 R4, desc[UR4][R2.64]
LDG.E.128 R12, desc[UR4][R2.64+0x200]
IADD3 R0, R0, 0x20, RZ
FFMA R20, R13.reuse, R21, R20
FFMA R22, R5, R21, R22
ISETP.GE.AND P0, PT, R0, R1, PT
@!P0 BRA `(.L_x_1)
EXIT
"""


def test_loop_with_two_128_bit_loads_then_a_use():
    a = km.analyse_sass(listing(LOOP_TWO_128))
    assert a.loop_head == 0x10
    assert a.loads_before_use == 2
    assert a.bytes_per_lane == 32
    assert a.first_use.startswith("0050: FFMA R20, R13.reuse")


def test_a_64_bit_load_writes_two_registers():
    a = km.analyse_sass(listing("""
.L_x_0:
LDG.E.64 R6, desc[UR4][R2.64]
LDG.E R9, desc[UR4][R2.64+0x8]
FADD R10, R7, R10
@P0 BRA `(.L_x_0)
EXIT
"""))
    assert [op for _, op, _ in a.loads] == ["LDG.E.64", "LDG.E"]
    assert a.bytes_per_lane == 12
    assert a.first_use.startswith("0020: FADD R10, R7")  # R7: the pair's high register


def test_a_load_address_from_a_loaded_register_is_a_use():
    """An id load, then a row load at that id: one load in flight (a dependent chain)."""
    a = km.analyse_sass(listing("""
.L_x_0:
LDG.E.64 R6, desc[UR4][R2.64]
LDG.E R9, desc[UR4][R6.64]
FADD R10, R9, R10
@P0 BRA `(.L_x_0)
EXIT
"""))
    assert a.loads_before_use == 1 and a.bytes_per_lane == 8


def test_reused_registers():
    """``.reuse`` is a read; a load's register overwritten before any read is no longer
    tracked, so a later read of the new value is no use of the load."""
    reuse = km.analyse_sass(listing("""
.L_x_0:
LDG.E R4, desc[UR4][R2.64]
LDG.E R5, desc[UR4][R2.64+0x80]
FFMA R8, R4.reuse, R4, R8
@P0 BRA `(.L_x_0)
EXIT
"""))
    assert reuse.loads_before_use == 2 and reuse.bytes_per_lane == 8
    overwritten = km.analyse_sass(listing("""
.L_x_0:
LDG.E R4, desc[UR4][R2.64]
MOV R4, R3
LDG.E.U16 R5, desc[UR4][R2.64+0x80]
FADD R8, R4, R8
HADD2.F32 R9, -RZ, R5.H0_H0
@P0 BRA `(.L_x_0)
EXIT
"""))
    assert overwritten.loads_before_use == 2 and overwritten.bytes_per_lane == 6
    assert overwritten.first_use.startswith("0040: HADD2.F32")


def test_a_kernel_with_no_loop():
    a = km.analyse_sass(listing("""
S2R R0, SR_TID.X
LDG.E R4, desc[UR4][R2.64]
LDG.E R5, desc[UR4][R2.64+0x80]
STG.E desc[UR4][R6.64], R4
EXIT
"""))
    assert a.loop_head is None and a.loops == 0
    assert a.loads_before_use == 2 and a.bytes_per_lane == 8
    assert a.first_use.startswith("0030: STG.E")


def test_the_hot_loop_is_the_innermost_with_the_most_loads():
    a = km.analyse_sass(listing("""
.L_x_outer:
LDG.E R1, desc[UR4][R2.64]
.L_x_small:
LDG.E R4, desc[UR4][R2.64]
FADD R8, R4, R8
@P0 BRA `(.L_x_small)
.L_x_big:
LDG.E R5, desc[UR4][R2.64]
LDG.E R6, desc[UR4][R2.64+0x4]
LDG.E R7, desc[UR4][R2.64+0x8]
FADD R8, R5, R8
@P1 BRA `(.L_x_big)
@P2 BRA `(.L_x_outer)
EXIT
"""))
    assert a.loops == 3
    assert a.loop_head == 0x40 and a.loop_loads == 3
    assert a.loads_before_use == 3 and a.bytes_per_lane == 12
    assert [loads for _, loads, _ in a.innermost] == [1, 3]


def test_a_rotated_loop_is_scanned_from_its_head():
    """A loop entered at its test (``BRA`` to the bottom): its head is the block control
    enters by, and the scan goes from there round to the blocks above it."""
    a = km.analyse_sass(listing("""
BRA `(.L_x_test)
.L_x_body:
LDG.E R4, desc[UR4][R2.64]
FADD R8, R4, R8
.L_x_test:
LDG.E R5, desc[UR4][R2.64+0x4]
ISETP.GE.AND P0, PT, R0, R1, PT
@P0 BRA `(.L_x_body)
EXIT
"""))
    assert a.loop_head == 0x30
    assert a.loads_before_use == 2  # R5, then R4 (from the lowest address: R4 alone)
    assert a.first_use.startswith("0020: FADD R8, R4")


# -- the check, on made-up rows -------------------------------------------------------------
def _detail(**row):
    base = {"op": "embedding_bag", "case": "fp32 D=128 L=32", "registers": 118, "blocks_per_sm": 2,
            "bytes_in_flight_per_sm": 8192, "modelled_fraction_of_copy": 0.5,
            "max_serial_items_per_warp": 32, "launches": 1, "host_syncs": 0,
            "modelled_op_fraction_of_copy": 0.5}
    base.update(row)
    return {"key": f"{base['op']},{base['case']}", "row": base}


def test_check_finds_regressions(tmp_path):
    details = [_detail()]
    path = tmp_path / "model.csv"
    km.write_csv(details, path)
    assert km.check(details, km.read_csv(path)) == []
    assert km.check([_detail(modelled_fraction_of_copy=0.52)], km.read_csv(path)) == []
    worse = [_detail(bytes_in_flight_per_sm=4096, blocks_per_sm=1, modelled_fraction_of_copy=0.45,
                     max_serial_items_per_warp=64, launches=2, host_syncs=1,
                     modelled_op_fraction_of_copy=0.3)]
    problems = km.check(worse, km.read_csv(path))
    assert len(problems) == 7, problems
    renamed = [_detail(case="fp32 D=128 L=16")]
    assert sorted(p.split(": ")[1] for p in km.check(renamed, km.read_csv(path))) == [
        "in the CSV but no longer computed by the model", "not in the CSV (write it with --write)"]


# -- the model, recomputed ------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    missing = km.missing_tools()
    if "numba-cuda" in missing:
        pytest.skip("numba-cuda is not installed")
    if missing:
        why = f"missing {', '.join(missing)}: pip install -e '.[test]'"
        if sys.platform == "linux":  # where the test extra installs them
            pytest.fail(why)
        pytest.skip(why)
    if SESSION["kernel_model"]:  # conftest started it beside the suite: its JSON report
        proc, report = SESSION["kernel_model"]
        proc.wait(timeout=900)
        if os.path.exists(report):
            with open(report) as f:
                return json.load(f)
    return km.compute()


@pytest.fixture(scope="module")
def cases(model):
    return {d["key"]: d for d in model["cases"]}


def test_no_case_regressed_against_the_record(model):
    problems = km.check(model["cases"], km.read_csv(CSV))
    assert not problems, ("\n".join(problems) + f"\n(an improvement? rewrite the record: "
                          f"python3 tests/kernel_model.py --write {CSV.relative_to(km.REPO)})")


def test_every_launched_kernel_is_in_a_phase(model):
    unmodelled = {d["key"]: d["unmodelled_kernels"] for d in model["cases"]
                  if d.get("unmodelled_kernels")}
    assert not unmodelled, f"launched but in no phase of kernel_model.phases(): {unmodelled}"


def test_figures_are_sane(model):
    for d in (d for d in model["cases"] if "error" not in d):  # errors fail the test above
        r = d["row"]
        assert r["registers"] > 0 and r["blocks_per_sm"] >= 1, d["key"]
        assert r["bytes_in_flight_per_sm"] > 0, f"{d['key']}: no load found in the main kernel"
        assert 0 < r["modelled_fraction_of_copy"] <= 1, d["key"]
        assert d["fraction_800ns"] <= r["modelled_fraction_of_copy"] + 1e-9, d["key"]
        assert r["launches"] >= 1 and d["host_seconds"] > 0, d["key"]
        assert 0 < r["modelled_op_fraction_of_copy"] <= r["modelled_fraction_of_copy"], d["key"]


@pytest.mark.parametrize("key", ["embedding_bag,fp32 D=128 L=32", "lookup,fp32 D=128",
                                 "fused_step,rowwise_adagrad fp32 D=128 zipf1.05"])
def test_the_training_path_never_waits_for_the_device(cases, key):
    """The forward, lookup and the fused step: no host sync, so the host's time per call
    hides behind the device's (the op's figure is the larger of the two)."""
    d = cases[key]
    assert d["row"]["host_syncs"] == 0
    assert d["op_seconds"] == max(d["seconds"], d["host_seconds"])


# -- the modelled targets ------------------------------------------------------------
def fraction(cases, key):
    return cases[key]["row"]["modelled_fraction_of_copy"]


@pytest.mark.parametrize("dim, target", [(128, 0.80), (64, 0.60), (16, 0.40)])
def test_forward_fp32_l32_modelled_fraction(cases, dim, target):
    assert fraction(cases, f"embedding_bag,fp32 D={dim} L=32") >= target


def test_forward_fp16_modelled_time_at_most_0_6_of_fp32(cases):
    fp16 = cases["embedding_bag,fp16 D=128 L=32"]["seconds"]
    fp32 = cases["embedding_bag,fp32 D=128 L=32"]["seconds"]
    assert fp16 <= 0.6 * fp32, f"fp16 {fp16 * 1e3:.3f} ms, fp32 {fp32 * 1e3:.3f} ms"


def test_fused_rowwise_adagrad_modelled_fraction(cases):
    assert fraction(cases, "fused_step,rowwise_adagrad fp32 D=128 zipf1.05") >= 0.50


def test_backward_and_fused_serial_items_per_warp(cases):
    serial = {k: d["row"]["max_serial_items_per_warp"] for k, d in cases.items()
              if d["row"]["op"] in ("embedding_bag_backward", "fused_step")}
    assert serial and max(serial.values()) <= 1024, serial
