"""Framework adapter overhead: ``embedding_bag`` through a framework adapter
(``hbkernels.adapters.<framework>``) vs the bare ``hbk.embedding_bag`` on the
same memory, at sizes small enough that per-call overhead dominates.

E=1000 rows, D=16, B=64 bags of L=4 uniform ids, fp32 (the same with
``--smoke``, with two repetitions). Modes:

* ``forward``: one pooled lookup (the adapter's table does not require grad);
* ``forward_grad``: the same lookup with the table requiring grad, so the
  framework records its autograd graph (adapters that register this mode);
* ``forward_backward``: a training step of the op: forward, then the table's
  dense gradient (the bare kernel pair ``embedding_bag`` +
  ``embedding_bag_backward`` + one scatter into a zeroed ``[E, D]`` array vs the
  adapter's ``out.backward(grad)``).

Providers: ``hbkernels`` (bare kernels on NumPy/CuPy arrays) and one per
adapter in :data:`ADAPTERS` (``name -> factory(ctx, mode, case) -> Provider or
None``); a new framework registers its factory with :func:`adapter` (with the
modes it measures, by default :data:`MODES`). Each
adapter is verified against the bare kernel's result before timing, and the
summary prints its overhead in µs per call on top of the kernel
(``median(adapter) - median(hbkernels)``).

    python3 -m hbkernels.bench.bench_adapters --device cpu
"""
import numpy as np

import hbkernels as hbk
from .common import HBK, Provider, cli_main, optional_module

OP = "adapter_embedding_bag"
MODES = ("forward", "forward_backward")  # what every adapter measures
ALL_MODES = ("forward", "forward_grad", "forward_backward")
ADAPTERS = {}  # provider name -> factory(ctx, mode, case) -> Provider | None
ADAPTER_MODES = {}  # provider name -> the modes its factory handles


def adapter(name, modes=MODES):
    """Register ``factory(ctx, mode, case) -> Provider | None`` as provider ``name``
    for ``modes`` (return None, after ``ctx.note``, when the framework cannot run here)."""
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; choose from {ALL_MODES}")

    def register(factory):
        ADAPTERS[name] = factory
        ADAPTER_MODES[name] = tuple(modes)
        return factory
    return register


def configs(ctx):
    return [dict(E=1000, D=16, B=64, L=4)]


def make_case(ctx, cfg):
    xp = ctx.xp
    E, D, B, L = cfg["E"], cfg["D"], cfg["B"], cfg["L"]
    rng = np.random.default_rng(ctx.seed)
    ids = xp.asarray(rng.integers(0, E, size=B * L, dtype=np.int64))
    offsets = xp.arange(B + 1, dtype=xp.int64) * L
    grad = xp.asarray(rng.standard_normal((B, D), dtype=np.float32))
    return {"w": ctx.random_table(E, D, "float32"), "ids": ids, "offsets": offsets, "grad": grad}


def bare(ctx, mode, case):
    """The kernels alone, on the arrays themselves."""
    xp = ctx.xp
    num_rows, dim = case["E"], case["D"]
    if mode in ("forward", "forward_grad"):
        return Provider(HBK, lambda a: hbk.embedding_bag(a["w"], a["ids"], a["offsets"]))

    def step(a):
        out = hbk.embedding_bag(a["w"], a["ids"], a["offsets"])
        sg = hbk.embedding_bag_backward(a["grad"], a["ids"], a["offsets"], num_rows=num_rows)
        dense = xp.zeros((num_rows, dim), np.float32)
        dense[sg.ids] = sg.rows
        return out, dense
    return Provider(HBK, step)


@adapter("torch-adapter", modes=ALL_MODES)
def torch_adapter(ctx, mode, case):
    """``hbkernels.adapters.torch.embedding_bag`` on zero-copy tensor views (eager: its
    autograd.Function fast path; without grad no autograd at all)."""
    torch = ctx.torch
    if torch is None:
        return None
    try:
        from hbkernels.adapters import torch as hbk_torch
    except ImportError as error:
        ctx.note(f"hbkernels.adapters.torch does not import ({error}): torch-adapter is skipped")
        return None
    if ctx.is_cuda and optional_module("cupy") is None:
        return None
    eb = hbk_torch.embedding_bag
    train = mode == "forward_backward"

    def prepare(a):
        t = ctx.as_torch(a)
        if mode != "forward":
            t["w"].requires_grad_(True)
        return t

    if not train:
        return Provider("torch-adapter", lambda t: eb(t["w"], t["ids"], t["offsets"]), prepare=prepare)

    def step(t):
        w = t["w"]
        w.grad = None
        out = eb(w, t["ids"], t["offsets"])
        out.backward(t["grad"])
        return out.detach(), w.grad
    return Provider("torch-adapter", step, prepare=prepare)


