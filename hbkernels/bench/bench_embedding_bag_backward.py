"""Training step of a pooled embedding: forward, sparse backward, Adagrad update.

hbkernels: ``embedding_bag`` + ``embedding_bag_backward`` + ``optim.Adagrad.step``
("hbkernels"), and ``embedding_bag`` + ``optim.Adagrad.fused_step``
("hbkernels-fused": backward and update in one pass, no gradient rows in memory).
Peer: torch ``F.embedding_bag(sparse=True)`` forward + ``backward`` +
``torch.optim.Adagrad.step``. torch cannot run the backward without its forward,
so every provider is timed over the whole step (mode ``fwd+bwd+adagrad``); the
``bwd+adagrad`` rows time hbk's backward and update alone, against the plain
array-library path (``unique`` + scatter-add + the Adagrad formula in NumPy/CuPy).

CPU: E=1e6 rows, B=16384 bags of L=32 ids, fp32, ``bwd+adagrad`` at D in {16, 64, 128} in
each id layout (``layout=`` in the size column, :func:`.common.zipf_ids`): Zipf(1.1)
scattered over the table, Zipf(1.1) and Zipf(1.05) ranked by frequency (hot rows packed at
the table's start), uniform; ``fwd+bwd+adagrad`` at D=64 with scattered ids. Each
``bwd+adagrad`` case also times ``gather-scatter`` (:mod:`.bounds`): each distinct row its
ids name read and written once, the least memory traffic of the layout, and, beside it, the
fused step of every other rule (``hbkernels-fused-SGD``, ``-RowWiseAdagrad``, ``-Adam``,
``-Ftrl``; timed, not compared: each is checked against the reference in the tests).
GPU: E=1e7, D=128, B=65536, L=32, Zipf(1.05), fp32.
GB/s counts the bytes the backward + update must move: grad_out read, the
touched rows read and written, their Adagrad state read and written, ids and
offsets read (the forward's bytes are not counted).

Each provider works on its own copy of the table and state (made untimed);
the check compares the tables after one step.

    python3 -m hbkernels.bench.bench_embedding_bag_backward --device cpu
"""

import hbkernels as hbk
from .bounds import gather_scatter
from .common import HBK, LAYOUTS, Provider, bags_size, cli_main

OP = "embedding_bag_backward"
LR = 0.05
OTHER_RULES = ("SGD", "RowWiseAdagrad", "Adam", "Ftrl")  # fused steps timed beside Adagrad's
#: every provider a case may time but the array library's and the bound
PROVIDERS = (HBK, HBK + "-fused", "torch", *(f"{HBK}-fused-{name}" for name in OTHER_RULES))


def configs(ctx):
    if ctx.smoke:
        return [dict(E=1000, D=8, B=64, L=4, alpha=1.1, layout=layout, step=layout == "scattered",
                     bound=True) for layout in LAYOUTS]
    if ctx.is_cuda:
        return [dict(E=10**7, D=128, B=65536, L=32, alpha=1.05, step=True, bound=False)]
    layouts = (("scattered", 1.1), ("ranked", 1.1), ("ranked", 1.05), ("uniform", 0.0))
    return [dict(E=10**6, D=dim, B=16384, L=32, alpha=alpha, layout=layout, bound=True,
                 step=(dim, layout) == (64, "scattered"))  # (torch's step: this case alone)
            for dim in (16, 64, 128) for layout, alpha in layouts]


def hbk_provider(ctx, name, *, fused, forward=True, optimizer=None):
    """hbk's step with ``optimizer`` (default ``Adagrad(lr=LR)``) on a copy of the table."""
    opt = optimizer or hbk.optim.Adagrad(lr=LR)

    def prepare(a):
        w = a["w"].copy()
        return dict(a, w=w, state=opt.init_state(w))

    def run(a):
        w, ids, offsets = a["w"], a["ids"], a["offsets"]
        if forward:
            hbk.embedding_bag(w, ids, offsets)
        if fused:
            opt.fused_step(w, a["state"], a["grad"], ids, offsets)
        else:
            grad = hbk.embedding_bag_backward(a["grad"], ids, offsets, num_rows=w.shape[0])
            opt.step(w, a["state"], grad)
        return w

    return Provider(name, run, prepare=prepare)


