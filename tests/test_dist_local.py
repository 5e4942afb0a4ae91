"""hbk.dist with the local backend (one process, no MPI), the wire dtypes, the
input checks, and import/selection safety. The multi-process backends are
tested by tests/test_dist_mpi.py."""
import doctest
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import hbkernels as hbk
from hbkernels.dist import _common, _nccl, _wire

ROOT = Path(__file__).resolve().parents[1]
ALL_DTYPES = [d.name for d in _common.SUPPORTED_DTYPES]
FLOATS = ["float16", "float32", "float64"]


@pytest.fixture
def comm():
    return hbk.dist.init("local")


def data(rng, shape, dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) < 0.5)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.asarray(rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape,
                                       dtype=dtype))
    return np.asarray(rng.standard_normal(shape) * 10).astype(dtype)


# -- import safety and backend selection ------------------------------------------------
LAUNCHERS_VARS = (hbk.dist.MPI_LAUNCHER_ENV_VARS + hbk.dist.MPI_SIZE_ENV_VARS +
                  hbk.dist.SLURM_ENV_VARS + hbk.dist.TORCH_LAUNCHER_ENV_VARS)


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHERS_VARS}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_import_and_init_outside_mpiexec_import_neither_mpi4py_nor_cupy():
    probe = (
        "import sys, hbkernels as hbk\n"
        "assert hbk.dist is sys.modules['hbkernels.dist']\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'cupy')]\n"
        "assert not loaded, loaded\n"
        "c = hbk.dist.init()\n"
        "assert (c.backend, c.rank, c.world_size) == ('local', 0, 1), c\n"
        "import hbkernels.dist._nccl\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'cupy')]\n"
        "assert not loaded, loaded\n"
        "print('fine')\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=_clean_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "fine"


def test_dist_is_public():
    assert "dist" in hbk.__all__
    assert issubclass(hbk.dist.CommError, RuntimeError)
    assert hbk.dist.CommError.__module__ == "hbkernels.dist"


def test_launcher_reads_the_environment(monkeypatch):
    for var in LAUNCHERS_VARS:
        monkeypatch.delenv(var, raising=False)
    assert hbk.dist.launcher() is None
    for var in hbk.dist.LAUNCHER_ENV_VARS:
        monkeypatch.setenv(var, "0")
        assert hbk.dist.launcher() == ("torch" if var == "RANK" else "mpi"), var
        monkeypatch.delenv(var)
    monkeypatch.setenv("PMI_RANK", "")  # set but empty: not a launcher
    assert hbk.dist.launcher() is None
    # variables saying one rank: a plain single process
    for one in ({"WORLD_SIZE": "1"}, {"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, {"PMI_SIZE": "1"},
                {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"},
                {"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}):  # an sbatch script's own process
        with monkeypatch.context() as m:
            for k, v in one.items():
                m.setenv(k, v)
            assert hbk.dist.launcher() is None, one
            assert hbk.dist.init().backend == "local", one
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")  # torch's variables win over srun's
    monkeypatch.setenv("RANK", "0")
    assert hbk.dist.launcher() == "torch"


@pytest.mark.parametrize("env, expect", [
    ({"WORLD_SIZE": "4", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29700"},
     "torch"),
    ({"LOCAL_WORLD_SIZE": "2"}, "torch"),
    ({"LOCAL_RANK": "1"}, "torch"),
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}, "mpi"),      # srun without an MPI plugin
    ({"SLURM_STEP_NUM_TASKS": "3"}, "mpi"),
    ({"PMI_SIZE": "2"}, "mpi"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "mpi"),
    ({"MPI_LOCALNRANKS": "2", "WORLD_SIZE": "2"}, "mpi"),      # MPI's variables win
])
def test_variables_saying_several_ranks_name_a_launcher(monkeypatch, env, expect):
    """Any launcher's variables saying there are several ranks name that launcher
    (so ``init()`` connects them, or raises): never ``None``, a one-rank job."""
    for var in LAUNCHERS_VARS:
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert hbk.dist.launcher() == expect


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "4", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29700"},
     "RANK is unset (RANK=<unset>, WORLD_SIZE=4, MASTER_ADDR=127.0.0.1, MASTER_PORT=29700, "
     "LOCAL_RANK=2); launch with torchrun, or set RANK"),
    ({"LOCAL_WORLD_SIZE": "2"}, "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are unset"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "29700"}, "LOCAL_WORLD_SIZE=2 does not fit in WORLD_SIZE=1 ranks"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1",
      "MASTER_PORT": "29700"}, "LOCAL_RANK=2 does not fit in WORLD_SIZE=2 ranks"),
])
def test_torchs_variables_that_cannot_connect_are_an_error_before_any_import(monkeypatch, env,
                                                                            message):
    """Checked from the environment alone: no torch import, no rendezvous."""
    for var in LAUNCHERS_VARS:
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(sys.modules, "torch", None)  # an import would fail differently
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    for backend in ("auto", "torch"):
        with pytest.raises(RuntimeError, match="torchrun launch: ") as e:
            hbk.dist.init(backend)
        assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("env", [
    {"PMI_RANK": "1", "PMI_SIZE": "2"},                                   # mpiexec -n 2
    {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4"},                           # srun -n 4
    {"PMI_RANK": "1", "PMI_SIZE": "2", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
     "MASTER_PORT": "29700"},
])
def test_backend_torch_under_an_mpi_launcher_without_torchs_ranks_is_an_error(monkeypatch, env):
    """torch.distributed is made from torch's variables only: under mpiexec or srun
    with them unset (or saying one rank), ``init("torch")`` raises, from the
    environment alone (no torch import), instead of N one-rank torch jobs."""
    for var in LAUNCHERS_VARS:
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    launched = max(int(v) + k.endswith(("RANK", "PROCID")) for k, v in env.items()
                   if k.startswith(("PMI", "SLURM")))
    with pytest.raises(RuntimeError, match=f"backend 'torch': the launcher started {launched} "
                       "ranks .* but torch.distributed's environment says this process is alone"
                       r".* use backend 'auto' or 'mpi' under mpiexec or srun, launch with "
                       "torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"):
        hbk.dist.init("torch")


def test_init_arguments(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        hbk.dist.init("gloo")
    with pytest.raises(ValueError, match="positive"):
        hbk.dist.init("local", timeout=0)
    monkeypatch.setenv("HBK_COMM_TIMEOUT", "7.5")
    assert hbk.dist.init("local").timeout == 7.5
    assert hbk.dist.init("LOCAL", timeout=2).timeout == 2.0
    monkeypatch.setenv("HBK_COMM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HBK_COMM_TIMEOUT"):
        hbk.dist.init("local")
    monkeypatch.delenv("HBK_COMM_TIMEOUT")
    assert hbk.dist.init("local").timeout == hbk.dist.DEFAULT_TIMEOUT


def test_docstring_examples_run():
    import hbkernels.dist as dist

    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(dist, "hbkernels.dist", globs={})
    assert sum(len(t.examples) for t in tests) >= 8
    for t in tests:
        runner.run(t)
    assert runner.failures == 0


def test_nccl_unique_id_round_trip():
    uid_tuple = tuple(int(v) for v in np.random.default_rng(0).integers(-128, 128, 128))
    assert _nccl._uid_from_bytes(_nccl._uid_to_bytes(uid_tuple)) == uid_tuple
    uid_bytes = bytes(range(128))
    assert _nccl._uid_from_bytes(_nccl._uid_to_bytes(uid_bytes)) == uid_bytes


# -- every op, local backend ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_alltoallv(comm, rng, dtype):
    for shape in [(7, 3), (5,), (4, 2, 3), (0, 3), (3, 0)]:
        send = data(rng, shape, dtype)
        recv, counts = comm.alltoallv(send, [shape[0]])
        assert isinstance(recv, np.ndarray) and recv.dtype == send.dtype
        assert recv.shape == send.shape
        np.testing.assert_array_equal(recv, send)
        assert counts.dtype == np.int64 and counts.tolist() == [shape[0]]
        if send.size:
            assert not np.shares_memory(recv, send)


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d != "bool"])
def test_allreduce(comm, rng, op, dtype):
    for shape in [(), (6,), (3, 4), (0,)]:
        x = data(rng, shape, dtype)
        out = comm.allreduce(x, op=op)
        assert out.dtype == x.dtype and out.shape == x.shape
        np.testing.assert_array_equal(out, x)
        if x.size:
            assert not np.shares_memory(out, x)
    assert comm.allreduce(np.ones(2, dtype), op=op.upper()).shape == (2,)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_allgather_allgatherv_broadcast(comm, rng, dtype):
    for shape in [(), (5,), (2, 3), (0, 2)]:
        x = data(rng, shape, dtype)
        g = comm.allgather(x)
        assert g.shape == (1,) + shape and g.dtype == x.dtype
        np.testing.assert_array_equal(g[0], x)
        b = comm.broadcast(x, root=0)
        assert b.shape == shape and b.dtype == x.dtype
        np.testing.assert_array_equal(b, x)
        if shape:
            v, counts = comm.allgatherv(x)
            np.testing.assert_array_equal(v, x)
            assert counts.tolist() == [shape[0]] and counts.dtype == np.int64