@adapter("jax-adapter")
def jax_adapter(ctx, mode, case):
    """The jitted ``hbkernels.adapters.jax.embedding_bag`` (its gradient through
    ``jax.vjp``) on JAX arrays of this device; ids/offsets as int32 (JAX's default
    without x64), timed on the wall clock with ``block_until_ready``."""
    jax, device = ctx.jax_device()
    if jax is None:
        return None
    try:
        from hbkernels.adapters import jax as hbk_jax
    except ImportError as error:
        ctx.note(f"hbkernels.adapters.jax does not import ({error}): jax-adapter is skipped")
        return None
    if ctx.is_cuda and hbk_jax.paths()["cuda"] != "buffer_callback":
        ctx.note("jax-adapter on CUDA would go through host memory (no buffer_callback or "
                 "no CuPy): skipped")
        return None
    from .common import to_host

    eb = hbk_jax.embedding_bag

    def prepare(a):
        return {"w": jax.device_put(to_host(a["w"]), device),
                "ids": jax.device_put(to_host(a["ids"]).astype(np.int32), device),
                "offsets": jax.device_put(to_host(a["offsets"]).astype(np.int32), device),
                "grad": jax.device_put(to_host(a["grad"]), device)}

    if mode == "forward":
        fn = jax.jit(eb)
        return Provider("jax-adapter", lambda j: fn(j["w"], j["ids"], j["offsets"]),
                        prepare=prepare, block=jax.block_until_ready)

    @jax.jit
    def step(w, ids, offsets, grad):
        out, vjp = jax.vjp(lambda w: eb(w, ids, offsets), w)
        return out, vjp(grad)[0]

    return Provider("jax-adapter", lambda j: step(j["w"], j["ids"], j["offsets"], j["grad"]),
                    prepare=prepare, block=jax.block_until_ready)


def _tf_provider(ctx, mode, name, graph):
    """``hbkernels.adapters.tf.embedding_bag`` on TF tensors over the same memory
    (DLPack; the table a ``tf.Variable`` for ``forward_backward``), eagerly or in
    a ``tf.function`` (``graph``: the kernels run in a ``tf.numpy_function`` host
    callback). The table gradient, a ``tf.IndexedSlices``, is made dense like the
    others'."""
    tf = optional_module("tensorflow")
    if tf is None:
        ctx.note("tensorflow is not installed (or disabled): tf adapters are skipped")
        return None
    if ctx.is_cuda and (graph or not tf.config.list_physical_devices("GPU")):
        ctx.note(f"{name} on CUDA needs a GPU build of TF and eager mode (tf.function "
                 "goes through host memory): skipped")
        return None
    try:
        from hbkernels.adapters import tf as hbk_tf
    except ImportError as error:
        ctx.note(f"hbkernels.adapters.tf does not import ({error}): {name} is skipped")
        return None
    device = "/GPU:0" if ctx.is_cuda else "/CPU:0"
    train = mode == "forward_backward"
    eb = hbk_tf.embedding_bag

    def prepare(a):
        with tf.device(device):
            t = {k: hbk_tf.from_kernel_array(v) for k, v in a.items()}
            if mode != "forward":
                t["w"] = tf.Variable(t["w"])
        return t

    if mode == "forward":
        def fn(w, ids, offsets):
            return eb(w, ids, offsets)
    elif mode == "forward_grad":  # a tape watches the table: the custom_gradient op records
        def fn(w, ids, offsets):
            with tf.GradientTape():
                return eb(w, ids, offsets)
    else:
        def fn(w, ids, offsets, grad):
            with tf.GradientTape() as tape:
                out = eb(w, ids, offsets)
            return out, tf.convert_to_tensor(tape.gradient(out, w, output_gradients=grad))
    if graph:
        fn = tf.function(fn)
    block = (lambda r: tf.test.experimental.sync_devices()) if ctx.is_cuda else None
    if not train:
        return Provider(name, lambda t: fn(t["w"], t["ids"], t["offsets"]), prepare=prepare,
                        block=block)
    return Provider(name, lambda t: fn(t["w"], t["ids"], t["offsets"], t["grad"]),
                    prepare=prepare, block=block)


