"""``hbkernels train``: a DLRM-style CTR model, end to end, on one or N ranks.

    hbkernels train                                     # synthetic clicks, CPU or the GPU
    hbkernels train --data criteo.parquet --epochs 5    # e.g. from `hbkernels data convert criteo`
    mpiexec -n 2 hbkernels train --steps 200            # 2 ranks: NCCL with a GPU each, else MPI
    torchrun --nproc-per-node 2 -m hbkernels train      # 2 ranks through torch.distributed

The model is :class:`hbkernels.models.DLRM`: a bottom MLP on the dense
features, one :class:`hbkernels.EmbeddingCollection` table per categorical
feature (Adagrad, sharded by ``--plan``), dot interaction, a top MLP; the
dense part is PyTorch (Adam) through
:class:`hbkernels.adapters.torch.EmbeddingCollectionModule`.

Data parallel over ranks, one global batch of ``--batch-size`` samples per
step: rank ``r`` of ``W`` takes samples ``[r*B//W, (r+1)*B//W)`` of synthetic
batch ``step`` (or its own row range of the Parquet files). The loss is the
mean over the global batch: every rank backpropagates its local sum divided
by the global count, the embedding gradients are summed by the collection and
the dense gradients by one ``allreduce``, so N ranks follow the trajectory of
one process (to float rounding). Evaluation gathers every rank's
predictions and computes logloss and AUC over the whole set exactly.

``--checkpoint DIR`` writes ``DIR/step-<n>/`` (the collection's checkpoint,
``dense.pt`` with the dense weights and Adam state, ``trainer.json`` with the
step, losses and configuration), then points ``DIR/latest`` at it (temp file,
fsync, rename) and removes older steps: a crash leaves the previous one.
``--resume`` continues from ``DIR/latest`` at the step it stopped (synthetic
batches are indexed by step; Parquet epochs are re-entered and skipped to the
batch), with the same configuration (a different one is refused), at any
world size and plan.
"""
import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np

from . import USER_ERRORS, CLIError, error_line
from ._help import HelpFormatter, plain
from .progress import Progress

PLANS = ("auto", "data_parallel", "table_wise", "row_wise", "column_wise")
DEFAULT_TABLES = ("c0:200000:1", "c1:100000:1", "c2:50000:1", "c3:20000:1", "c4:10000:1",
                  "c5:5000:1", "c6:1000:1", "history:100000:8:var")
CONFIG_KEYS = ("data", "tables", "dense_features", "alpha", "label", "dense_columns",
               "sparse_columns", "num_rows", "dim", "bottom", "top", "batch_size", "seed",
               "sparse_lr", "dense_lr", "shuffle_buffer")
LATEST = "latest"
ABORT_PAUSE_SECONDS = 0.5  # see abort_all


def int_list(text):
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def name_list(text):
    return [x.strip() for x in text.split(",") if x.strip()]


