"""Host cost per call: each op at a tiny size (B=256 one-id bags, D=16, E=1000), where the
device work is a few microseconds and the call's time is what the host spends on it
(validation, launches, allocations, waits), against torch's ``F.embedding_bag``.

Each provider runs ``calls`` times back to back, then waits once for the device; the
row's median is the wall time per call over such loops. On a GPU a note gives
hbkernels' kernel launches and host synchronisations per call (the backend's own
counters: ``hbkernels.cuda._launcher.LAUNCHES``, ``hbkernels.cuda._device.HOST_SYNCS``).

    python3 -m hbkernels.bench.bench_launch --device cuda
"""
import time

import hbkernels as hbk
from .common import HBK, Timing, cli_main

OP = "host_per_call"
B, D, E = 256, 16, 1000


def sizes(ctx):
    """``(B, D, E)``: :data:`B`, :data:`D`, :data:`E`, or tiny ones in the CUDA simulator."""
    return (4, 4, 64) if ctx.simulated else (B, D, E)


def counters(ctx):
    """``() -> (launches, syncs)`` so far, on a GPU; None on the CPU."""
    if not ctx.is_cuda:
        return None
    from hbkernels.cuda import _device, _launcher

    return lambda: (_launcher.LAUNCHES[0], _device.HOST_SYNCS[0])


def per_call(ctx, call, calls, loops):
    """``(Timing of ms per call, launches per call, syncs per call)``."""
    count = counters(ctx)
    for _ in range(3):
        call()
    ctx.sync()
    before = count() if count else None
    call()
    ctx.sync()
    counted = (None, None) if count is None else tuple(a - b for a, b in zip(count(), before))
    times = []
    for _ in range(loops):
        ctx.sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        ctx.sync()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return Timing.of(times), counted


def cases(ctx):
    xp, torch = ctx.xp, ctx.torch
    b, d, e = sizes(ctx)
    table = ctx.random_table(e, d, "float32")
    ids = ctx.zipf_ids(b, e, 1.05)
    offsets = xp.arange(b + 1, dtype=xp.int64)
    grad = xp.ones((b, d), dtype=xp.float32)
    opt = hbk.optim.RowWiseAdagrad(lr=0.01)
    skip = hbk.optim.RowWiseAdagrad(lr=0.01, nonfinite="skip")
    state, state_skip = opt.init_state(table), skip.init_state(table)
    out = [
        ("embedding_bag", HBK, lambda: hbk.embedding_bag(table, ids, offsets)),
        ("embedding_bag", HBK + "-unchecked",
         lambda: hbk.embedding_bag(table, ids, offsets, bounds="unchecked")),
        ("lookup", HBK, lambda: hbk.lookup(table, ids)),
        ("fused_step", HBK, lambda: opt.fused_step(table, state, grad, ids, offsets)),
        ("fused_step", HBK + "-unchecked", lambda: skip.fused_step(
            table, state_skip, grad, ids, offsets, bounds="unchecked")),
        ("embedding_bag_backward", HBK,
         lambda: hbk.embedding_bag_backward(grad, ids, offsets, num_rows=e)),
    ]
    if torch is not None:
        t = ctx.as_torch({"w": table, "ids": ids, "offsets": offsets[:-1]})
        bag = torch.nn.functional.embedding_bag
        out.append(("embedding_bag", "torch",
                    lambda: bag(t["ids"], t["w"], t["offsets"], mode="sum")))
    return out


def run(ctx):
    calls, loops = (1, 1) if ctx.simulated else (5, 2) if ctx.smoke else (200, 7)
    b, d, e = sizes(ctx)
    for op, provider, call in cases(ctx):
        timing, (launches, syncs) = per_call(ctx, call, calls, loops)
        if launches is not None:
            ctx.note(f"{provider} {op}: {launches} kernel launches, {syncs} host syncs per call")
        ctx.record(OP, provider, op, f"B={b} L=1 D={d} E={e}", "float32", timing, 0,
                   reference=("torch",))


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
