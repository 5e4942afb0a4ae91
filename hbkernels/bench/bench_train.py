"""train: one step of ``hbkernels train``'s DLRM against the same DLRM in TorchRec,
on the same synthetic batches, in one process.

hbkernels: :class:`hbkernels.train.Trainer` as ``hbkernels train`` builds it
(an :class:`hbkernels.EmbeddingCollection` with Adagrad, torch MLPs with
Adam (``fused=True``), ``--threads auto``), one ``train_step`` per call. TorchRec:
``torchrec.models.dlrm.DLRM`` (dense arch 13 -> 64 -> D, dot interaction,
over arch 64 -> 32 -> 1, as :class:`hbkernels.models.DLRM`) over a
``FusedEmbeddingBagCollection`` (FBGEMM's TBE on the CPU with its fused
exact Adagrad, the sparse optimizer applied in the backward as TorchRec's
``DistributedModelParallel`` does), the same fused Adam on the dense part, the batch turned
into a ``KeyedJaggedTensor`` inside the step. Both take the same global batch
of ``hbkernels train``'s default tables (8 tables, 486 K rows, D = 16, one
multi-hot), the same learning rates, BCE on logits; the calls alternate in
a fresh order each round (:meth:`Context.measure_together`), so both meet
the same machine. The table reports ms per step (samples/s = batch / that)
and the mean loss of each provider's last steps (same batches, different
initial weights: close, not equal). ``hbkernels-dynamic`` is ``hbkernels train
--dynamic``: the same model with every table a dynamic one (as many rows, raw
64-bit ids: the batches' ids hashed before the clock starts).

    python3 -m hbkernels.bench.bench_train --device cpu --reps 100
"""
import argparse
import math
import os
import tempfile
import warnings

import numpy as np

from .common import HBK, Provider, cli_main, optional_module

OP = "train"
DYNAMIC = HBK + "-dynamic"
BATCH_SIZE = 2048
BATCHES = 64
SPARSE_LR, DENSE_LR, EPS = 0.05, 1e-3, 1e-10


def trainer_args(batch_size, metrics):
    """The arguments ``hbkernels train --batch-size N`` runs with."""
    from ..cli.train import DEFAULT_TABLES, add_command
    from ..data.__main__ import parse_table

    commands = argparse.ArgumentParser().add_subparsers(dest="command")
    add_command(commands)
    args = commands.choices["train"].parse_args(["--batch-size", str(batch_size), "--metrics", metrics])
    args.tables = [parse_table(t) for t in DEFAULT_TABLES]
    return args


def torchrec_model(torch, args):
    """TorchRec's DLRM over a fused (TBE) embedding-bag collection, and its Adam."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchrec.models.dlrm import DLRM
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        tables = [EmbeddingBagConfig(num_embeddings=t.num_rows, embedding_dim=args.dim,
                                     name=f"t_{t.name}", feature_names=[t.name])
                  for t in args.tables]
        ebc = FusedEmbeddingBagCollection(tables, optimizer_type=torch.optim.Adagrad,
                                          optimizer_kwargs={"lr": args.sparse_lr, "eps": EPS},
                                          device=torch.device("cpu"))
        torch.manual_seed(args.seed)
        model = DLRM(embedding_bag_collection=ebc, dense_in_features=args.dense_features,
                     dense_arch_layer_sizes=[*args.bottom, args.dim],
                     over_arch_layer_sizes=[*args.top, 1])
    dense = [p for n, p in model.named_parameters() if "embedding_bag_collection" not in n]
    return model, torch.optim.Adam(dense, lr=args.dense_lr, fused=True)


def keyed_jagged(torch, kjt_class, features, batch):
    """The batch's sparse features as a KeyedJaggedTensor (one length per sample and key)."""
    values, lengths = [], []
    for f in features:
        x = batch.sparse[f]
        if hasattr(x, "offsets"):
            values.append(np.asarray(x.values, np.int64))
            lengths.append(np.diff(np.asarray(x.offsets)).astype(np.int64))
        else:
            values.append(np.asarray(x, np.int64))
            lengths.append(np.ones(len(x), np.int64))
    return kjt_class.from_lengths_sync(keys=list(features),
                                       values=torch.from_numpy(np.concatenate(values)),
                                       lengths=torch.from_numpy(np.concatenate(lengths)))


