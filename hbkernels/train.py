"""The training loop of ``hbkernels train`` (:mod:`hbkernels.cli.train` parses its
arguments): :class:`Trainer` builds the DLRM (:class:`hbkernels.models.DLRM` over an
:class:`hbkernels.EmbeddingCollection`), feeds it synthetic or Parquet clicks,
evaluates, checkpoints and resumes, on one or N ranks (the scheme is in the
command's module docstring)."""
import json
import math
import os
import shutil
import time
import zlib
from pathlib import Path

import numpy as np

from .cli._errors import CLIError, error_line
from ._machine import simulator_enabled
from .cli.progress import Progress
from .threads import Governor, rank_share, set_num_threads

CONFIG_KEYS = ("data", "tables", "dense_features", "alpha", "label", "dense_columns",
               "sparse_columns", "num_rows", "dim", "bottom", "top", "batch_size", "seed",
               "sparse_lr", "dense_lr", "shuffle_buffer", "dynamic", "evict", "admit_count",
               "capacity_fraction")
LATEST = "latest"
GRAPH_WARMUP = 3  # steps run uncaptured (on a side stream) before the step is captured


def parquet_clicks(args, path, rank, world_size, shuffle_buffer):
    """This rank's :class:`hbkernels.data.ParquetClicks` of ``path`` (per-rank batch B // W)."""
    from .data.ctr import ParquetClicks

    if args.batch_size < world_size:
        raise CLIError(f"--batch-size {args.batch_size} is smaller than the {world_size} ranks")
    return ParquetClicks(path, args.batch_size // world_size,
                         num_rows=None if args.dynamic else args.num_rows,
                         label=args.label, dense=args.dense_columns, sparse=args.sparse_columns,
                         rank=rank, world_size=world_size, shuffle_buffer=shuffle_buffer,
                         seed=args.seed)


def check_clicks(args, clicks, path, purpose):
    """CLIError unless ``clicks`` (a :class:`hbkernels.data.ParquetClicks` of ``path``) has
    rows to ``purpose`` ("train on", "evaluate on") and features enough for the DLRM."""
    if len(clicks) == 0:
        raise CLIError(f"no rows to {purpose} in {path}")
    check_interaction(clicks.features, len(clicks.dense), f"{path} (label {args.label!r})")


def check_interaction(features, num_dense, what):
    """CLIError unless the DLRM has two vectors to interact (``what``: the data, as the
    message names it)."""
    if len(features) + (1 if num_dense else 0) < 2:
        dense = f"{num_dense} dense" if num_dense else "no dense"
        raise CLIError(f"the DLRM needs two categorical features, or one and dense features, "
                       f"to interact; {what} has categorical {features or 'none'} and {dense} "
                       f"features")


def check_labels(label, column, path):
    """CLIError unless every value of ``label`` (a batch's labels, float) is in [0, 1]:
    0 or 1 for a click, or a probability in between (a soft label); NaN is refused."""
    bad = ~((label >= 0) & (label <= 1))   # NaN fails both comparisons
    if bad.any():
        values = np.unique(label[bad])
        shown = ", ".join(f"{v:g}" for v in values[:5]) + (", ..." if len(values) > 5 else "")
        raise CLIError(f"labels must be in [0, 1] (0 or 1, or a probability in between), but "
                       f"column {column!r} of {path} holds {shown}")