def test_barrier(comm):
    assert comm.barrier() is None


def test_results_in_callers_family(backend, rng):
    """NumPy in, NumPy out; CUDA in (a real GPU or Numba's simulator), CUDA out."""
    comm = hbk.dist.init("local")
    x = rng.standard_normal((6, 4)).astype(np.float32)
    d = backend.put(x)
    recv, counts = comm.alltoallv(d, np.array([6]))
    np.testing.assert_array_equal(backend.get(recv), x)
    assert isinstance(counts, np.ndarray)
    np.testing.assert_array_equal(backend.get(comm.allreduce(d, op="max")), x)
    np.testing.assert_array_equal(backend.get(comm.allgather(d))[0], x)
    v, _ = comm.allgatherv(d)
    np.testing.assert_array_equal(backend.get(v), x)
    np.testing.assert_array_equal(backend.get(comm.broadcast(d)), x)
    w = backend.get(comm.allreduce(d, wire_dtype="bfloat16"))
    np.testing.assert_array_equal(w, _wire.round_trip(x, "bfloat16"))
    # counts may live on the device too
    recv, counts = comm.alltoallv(d, backend.put(np.array([6])))
    assert counts.tolist() == [6]


# -- wire dtypes --------------------------------------------------------------------------------
def _bf16_value(c):
    """Value of the non-negative bf16 pattern ``c``; inf (0x7F80) counts as 2**128,
    where IEEE rounding puts the next binade."""
    if c >= 0x7F80:
        return Fraction(2) ** 128
    return Fraction(float(np.array([c << 16], np.uint32).view(np.float32)[0]))


