"""alltoallv: hbk.dist against the raw transport on the same buffers.

CPU (default): hbk's MPI backend ``comm.alltoallv(send, counts)`` vs raw
mpi4py ``COMM_WORLD.Alltoallv`` on the same NumPy buffers, two ways:
``mpi4py`` gets its receive counts and buffer precomputed (a lower bound no
real exchange of unknown sizes reaches); ``mpi4py+counts`` does what a user of
raw mpi4py must do per call, as hbk does: ``Alltoall`` of the counts, allocate
the receive buffer, ``Alltoallv`` (hbk also agrees on dtypes and shapes and
polls with a deadline).
GPU (``--device cuda``): hbk's NCCL backend vs raw CuPy NCCL send/recv per
peer in one ``groupStart``/``groupEnd`` on the same CuPy buffers.

Every rank sends ``per_peer`` bytes to every rank (itself included), as rows
of D=64 float32 (256 B): 64 KiB, 1 MiB and 8 MiB per peer. Timing: every
repetition starts after a barrier (and, on a GPU, a stream synchronize) and
is timed with ``perf_counter`` (on a GPU until the stream is idle); a
repetition's time is the slowest rank's. hbk and the peer alternate
repetition by repetition, so the noise of a shared machine hits both alike.
GB/s = bytes one rank sends (all its blocks) / median time. Rank 0 appends
the rows (``hbkernels/bench/common.py`` columns; op=alltoallv, provider hbkernels or
mpi4py / cupy-nccl, mode mpi or nccl) and prints the hbk overhead.

    mpiexec -n 2 python3 -m mpi4py -m hbkernels.bench.bench_alltoallv [--smoke] [--out CSV] [--device cuda]
"""
import sys
import time
from pathlib import Path


import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hbkernels as hbk  # noqa: E402
from .common import (  # noqa: E402
    HBK, RESULTS_DIR, Timing, append_csv, cpu_name, gpu_name, optional_module, parser, slug,
)

OP = "alltoallv"
D = 64
KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 1 * MiB, 8 * MiB]
SMOKE_SIZES = [4 * KiB]


def fmt_size(nbytes):
    return f"{nbytes // MiB}MiB" if nbytes >= MiB else f"{nbytes // KiB}KiB"


def repetitions(world, est_s, smoke, reps, budget_s=2.0):
    """The same repetition count on every rank (rank 0 decides)."""
    if smoke:
        n = 3
    elif reps:
        n = reps
    else:
        n = int(np.clip(budget_s / max(est_s, 1e-6) / 2, 30, 2000))
    return int(world.bcast(n, root=0))


def estimate(run, sync, n=5):
    """The fastest of ``n`` untimed-looking calls: sizes the repetition count."""
    best = float("inf")
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def time_alternating(world, runs, reps, warmup, sync):
    """{name: Timing} of each callable in ``runs``, alternating per repetition;
    each repetition's time is the max over ranks."""
    for _ in range(warmup):
        for f in runs.values():
            f()
            sync()
    names = list(runs)
    times = {n: np.empty(reps) for n in names}
    for i in range(reps):
        for name in (names if i % 2 == 0 else names[::-1]):
            sync()
            world.Barrier()
            t0 = time.perf_counter()
            runs[name]()
            sync()
            times[name][i] = time.perf_counter() - t0
    out = {}
    for name in names:
        world.Allreduce(MPI.IN_PLACE, times[name], op=MPI.MAX)
        out[name] = Timing.of(times[name] * 1e3)
    return out


def row(provider, mode, size, timing, nbytes, device):
    gbps = nbytes / (timing.median_ms * 1e6) if timing.median_ms > 0 else 0.0
    return {"op": OP, "provider": provider, "mode": mode, "size": size, "dtype": "float32",
            "median_ms": f"{timing.median_ms:.6g}", "p20_ms": f"{timing.p20_ms:.6g}",
            "p80_ms": f"{timing.p80_ms:.6g}", "gbps": f"{gbps:.6g}", "device": device}


