"""Real-GPU checks at sizes the simulator cannot reach: many blocks, grid-stride
loops, CuPy streams, and arrays arriving through __cuda_array_interface__.
Every op is compared with the CPU backend on the same data."""
import importlib.util

import numpy as np
import pytest
from conftest import assert_close, random_offsets
from helpers import raises

import hbkernels as hbk

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy") if importlib.util.find_spec("cupy") else None


def needs_cupy():
    if cupy is None:
        pytest.skip("CuPy is not installed")


@pytest.mark.parametrize("dim", [1, 17, 64, 128, 257])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_embedding_bag_large(rng, dim, dtype, combiner):
    needs_cupy()
    weights = rng.standard_normal((100_000, dim)).astype(dtype)
    offsets = random_offsets(rng, 20_000, 40)
    values = rng.integers(0, weights.shape[0], size=int(offsets[-1]))
    psw = rng.uniform(0.5, 1.5, size=values.shape).astype(np.float32)
    expected = hbk.embedding_bag(weights, values, offsets, combiner=combiner, per_sample_weights=psw)
    out = hbk.embedding_bag(cupy.asarray(weights), cupy.asarray(values), cupy.asarray(offsets),
                            combiner=combiner, per_sample_weights=cupy.asarray(psw))
    assert isinstance(out, cupy.ndarray)
    assert_close(cupy.asnumpy(out), expected.astype(np.float64), dtype)


def test_ops_on_a_non_default_stream(rng):
    needs_cupy()
    weights = rng.standard_normal((5000, 32)).astype(np.float32)
    ids = rng.integers(0, 5000, size=100_000)
    offsets = np.arange(0, ids.size + 1, 10)
    with cupy.cuda.Stream(non_blocking=True):
        out = hbk.embedding_bag(cupy.asarray(weights), cupy.asarray(ids), cupy.asarray(offsets))
        rows = hbk.lookup(cupy.asarray(weights), cupy.asarray(ids))
        sums = hbk.segment_sum(cupy.asarray(rows), cupy.asarray(ids), 5000)
        out_h, rows_h, sums_h = cupy.asnumpy(out), cupy.asnumpy(rows), cupy.asnumpy(sums)
    assert_close(out_h, hbk.embedding_bag(weights, ids, offsets).astype(np.float64), np.float32)
    np.testing.assert_array_equal(rows_h, weights[ids])
    assert_close(sums_h, hbk.segment_sum(weights[ids], ids, 5000).astype(np.float64), np.float32)


@pytest.mark.parametrize("n", [1, 1000, 1_000_000])
@pytest.mark.parametrize("sorted_", [False, True])
def test_unique_large(rng, n, sorted_):
    needs_cupy()
    ids = rng.zipf(1.05, size=n).astype(np.int64) % 10**7
    uniq, inverse, counts = hbk.unique(cupy.asarray(ids), return_inverse=True,
                                       return_counts=True, sorted=sorted_)
    uniq, inverse, counts = (cupy.asnumpy(a) for a in (uniq, inverse, counts))
    ref_uniq, ref_counts = np.unique(ids, return_counts=True)
    order = np.arange(uniq.size) if sorted_ else np.argsort(uniq)
    np.testing.assert_array_equal(uniq[order], ref_uniq)
    np.testing.assert_array_equal(counts[order], ref_counts)
    np.testing.assert_array_equal(uniq[inverse], ids)


@pytest.mark.parametrize("num_shards", [2, 8, 64])
def test_partition_large_matches_cpu(rng, num_shards):
    needs_cupy()
    ids = rng.integers(0, 10**6, size=1_000_000)
    expected = hbk.partition(ids, num_shards)
    got = hbk.partition(cupy.asarray(ids), num_shards)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(cupy.asnumpy(a), b)


def test_segment_reduce_large(rng):
    needs_cupy()
    offsets = random_offsets(rng, 30_000, 20)
    data = rng.standard_normal((int(offsets[-1]), 33)).astype(np.float32)
    got = hbk.segment_reduce(cupy.asarray(data), cupy.asarray(offsets), combiner="mean")
    assert_close(cupy.asnumpy(got), hbk.segment_reduce(data, offsets, combiner="mean")
                 .astype(np.float64), np.float32)