@adapter("tf-adapter", modes=ALL_MODES)
def tf_adapter(ctx, mode, case):
    return _tf_provider(ctx, mode, "tf-adapter", graph=False)


@adapter("tf-adapter-function")
def tf_function_adapter(ctx, mode, case):
    return _tf_provider(ctx, mode, "tf-adapter-function", graph=True)


def run(ctx):
    saved = ctx.reps, ctx.warmup
    if not ctx.smoke:  # µs-scale calls: many repetitions make the median steady
        ctx.reps = ctx.reps or 2000
        ctx.warmup = max(ctx.warmup, 50)
    try:
        for cfg in configs(ctx):
            E, D, B, L = cfg["E"], cfg["D"], cfg["B"], cfg["L"]
            case = dict(cfg)
            inputs = make_case(ctx, cfg)
            size = f"E={E} D={D} B={B} L={L}"
            nbytes = B * L * D * 4 + inputs["ids"].nbytes + inputs["offsets"].nbytes + B * D * 4
            for mode in ALL_MODES:
                providers = [bare(ctx, mode, case)]
                providers += [factory(ctx, mode, case) for name, factory in ADAPTERS.items()
                              if mode in ADAPTER_MODES[name]]
                if all(p is None for p in providers[1:]):
                    ctx.note(f"{OP} {mode}: no framework adapter can run here; skipped")
                    continue
                ctx.compare(OP, mode, size, "float32", inputs, providers, nbytes=nbytes,
                            rtol=1e-5, atol=1e-5, reference=(HBK,))
                if not ctx.smoke:
                    interleaved(ctx, mode, [p for p in providers if p is not None], inputs)
            ctx.release()
    finally:
        ctx.reps, ctx.warmup = saved
    report_overhead(ctx)


def interleaved(ctx, mode, providers, inputs, rounds=2000):
    """Overhead measured by alternating one call of every provider ``rounds`` times
    (a steadier difference than the rows' separate runs on a busy machine); printed only."""
    import time

    prepared = [(p, p.prepare(inputs) if p.prepare else inputs) for p in providers]
    times = {p.name: [] for p in providers}
    for i in range(rounds + 50):
        for p, a in prepared:
            t0 = time.perf_counter()
            result = p.run(a)
            if p.block is not None:
                p.block(result)
            ctx.sync()
            if i >= 50:
                times[p.name].append(time.perf_counter() - t0)
    base = 1e6 * float(np.median(times[HBK]))
    for name, ts in times.items():
        if name != HBK:
            us = 1e6 * float(np.median(ts))
            print(f"{OP} {mode}: {name} {us:.1f} µs vs bare kernel {base:.1f} µs, calls "
                  f"interleaved: overhead {us - base:+.1f} µs per call")


def overheads(ctx):
    """[(mode, provider, kernel µs, adapter µs, overhead µs)] of this run's rows."""
    out = []
    for row in ctx.rows:
        if row["op"] != OP or row["provider"] == HBK:
            continue
        base = next((r for r in ctx.rows if r["op"] == OP and r["mode"] == row["mode"]
                     and r["size"] == row["size"] and r["provider"] == HBK), None)
        if base is None:
            continue
        k_us, a_us = 1e3 * float(base["median_ms"]), 1e3 * float(row["median_ms"])
        out.append((row["mode"], row["provider"], k_us, a_us, a_us - k_us))
    return out


def report_overhead(ctx):
    for mode, name, k_us, a_us, extra in overheads(ctx):
        print(f"{OP} {mode}: {name} {a_us:.1f} µs vs bare kernel {k_us:.1f} µs: "
              f"overhead {extra:+.1f} µs per call ({ctx.device_name})")


def main(argv=None):
    return cli_main(run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