# -- CPU: hbk MPI backend vs raw mpi4py --------------------------------------------------------
def cpu_case(world, comm, per_peer, args):
    W, R = world.Get_size(), world.Get_rank()
    rows = per_peer // (4 * D)
    counts = np.full(W, rows, np.int64)
    rng = np.random.default_rng([args.seed, R])
    send = rng.standard_normal((rows * W, D), dtype=np.float32)
    recv = np.empty_like(send)
    elems = counts * D
    displ = np.arange(W, dtype=np.int64) * rows * D
    send_spec = [send, (elems, displ), MPI.FLOAT]
    recv_spec = [recv, (elems, displ), MPI.FLOAT]

    def raw():
        world.Alltoallv(send_spec, recv_spec)

    def raw_with_counts():
        recv_counts = np.empty(W, np.int64)
        world.Alltoall(counts, recv_counts)
        recv_elems = recv_counts * D
        out = np.empty((int(recv_counts.sum()), D), np.float32)
        recv_displ = np.concatenate([[0], np.cumsum(recv_elems)[:-1]])
        world.Alltoallv(send_spec, [out, (recv_elems, recv_displ), MPI.FLOAT])
        return out

    def mine():
        return comm.alltoallv(send, counts)

    got, got_counts = mine()
    np.testing.assert_array_equal(raw_with_counts(), got)
    raw()
    assert got_counts.tolist() == counts.tolist()
    np.testing.assert_array_equal(got, recv, err_msg="hbk alltoallv differs from mpi4py Alltoallv")
    est = estimate(raw, lambda: None)
    reps = repetitions(world, world.allreduce(est, op=MPI.MAX), args.smoke, args.reps)
    warmup = 1 if args.smoke else max(3, min(20, reps // 10))
    runs = {HBK: mine, "mpi4py": raw, "mpi4py+counts": raw_with_counts}
    return time_alternating(world, runs, reps, warmup, lambda: None), reps


# -- GPU: hbk NCCL backend vs raw CuPy NCCL send/recv -----------------------------------------
def gpu_case(world, comm, per_peer, args, raw_comm, cp):
    from cupy.cuda import nccl

    W, R = world.Get_size(), world.Get_rank()
    rows = per_peer // (4 * D)
    counts = np.full(W, rows, np.int64)
    send = cp.random.RandomState(args.seed + R).standard_normal((rows * W, D), dtype=cp.float32)
    recv = cp.empty_like(send)
    nbytes = rows * D * 4
    stream = cp.cuda.get_current_stream()
    f32 = nccl.NCCL_FLOAT32

    def raw():
        nccl.groupStart()
        for p in range(W):
            if p == R:
                continue
            raw_comm.send(send.data.ptr + p * nbytes, rows * D, f32, p, stream.ptr)
            raw_comm.recv(recv.data.ptr + p * nbytes, rows * D, f32, p, stream.ptr)
        nccl.groupEnd()
        recv[R * rows:(R + 1) * rows] = send[R * rows:(R + 1) * rows]

    def mine():
        return comm.alltoallv(send, counts)

    got, _ = mine()
    raw()
    stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(recv),
                                  err_msg="hbk alltoallv differs from raw NCCL send/recv")
    est = estimate(raw, stream.synchronize)
    reps = repetitions(world, world.allreduce(est, op=MPI.MAX), args.smoke, args.reps)
    warmup = 2 if args.smoke else max(5, min(20, reps // 10))
    timings = time_alternating(world, {HBK: mine, "cupy-nccl": raw}, reps, warmup,
                               stream.synchronize)
    del send, recv, got
    cp.get_default_memory_pool().free_all_blocks()
    return timings, reps


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    W, R = world.Get_size(), world.Get_rank()
    if args.device == "cuda":
        cp = optional_module("cupy")
        if cp is None:
            raise SystemExit("--device cuda needs CuPy (pip install 'hbkernels[cuda13]')")
        comm = hbk.dist.init("nccl")  # picks and makes current this rank's GPU
        from cupy.cuda import nccl

        uid = world.bcast(nccl.get_unique_id() if R == 0 else None, root=0)
        raw_comm = nccl.NcclCommunicator(W, uid, R)
        device, mode, peer = gpu_name(cp), "nccl", "cupy-nccl"
    else:
        comm = hbk.dist.init("mpi")
        device, mode, peer = cpu_name(), "mpi", "mpi4py"
    out = Path(args.out) if args.out else RESULTS_DIR / f"{slug(device)}.csv"
    if R == 0:
        print(f"{OP}: {W} ranks, device: {device}; rows -> {out}")
    summary = []
    for per_peer in (SMOKE_SIZES if args.smoke else SIZES):
        if args.device == "cuda":
            timings, reps = gpu_case(world, comm, per_peer, args, raw_comm, cp)
        else:
            timings, reps = cpu_case(world, comm, per_peer, args)
        size = f"per_peer={fmt_size(per_peer)} ranks={W} D={D}"
        sent = per_peer * W
        if R == 0:
            for name, t in timings.items():
                r = row(name, mode, size, t, sent, device)
                append_csv(out, r)
                print(f"  {OP} {mode:<5} {size:<30} {name:<10} {t.median_ms:9.3f} ms "
                      f"[{t.p20_ms:.3f}, {t.p80_ms:.3f}] {float(r['gbps']):7.2f} GB/s ({reps} reps)")
            over = 100 * (timings[HBK].median_ms / timings[peer].median_ms - 1)
            summary.append((fmt_size(per_peer), over))
            print(f"  hbk overhead vs {peer} at {fmt_size(per_peer)}/peer: {over:+.1f} %")
            if peer + "+counts" in timings:
                fair = 100 * (timings[HBK].median_ms / timings[peer + "+counts"].median_ms - 1)
                print(f"  hbk overhead vs {peer}+counts at {fmt_size(per_peer)}/peer: {fair:+.1f} %")
    if R == 0:
        print("overhead (median hbk / median " + peer + " - 1): "
              + ", ".join(f"{s}: {o:+.1f} %" for s, o in summary))
    world.Barrier()
    return summary


if __name__ == "__main__":
    main()