def ref_bf16_bits(x):
    """bfloat16 bits of float ``x`` by exhaustive nearest-even search (pure Python)."""
    if math.isnan(x):
        return None
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if math.isinf(a):
        return sign | 0x7F80
    with np.errstate(over="ignore"):
        top = int(np.array([a], np.float32).view(np.uint32)[0]) >> 16
    exact = Fraction(a)
    best = None
    for c in (top - 1, top, top + 1):
        if not 0 <= c <= 0x7F80:
            continue
        key = (abs(_bf16_value(c) - exact), c & 1)
        if best is None or key < best[0]:
            best = (key, c)
    return sign | best[1]


def wire_samples(rng, dtype):
    vals = [0.0, -0.0, 1.0, -1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-30),
            2**-133, 2**-134, 3 * 2**-134, 1e-40, 3.3895e38, 3.39e38, 3.4e38, 65504.0, 65520.0,
            1e5, 6e-8, 1e-8, np.pi, -np.e]
    x = np.concatenate([np.array(vals), rng.standard_normal(500) * 10.0 ** rng.integers(-40, 38, 500)])
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bf16_rounds_to_nearest_even(rng, dtype):
    x = wire_samples(rng, dtype)
    got = _wire.to_bf16_bits(x)
    assert got.dtype == np.uint16 and got.shape == x.shape
    for v, g in zip(x.tolist(), got.tolist()):
        assert g == ref_bf16_bits(v), (v, hex(g), hex(ref_bf16_bits(v)))


def test_bf16_special_values():
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 3.4028235e38, -3.4028235e38], np.float32)
    b = _wire.to_bf16_bits(x)
    back = _wire.from_bf16_bits(b)
    assert np.isnan(back[:2]).all()
    assert back[2:].tolist() == [np.inf, -np.inf, np.inf, -np.inf]
    payload_nan = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001], np.uint32).view(np.float32)
    assert np.isnan(_wire.from_bf16_bits(_wire.to_bf16_bits(payload_nan))).all()