def add_command(subparsers):
    from ..data.__main__ import parse_table

    p = subparsers.add_parser(
        "train", help="train a DLRM-style CTR model (synthetic data or Parquet; mpiexec for N ranks)",
        description=plain("\n\n".join(__doc__.split("\n\n")[:3])), formatter_class=HelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--data", default="synthetic",
                      help="'synthetic' (made on the fly) or Parquet file(s)/directory")
    data.add_argument("--eval-data", default=None,
                      help="Parquet evaluation set (default: the training data, labelled so)")
    data.add_argument("--table", dest="tables", type=parse_table, action="append", default=None,
                      metavar="NAME:ROWS:HOTNESS[:var]",
                      help=f"synthetic: a categorical feature (repeat; default {' '.join(DEFAULT_TABLES)})")
    data.add_argument("--dense-features", type=int, default=13, help="synthetic: dense features")
    data.add_argument("--alpha", type=float, default=1.05, help="synthetic: Zipf exponent of the ids")
    data.add_argument("--eval-samples", type=int, default=16384, help="synthetic: held-out samples")
    data.add_argument("--label", default="label", help="Parquet: label column")
    data.add_argument("--dense-columns", type=name_list, default=None,
                      help="Parquet: dense columns (default: every float column)")
    data.add_argument("--sparse-columns", type=name_list, default=None,
                      help="Parquet: categorical columns (default: every integer/string/list column)")
    data.add_argument("--num-rows", type=int, default=100_000,
                      help="Parquet: rows per table; ids are taken modulo this (hashing trick)")
    data.add_argument("--shuffle-buffer", type=int, default=0, help="Parquet: shuffle window in rows")
    model = p.add_argument_group("model and training")
    model.add_argument("--steps", type=int, default=300, help="training steps (global batches)")
    model.add_argument("--epochs", type=int, default=None,
                       help="Parquet: train this many epochs (sets --steps)")
    model.add_argument("--batch-size", type=int, default=1024, help="global batch size (all ranks)")
    model.add_argument("--dim", type=int, default=16, help="embedding and bottom-MLP output width")
    model.add_argument("--bottom", type=int_list, default="64", help="bottom MLP hidden sizes")
    model.add_argument("--top", type=int_list, default="64,32", help="top MLP hidden sizes")
    model.add_argument("--plan", default="auto", help=f"table placement: {', '.join(PLANS)}")
    model.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                       help="auto: the GPU where CUDA and CuPy work, else the CPU")
    model.add_argument("--sparse-lr", type=float, default=0.05, help="Adagrad rate of the tables")
    model.add_argument("--dense-lr", type=float, default=1e-3, help="Adam rate of the MLPs")
    model.add_argument("--seed", type=int, default=0, help="of the data, the tables and the MLPs")
    out = p.add_argument_group("evaluation, checkpoints, output")
    out.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end)")
    out.add_argument("--checkpoint", default=None, metavar="DIR", help="checkpoint directory")
    out.add_argument("--checkpoint-every", type=int, default=0,
                     help="checkpoint every N steps (0: at the end only)")
    out.add_argument("--resume", action="store_true", help="continue from DIR/latest")
    out.add_argument("--metrics", default="hbkernels-train-metrics.json",
                     help="metrics JSON written by rank 0, and beside it a PNG of loss and AUC "
                          "per step")
    p.set_defaults(run=run)


