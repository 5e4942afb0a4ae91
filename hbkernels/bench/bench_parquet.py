"""Parquet loading (issue 6): hbkernels ParquetDataset vs pyarrow and a row-wise pandas loop.

Data (``write_synthetic``, in a temp dir): ``--rows`` rows (2M; ``--smoke`` 20k) in
row groups of 2**17 (smoke 4096) of 13 dense float32 ``d0..d12``, 26 one-hot
int64 ``c0..c25`` and 2 multi-hot ``list<int64>`` ``m0``/``m1`` (lengths uniform in
[1, 19] and [1, 59]: mean hotness 10 and 30), Zipf(1.05) ids; size
``{rows}x41cols`` counts these 41 feature columns, every provider also reads
the int32 ``label``. The 4x data set is a directory of 4 hard links of the file.

Throughput, one epoch = all rows in batches of B=8192, each batch a dict of
NumPy arrays (list columns as values + int64 offsets from 0), touched (its
arrays' lengths summed, the rows checked):

* ``hbkernels`` / ``hbkernels-noprefetch``: ``ParquetDataset(path, B, prefetch=2 / 0)``
* ``pyarrow-read_table``: ``pq.read_table(path)`` alone (whole-table decode, no batches)
* ``pyarrow-iter_batches``: ``ParquetFile.iter_batches(B)``, columns to NumPy
* ``pandas-rowwise``: ``pd.read_parquet``, list cells made per-row Python lists
  (``ndarray.tolist``), then per batch ``df.iloc[i:i+B]``, scalar columns
  ``.to_numpy()``, list columns from ``.tolist()``: per-row ``len`` to offsets,
  ``np.fromiter(chain.from_iterable(rows))`` to values; always all rows.

First every batch provider is streamed alongside hbkernels, each batch checked
equal; then ``--warmup`` (1) untimed and ``--reps`` (5, smoke 2) timed rounds run
every provider's epoch in turn, on the warm page cache; median, p20, p80 ms
per epoch; gbps = Parquet file bytes / median s / 1e9.

Peak RSS: VmHWM (``ru_maxrss`` without the parent's RSS that survives fork+exec)
of a fresh process (``--measure-rss``) running one epoch of hbkernels (prefetch
2) or read_table on the 1x and the 4x data, with its baseline after imports.
CSV rows go to ``--out`` (op=parquet_load, mode=rows), the report
(rows/s, targets: hbk >= 0.8x read_table, >= 10x pandas-rowwise, RSS 4x/1x ~1)
to ``<csv stem>-parquet.md``.

    python3 -m hbkernels.bench.bench_parquet [--smoke] [--out CSV] [--rows N]
"""
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from itertools import chain, zip_longest
from pathlib import Path

import numpy as np  # noqa: E402

from .common import (  # noqa: E402
    HBK, RESULTS_DIR, Timing, append_csv, cpu_name, optional_module, parser, slug,
)
from hbkernels.data import ParquetDataset, write_synthetic  # noqa: E402

pa, pq = optional_module("pyarrow"), optional_module("pyarrow.parquet")
if pq is None:
    raise SystemExit("bench_parquet needs pyarrow (pip install 'hbkernels[data]')")

OP = "parquet_load"
CARDINALITIES = (10**6, 10**5, 10**4, 10**3, 100)  # of the one-hot tables, in turn
TABLES = [(f"c{i}", CARDINALITIES[i % 5], 1) for i in range(26)] + [
    ("m0", 10**6, 10, True), ("m1", 10**6, 30, True)]
DENSE, FEATURES = 13, 41
RSS_PROVIDERS = (HBK, "pyarrow-read_table")


# -- providers: an epoch returns the rows it saw ---------------------------------
def hbk_batches(path, B, prefetch=2):
    return iter(ParquetDataset(path, batch_size=B, prefetch=prefetch))


def arrow_batches(path, B):
    def column(col):
        if not pa.types.is_list(col.type):
            return col.to_numpy(zero_copy_only=False)
        offs = np.asarray(col.offsets).astype(np.int64)  # of this slice of the row group
        values = col.values.slice(offs[0], offs[-1] - offs[0]).to_numpy()
        return values, offs - offs[0]

    for rb in pq.ParquetFile(path).iter_batches(batch_size=B):
        yield {name: column(col) for name, col in zip(rb.schema.names, rb.columns)}


def pandas_batches(path, B, pd):
    df = pd.read_parquet(path)
    lists = [c for c in df.columns if df[c].dtype == object]
    for c in lists:  # one Python list of ints per row
        df[c] = df[c].map(np.ndarray.tolist)
    for i in range(0, len(df), B):
        chunk = df.iloc[i:i + B]
        batch = {c: chunk[c].to_numpy() for c in df.columns if c not in lists}
        for c in lists:
            rows = chunk[c].tolist()
            offsets = np.zeros(len(rows) + 1, np.int64)
            np.cumsum([len(r) for r in rows], out=offsets[1:])
            batch[c] = (np.fromiter(chain.from_iterable(rows), np.int64, offsets[-1]), offsets)
        yield batch