# -- the training loop --------------------------------------------------------------------------
class StagedInputs:
    """Fixed input tensors, views of one device buffer, refilled from the host with one copy
    each time (:meth:`fill`). On a GPU the host side is two pinned buffers used in turn: one
    is written while the copy from the other may still run, and is written again only after
    its own last copy has ended. Elsewhere the buffer is written in place."""

    ALIGN = 16  # bytes: each part starts on a multiple

    def __init__(self, torch, device, parts, staged=None):
        """``parts``: ``(NumPy dtype, shape)`` of each tensor; ``staged``: fill through host
        buffers and a copy (default: on a GPU)."""
        self.torch, self.device, spans, end = torch, device, [], 0
        for dtype, shape in parts:  # each part's bytes, [start, stop)
            start = -(-end // self.ALIGN) * self.ALIGN
            end = start + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            spans.append(slice(start, end))
        self.buffer = torch.zeros(max(end, 1), dtype=torch.uint8, device=device)
        self.tensors = [self.buffer[span].view(torch.from_numpy(np.empty(0, d)).dtype).view(s)
                        for span, (d, s) in zip(spans, parts)]
        staged = device == "cuda" if staged is None else staged
        self.hosts = ([torch.zeros(self.buffer.shape[0], dtype=torch.uint8,
                                   pin_memory=device == "cuda") for _ in range(2)]
                      if staged else [self.buffer])
        self.copied = [None] * len(self.hosts)  # the event after each host buffer's last copy
        self.views = [[h.numpy()[span].view(d).reshape(s) for span, (d, s) in zip(spans, parts)]
                      for h in self.hosts]
        self.turn = 0

    def fill(self, arrays):
        """Copy ``arrays`` (one per part, each no longer than its part) in, queued on the
        current stream; returns the tensors, each cut to its array's length."""
        k = self.turn
        self.turn = (k + 1) % len(self.hosts)
        if self.copied[k] is not None:
            self.copied[k].synchronize()
        for view, a in zip(self.views[k], arrays):
            view[:a.shape[0]] = a
        if self.hosts[k] is not self.buffer:
            self.buffer.copy_(self.hosts[k], non_blocking=True)
            if self.device == "cuda":
                if self.copied[k] is None:
                    self.copied[k] = self.torch.cuda.Event()
                self.copied[k].record()
        return [t[:a.shape[0]] for t, a in zip(self.tensors, arrays)]


class LaggedLoss:
    """Step losses read back one step late: a step's loss (a 0-d tensor) is copied to the
    host as the step's last queued work (on a GPU into one of two pinned buffers, in turn,
    with an event), and read once the next step is queued, so the host prepares a step
    while the device runs the one before."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device == "cuda"
        self.hosts = [None, None]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.turn, self.pending = 0, None

    def put(self, loss, info):
        """Queue the copy of ``loss`` on the current stream; ``info`` comes back with it
        from :meth:`take`."""
        k = self.turn
        self.turn = 1 - k
        if self.hosts[k] is None or self.hosts[k].dtype != loss.dtype:
            self.hosts[k] = self.torch.zeros((), dtype=loss.dtype, pin_memory=self.cuda)
        self.hosts[k].copy_(loss.detach(), non_blocking=self.cuda)
        if self.cuda:
            self.events[k].record()
        self.pending = (k, info)

    def take(self):
        """``(loss as a float, info)`` of the step put last (a wait for its copy), or
        None; cleared."""
        if self.pending is None:
            return None
        (k, info), self.pending = self.pending, None
        if self.cuda:
            self.events[k].synchronize()
        return float(self.hosts[k]), info


class Laps:
    """Wall time of a step's phases: ``lap(name)`` charges the time since the last lap (or
    :meth:`start`) to ``name``; :meth:`keep` adds the step's laps to the totals."""

    def __init__(self):
        self.total, self.steps = {}, 0
        self.start()

    def start(self):
        self.mark, self.step = time.perf_counter(), {}

    def lap(self, name):
        now = time.perf_counter()
        self.step[name] = self.step.get(name, 0.0) + now - self.mark
        self.mark = now

    def keep(self):
        for name, seconds in self.step.items():
            self.total[name] = self.total.get(name, 0.0) + seconds
        self.steps += 1

    def per_step_ms(self):
        """``{phase: ms per kept step}``, in the order the phases first came."""
        return {name: 1e3 * s / self.steps for name, s in self.total.items()} if self.steps else {}