# -- setup ------------------------------------------------------------------------------------
def check_args(args):
    if args.plan not in PLANS:
        raise CLIError(f"unknown plan {args.plan!r}; choose from {', '.join(PLANS)}")
    for name in ("steps", "batch_size", "dim", "eval_samples", "num_rows"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("eval_every", "checkpoint_every", "shuffle_buffer", "dense_features"):
        if getattr(args, name) < 0:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.resume and not args.checkpoint:
        raise CLIError("--resume needs --checkpoint DIR")
    synthetic = args.data == "synthetic"
    if not synthetic:
        for path in filter(None, (args.data, args.eval_data)):
            if not os.path.exists(path):
                raise CLIError(f"no such file or directory: {path}")
    elif args.epochs is not None or args.eval_data is not None:
        raise CLIError("--epochs and --eval-data need Parquet --data")
    if args.tables is None:
        from ..data.__main__ import parse_table

        args.tables = [parse_table(t) for t in DEFAULT_TABLES]


def parquet_clicks(args, path, rank, world_size, shuffle_buffer):
    """This rank's :class:`hbkernels.data.ParquetClicks` of ``path`` (per-rank batch B // W)."""
    from ..data.ctr import ParquetClicks

    if args.batch_size < world_size:
        raise CLIError(f"--batch-size {args.batch_size} is smaller than the {world_size} ranks")
    return ParquetClicks(path, args.batch_size // world_size, num_rows=args.num_rows,
                         label=args.label, dense=args.dense_columns, sparse=args.sparse_columns,
                         rank=rank, world_size=world_size, shuffle_buffer=shuffle_buffer,
                         seed=args.seed)


def resolve_device(requested):
    """'cpu' or 'cuda'; CLIError when ``cuda`` is asked for and there is none."""
    if requested == "cpu":
        return "cpu"
    from .info import probe_cuda

    devices, reason = probe_cuda()
    if not devices:
        if requested == "cuda":
            raise CLIError(f"--device cuda: no CUDA GPU ({reason})")
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        if requested == "cuda":
            raise CLIError("--device cuda: this PyTorch has no CUDA (install a CUDA build of torch)")
        return "cpu"
    return "cuda"


def open_communicator(device):
    """One rank alone, torchrun's ranks (torch.distributed), or mpiexec's ranks: NCCL
    with a GPU each, MPI on the CPU."""
    from .. import dist

    if device == "cuda" or dist.launcher() != "mpi":
        return dist.init("auto")
    return dist.init("mpi")


def abort_all(comm, exc):
    """Print ``exc`` as one line and end every rank (a peer would wait in a collective).
    The pause lets mpiexec's proxy forward the line before the abort kills it (without
    it the line was lost in about 1 run of 5)."""
    print(f"hbkernels train: error on rank {comm.rank}: {error_line(exc)}", flush=True)
    time.sleep(ABORT_PAUSE_SECONDS)
    if comm.backend in ("mpi", "nccl"):  # launched by mpiexec: it ends the job
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    os._exit(1)  # torchrun: its agent ends the other ranks when one exits non-zero


def run(args):
    check_args(args)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise CLIError("hbkernels train needs PyTorch: pip install 'hbkernels[train]'") from None
    device = resolve_device(args.device)
    if args.data != "synthetic":  # bad paths and columns: one line (rank 0's) before MPI starts
        for path in filter(None, (args.data, args.eval_data)):
            parquet_clicks(args, path, 0, 1, 0)
    comm = open_communicator(device)
    try:
        return Trainer(args, comm, device).fit()
    except BaseException as exc:
        if comm.world_size > 1 and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            if os.environ.get("HBK_DEBUG") or not isinstance(exc, USER_ERRORS):  # a bug: its traceback
                import traceback

                traceback.print_exc()
            abort_all(comm, exc)
        raise


# -- the training loop --------------------------------------------------------------------------
class Trainer:
    def __init__(self, args, comm, device):
        import torch

        self.torch = torch
        self.args, self.comm, self.device = args, comm, device
        self.rank, self.world = comm.rank, comm.world_size
        self.root = self.rank == 0
        if device == "cuda":
            import cupy

            torch.cuda.set_device(cupy.cuda.Device().id)
        if self.world > 1:  # share the cores of a node between its ranks
            threads = max(1, (os.cpu_count() or 1) // self.world)
            torch.set_num_threads(threads)
            import numba

            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        self.synthetic = args.data == "synthetic"
        self.config = self.make_config()
        self.train_data, self.eval_data = self.make_data()
        if self.synthetic:
            self.features = [t.name for t in args.tables]
            self.num_dense = args.dense_features
            self.steps = args.steps
        else:
            self.features = self.train_data.features
            self.num_dense = len(self.train_data.dense)
            self.steps = args.epochs * len(self.train_data) if args.epochs else args.steps
        if self.synthetic:
            self.eval_split = "held-out synthetic samples"
        else:
            self.eval_split = f"--eval-data {args.eval_data}" if args.eval_data else "training data"
        self.step = 0
        self.history, self.evals = [], []
        self.train_seconds = 0.0      # of every run that led to this step (resumes included)
        self.timed_seconds, self.timed_samples = 0.0, 0   # this run's, for samples/s
        self.build()

    def make_config(self):
        a = self.args
        config = {k: getattr(a, k) for k in CONFIG_KEYS}
        config["tables"] = [list(t) for t in a.tables] if self.synthetic else None
        config["bottom"], config["top"] = list(a.bottom), list(a.top)
        if self.synthetic:
            for k in ("label", "dense_columns", "sparse_columns", "num_rows", "shuffle_buffer"):
                config[k] = None
        else:
            config["dense_features"] = config["alpha"] = None
            config["data"] = os.path.abspath(a.data)
        return config

    def make_data(self):
        a = self.args
        if self.synthetic:
            from ..data.ctr import SyntheticClicks

            return SyntheticClicks(a.tables, a.dense_features, alpha=a.alpha, seed=a.seed), None
        return (parquet_clicks(a, a.data, self.rank, self.world, a.shuffle_buffer),
                parquet_clicks(a, a.eval_data or a.data, self.rank, self.world, 0))

    def table_specs(self):
        from ..types import TableSpec

        a = self.args
        shape = {t.name: (t.num_rows, t.hotness) for t in a.tables} if self.synthetic else {}
        return [TableSpec(f, num_rows=shape.get(f, (a.num_rows, 1))[0], dim=a.dim, combiner="sum",
                          hotness=shape.get(f, (a.num_rows, 1))[1])
                for f in self.features]

    def build(self):
        from .. import optim
        from ..adapters.torch import EmbeddingCollectionModule
        from ..embedding_collection import EmbeddingCollection
        from ..models import DLRM

        torch, a = self.torch, self.args
        state = self.read_checkpoint() if a.resume else None
        hint = max(1, a.batch_size // self.world)
        if state is None:
            coll = EmbeddingCollection(self.table_specs(), self.comm, optim.Adagrad(lr=a.sparse_lr),
                                       plan=a.plan, batch_size_hint=hint, seed=a.seed,
                                       device=self.device)
        else:
            coll = EmbeddingCollection.load(state["dir"] / "embeddings", self.comm, plan=a.plan,
                                            batch_size_hint=hint, device=self.device)
        torch.manual_seed(a.seed)
        self.model = DLRM(EmbeddingCollectionModule(coll), self.features, self.num_dense, a.dim,
                          bottom=a.bottom, top=a.top).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=a.dense_lr)
        self.dense_params = [p for p in self.model.parameters() if p.requires_grad]
        self.collection = coll
        if state is not None:
            dense = torch.load(state["dir"] / "dense.pt", map_location=self.device, weights_only=True)
            missing, unexpected = self.model.load_state_dict(dense["model"], strict=False)
            if unexpected or any(not k.startswith("embeddings.") for k in missing):
                raise CLIError(f"checkpoint {state['dir']}: dense.pt does not fit the model "
                               f"(missing {missing}, unexpected {unexpected})")
            self.optimizer.load_state_dict(dense["optimizer"])
            self.step = state["step"]
            self.history, self.evals = state["history"], state["evals"]
            self.train_seconds = state["train_seconds"]

    # -- batches ------------------------------------------------------------------------------
    def tensors(self, batch):
        from ..types import Ragged

        torch = self.torch

        def t(a):
            a = np.ascontiguousarray(a)
            return torch.from_numpy(a if a.flags.writeable else a.copy()).to(self.device)

        sparse = {f: (t(x.values), t(x.offsets)) if isinstance(x, Ragged) else t(x)
                  for f, x in batch.sparse.items()}
        return t(batch.dense), sparse, t(batch.label)

    def local_slice(self, size):
        return size * self.rank // self.world, size * (self.rank + 1) // self.world

    def train_batches(self):
        """(step, this rank's batch, global batch size) from ``self.step`` on."""
        a = self.args
        if self.synthetic:
            lo, hi = self.local_slice(a.batch_size)
            for step in range(self.step, self.steps):
                yield step, self.train_data.batch(step, a.batch_size).rows(lo, hi), a.batch_size
            return
        per_epoch = len(self.train_data)
        if per_epoch == 0 and self.step < self.steps:
            raise CLIError(f"no rows to train on in {a.data}")
        step = self.step
        while step < self.steps:
            epoch, skip = divmod(step, per_epoch)
            self.train_data.set_epoch(epoch)
            for k, batch in enumerate(self.train_data):
                if k < skip:
                    continue
                if step >= self.steps:
                    break
                n = len(batch)
                if self.world > 1:
                    n = int(self.comm.allreduce(np.array([n], np.int64))[0])
                yield step, batch, n
                step += 1

    def eval_batches(self):
        a = self.args
        if not self.synthetic:
            self.eval_data.set_epoch(0)
            yield from self.eval_data
            return
        from ..data.ctr import EVAL

        for index in range(math.ceil(a.eval_samples / a.batch_size)):
            size = min(a.batch_size, a.eval_samples - index * a.batch_size)
            yield self.train_data.batch(index, size, stream=EVAL).rows(*self.local_slice(size))

    # -- steps --------------------------------------------------------------------------------
    def train_step(self, batch, global_count):
        torch = self.torch
        dense, sparse, label = self.tensors(batch)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        logits = self.model(dense, sparse)
        loss_sum = torch.nn.functional.binary_cross_entropy_with_logits(logits, label, reduction="sum")
        (loss_sum / global_count).backward()   # the collection applies its sparse update here
        grads = [p.grad.reshape(-1) for p in self.dense_params]
        flat = torch.cat(grads + [loss_sum.detach().reshape(1)])
        if self.world > 1:
            flat = self.allreduce(flat)
        offset = 0
        for p, g in zip(self.dense_params, grads):
            p.grad.copy_(flat[offset:offset + g.numel()].view_as(p.grad))
            offset += g.numel()
        self.optimizer.step()
        return float(flat[-1]) / global_count

    def allreduce(self, tensor):
        torch = self.torch
        if self.device == "cuda":
            import cupy

            return torch.from_dlpack(self.comm.allreduce(cupy.from_dlpack(tensor.contiguous())))
        return torch.from_numpy(self.comm.allreduce(tensor.detach().numpy()))

    def evaluate(self):
        """(logloss, AUC, samples) over the whole evaluation set, every rank's predictions gathered."""
        torch = self.torch
        probs, labels = [], []
        self.model.eval()
        with torch.no_grad():
            for batch in self.eval_batches():
                dense, sparse, _ = self.tensors(batch)
                probs.append(torch.sigmoid(self.model(dense, sparse)).double().cpu().numpy())
                labels.append(np.asarray(batch.label, np.float64))
        both = np.stack([np.concatenate(probs), np.concatenate(labels)], axis=1)
        if self.world > 1:
            both, _ = self.comm.allgatherv(both)
        from ..metrics import logloss, roc_auc

        return logloss(both[:, 1], both[:, 0]), roc_auc(both[:, 1], both[:, 0]), int(both.shape[0])

    def record_eval(self):
        loss, auc, n = self.evaluate()
        self.evals.append({"step": self.step, "logloss": loss, "auc": auc, "samples": n})
        if self.root:
            print(f"step {self.step}: eval ({self.eval_split}) logloss {loss:.5f}, AUC {auc:.5f} "
                  f"over {n} samples", flush=True)

    def fit(self):
        a = self.args
        if self.root:
            print(f"hbkernels train: {self.world} rank(s), backend {self.comm.backend}, device "
                  f"{self.device}, global batch {a.batch_size}, {self.steps} steps"
                  + (f" (resuming at step {self.step})" if self.step else ""), flush=True)
            print(self.collection.plan, flush=True)
        bar = Progress(self.steps, "train", initial=self.step, enabled=self.root)
        mark = time.perf_counter()
        for i, (step, batch, count) in enumerate(self.train_batches()):
            loss = self.train_step(batch, count)
            now = time.perf_counter()
            self.train_seconds += now - mark   # data and step; not evaluations, not checkpoints
            if i:  # the first step compiles kernels: samples/s leaves it out
                self.timed_seconds += now - mark
                self.timed_samples += count
            self.step = step + 1
            self.history.append({"step": self.step, "loss": loss, "samples": count})
            bar.update(loss=f"{loss:.4f}")
            if a.eval_every and self.step % a.eval_every == 0 and self.step < self.steps:
                self.record_eval()
            if (a.checkpoint and a.checkpoint_every and self.step % a.checkpoint_every == 0
                    and self.step < self.steps):
                self.save_checkpoint()
            mark = time.perf_counter()
        bar.close()
        if not self.evals or self.evals[-1]["step"] != self.step:
            self.record_eval()
        if a.checkpoint:
            self.save_checkpoint()
        if self.root:
            self.report()
        return 0

    # -- output ---------------------------------------------------------------------------------
    def report(self):
        a = self.args
        rate = self.timed_samples / self.timed_seconds if self.timed_seconds > 0 else float("nan")
        last = self.evals[-1]
        metrics = {
            "world_size": self.world, "backend": self.comm.backend, "device": self.device,
            "steps": self.step, "batch_size": a.batch_size, "samples_per_s": rate,
            "train_seconds": self.train_seconds, "plan": self.collection.plan.to_json(),
            "final": {"train_loss": self.history[-1]["loss"] if self.history else None,
                      "eval_logloss": last["logloss"], "eval_auc": last["auc"],
                      "eval_samples": last["samples"], "eval_split": self.eval_split},
            "train": self.history, "eval": self.evals, "config": self.config,
        }
        write_json(a.metrics, metrics)
        chart = Path(a.metrics).with_suffix(".png")
        drawn = draw_curve(chart, self.history, self.evals, self.eval_split)
        print(f"{self.step} steps x {a.batch_size} samples on {self.world} rank(s): "
              f"{rate:,.0f} samples/s; eval ({self.eval_split}) logloss {last['logloss']:.5f}, "
              f"AUC {last['auc']:.5f}; metrics -> {a.metrics}"
              + (f", curve -> {chart}" if drawn is None else f" ({drawn})"), flush=True)

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self):
        from ..checkpoint import fsync_dir

        root = Path(self.args.checkpoint)
        step_dir = root / f"step-{self.step:08d}"
        self.collection.save(step_dir / "embeddings")          # collective, atomic on its own
        if self.root:
            def write_dense(f):
                self.torch.save({"model": self.dense_state_dict(),
                                 "optimizer": self.optimizer.state_dict()}, f)
            from ..checkpoint import write_atomic

            write_atomic(step_dir / "dense.pt", write_dense)
            write_json(step_dir / "trainer.json", {
                "step": self.step, "config": self.config, "history": self.history,
                "evals": self.evals, "train_seconds": self.train_seconds})
            fsync_dir(step_dir)
        self.comm.barrier()
        if self.root:
            write_atomic(root / LATEST, lambda f: f.write(step_dir.name.encode()))
            fsync_dir(root)
            for old in root.glob("step-*"):
                if old.name != step_dir.name:
                    shutil.rmtree(old, ignore_errors=True)
        self.comm.barrier()

    def dense_state_dict(self):
        """The model's state without the tables (they are in the collection's checkpoint;
        the module's own ``state_dict()`` would gather them, a collective)."""
        return {k: v for name, child in self.model.named_children() if name != "embeddings"
                for k, v in child.state_dict(prefix=f"{name}.").items()}

    def read_checkpoint(self):
        root = Path(self.args.checkpoint)
        try:
            name = (root / LATEST).read_text().strip()
        except FileNotFoundError:
            raise CLIError(f"no checkpoint to resume in {root} (no {root / LATEST})") from None
        step_dir = root / name
        try:
            state = json.loads((step_dir / "trainer.json").read_text())
        except (OSError, ValueError) as e:
            raise CLIError(f"checkpoint {step_dir} is unreadable: {error_line(e)}") from None
        changed = [k for k in CONFIG_KEYS if state["config"].get(k) != self.config.get(k)]
        if changed:
            detail = ", ".join(f"{k}: {state['config'].get(k)!r} -> {self.config.get(k)!r}"
                               for k in changed)
            raise CLIError(f"--resume with another configuration than {step_dir} ({detail})")
        state["dir"] = step_dir
        return state


def write_json(path, obj):
    from ..checkpoint import write_json_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, obj)


def draw_curve(path, history, evals, eval_split):
    """Write ``path``, a PNG of the training loss per step (and the evaluation logloss at
    each evaluation) above the evaluation AUC; returns None, or why no chart was drawn."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return "matplotlib is not installed: no curve (pip install 'hbkernels[train]')"
    fig = Figure(figsize=(7, 5.5))
    FigureCanvasAgg(fig)
    loss_ax, auc_ax = fig.subplots(2, 1, sharex=True)
    loss_ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8,
                 label="training loss (batch)")
    loss_ax.plot([e["step"] for e in evals], [e["logloss"] for e in evals], "o-",
                 label=f"eval logloss ({eval_split})")
    loss_ax.set_ylabel("logloss")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    auc_ax.plot([e["step"] for e in evals], [e["auc"] for e in evals], "o-", color="C2")
    auc_ax.set_ylabel(f"AUC ({eval_split})")
    auc_ax.set_xlabel("step")
    auc_ax.grid(alpha=0.3)
    fig.suptitle("hbkernels train")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return None