def torch_provider(ctx):
    torch = ctx.torch
    if torch is None:
        return None

    def prepare(a):
        t = ctx.as_torch(a)
        weight = torch.nn.Parameter(t["w"].clone())
        return dict(t, weight=weight, opt=torch.optim.Adagrad([weight], lr=LR))

    def run(a):
        weight = a["weight"]
        out = torch.nn.functional.embedding_bag(
            a["ids"], weight, a["offsets"], mode="sum", sparse=True, include_last_offset=True)
        out.backward(a["grad"])
        a["opt"].step()
        weight.grad = None
        return weight.detach()

    return Provider("torch", run, prepare=prepare)


def array_provider(ctx, B, L):
    """NumPy/CuPy: dedup, scatter-add the bag gradients per distinct id, Adagrad on those rows."""
    xp = ctx.xp
    add_at = ctx.add_at

    def prepare(a):
        w = a["w"].copy()
        return dict(a, w=w, sum=xp.zeros_like(w), bag_of=xp.repeat(xp.arange(B), L))

    def run(a):
        w, acc = a["w"], a["sum"]
        uniq, inverse = xp.unique(a["ids"], return_inverse=True)
        rows = xp.zeros((uniq.shape[0], w.shape[1]), w.dtype)
        add_at(rows, inverse.reshape(-1), a["grad"][a["bag_of"]])
        acc[uniq] += rows * rows
        w[uniq] -= LR * rows / (xp.sqrt(acc[uniq]) + 1e-10)
        return w

    return Provider(ctx.xp_name, run, prepare=prepare)


def run(ctx):
    xp = ctx.xp
    for cfg in configs(ctx):
        E, D, B, L = cfg["E"], cfg["D"], cfg["B"], cfg["L"]
        ids, offsets = ctx.fixed_bags(cfg)
        touched = int(xp.unique(ids).shape[0])
        w = ctx.random_table(E, D, "float32")
        grad = ctx.random_table(B, D, "float32", seed_offset=1)
        row = D * 4
        nbytes = grad.nbytes + 2 * touched * row + 2 * touched * row + ids.nbytes + offsets.nbytes
        size = f"{bags_size(cfg)} touched={touched}"
        inputs = {"w": w, "ids": ids, "offsets": offsets, "grad": grad}
        peer = torch_provider(ctx) if cfg["step"] else None
        if peer is None and cfg["step"]:
            ctx.note("torch is not installed (or disabled): the fwd+bwd+adagrad step is skipped")
        elif peer is not None:
            ctx.compare(OP, "fwd+bwd+adagrad", size, "float32", inputs, [
                hbk_provider(ctx, HBK, fused=False),
                hbk_provider(ctx, HBK + "-fused", fused=True),
                peer,
            ], nbytes=nbytes, rtol=1e-4, atol=1e-5)
        ctx.compare(OP, "bwd+adagrad", size, "float32", inputs, [
            hbk_provider(ctx, HBK, fused=False, forward=False),
            hbk_provider(ctx, HBK + "-fused", fused=True, forward=False),
            array_provider(ctx, B, L),
        ], nbytes=nbytes, rtol=1e-4, atol=1e-5,
            bounds=[gather_scatter()] if cfg["bound"] and not ctx.is_cuda else [],
            parts=[hbk_provider(ctx, f"{HBK}-fused-{name}", fused=True, forward=False,
                                optimizer=getattr(hbk.optim, name)(lr=LR))
                   for name in OTHER_RULES])
        del w, grad, ids, offsets
        ctx.release()


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
