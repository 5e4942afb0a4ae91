"""The GPU launch path (hbkernels.cuda._launcher) without a GPU: argument kinds and
flattened values, the packed parameter buffer as the driver reads it (each pointer of
the parameter array at its 8-byte slot), one compile per signature and device, and
the on-disk kernel cache (hbkernels.cuda._kernel_cache). The PTX parameters of every
kernel the suite launches are held to the same packing by tests/compile_kernels.py."""
import ctypes
import struct
import threading
import types as pytypes
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba.cuda")
from numba import types  # noqa: E402

from hbkernels._modes import Bounds  # noqa: E402
from hbkernels.cuda import _kernel_cache, _launcher  # noqa: E402


class FakeCupy:
    """The attributes the launcher reads of a CuPy array."""

    def __init__(self, shape, dtype, strides=None, ptr=0x7F0000001000):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.itemsize = len(self.shape), self.dtype.itemsize
        self.size = int(np.prod(self.shape, dtype=np.int64))
        dense = _launcher._c_strides(self.shape, self.itemsize)
        self.strides = tuple(strides) if strides is not None else dense
        contiguous = self.strides == dense or self.size <= 1
        self._c_contiguous = contiguous
        self.flags = pytypes.SimpleNamespace(c_contiguous=contiguous)
        self.data = pytypes.SimpleNamespace(ptr=ptr)


FakeCupy.__module__ = "cupy._core.core"


class OlderCupy(FakeCupy):
    """A CuPy array without ``_c_contiguous``: its layout read from ``flags``."""

    def __getattribute__(self, name):
        if name == "_c_contiguous":
            raise AttributeError(name)
        return super().__getattribute__(name)


OlderCupy.__module__ = "cupy._core.core"


class Interface:
    """An array known only by ``__cuda_array_interface__`` (as Numba's device arrays)."""

    def __init__(self, shape, dtype, strides=None, ptr=0x7F0000002000):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": np.dtype(dtype).str,
                                         "strides": strides, "data": (ptr, False), "version": 3}


def test_kinds_and_flat_values():
    a = FakeCupy((5, 3), np.float32)
    b = Interface((7,), np.int64)
    kinds, flat = _launcher.arguments((a, b, 4, True, 2.5, np.uint64(9), np.float32(1.5)))
    assert kinds == ((np.dtype(np.float32), 2, True), (np.dtype(np.int64), 1, True), int, bool,
                     float, np.uint64, np.float32)
    assert flat == [0, 0, 15, 4, a.data.ptr, 5, 3, 12, 4,
                    0, 0, 7, 8, 0x7F0000002000, 7, 8, 4, True, 2.5, 9, 1.5]
    assert [_launcher.numba_type(k) for k in kinds] == [
        types.Array(types.float32, 2, "C"), types.Array(types.int64, 1, "C"), types.int64,
        types.boolean, types.float64, types.uint64, types.float32]


def test_strided_bf16_and_empty_arrays():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    strided = FakeCupy((4, 2), np.float32, strides=(32, 4))
    bf16 = FakeCupy((3, 8), ml_dtypes.bfloat16)
    empty = Interface((0, 5), np.int32, ptr=0)
    kinds, flat = _launcher.arguments((strided, bf16, empty))
    assert [_launcher.numba_type(k) for k in kinds] == [
        types.Array(types.float32, 2, "A"), types.Array(types.int16, 2, "C"),
        types.Array(types.int32, 2, "C")]
    assert flat[:9] == [0, 0, 8, 4, strided.data.ptr, 4, 2, 32, 4]
    assert flat[-9:] == [0, 0, 0, 4, 0, 0, 5, 20, 4]


def test_an_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="CUDA array or a scalar, got builtins.list"):
        _launcher.arguments(([1, 2],))


def test_parameters_follow_numbas_kernel_abi():
    argtypes = (types.Array(types.float32, 2, "C"), types.int32, types.boolean, types.float64)
    assert [ptx for _, ptx in _launcher.parameters(argtypes)] == ["u64"] * 9 + ["u32", "u8", "f64"]
    packed = _launcher.packer(argtypes).pack(0, 0, 6, 4, 0x1000, 2, 3, 12, 4, -7, True, 0.5)
    assert len(packed) == 12 * 8
    assert struct.unpack_from("<i", packed, 9 * 8)[0] == -7
    assert packed[10 * 8] == 1 and struct.unpack_from("<d", packed, 11 * 8)[0] == 0.5