def run(ctx):
    torch = ctx.torch
    torchrec = optional_module("torchrec")
    if ctx.is_cuda or torch is None or torchrec is None:
        ctx.note(f"{OP}: needs torch and TorchRec (with fbgemm-gpu-cpu) on the CPU; skipped")
        return
    from ..dist import init
    from ..train import Trainer

    batch_size = 64 if ctx.smoke else BATCH_SIZE
    with tempfile.TemporaryDirectory(prefix="hbkernels-bench-train-") as tmp:
        args = trainer_args(batch_size, os.path.join(tmp, "metrics.json"))
        trainer = Trainer(args, init("local"), "cpu")
        model, adam = torchrec_model(torch, args)
        kjt_class = torchrec.KeyedJaggedTensor
        batches = [trainer.train_data.batch(i, batch_size) for i in range(4 if ctx.smoke else BATCHES)]
        losses = {HBK: [], "torchrec": []}

        def hbk_step(batch):
            (loss, _, _), = trainer.train_step(batch, 0, batch_size)  # (read back at once)
            losses[HBK].append(loss)
            if trainer.governor is not None:
                trainer.governor.tick()

        def torchrec_step(batch):
            model.train()
            adam.zero_grad()
            kjt = keyed_jagged(torch, kjt_class, trainer.features, batch)
            dense = torch.from_numpy(np.require(batch.dense, np.float32, ("C", "W")))
            label = torch.from_numpy(np.require(batch.label, np.float32, ("C", "W")))
            logits = model(dense, kjt).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label)
            loss.backward()   # the fused collection applies Adagrad to its rows here
            adam.step()
            losses["torchrec"].append(loss.item())

        dyn_args = trainer_args(batch_size, os.path.join(tmp, "dynamic.json"))
        dyn_args.dynamic = True
        dynamic = Trainer(dyn_args, init("local"), "cpu")
        raw = {id(b): dynamic.raw_ids(b) for b in batches}  # hashed ids, made before the clock
        losses[DYNAMIC] = []

        def dynamic_step(batch):
            (loss, _, _), = dynamic.train_step(raw[id(batch)], 0, batch_size)
            losses[DYNAMIC].append(loss)
            if dynamic.governor is not None:
                dynamic.governor.tick()

        providers = [Provider(HBK, hbk_step), Provider("torchrec", torchrec_step),
                     Provider(DYNAMIC, dynamic_step)]
        providers = [p for p in providers if ctx.selected(p.name)]
        timings = ctx.measure_together([(p.run, batches, None) for p in providers])
    size = (f"B={batch_size} tables={len(args.tables)} D={args.dim} "
            f"rows={sum(t.num_rows for t in args.tables)}")
    for p, timing in zip(providers, timings):
        ctx.record(OP, p.name, "dlrm", size, "float32", timing, 0,
                   reference=("torchrec",))
        tail = losses[p.name][-min(20, len(losses[p.name])):]
        print(f"  {p.name}: {batch_size / timing.median_ms * 1e3:,.0f} samples/s, "
              f"mean loss of its last {len(tail)} steps {np.mean(tail):.4f}")
    ms = {p.name: t.median_ms for p, t in zip(providers, timings) if math.isfinite(t.median_ms)}
    if HBK in ms and "torchrec" in ms:
        print(f"  hbkernels / torchrec samples/s = {ms['torchrec'] / ms[HBK]:.2f}")
    if HBK in ms and DYNAMIC in ms:
        print(f"  dynamic / static step time = {ms[DYNAMIC] / ms[HBK]:.2f}")


def main(argv=None):
    return cli_main(run, argv, __doc__)


if __name__ == "__main__":
    main()