class Trainer:
    def __init__(self, args, comm, device):
        import torch

        self.torch = torch
        self.args, self.comm, self.device = args, comm, device
        self.rank, self.world = comm.rank, comm.world_size
        self.root = self.rank == 0
        # the dense part's device: under Numba's CUDA simulator the tables are on "cuda"
        # (simulated) and torch on the CPU
        self.torch_device = "cpu" if simulator_enabled() else device
        if self.torch_device == "cuda":
            import cupy

            torch.cuda.set_device(cupy.cuda.Device().id)
        # the ranks of a node share its cores; within its share, one thread per free core
        share = rank_share(self.world)
        if args.threads == "auto":
            self.governor = Governor(share)
        else:
            self.governor = None
            set_num_threads(args.threads)
        self.synthetic = args.data == "synthetic"
        self.config = self.make_config()
        self.train_data, self.eval_data = self.make_data()
        if self.synthetic:
            self.features = [t.name for t in args.tables]
            self.num_dense = args.dense_features
            self.steps = args.steps
            check_interaction(self.features, self.num_dense, "the synthetic data (--table, "
                              "--dense-features)")
        else:
            check_clicks(args, self.train_data, args.data, "train on")
            check_clicks(args, self.eval_data, args.eval_data or args.data, "evaluate on")
            self.features = self.train_data.features
            self.num_dense = len(self.train_data.dense)
            self.steps = args.epochs * len(self.train_data) if args.epochs else args.steps
        if self.synthetic:
            self.eval_split = "held-out synthetic samples"
        else:
            self.eval_split = f"--eval-data {args.eval_data}" if args.eval_data else "training data"
        self.step = 0
        # --overwrite: the step directories of the checkpoint being replaced (listed before any
        # rank saves, so every rank names this run's saves alike), removed once one is written
        self.replaced = (set(p.name for p in Path(args.checkpoint).glob("step-*"))
                         if args.checkpoint and getattr(args, "overwrite", False) else set())
        self.saved = None  # the step directory this run wrote last
        self.first_step = 0  # the step this run starts at (a resumed run's is not 0)
        self.history, self.evals = [], []
        self.train_seconds = 0.0      # of every run that led to this step (resumes included)
        self.timed_seconds, self.timed_samples = 0.0, 0   # this run's, for samples/s
        self.first_step_seconds = None  # this run's first step: kernels compiled or loaded
        self.laps = Laps()  # this run's timed steps by phase: data, inputs, step, wait
        self.sparse_steps = []  # (forward, backward) seconds of the collection's calls, each timed step
        if args.cuda_graph and (device != "cuda" or self.world > 1):
            raise CLIError("--cuda-graph captures the step of one rank on a GPU (--device cuda); "
                           f"this run has {self.world} rank(s) on {device}")
        # --cuda-graph: the losses read one step late
        self.lagged = LaggedLoss(torch, self.torch_device) if args.cuda_graph else None
        self.static = None  # --cuda-graph: the step's fixed inputs (StagedInputs)
        self.graph = None  # (torch CUDAGraph, the collection's CapturedStep, loss, count)
        self.uncaptured = 0  # --cuda-graph on a GPU: steps run before the capture
        self.side_stream = None  # and the stream they run on
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
            from .data.ctr import SyntheticClicks

            return SyntheticClicks(a.tables, a.dense_features, alpha=a.alpha, seed=a.seed), None
        return (parquet_clicks(a, a.data, self.rank, self.world, a.shuffle_buffer),
                parquet_clicks(a, a.eval_data or a.data, self.rank, self.world, 0))

    def table_specs(self):
        from .types import TableSpec

        a = self.args
        shape = {t.name: (t.num_rows, t.hotness) for t in a.tables} if self.synthetic else {}
        specs = [TableSpec(f, num_rows=shape.get(f, (a.num_rows, 1))[0], dim=a.dim, combiner="sum",
                           hotness=shape.get(f, (a.num_rows, 1))[1])
                 for f in self.features]
        if a.dynamic:  # rows given out by id; the initial scale of the static table's
            specs = [s._replace(num_rows=None, evict=a.evict, admit_count=a.admit_count,
                                capacity=max(self.world, int(s.num_rows * a.capacity_fraction)),
                                init_scale=s.scale) for s in specs]
        return specs

    def raw_ids(self, batch):
        """``--dynamic`` on synthetic data: each table's ids as raw 64-bit hashes
        (splitmix64 of the id and the table), the way hashed strings arrive."""
        if not (self.args.dynamic and self.synthetic):
            return batch
        from ._bits import splitmix64
        from .types import Ragged

        def raw(name, ids):
            with np.errstate(over="ignore"):
                key = np.uint64(zlib.crc32(name.encode()))
                return splitmix64(ids.astype(np.int64).view(np.uint64) ^ key).view(np.int64)

        sparse = {f: Ragged(raw(f, x.values), x.offsets) if isinstance(x, Ragged) else raw(f, x)
                  for f, x in batch.sparse.items()}
        return type(batch)(batch.label, batch.dense, sparse)

    def build(self):
        from . import optim
        from .adapters.torch import EmbeddingCollectionModule
        from .sharding.collection import EmbeddingCollection
        from .models import DLRM

        torch, a = self.torch, self.args
        state = self.read_checkpoint() if a.resume else None
        hint = max(1, a.batch_size // self.world)
        # how the ids are numbered, for the planner's model: synthetic ids of exponent 0 are uniform
        layout = "uniform" if a.data == "synthetic" and a.alpha == 0 else "scattered"
        if state is None:
            coll = EmbeddingCollection(self.table_specs(), self.comm, optim.Adagrad(lr=a.sparse_lr),
                                       plan=a.plan, batch_size_hint=hint, seed=a.seed,
                                       device=self.device, plan_profile=a.plan_profile,
                                       id_layout=layout)
        else:
            coll = EmbeddingCollection.load(state["dir"] / "embeddings", self.comm, plan=a.plan,
                                            batch_size_hint=hint, device=self.device,
                                            plan_profile=a.plan_profile, id_layout=layout)
        torch.manual_seed(a.seed)
        self.model = DLRM(EmbeddingCollectionModule(coll), self.features, self.num_dense, a.dim,
                          bottom=a.bottom, top=a.top).to(self.torch_device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=a.dense_lr, fused=True,
                                          capturable=a.cuda_graph and self.torch_device == "cuda")
        self.dense_params = [p for p in self.model.parameters() if p.requires_grad]
        self.collection = coll
        if a.cuda_graph:
            coll.reserve(a.batch_size, self.max_ids(a.batch_size))
        if state is not None:
            dense = torch.load(state["dir"] / "dense.pt", map_location=self.torch_device, weights_only=True)
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
        from .types import Ragged

        torch = self.torch

        def t(a):
            a = np.ascontiguousarray(a)
            return torch.from_numpy(a if a.flags.writeable else a.copy()).to(self.torch_device)

        sparse = {f: (t(x.values), t(x.offsets)) if isinstance(x, Ragged) else t(x)
                  for f, x in batch.sparse.items()}
        return t(batch.dense), sparse, t(batch.label)

    def max_ids(self, size):
        """``{feature: most ids}`` of a batch of ``size`` samples: ``size`` times a
        synthetic table's longest bag (one id per sample for Parquet columns)."""
        if not self.synthetic:
            return dict.fromkeys(self.features, size)
        return {t.name: size * (2 * t.hotness - 1 if t.variable else t.hotness)
                for t in self.args.tables}

    def static_tensors(self, batch):
        """``tensors(batch)`` copied into the step's fixed input tensors (made at the
        first batch; each feature's values padded to its reserved count, ids past the
        last offset never read): what a captured step reads, with one copy from the host."""
        from .types import Ragged

        arrays = [batch.dense, batch.label]
        for x in batch.sparse.values():
            arrays += [x.values, x.offsets] if isinstance(x, Ragged) else [x]
        if self.static is None:
            size = self.args.batch_size
            caps = self.max_ids(size)
            parts = [(batch.dense.dtype, (size,) + batch.dense.shape[1:]), (batch.label.dtype, (size,))]
            for f, x in batch.sparse.items():
                if not isinstance(x, Ragged):
                    parts.append((x.dtype, (size,)))
                elif not self.synthetic:
                    raise CLIError(f"--cuda-graph takes Parquet columns of one id per sample; "
                                   f"{f!r} is a list column")
                else:
                    parts += [(x.values.dtype, (caps[f],)), (x.offsets.dtype, (size + 1,))]
            self.static = StagedInputs(self.torch, self.torch_device, parts)
        cut = self.static.fill(arrays)
        out, i = {}, 2
        for f, x in batch.sparse.items():
            if isinstance(x, Ragged):  # the values whole: the padding is never read
                out[f] = (self.static.tensors[i], cut[i + 1])
                i += 2
            else:
                out[f] = cut[i]
                i += 1
        return cut[0], out, cut[1]

    def local_slice(self, size):
        return size * self.rank // self.world, size * (self.rank + 1) // self.world

    def train_batches(self):
        """(step, this rank's batch, global batch size) from ``self.step`` on."""
        a = self.args
        if self.synthetic:
            lo, hi = self.local_slice(a.batch_size)
            batches = self.train_data.batches(range(self.step, self.steps), a.batch_size,
                                              threads=a.batch_threads)
            for step, batch in zip(range(self.step, self.steps), batches):
                yield step, self.raw_ids(batch.rows(lo, hi)), a.batch_size
            return
        per_epoch = len(self.train_data)
        step = self.step
        while step < self.steps:
            epoch, skip = divmod(step, per_epoch)
            self.train_data.set_epoch(epoch)
            for k, batch in enumerate(self.train_data):
                if k < skip:
                    continue
                if step >= self.steps:
                    break
                check_labels(batch.label, a.label, a.data)
                n = len(batch)
                if self.world > 1:
                    n = int(self.comm.allreduce(np.array([n], np.int64))[0])
                yield step, batch, n
                step += 1

    def eval_batches(self):
        a = self.args
        if not self.synthetic:
            self.eval_data.set_epoch(0)
            for batch in self.eval_data:
                check_labels(batch.label, a.label, a.eval_data or a.data)
                yield batch
            return
        from .data.ctr import EVAL

        for index in range(math.ceil(a.eval_samples / a.batch_size)):
            size = min(a.batch_size, a.eval_samples - index * a.batch_size)
            yield self.raw_ids(self.train_data.batch(index, size, stream=EVAL).rows(*self.local_slice(size)))

    # -- steps --------------------------------------------------------------------------------
    def train_step(self, batch, number, global_count):
        """Queue step ``number``; ``[(mean loss, number, global count)]`` of the steps
        whose loss is read back (with ``--cuda-graph`` the step before this one,
        :class:`LaggedLoss`; else this one). Its phases are lapped: ``inputs`` (the batch
        to tensors on the device), ``step`` (the step queued), ``wait`` (losses read back:
        where the host waits for the device)."""
        loss = self.queue_step(batch, global_count)
        self.laps.lap("step")
        if self.lagged is None:
            done = [(float(loss) / global_count, number, global_count)]
        else:
            done = self.take_lagged()
            self.lagged.put(loss, (number, global_count))  # on torch's stream, as the step
        self.laps.lap("wait")
        return done

    def take_lagged(self):
        """``[(mean loss, number, global count)]`` of the step whose loss is still to be
        read, or ``[]``."""
        taken = None if self.lagged is None else self.lagged.take()
        if taken is None:
            return []
        loss_sum, (number, global_count) = taken
        return [(loss_sum / global_count, number, global_count)]

    def record_losses(self, done):
        """``done`` (as :meth:`train_step` returns it) into the history."""
        for loss, number, samples in done:
            self.history.append({"step": number, "loss": loss, "samples": samples})

    def queue_step(self, batch, global_count):
        """The step queued; its loss summed over the global batch (a 0-d tensor)."""
        if not self.args.cuda_graph:
            inputs = self.tensors(batch)
            self.laps.lap("inputs")
            return self.step_on(*inputs, global_count)
        inputs = self.static_tensors(batch)
        self.laps.lap("inputs")
        if self.torch_device != "cuda" or len(batch) != self.args.batch_size:
            return self.step_on(*inputs, global_count)  # the simulator; a last, smaller batch
        torch = self.torch
        if self.graph is None and self.uncaptured < GRAPH_WARMUP:
            self.uncaptured += 1  # (torch's rule: before a capture, steps on a side stream)
            if self.side_stream is None:
                self.side_stream = torch.cuda.Stream()
            side = self.side_stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self.step_on(*inputs, global_count)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self.graph is None or self.graph[3] != global_count:
            self.capture(*inputs, global_count)
        graph, step, loss_sum, _ = self.graph
        from .adapters.torch import cuda_stream_of

        with cuda_stream_of(loss_sum):
            step.replay(graph.replay)
        return loss_sum

    def capture(self, dense, sparse, label, global_count):
        """Capture the step over the fixed inputs (``static_tensors``) into a CUDA graph:
        the forward, the loss, the backward (which updates the tables) and the dense
        optimizer's step; the capture runs nothing."""
        torch = self.torch
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)  # the captured backward writes its own
        graph = torch.cuda.CUDAGraph()
        with self.collection.capture() as step, torch.cuda.graph(graph):
            logits = self.model(dense, sparse)
            loss_sum = torch.nn.functional.binary_cross_entropy_with_logits(logits, label,
                                                                             reduction="sum")
            (loss_sum / global_count).backward()
            self.optimizer.step()
        self.graph = (graph, step, loss_sum.detach(), global_count)

    def step_on(self, dense, sparse, label, global_count):
        """One step, uncaptured, over tensors on the dense part's device; its loss summed
        over the global batch (a 0-d tensor)."""
        torch = self.torch
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        logits = self.model(dense, sparse)
        loss_sum = torch.nn.functional.binary_cross_entropy_with_logits(logits, label, reduction="sum")
        (loss_sum / global_count).backward()   # the collection applies its sparse update here
        if self.world == 1:
            self.optimizer.step()
            return loss_sum.detach()
        grads = [p.grad.reshape(-1) for p in self.dense_params]
        flat = self.allreduce(torch.cat(grads + [loss_sum.detach().reshape(1)]))
        offset = 0
        for p, g in zip(self.dense_params, grads):
            p.grad.copy_(flat[offset:offset + g.numel()].view_as(p.grad))
            offset += g.numel()
        self.optimizer.step()
        return flat[-1]

    def allreduce(self, tensor):
        torch = self.torch
        if self.torch_device == "cuda":
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
        from .metrics import logloss, roc_auc

        return logloss(both[:, 1], both[:, 0]), roc_auc(both[:, 1], both[:, 0]), int(both.shape[0])

    def record_eval(self):
        loss, auc, n = self.evaluate()
        self.evals.append({"step": self.step, "logloss": loss, "auc": auc, "samples": n})
        if self.root:
            print(f"step {self.step}: eval ({self.eval_split}) logloss {loss:.5f}, AUC {auc:.5f} "
                  f"over {n} samples", flush=True)

    def evaluate_quantized(self, bits):
        """``{"bits", "logloss", "auc", "samples"}`` of the evaluation with every table
        quantized to ``bits`` (the collection's :meth:`quantized`; collective)."""
        from .adapters.torch import EmbeddingCollectionModule

        trained = self.model.embeddings
        self.model.embeddings = EmbeddingCollectionModule(self.collection.quantized(bits=bits))
        try:
            loss, auc, n = self.evaluate()
        finally:
            self.model.embeddings = trained
        if self.root:
            print(f"step {self.step}: eval ({self.eval_split}) on int{bits} tables: logloss "
                  f"{loss:.5f}, AUC {auc:.5f} ({signed(auc - self.evals[-1]['auc'])})", flush=True)
        return {"bits": bits, "logloss": loss, "auc": auc, "samples": n}

    def fit(self):
        a = self.args
        if self.root:
            print(f"hbkernels train: {self.world} rank(s), backend {self.comm.backend}, device "
                  f"{self.device}, global batch {a.batch_size}, {self.steps} steps"
                  + (f" (resuming at step {self.step})" if self.step else ""), flush=True)
            print(self.collection.plan, flush=True)
        self.first_step = self.step  # of this run
        # the first step compiles (or loads) the kernels: the time left is estimated without it
        bar = Progress(self.steps, "train", initial=self.step, enabled=self.root, warm=1)
        mark = time.perf_counter()
        self.laps.start()
        for i, (step, batch, count) in enumerate(self.train_batches()):
            self.laps.lap("data")
            calls = dict(self.collection.call_seconds)
            done = self.train_step(batch, step + 1, count)
            self.step = step + 1
            evaluate = a.eval_every and self.step % a.eval_every == 0 and self.step < self.steps
            save = (a.checkpoint and a.checkpoint_every and self.step % a.checkpoint_every == 0
                    and self.step < self.steps)
            if evaluate or save or self.step == self.steps:  # this step's loss is wanted now
                done += self.take_lagged()
                self.laps.lap("wait")
            if self.governor is not None:
                self.governor.tick()
            now = time.perf_counter()
            self.train_seconds += now - mark   # data and step; not evaluations, not checkpoints
            if i:  # the first step compiles kernels: samples/s leaves it out
                self.timed_seconds += now - mark
                self.timed_samples += count
                self.laps.keep()
                self.sparse_steps.append(tuple(self.collection.call_seconds[call] - calls[call]
                                               for call in ("forward", "backward")))
            else:
                self.first_step_seconds = now - mark
            self.record_losses(done)
            bar.update(**({"loss": f"{self.history[-1]['loss']:.4f}"} if self.history else {}))
            if evaluate:
                self.record_eval()
            if save:
                self.save_checkpoint()
            mark = time.perf_counter()
            self.laps.start()
        self.record_losses(self.take_lagged())  # a run stopped early
        bar.close()
        if not self.evals or self.evals[-1]["step"] != self.step:
            self.record_eval()
        self.quantized_evals = [self.evaluate_quantized(bits) for bits in a.eval_bits]
        if a.checkpoint:
            self.save_checkpoint()
        dynamic = {name: self.collection.dynamic_counts(name)  # collective
                   for name, spec in self.collection.tables.items() if spec.dynamic}
        if self.root:
            self.report(dynamic)
        return 0

    # -- output ---------------------------------------------------------------------------------
    def report(self, dynamic):
        """Write the metrics JSON and the curve, print the summary; ``dynamic``: each
        dynamic table's live, admitted and evicted ids over all ranks."""
        a = self.args
        rate = self.timed_samples / self.timed_seconds if self.timed_seconds > 0 else float("nan")
        last = self.evals[-1]
        metrics = {
            "world_size": self.world, "backend": self.comm.backend, "device": self.device,
            "steps": self.step, "batch_size": a.batch_size, "samples_per_s": rate,
            "cuda_graph": bool(a.cuda_graph and self.graph is not None),
            "train_seconds": self.train_seconds, "first_step_seconds": self.first_step_seconds,
            "step_phases_ms": self.laps.per_step_ms(),
            "sparse_step_ms": self.sparse_step_ms(),
            "plan": self.collection.plan.to_json(),
            "threads": ({"mode": "auto", "last": self.governor.threads,
                         "changes": self.governor.changes} if self.governor
                        else {"mode": "fixed", "last": a.threads, "changes": 0}),
            "final": {"train_loss": self.history[-1]["loss"] if self.history else None,
                      "eval_logloss": last["logloss"], "eval_auc": last["auc"],
                      "eval_samples": last["samples"], "eval_split": self.eval_split},
            "train": self.history, "eval": self.evals, "config": self.config,
        }
        if self.quantized_evals:
            metrics["final"]["quantized"] = self.quantized_evals
        if dynamic:
            metrics["dynamic"] = dynamic
            totals = {k: sum(c[k] for c in dynamic.values()) for k in ("size", "admitted", "evicted")}
            print(f"dynamic tables: {totals['admitted']:,} ids admitted, {totals['evicted']:,} "
                  f"evicted, {totals['size']:,} live in {len(dynamic)} tables", flush=True)
        write_json(a.metrics, metrics)
        chart = Path(a.metrics).with_suffix(".png")
        drawn = draw_curve(chart, self.history, self.evals, self.eval_split)
        first = ("" if self.first_step_seconds is None
                 else f" (first step {self.first_step_seconds:.2f} s)")
        phases = self.laps.per_step_ms()
        if phases:
            print("per step, ms (the first step left out): "
                  + ", ".join(f"{name} {ms:.3f}" for name, ms in phases.items()), flush=True)
            print(self.sparse_line(metrics["sparse_step_ms"]), flush=True)
        ran = self.step - self.first_step
        resumed = f" (steps {self.first_step + 1}-{self.step})" if self.first_step else ""
        print(f"{ran} steps{resumed} x {a.batch_size} samples on {self.world} rank(s): "
              f"{rate:,.0f} samples/s{first}; eval ({self.eval_split}) logloss {last['logloss']:.5f}, "
              f"AUC {last['auc']:.5f}; metrics -> {a.metrics}"
              + (f", curve -> {chart}" if drawn is None else f" ({drawn})")
              + (f"; checkpoint -> {self.saved}" if self.saved is not None else ""), flush=True)

    def sparse_step_ms(self):
        """The sparse step in ms: ``forward``, ``backward`` and ``measured`` (their sum),
        medians over the timed steps of this rank's collection calls, ``mean`` of the sum,
        ``steps`` timed (the measured ones None where the steps were replayed from a CUDA
        graph, which calls nothing); beside the planner's ``predicted`` step (the busiest
        rank's), its ``predicted_parts`` on this rank and what it was ``predicted_by``."""
        measured = self.graph is None and bool(self.sparse_steps)
        steps = np.asarray(self.sparse_steps if measured else [(0.0, 0.0)]) * 1e3
        ms = {"forward": float(np.median(steps[:, 0])), "backward": float(np.median(steps[:, 1])),
              "measured": float(np.median(steps.sum(axis=1))), "mean": float(steps.sum(axis=1).mean())}
        ms = {k: v if measured else None for k, v in ms.items()}
        ms["steps"] = len(self.sparse_steps) if measured else 0
        estimate = self.collection.estimate()
        ms["predicted"] = 1e3 * estimate.seconds
        ms["predicted_parts"] = estimate.parts_ms(self.comm.rank)
        ms["predicted_by"] = estimate.label()
        return ms

    def sparse_line(self, ms):
        """The summary's lines on the sparse step: measured (the collection's calls) beside
        the planner's prediction."""
        parts = ", ".join(f"{k} {v:.3f}" for k, v in ms["predicted_parts"].items())
        predicted = f"{ms['predicted']:.3f} predicted ({parts} on this rank; {ms['predicted_by']})"
        if ms["measured"] is None:
            return (f"sparse step, ms: {predicted}; not measured (the steps were replayed from "
                    f"a CUDA graph)")
        queued = " (host time: on a GPU a call returns once its work is queued)" if (
            self.torch_device == "cuda") else ""
        return (f"sparse step, ms: {ms['measured']:.3f} measured on this rank, the median of "
                f"{ms['steps']} steps (forward {ms['forward']:.3f}, backward {ms['backward']:.3f})"
                f"{queued}\n                 {predicted}")

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self):
        from ._files import fsync_dir

        root = Path(self.args.checkpoint)
        name, again = f"step-{self.step:08d}", 1
        while name in self.replaced:  # never written into: the replaced checkpoint stays whole
            name, again = f"step-{self.step:08d}.{again}", again + 1
        step_dir = root / name
        self.collection.save(step_dir / "embeddings")          # collective, atomic on its own
        if self.root:
            def write_dense(f):
                self.torch.save({"model": self.dense_state_dict(),
                                 "optimizer": self.optimizer.state_dict()}, f)
            from ._files import write_atomic

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
        self.saved = step_dir

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
            if self.root:
                print(f"--resume: no checkpoint in {root} (no {LATEST}): starting fresh", flush=True)
            return None
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