@pytest.fixture
def fake_gpu(monkeypatch):
    """The launcher's GPU path with a driver that decodes each launch's parameters
    through the pointer array it was given, and a compiler that only counts."""
    launched, compiled = [], []

    def decode(pointers, argtypes):
        params = _launcher.parameters(argtypes)
        addresses = (ctypes.c_void_p * len(params)).from_address(pointers)
        return [struct.unpack(code, ctypes.string_at(addresses[i], struct.calcsize(code)))[0]
                for i, (code, _) in enumerate(params)]

    class Module:  # the function of the n-th compile is at 0xF00D + n
        def load(self, cubin):
            assert cubin.startswith(b"cubin")
            self.n = int(cubin[5:])

        def get_function(self, name):
            return pytypes.SimpleNamespace(ptr=0xF00D + self.n)

    def launch(function, gx, gy, gz, bx, by, bz, shared, stream, pointers, extra):
        argtypes = compiled[function - 0xF00D][1]
        launched.append(((function, gx, gy, gz, bx, by, bz, shared, stream, extra),
                         decode(pointers, argtypes)))

    def compile_(kernel, argtypes, cc, fresh=False):
        compiled.append((kernel, argtypes, cc))
        return b"cubin%d" % (len(compiled) - 1), "entry"

    fake_gpu = pytypes.SimpleNamespace(launched=launched, compiled=compiled)
    monkeypatch.setattr(_launcher, "_SIMULATOR", False)
    monkeypatch.setattr(_launcher, "_LOADED", {})
    monkeypatch.setattr(_launcher, "_LAST", {})
    monkeypatch.setattr(_launcher, "RECORDER", [None])  # these kernels are not compiled
    monkeypatch.setattr(_launcher, "_GPU", dict(
        launch=launch, device=lambda: 0, stream=lambda: pytypes.SimpleNamespace(ptr=0x5EED),
        module=Module, capability=lambda d: "90", context=lambda: (1, 1)))
    monkeypatch.setattr(_kernel_cache, "compiled", compile_)
    return fake_gpu