def parts(v):
    """The arrays of one column: (values, offsets) of a list column (Ragged is a tuple too)."""
    return v if isinstance(v, tuple) else (v,)


def touch(batch):
    """Rows of a batch, after summing the lengths of all its arrays."""
    sum(len(a) for v in batch.values() for a in parts(v))
    v = next(iter(batch.values()))
    return len(v[1]) - 1 if isinstance(v, tuple) else len(v)


def batch_providers(B, pd):
    out = {HBK: lambda p: hbk_batches(p, B),
           HBK + "-noprefetch": lambda p: hbk_batches(p, B, prefetch=0),
           "pyarrow-iter_batches": lambda p: arrow_batches(p, B)}
    if pd is not None:
        out["pandas-rowwise"] = lambda p: pandas_batches(p, B, pd)
    return out


def epochs(B, pd):
    """name -> (path -> rows read): every provider's epoch."""
    out = {name: (lambda p, f=f: sum(touch(b) for b in f(p)))
           for name, f in batch_providers(B, pd).items()}
    out["pyarrow-read_table"] = lambda p: pq.read_table(p).num_rows
    return out


def verify(factories, path):
    """Streams every provider alongside the first (hbkernels); each batch must be equal."""
    its = {name: f(path) for name, f in factories.items()}
    try:
        for k, batches in enumerate(zip_longest(*its.values())):
            ref = batches[0]
            for name, b in zip(list(its)[1:], batches[1:]):
                if b is None or ref is None:
                    raise AssertionError(f"{name}: not as many batches as {HBK} (batch {k})")
                assert b.keys() == ref.keys(), f"{name}: columns {list(b)} != {list(ref)}"
                for c, v in ref.items():
                    for x, y in zip(parts(v), parts(b[c])):
                        np.testing.assert_array_equal(y, x, err_msg=f"{name} vs {HBK}: batch {k} column {c}")
    finally:
        for it in its.values():
            getattr(it, "close", lambda: None)()
    peers = ", ".join(list(its)[1:]) or "no batch peer"
    print(f"verified {peers} against {HBK}: {k + 1} batches")