def test_bf16_double_rounding_avoided():
    # 1 + 2**-8 + 2**-30: float32 rounds it to the tie 1 + 2**-8, which would go to 1.0
    x = np.array([1 + 2**-8 + 2**-30, 1 + 2**-8, 1 + 3 * 2**-8 - 2**-40])
    got = _wire.from_bf16_bits(_wire.to_bf16_bits(x)).tolist()
    assert got == [1 + 2**-7, 1.0, 1 + 2**-7]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_wire_exact_on_representable_values(comm, rng, dtype, wire):
    # 8 significant bits, exponents in [-10, 5]: exact in both float16 and bfloat16
    x = (rng.integers(-255, 256, size=(40, 3)) * 2.0 ** rng.integers(-10, 6, size=(40, 3)))
    x = x.astype(dtype)
    recv, _ = comm.alltoallv(x, [40], wire_dtype=wire)
    assert recv.dtype == x.dtype
    np.testing.assert_array_equal(recv, x)
    for out in (comm.allreduce(x, wire_dtype=wire), comm.allgather(x, wire_dtype=wire)[0],
                comm.allgatherv(x, wire_dtype=wire)[0], comm.broadcast(x, wire_dtype=wire)):
        assert out.dtype == x.dtype
        np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("wire, rel", [("float16", 2.0**-11), ("bfloat16", 2.0**-8)])
def test_wire_rounding_within_tolerance(comm, rng, dtype, wire, rel):
    x = rng.uniform(-100, 100, size=(64, 5)).astype(dtype)
    recv, _ = comm.alltoallv(x, [64], wire_dtype=wire)
    assert recv.dtype == x.dtype
    err = np.abs(recv.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= rel * np.abs(x.astype(np.float64)) + 1e-30)
    if wire == "float16":
        np.testing.assert_array_equal(recv, x.astype(np.float16).astype(dtype))
    else:
        expect = [ref_bf16_bits(v) for v in x.ravel().tolist()]
        np.testing.assert_array_equal(_wire.to_bf16_bits(recv).ravel(), expect)


@pytest.mark.parametrize("wire", ["float16", np.float16, "fp16", "bfloat16", "bf16", None])
def test_wire_dtype_spellings_and_integers_ignore_it(comm, wire):
    ids = np.array([2**40 + 1, -3, 7], np.int64)
    recv, _ = comm.alltoallv(ids, [3], wire_dtype=wire)
    np.testing.assert_array_equal(recv, ids)
    assert comm.allreduce(np.array([70000], np.int32), wire_dtype=wire)[0] == 70000


def test_wire_dtype_rejected(comm):
    for bad in ["int8", "float32", np.int32, "bfloat"]:
        with pytest.raises(ValueError, match="wire_dtype"):
            comm.allreduce(np.ones(3), wire_dtype=bad)


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("counts, match", [
    ([2], "sum to 2 but send has 4 rows"),
    ([2, 2], "2 entries, expected world_size = 1"),
    ([], "0 entries"),
    ([[4]], "1-D"),
    ([-1], "negative"),
    ([4.5], "integers"),
    (None, "required"),
])
def test_alltoallv_bad_counts(comm, counts, match):
    with pytest.raises(ValueError, match=match):
        comm.alltoallv(np.zeros((4, 2)), counts)


def test_alltoallv_accepts_integral_counts(comm):
    assert comm.alltoallv(np.zeros((4, 2)), np.array([4.0]))[1].tolist() == [4]
    assert comm.alltoallv(np.zeros((4, 2)), (np.uint8(4),))[1].tolist() == [4]


def test_bad_arrays(comm):
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.alltoallv(np.zeros((4, 6))[:, ::2], [4])
    with pytest.raises(ValueError, match="C-contiguous"):
        comm.allreduce(np.zeros((4, 6)).T)
    with pytest.raises(ValueError, match="complex128 is not supported"):
        comm.allgather(np.zeros(3, np.complex128))
    with pytest.raises(ValueError, match="not supported"):
        comm.broadcast(np.array(["a"]))
    with pytest.raises(ValueError, match="at least one dimension"):
        comm.alltoallv(np.zeros((), np.float32), [1])
    with pytest.raises(ValueError, match="at least one dimension"):
        comm.allgatherv(np.zeros(()))
    with pytest.raises(ValueError, match="at most 8"):
        comm.allgather(np.zeros((1,) * 9))
    with pytest.raises(TypeError):
        comm.allreduce([1.0, 2.0])