def signed(x, places=5):
    """``x`` with its sign, to ``places`` decimals; one that rounds to zero is ``+0``.

    >>> signed(-1e-9), signed(-0.25, 2)
    ('+0.00000', '-0.25')
    """
    return f"{round(x, places) + 0.0:+.{places}f}"


def collection_checkpoint(path):
    """``(the collection checkpoint at path, the step directory read or None)``: ``path``
    itself when it is one (``EmbeddingCollection.save`` wrote it), the ``embeddings`` of a
    ``train --checkpoint`` step directory, or of the newest step of a ``train
    --checkpoint`` directory (the one its ``latest`` names: the second value); else a
    CLIError saying what it takes."""
    from .sharding.checkpoint import MANIFEST

    root = Path(path)
    if (root / MANIFEST).is_file():
        return root, None
    newest = None
    if (root / LATEST).is_file():
        newest = root / (root / LATEST).read_text().strip()
    if ((newest or root) / "embeddings" / MANIFEST).is_file():
        return (newest or root) / "embeddings", newest
    raise CLIError(f"{path} holds no checkpoint: give a collection checkpoint (the directory "
                   f"EmbeddingCollection.save wrote) or a `hbkernels train --checkpoint` "
                   f"directory (its newest step is read) or one of its step directories")


def write_json(path, obj):
    from ._files import write_json_atomic

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