def test_bounds_error_on_gpu_names_first_bad_position(rng):
    needs_cupy()
    values = rng.integers(0, 1000, size=500_000)
    values[123_456] = 1000
    values[400_000] = -7
    offsets = np.arange(0, values.size + 1, 50)
    with raises(hbk.BoundsError, match=r"values\[123456\] = 1000"):
        hbk.embedding_bag(cupy.ones((1000, 8), cupy.float32), cupy.asarray(values),
                          cupy.asarray(offsets))


def test_torch_cuda_tensor_through_cuda_array_interface(rng):
    needs_cupy()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    w = torch.randn(1000, 16, device="cuda")
    ids = torch.randint(0, 1000, (300,), device="cuda")
    out = hbk.lookup(w, ids)
    assert isinstance(out, cupy.ndarray)
    assert out.data.ptr != w.data_ptr()
    np.testing.assert_array_equal(cupy.asnumpy(out), w[ids].cpu().numpy())
    with raises(TypeError, match="move them to one device"):
        hbk.lookup(w, ids.cpu().numpy())


@pytest.mark.parametrize("plan", ["table_wise", "data_parallel", "row_wise", "column_wise"])
def test_embedding_collection_on_the_gpu_matches_the_cpu(rng, plan):
    """A device="cuda" collection (one host-memory table among them) trains like the
    CPU collection on the same batches: outputs, weights and optimizer state."""
    needs_cupy()
    tables = [hbk.TableSpec("a", 5000, 16, "sum"), hbk.TableSpec("b", 300, 7, "mean"),
              hbk.TableSpec("c", 1000, 16, "sqrtn", dtype="float16"),
              hbk.TableSpec("host", 2000, 8, "sum", device="cpu")]
    local = hbk.dist.init("local")

    def make(device):
        return hbk.EmbeddingCollection(tables, comm=local, optimizer=hbk.optim.Adagrad(lr=0.05),
                                       plan=plan, device=device, seed=3)
    gpu, cpu = make("cuda"), make("cpu")
    for _ in range(3):
        batch, grads = {}, {}
        for t in tables:
            offsets = random_offsets(rng, 64, 6)
            values = rng.integers(0, t.num_rows, size=int(offsets[-1]))
            batch[t.name] = (values, offsets)
            grads[t.name] = rng.standard_normal((64, t.dim)).astype(np.float32)
        out_g = gpu.forward({f: hbk.Ragged(cupy.asarray(v), cupy.asarray(o)) for f, (v, o) in batch.items()})
        out_c = cpu.forward({f: hbk.Ragged(v, o) for f, (v, o) in batch.items()})
        for f in batch:
            assert isinstance(out_g[f], cupy.ndarray)
            dtype = np.float16 if f == "c" else np.float32
            assert_close(cupy.asnumpy(out_g[f]), out_c[f].astype(np.float64), dtype)
        gpu.backward({f: cupy.asarray(g) for f, g in grads.items()})
        cpu.backward(grads)
    for t in tables:
        dtype = np.float16 if t.name == "c" else np.float32
        assert_close(cupy.asnumpy(cupy.asarray(gpu.full_weights(t.name))),
                     cpu.full_weights(t.name).astype(np.float64), dtype)
        assert_close(cupy.asnumpy(cupy.asarray(gpu.full_state(t.name)["sum"])),
                     cpu.full_state(t.name)["sum"].astype(np.float64), np.float32)


@pytest.mark.parametrize("evict", ["lru", "lfu"])
def test_hash_table_on_the_gpu_matches_the_cpu(rng, evict):
    """Large batches with many blocks racing for index positions (CAS) and for the use
    counts (atomic max): the same live ids, scores, victims and admissions as the CPU."""
    needs_cupy()
    gpu = hbk.HashTable(1 << 14, evict=evict, admit_count=2, device="cuda")  # ~23k ids admitted
    cpu = hbk.HashTable(1 << 14, evict=evict, admit_count=2)
    pool = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 200_000, dtype=np.int64)
    for call in range(12):
        ids = pool[np.minimum(rng.zipf(1.1, 100_000) - 1, len(pool) - 1)]
        got = cupy.asnumpy(gpu.slots(cupy.asarray(ids)))
        want = cpu.slots(ids)
        np.testing.assert_array_equal(got >= 0, want >= 0)
        live = got >= 0
        pairs = np.unique(np.stack([ids[live], got[live]]), axis=1)
        assert pairs.shape[1] == np.unique(ids[live]).shape[0] == np.unique(got[live]).shape[0]
        if call % 4 == 3:
            gone = rng.choice(pool, 5000)
            assert gpu.erase(cupy.asarray(gone)) == cpu.erase(gone)
        np.testing.assert_array_equal(cupy.asnumpy(gpu.ids()), cpu.ids())
        probe = cpu.ids()
        np.testing.assert_array_equal(cupy.asnumpy(gpu.scores(cupy.asarray(probe))), cpu.scores(probe))
        assert (gpu.size, gpu.admitted, gpu.evicted) == (cpu.size, cpu.admitted, cpu.evicted)
    assert cpu.evicted > 0