def test_bad_reduce_op_root_and_bool(comm):
    with pytest.raises(ValueError, match="op must be one of"):
        comm.allreduce(np.ones(3), op="avg")
    with pytest.raises(ValueError, match="bool"):
        comm.allreduce(np.ones(3, bool), op="max")
    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast(np.ones(3), root=1)
    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast(np.ones(3), root=-1)
    with pytest.raises(ValueError, match="must be an int"):
        comm.broadcast(np.ones(3), root=0.0)


def test_communicator_stays_usable_after_bad_input(comm):
    with pytest.raises(ValueError):
        comm.alltoallv(np.zeros((4, 2)), [3])
    assert comm.allreduce(np.array([5]))[0] == 5


def test_agreement_messages():
    """The cross-rank checks, on hand-made metadata of a 2-rank world."""
    def call(dtype=np.float32, shape=(4, 3), counts=(2, 2), extra=0):
        c = _common.Call(op="alltoallv", dtype=np.dtype(dtype), shape=shape, extra=extra,
                         counts=np.array(counts, np.int64))
        return c

    def metas(*calls, op="alltoallv", bad=(), seqs=(1, 1)):
        return np.stack([_common.meta_vector(op, c, s, 2, bad=i in bad)
                         for i, (c, s) in enumerate(zip(calls, seqs))])

    _common.check_agreement("alltoallv", metas(call(), call(shape=(9, 3))))  # rows may differ
    with pytest.raises(hbk.dist.CommError, match="rank 1 sent float64, rank 0 float32"):
        _common.check_agreement("alltoallv", metas(call(), call(dtype=np.float64)))
    with pytest.raises(hbk.dist.CommError, match=r"rank 1 sent rows of shape \(5,\), rank 0 \(3,\)"):
        _common.check_agreement("alltoallv", metas(call(), call(shape=(4, 5))))
    with pytest.raises(hbk.dist.CommError, match="rank 0 failed its input checks"):
        _common.check_agreement("alltoallv", metas(None, call(), bad=(0,)))
    with pytest.raises(hbk.dist.CommError, match="out of step"):
        _common.check_agreement("alltoallv", metas(call(), call(), seqs=(1, 2)))
    with pytest.raises(hbk.dist.CommError, match=r"shapes differ.*rank 1 passed \(4, 5\)"):
        _common.check_agreement("allreduce", metas(call(), call(shape=(4, 5)), op="allreduce"))
    with pytest.raises(hbk.dist.CommError, match="rank 1 asked for max, rank 0 sum"):
        _common.check_agreement("allreduce", metas(call(), call(extra=1), op="allreduce"))
    mixed = np.stack([_common.meta_vector("allreduce", call(), 1, 2),
                      _common.meta_vector("allgather", call(), 1, 2)])
    with pytest.raises(hbk.dist.CommError, match="rank 1 called allgather, rank 0 allreduce"):
        _common.check_agreement("allreduce", mixed)
    with pytest.raises(KeyError, match="mine"):  # a rank's own input error wins
        _common.check_agreement("alltoallv", metas(None, call(), bad=(0,)), KeyError("mine"))


# -- GPU (real device) ---------------------------------------------------------------------------
@pytest.mark.gpu
def test_wire_on_cupy_matches_numpy(rng):
    cupy = pytest.importorskip("cupy")
    for dtype in ("float32", "float64"):
        x = wire_samples(rng, dtype)
        np.testing.assert_array_equal(cupy.asnumpy(_wire.to_bf16_bits(cupy.asarray(x), cupy)),
                                      _wire.to_bf16_bits(x))
    comm = hbk.dist.init("local")
    x = cupy.asarray(rng.standard_normal((50, 4)).astype(np.float32))
    recv, counts = comm.alltoallv(x, [50], wire_dtype="bfloat16")
    assert isinstance(recv, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(recv), _wire.round_trip(cupy.asnumpy(x), "bfloat16"))
