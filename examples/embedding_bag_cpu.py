"""Pooled embedding lookup on the CPU with hbkernels.

Builds a random table and a batch of variable-length bags of Zipf-distributed
ids (a few hot rows, a long tail, some empty bags), runs hbk.embedding_bag
with the sum, mean and sqrtn combiners, checks each against a plain NumPy
computation and prints timings. The first call of the process includes Numba
compiling the kernel (or loading it from its on-disk cache): it is printed
on its own.

    PYTHONPATH=. python3 examples/embedding_bag_cpu.py
"""
import sys
import time
from pathlib import Path

import numpy as np

try:
    import hbkernels as hbk
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import hbkernels as hbk

NUM_ROWS, DIM = 200_000, 64
BATCH, MEAN_BAG, EMPTY_FRACTION = 4096, 20, 0.02
ZIPF_ALPHA = 1.1
REPEATS = 20


def zipf_bags(rng):
    """CSR bags: Poisson lengths (2% forced empty), ids whose ranks follow Zipf(alpha)
    (inverse CDF), scattered over the table by a random permutation."""
    lengths = rng.poisson(MEAN_BAG, BATCH)
    lengths[rng.random(BATCH) < EMPTY_FRACTION] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cdf = np.cumsum(np.arange(1, NUM_ROWS + 1, dtype=np.float64) ** -ZIPF_ALPHA)
    ranks = np.searchsorted(cdf / cdf[-1], rng.random(offsets[-1]), side="right")
    values = rng.permutation(NUM_ROWS)[np.minimum(ranks, NUM_ROWS - 1)]
    return values.astype(np.int64), offsets


def numpy_embedding_bag(table, values, offsets, combiner):
    """The same pooling in plain NumPy (float64 accumulation)."""
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    out = np.zeros((lengths.shape[0], table.shape[1]))
    out[nonempty] = np.add.reduceat(table[values].astype(np.float64),
                                    offsets[:-1][nonempty], axis=0)
    if combiner == "mean":
        out /= np.maximum(lengths, 1)[:, None]
    elif combiner == "sqrtn":
        out /= np.sqrt(np.maximum(lengths, 1))[:, None]
    return out.astype(table.dtype)


def main():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((NUM_ROWS, DIM), dtype=np.float32)
    values, offsets = zipf_bags(rng)
    print(f"table {NUM_ROWS} x {DIM} fp32, {BATCH} bags, {values.size} ids "
          f"(Zipf {ZIPF_ALPHA}, {np.unique(values).size} distinct, "
          f"{int((np.diff(offsets) == 0).sum())} empty bags)")

    t0 = time.perf_counter()
    hbk.embedding_bag(table, values, offsets)
    print(f"first call (includes Numba compilation or cache load): "
          f"{1e3 * (time.perf_counter() - t0):.1f} ms")

    moved = values.size * DIM * 4 + values.nbytes + offsets.nbytes + BATCH * DIM * 4
    for combiner in ("sum", "mean", "sqrtn"):
        out = hbk.embedding_bag(table, values, offsets, combiner=combiner)
        np.testing.assert_allclose(out, numpy_embedding_bag(table, values, offsets, combiner),
                                   rtol=1e-5, atol=1e-4)
        times = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            hbk.embedding_bag(table, values, offsets, combiner=combiner)
            times.append(time.perf_counter() - t0)
        ms = 1e3 * float(np.median(times))
        print(f"{combiner:>5}: matches NumPy; median {ms:7.3f} ms over {REPEATS} calls, "
              f"{BATCH / ms * 1e3 / 1e6:.2f} M bags/s, {moved / ms / 1e6:.1f} GB/s")
    print("OK")


if __name__ == "__main__":
    main()