# -- peak RSS in a fresh process ---------------------------------------------------
def maxrss_mib():
    """Peak RSS of this process in MiB: VmHWM, as ``ru_maxrss`` also counts the parent's
    RSS at fork (Linux keeps the forked image's peak across exec)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure_rss(provider, path, B):
    base = maxrss_mib()
    rows = epochs(B, None)[provider](path)
    print(json.dumps({"baseline": base, "peak": maxrss_mib(), "rows": rows}))


def rss(provider, path, B):
    cmd = [sys.executable, "-m", "hbkernels.bench.bench_parquet", "--measure-rss", provider, str(path),
           "--batch-size", str(B)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


# -- data ------------------------------------------------------------------------------
def write_data(tmp, rows, row_group, seed):
    path = Path(tmp) / "x1.parquet"
    t0 = time.perf_counter()
    write_synthetic(path, rows, TABLES, dense=DENSE, row_group_size=row_group, seed=seed)
    x4 = Path(tmp) / "x4"
    x4.mkdir()
    for i in range(4):
        os.link(path, x4 / f"part-{i}.parquet")
    print(f"wrote {rows} rows x {FEATURES} feature columns + label, {path.stat().st_size / 1e6:.1f} MB "
          f"({row_group} rows per row group) in {time.perf_counter() - t0:.1f} s; 4x: {x4}")
    return path, x4


# -- report --------------------------------------------------------------------------
def report(md, head, timings, rows, rss_rows, elapsed):
    hbk_rate = rows / timings[HBK].median_ms * 1e3
    lines = [head, "", "| provider | median ms / epoch | p20 | p80 | rows/s | hbkernels speedup |",
             "|---|---|---|---|---|---|"]
    for name, t in timings.items():
        lines.append(f"| {name} | {t.median_ms:.1f} | {t.p20_ms:.1f} | {t.p80_ms:.1f} | "
                     f"{rows / t.median_ms * 1e3:,.0f} | {t.median_ms / timings[HBK].median_ms:.2f}x |")
    lines.append("")
    for peer, target in (("pyarrow-read_table", 0.8), ("pandas-rowwise", 10.0)):
        if peer in timings:
            r = timings[peer].median_ms / timings[HBK].median_ms
            lines.append(f"- hbkernels rows/s / {peer} rows/s = **{r:.2f}** (target >= {target}: "
                         f"**{'met' if r >= target else 'NOT met'}**)")
        else:
            lines.append(f"- {peer}: not measured (peer missing or not selected)")
    lines += ["", "Peak RSS (MiB, VmHWM of a fresh process running one epoch; baseline = after imports):",
              "",
              "| provider | baseline | peak 1x | peak 4x | 4x/1x | above baseline 1x | 4x | 4x/1x |",
              "|---|---|---|---|---|---|---|---|"]
    for name, (r1, r4) in rss_rows.items():
        b = r1["baseline"]
        a1, a4 = r1["peak"] - b, r4["peak"] - r4["baseline"]
        lines.append(f"| {name} | {b:.0f} | {r1['peak']:.0f} | {r4['peak']:.0f} | "
                     f"{r4['peak'] / r1['peak']:.2f} | {a1:.0f} | {a4:.0f} | {a4 / max(a1, 1):.2f} |")
    if HBK in rss_rows:
        r1, r4 = rss_rows[HBK]
        ratio = r4["peak"] / r1["peak"]
        lines.append(f"\n- hbkernels peak RSS 4x/1x = **{ratio:.2f}** (target ~1, i.e. bounded by batch and "
                     f"row-group size, taken as <= 1.2: **{'met' if ratio <= 1.2 else 'NOT met'}**)")
    lines.append(f"\nTotal run time {elapsed:.0f} s.\n")
    text = "\n".join(lines)
    print("\n" + text)
    new = not md.exists()
    with open(md, "a") as f:
        if new:
            f.write("# Parquet loading: hbkernels ParquetDataset vs pyarrow and pandas\n\nWritten by "
                    "`hbkernels/bench/bench_parquet.py` (data, method and definitions in its docstring), one section "
                    "per run; the CSV rows beside this file hold the epoch times.\n\n")
        f.write(text + "\n")


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=None, help="rows of the 1x file (default 2M; --smoke 20k)")
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--measure-rss", nargs=2, metavar=("PROVIDER", "PATH"),
                   help="internal: run one epoch, print the peak RSS")
    args = p.parse_args(argv)
    if args.measure_rss:
        return measure_rss(*args.measure_rss, args.batch_size)
    if args.device != "cpu":
        raise SystemExit("bench_parquet measures host loading: --device cpu only")
    start, load = time.perf_counter(), os.getloadavg()[0]
    rows = args.rows or (20_000 if args.smoke else 2_000_000)
    B, reps = args.batch_size, args.reps or (2 if args.smoke else 5)
    device = cpu_name()
    out = Path(args.out) if args.out else RESULTS_DIR / f"{slug(device)}.csv"
    pd = optional_module("pandas")
    if pd is None:
        print("note: pandas is not installed (or disabled): pandas-rowwise is skipped")
    only = {s.strip() for s in args.providers.split(",")} | {HBK} if args.providers else None
    runs = {n: f for n, f in epochs(B, pd).items() if only is None or n in only}
    with tempfile.TemporaryDirectory(prefix="hbk-bench-parquet-") as tmp:
        path, x4 = write_data(tmp, rows, 4096 if args.smoke else 1 << 17, args.seed)
        nbytes = path.stat().st_size
        verify({n: f for n, f in batch_providers(B, pd).items() if n in runs}, path)
        for _ in range(1 if args.warmup is None else args.warmup):
            for f in runs.values():
                f(path)
        times = {n: [] for n in runs}
        for _ in range(reps):
            for name, f in runs.items():
                t0 = time.perf_counter()
                seen = f(path)
                times[name].append((time.perf_counter() - t0) * 1e3)
                if seen != rows:
                    raise AssertionError(f"{name} read {seen} rows, expected {rows}")
        timings = {n: Timing.of(t) for n, t in times.items()}
        size = f"{rows}x{FEATURES}cols"
        for name, t in timings.items():
            append_csv(out, {"op": OP, "provider": name, "mode": "rows", "size": size, "dtype": "mixed",
                             "median_ms": f"{t.median_ms:.6g}", "p20_ms": f"{t.p20_ms:.6g}",
                             "p80_ms": f"{t.p80_ms:.6g}", "gbps": f"{nbytes / t.median_ms / 1e6:.6g}",
                             "device": device})
        rss_rows = {n: (rss(n, path, B), rss(n, x4, B)) for n in RSS_PROVIDERS}
    cmd = " ".join(["python3 -m hbkernels.bench.bench_parquet", *(argv if argv is not None else sys.argv[1:])])
    shown = out.resolve().relative_to(Path.cwd()) if out.resolve().is_relative_to(Path.cwd()) else out
    head = (f"## {size}, batch {B}: {device}, {os.cpu_count()} cores, "
            f"{datetime.datetime.now():%Y-%m-%d %H:%M}\n\n`{cmd}` ({nbytes / 1e6:.1f} MB Parquet, "
            f"{reps} timed epochs per provider; load average {load:.2f} at start, "
            f"{os.getloadavg()[0]:.2f} at the end; rows -> `{shown}`)")
    report(out.with_name(f"{out.stem}-parquet.md"), head, timings, rows, rss_rows, time.perf_counter() - start)
    return timings


if __name__ == "__main__":
    main()