def test_a_launch_packs_what_the_kernel_reads(fake_gpu):
    kernel = object()
    table, ids = FakeCupy((100, 16), np.float32), FakeCupy((33,), np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no Numba dispatch, no occupancy warnings
        _launcher.launch(kernel, 7, 256, table, ids, 33, False, np.uint64(2**63 + 5))
    (config, values), = fake_gpu.launched
    assert config == (0xF00D, 7, 1, 1, 256, 1, 1, 0, 0x5EED, 0)
    assert values == [0, 0, 1600, 4, table.data.ptr, 100, 16, 64, 4,
                      0, 0, 33, 4, ids.data.ptr, 33, 4, 33, False, 2**63 + 5]
    (_, argtypes, cc), = fake_gpu.compiled
    assert cc == (9, 0) and argtypes[1] == types.Array(types.int32, 1, "C")


def test_a_prepared_launch_packs_once_and_launches_as_launch_does(fake_gpu, monkeypatch):
    kernel = object()
    table, ids = FakeCupy((100, 16), np.float32), FakeCupy((33,), np.int32)
    _launcher.launch(kernel, 7, 256, table, ids, 33)
    run = _launcher.prepare(kernel, 7, 256, table, ids, 33)
    before = _launcher.LAUNCHES[0]
    with monkeypatch.context() as m:
        m.setattr(_launcher, "arguments", None)  # a call packs nothing
        run()
        run()
    assert _launcher.LAUNCHES[0] - before == 2
    assert fake_gpu.launched[1] == fake_gpu.launched[2] == fake_gpu.launched[0]
    assert len(fake_gpu.compiled) == 1
    monkeypatch.setitem(_launcher._GPU, "device", lambda: 1)  # another device: as launch does
    run()
    assert fake_gpu.launched[3][1] == fake_gpu.launched[0][1] and len(fake_gpu.compiled) == 2


def test_one_compile_per_signature(fake_gpu):
    kernel = object()
    for n in range(3):
        _launcher.launch(kernel, 1, 32, FakeCupy((n + 1,), np.int64), n)
    _launcher.launch(kernel, 1, 32, FakeCupy((4,), np.int32), 0)  # another signature
    assert len(fake_gpu.compiled) == 2 and len(fake_gpu.launched) == 4
    assert [v[2] for _, v in fake_gpu.launched] == [1, 2, 3, 4]


def test_threads_pack_into_their_own_buffers(fake_gpu):
    kernel = object()
    _launcher.launch(kernel, 1, 32, 1)
    (loaded,) = _launcher._LOADED.values()
    here = loaded.buffers()
    there = []
    thread = threading.Thread(target=lambda: there.append(loaded.buffers()))
    thread.start()
    thread.join()
    assert here[2] != there[0][2] and loaded.buffers()[2] == here[2]


def test_a_value_that_does_not_fit_is_an_overflow_error(fake_gpu):
    with pytest.raises(OverflowError, match="kernel entry"):
        _launcher.launch(object(), 1, 32, 2**64)
    assert not fake_gpu.launched
    kernel = object()
    _launcher.launch(kernel, 1, 32, FakeCupy((3,), np.int64), 5)
    with pytest.raises(OverflowError, match="kernel entry"):  # packed as the last launch was
        _launcher.launch(kernel, 1, 32, FakeCupy((3,), np.int64), 2**64)
    assert len(fake_gpu.launched) == 1


def _expected(*args):
    return _launcher.arguments(args)[1]


def test_a_launch_like_the_last_packs_without_working_out_kinds(fake_gpu, monkeypatch):
    kernel = object()
    first = (FakeCupy((100, 16), np.float32), FakeCupy((33,), np.int32), 33, False, np.float32(2),
             Bounds.RAISE)
    _launcher.launch(kernel, 7, 256, *first)
    again = (FakeCupy((50, 16), np.float32, ptr=0x7F0000009000), FakeCupy((7,), np.int32, ptr=0x10),
             7, True, np.float32(3), Bounds.ZERO)
    with monkeypatch.context() as m:
        m.setattr(_launcher, "arguments", None)  # the kinds are not worked out again
        _launcher.launch(kernel, 3, 256, *again)
    assert [v for _, v in fake_gpu.launched] == [_expected(*first), _expected(*again)]
    assert fake_gpu.launched[1][0][1] == 3 and len(fake_gpu.compiled) == 1


@pytest.mark.parametrize("change", ["dtype", "strided", "ndim", "bool for int", "array type",
                                    "older cupy"])
def test_a_launch_unlike_the_last_is_worked_out_again(fake_gpu, change):
    kernel = object()
    base = [FakeCupy((4, 2), np.float32), 3]
    other = {
        "dtype": [FakeCupy((4, 2), np.float64), 3],
        "strided": [FakeCupy((4, 2), np.float32, strides=(16, 4)), 3],
        "ndim": [FakeCupy((8,), np.float32), 3],
        "bool for int": [FakeCupy((4, 2), np.float32), True],
        "array type": [Interface((4, 2), np.float32), 3],
        "older cupy": [OlderCupy((4, 2), np.float32), 3],
    }[change]
    for args in (base, other, base, other):
        _launcher.launch(kernel, 1, 32, *args)
    assert [v for _, v in fake_gpu.launched] == [_expected(*a) for a in (base, other, base, other)]
    same = change in ("array type", "older cupy")  # one signature, read another way
    with pytest.raises(TypeError, match="CUDA array or a scalar"):  # no fast path for 3 arguments
        _launcher.launch(kernel, 1, 32, *other, [0])
    assert len(fake_gpu.compiled) == (1 if same else 2)
    assert [numba for _, numba, _ in fake_gpu.compiled][-1][0] == _launcher.numba_type(
        _launcher.arguments(other)[0][0])


# -- the on-disk cache --------------------------------------------------------------------------
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HBK_CUDA_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(_kernel_cache, "_MEMORY", {})
    _kernel_cache.directory.cache_clear()
    yield tmp_path / "kernels"
    _kernel_cache.directory.cache_clear()


def test_the_cache_directory(tmp_path, monkeypatch):
    _kernel_cache.directory.cache_clear()
    try:
        monkeypatch.setenv("HBK_CUDA_CACHE_DIR", "off")
        assert _kernel_cache.directory() is None
        _kernel_cache.directory.cache_clear()
        monkeypatch.delenv("HBK_CUDA_CACHE_DIR")
        monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
        assert _kernel_cache.directory() == str(tmp_path / "numba" / "hbkernels-cuda")
        _kernel_cache.directory.cache_clear()
        monkeypatch.delenv("NUMBA_CACHE_DIR")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert _kernel_cache.directory() == str(tmp_path / "xdg" / "hbkernels" / "cuda")
    finally:
        _kernel_cache.directory.cache_clear()


def fake_ptx(kinds, name="_Z6kernelPx"):
    """The PTX entry of a kernel taking parameters of the PTX types ``kinds``."""
    params = ",\n".join(f".param .{kind} {name}_param_{i}" for i, kind in enumerate(kinds))
    return f".visible .entry {name}(\n{params}\n)\n{{\nret;\n}}"


def test_compiled_once_per_machine(cache_dir, monkeypatch):
    from hbkernels.cuda import _abi, _compile, ragged

    calls = []
    monkeypatch.setattr(_compile, "ptx", lambda k, a, cc: calls.append(cc) or
                        fake_ptx(_abi.ptx_types(a)))
    monkeypatch.setattr(_compile, "link", lambda ptx, cc: (b"\x7fELF-cubin", "log"))
    argtypes = (types.Array(types.int64, 1, "C"),) * 3
    kernel = ragged._ragged_kernel
    stats = dict(_kernel_cache.STATS)
    assert _kernel_cache.compiled(kernel, argtypes, (9, 0)) == (b"\x7fELF-cubin", "_Z6kernelPx")
    assert _kernel_cache.compiled(kernel, argtypes, (9, 0))[1] == "_Z6kernelPx"  # memory
    monkeypatch.setattr(_kernel_cache, "_MEMORY", {})  # a new process: from the disk
    assert _kernel_cache.compiled(kernel, argtypes, (9, 0))[0] == b"\x7fELF-cubin"
    _kernel_cache.compiled(kernel, argtypes, (10, 0))  # another architecture compiles
    assert calls == [(9, 0), (10, 0)]
    assert {k: _kernel_cache.STATS[k] - stats[k] for k in stats} == \
        {"memory": 1, "disk": 1, "compiled": 2}
    files = sorted(cache_dir.glob("*.cubin"))
    assert len(files) == 2 and {f.stem for f in files} == {f.stem for f in cache_dir.glob("*.lock")}
    files[0].write_bytes(b"not a cubin")  # damaged: compiled again
    monkeypatch.setattr(_kernel_cache, "_MEMORY", {})
    assert _kernel_cache.load(files[0]) is None
    _kernel_cache.compiled(kernel, argtypes, (9, 0))
    _kernel_cache.compiled(kernel, argtypes, (10, 0))
    assert len(calls) == 3


def test_keys_name_what_was_compiled():
    from hbkernels.cuda.embedding_bag import pool_kernel
    from hbkernels.cuda.ragged import _features_kernel, _ragged_kernel

    a64, a32 = types.Array(types.int64, 1, "C"), types.Array(types.int32, 1, "C")
    key = _kernel_cache.key
    assert key(_ragged_kernel, (a64,), (9, 0)) != key(_ragged_kernel, (a32,), (9, 0))
    assert key(_ragged_kernel, (a64,), (9, 0)) != key(_ragged_kernel, (a64,), (8, 0))
    assert key(_ragged_kernel, (a64,), (9, 0)) != key(_features_kernel, (a64,), (9, 0))
    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    one = pool_kernel(f32, None, 4, 4, 1, False, True)
    other = pool_kernel(f16, None, 4, 4, 1, False, True)
    assert _kernel_cache.identity(one)[:3] == ("hbkernels.cuda.embedding_bag", "pool_kernel",
                                               (f32, None, 4, 4, 1, False, True))
    assert key(one, (a64,), (9, 0)) != key(other, (a64,), (9, 0))


def test_a_ptx_entry_the_launcher_does_not_pack_is_an_error_naming_it(cache_dir, monkeypatch):
    """A Numba whose kernel ABI drifted: the compile fails naming the kernel and the first
    parameter that differs, and nothing is cached or launched."""
    from hbkernels.cuda import _abi, _compile, ragged

    argtypes = (types.Array(types.int64, 1, "C"), types.int32)
    kinds = _abi.ptx_types(argtypes)
    assert kinds == ["u64"] * 7 + ["u32"]
    drifted = kinds[:4] + ["u32"] + kinds[5:]  # the data pointer narrowed
    monkeypatch.setattr(_compile, "ptx", lambda k, a, cc: fake_ptx(drifted))
    monkeypatch.setattr(_compile, "link", lambda ptx, cc: pytest.fail("linked a bad entry"))
    with pytest.raises(TypeError, match=r"kernel hbkernels\.cuda\.ragged\._ragged_kernel: .*"
                       r"parameter 4 is \.u64 in the launcher and \.u32 in the PTX"):
        _kernel_cache.compiled(ragged._ragged_kernel, argtypes, (9, 0))
    monkeypatch.setattr(_compile, "ptx", lambda k, a, cc: fake_ptx(kinds[:-1]))  # one too few
    with pytest.raises(TypeError, match=r"packs 8 parameters .* takes 7; parameter 7 is \.u32 "
                       r"in the launcher and nothing in the PTX"):
        _kernel_cache.compiled(ragged._ragged_kernel, argtypes, (9, 0))
    assert not list(cache_dir.glob("*.cubin"))


LOCK_SCRIPT = """
import os, sys, time
from numba import types
from hbkernels.cuda import _abi, _compile, _kernel_cache, ragged

log, go = sys.argv[1], sys.argv[2]
argtypes = (types.Array(types.int64, 1, "C"),) * 3

def ptx(kernel, a, cc):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(1.0)  # long enough that the others ask for the key meanwhile
    params = ",".join(f".param .{k} k_param_{i}" for i, k in enumerate(_abi.ptx_types(a)))
    return f".visible .entry k({params})"

_compile.ptx = ptx
_compile.link = lambda text, cc: (b"\\x7fELF-cubin", "")
while not os.path.exists(go):
    time.sleep(0.005)
assert _kernel_cache.compiled(ragged._ragged_kernel, argtypes, (9, 0)) == (b"\\x7fELF-cubin", "k")
print(_kernel_cache.STATS["compiled"], _kernel_cache.STATS["disk"])
"""


def test_processes_asking_for_one_kernel_at_once_compile_it_once(tmp_path):
    """Three processes ask for the same key at the same moment: one compiles, the others
    wait on its lock file and load its cubin."""
    import os
    import subprocess
    import sys

    from mpirun import ROOT

    log, go = tmp_path / "compiles.log", tmp_path / "go"
    env = dict(os.environ, HBK_CUDA_CACHE_DIR=str(tmp_path / "kernels"), PYTHONPATH=str(ROOT),
               NUMBA_ENABLE_CUDASIM="1")
    procs = [subprocess.Popen([sys.executable, "-c", LOCK_SCRIPT, str(log), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    import time

    time.sleep(3.0)  # every process imported and waits for the start
    go.touch()
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    stats = sorted(tuple(int(n) for n in out.split()) for out, _ in results)
    assert stats == [(0, 1), (0, 1), (1, 0)], stats
    assert len(log.read_text().split()) == 1
    assert len(list((tmp_path / "kernels").glob("*.cubin"))) == 1


def test_keys_change_with_the_code_a_kernel_compiles_in_only(tmp_path, monkeypatch):
    """A kernel's key hashes its module and the hbkernels modules it imports, directly or
    not: an edit to one of those compiles it afresh; an edit elsewhere keeps its cubin."""
    import shutil

    import hbkernels

    package = tmp_path / "hbkernels"
    shutil.copytree(Path(hbkernels.__file__).parent, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(_kernel_cache, "_PACKAGE", package)

    def hashes():
        _kernel_cache.source_hash.cache_clear()
        _kernel_cache._imported.cache_clear()
        return {m: _kernel_cache.source_hash(m) for m in
                ("hbkernels.cuda._segments", "hbkernels.cuda.embedding_bag")}

    try:
        before = hashes()
        assert before["hbkernels.cuda._segments"] != before["hbkernels.cuda.embedding_bag"]
        for elsewhere in ("train.py", "sharding/collection.py", "cli/train.py"):
            with open(package / elsewhere, "a") as f:
                f.write("\n# an edit no kernel compiles in\n")
        assert hashes() == before
        with open(package / "cuda" / "_launch.py", "a") as f:  # imported by both
            f.write("\n# an edit to the kernels' helpers\n")
        after = hashes()
        assert all(after[m] != before[m] for m in before)
        with open(package / "cuda" / "embedding_bag.py", "a") as f:
            f.write("\n# an edit to one kernel's module\n")
        last = hashes()
        assert last["hbkernels.cuda._segments"] == after["hbkernels.cuda._segments"]
        assert last["hbkernels.cuda.embedding_bag"] != after["hbkernels.cuda.embedding_bag"]
    finally:
        _kernel_cache.source_hash.cache_clear()
        _kernel_cache._imported.cache_clear()