def test_dynamic_table_on_the_gpu_matches_the_cpu(rng):
    """A device="cuda" collection with a dynamic table (raw 64-bit ids, LFU eviction,
    admission at the second sight) trains like the CPU one: outputs, live ids, rows."""
    needs_cupy()
    tables = [hbk.TableSpec("d", num_rows=None, dim=16, capacity=300, evict="lfu", admit_count=2),
              hbk.TableSpec("a", 5000, 16, "sum")]
    local = hbk.dist.init("local")

    def make(device):
        return hbk.EmbeddingCollection(tables, comm=local, optimizer=hbk.optim.Adagrad(lr=0.05),
                                       device=device, seed=3)
    gpu, cpu = make("cuda"), make("cpu")
    pool = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, 600, dtype=np.int64)
    for _ in range(10):  # about 160 distinct ids a step, 600 in all: 300 slots evict
        offsets = random_offsets(rng, 64, 6)
        ids = rng.choice(pool, int(offsets[-1]))
        a = rng.integers(0, 5000, 64)
        out_g = gpu.forward({"d": hbk.Ragged(cupy.asarray(ids), cupy.asarray(offsets)),
                             "a": cupy.asarray(a)})
        out_c = cpu.forward({"d": hbk.Ragged(ids, offsets), "a": a})
        for f in out_c:
            assert_close(cupy.asnumpy(out_g[f]), out_c[f].astype(np.float64), np.float32)
        grads = {f: rng.standard_normal(o.shape).astype(np.float32) for f, o in out_c.items()}
        gpu.backward({f: cupy.asarray(g) for f, g in grads.items()})
        cpu.backward(grads)
    (ids_g, rows_g), (ids_c, rows_c) = gpu.full_weights("d"), cpu.full_weights("d")
    np.testing.assert_array_equal(cupy.asnumpy(ids_g), ids_c)
    assert_close(cupy.asnumpy(rows_g), rows_c.astype(np.float64), np.float32)
    assert gpu.dynamic_counts("d") == cpu.dynamic_counts("d") and cpu.dynamic_counts("d")["evicted"] > 0


@pytest.mark.parametrize("storage", ["host", "mmap"])
def test_tiered_table_on_the_gpu_equals_the_table_in_gpu_memory(rng, tmp_path, storage):
    """A cache of 64 rows in GPU memory over a table in host memory or in files (one
    row-wise and one prefetched): outputs, rows and state equal the same table held
    whole in GPU memory, bit for bit."""
    needs_cupy()
    tier = dict(storage=storage, cache_rows=64, path=str(tmp_path / "t") if storage == "mmap" else None)
    local = hbk.dist.init("local")

    def make(**kw):
        return hbk.EmbeddingCollection([hbk.TableSpec("t", 5000, 16, "sum", **kw),
                                        hbk.TableSpec("a", 100, 16, "mean")], comm=local,
                                       optimizer=hbk.optim.RowWiseAdagrad(lr=0.05), device="cuda")
    ref, got = make(), make(**tier)
    batches = []
    for _ in range(9):
        offsets = random_offsets(rng, 64, 6)
        batches.append({"t": hbk.Ragged(cupy.asarray(rng.zipf(1.2, int(offsets[-1])) % 5000),
                                        cupy.asarray(offsets)),
                        "a": cupy.asarray(rng.integers(0, 100, 64))})
    for k in range(8):
        a, b = ref.forward(batches[k]), got.forward(batches[k])
        got.prefetch(batches[k + 1])
        for f in a:
            np.testing.assert_array_equal(cupy.asnumpy(a[f]), cupy.asnumpy(b[f]))
        grads = {f: cupy.asarray(rng.standard_normal(o.shape).astype(np.float32)) for f, o in a.items()}
        ref.backward(grads)
        got.backward(grads)
    for name in ("t", "a"):
        np.testing.assert_array_equal(cupy.asnumpy(ref.full_weights(name)),
                                      cupy.asnumpy(got.full_weights(name)))
    assert got.cache_stats("t")["evictions"] > 0
