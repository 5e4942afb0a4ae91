"""``hbkernels train``: a DLRM-style CTR model, end to end, on one or N ranks.

    hbkernels train                                     # synthetic clicks, CPU or the GPU
    hbkernels train --data criteo.parquet --epochs 5    # e.g. from `hbkernels data convert criteo`
    hbkernels train --dynamic --admit-count 2           # raw 64-bit ids, hash tables, eviction
    mpiexec -n 2 hbkernels train --steps 200            # 2 ranks: NCCL with a GPU each, else MPI
    torchrun --nproc-per-node 2 -m hbkernels train      # 2 ranks through torch.distributed

The model is :class:`hbkernels.models.DLRM`: a bottom MLP on the dense
features, one :class:`hbkernels.EmbeddingCollection` table per categorical
feature (Adagrad, sharded by ``--plan``), dot interaction, a top MLP; the
dense part is PyTorch (Adam, torch's fused kernel) through
:class:`hbkernels.adapters.torch.EmbeddingCollectionModule`.

Data parallel over ranks, one global batch of ``--batch-size`` samples per
step: rank ``r`` of ``W`` takes samples ``[r*B//W, (r+1)*B//W)`` of synthetic
batch ``step`` (or its own row range of the Parquet files). The loss is the
mean over the global batch: every rank backpropagates its local sum divided
by the global count, the embedding gradients are summed by the collection and
the dense gradients by one ``allreduce``, so N ranks follow the trajectory of
one process (to float rounding). Evaluation gathers every rank's
predictions and computes logloss and AUC over the whole set exactly.

``--eval-bits 8,4`` evaluates once more at the end for each width, with every
table quantized row-wise (:meth:`hbkernels.EmbeddingCollection.quantized`; the
dense part as trained), and reports each AUC beside the float one.

``--checkpoint DIR`` writes ``DIR/step-<n>/`` (the collection's checkpoint,
``dense.pt`` with the dense weights and Adam state, ``trainer.json`` with the
step, losses and configuration), then points ``DIR/latest`` at it (temp file,
fsync, rename) and removes older steps: a crash leaves the previous one.
``--resume`` continues from ``DIR/latest`` at the step it stopped (synthetic
batches are indexed by step; Parquet epochs are re-entered and skipped to the
batch), with the same configuration (a different one is refused), at any
world size and plan; a DIR with no checkpoint starts fresh, saying so. A DIR that
holds a checkpoint is refused without ``--resume`` or ``--overwrite``, which replaces
it only once the new run's first checkpoint is written.
"""
import argparse
import os
import time

from ..quantize import BITS
from ..types import PLACEMENTS
from ..train import LATEST, Trainer, check_clicks, parquet_clicks
from ._errors import USER_ERRORS, CLIError, error_line, usable_dir, writable_file
from ._help import HelpFormatter, plain

PLANS = ("auto",) + PLACEMENTS
DEFAULT_TABLES = ("c0:200000:1", "c1:100000:1", "c2:50000:1", "c3:20000:1", "c4:10000:1",
                  "c5:5000:1", "c6:1000:1", "history:100000:8:var")
ABORT_PAUSE_SECONDS = 0.5  # see abort_all


def int_list(text):
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def threads_option(text):
    """``"auto"`` or a positive int."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a positive integer, got {text!r}")
    return value


def name_list(text):
    return [x.strip() for x in text.split(",") if x.strip()]


def add_command(subparsers):
    from ..data.__main__ import at_least, parse_table

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
    data.add_argument("--dense-features", type=at_least(0), default=13, help="synthetic: dense features")
    data.add_argument("--alpha", type=at_least(0.0, float), default=1.05, help="synthetic: Zipf exponent of the ids")
    data.add_argument("--eval-samples", type=at_least(1), default=16384, help="synthetic: held-out samples")
    data.add_argument("--batch-threads", type=at_least(0), default=0,
                      help="synthetic: make the training batches ahead on this many threads while "
                           "the steps run (the same batches; 0: each in turn, before its step)")
    data.add_argument("--label", default="label",
                      help="Parquet: label column, values in [0, 1] (0 or 1, or a probability)")
    data.add_argument("--dense-columns", type=name_list, default=None,
                      help="Parquet: dense columns (default: every float column)")
    data.add_argument("--sparse-columns", type=name_list, default=None,
                      help="Parquet: categorical columns (default: every integer/string/list column)")
    data.add_argument("--num-rows", type=at_least(1), default=100_000,
                      help="Parquet: rows per table; ids are taken modulo this (hashing trick)")
    data.add_argument("--shuffle-buffer", type=at_least(0), default=0, help="Parquet: shuffle window in rows")
    data.add_argument("--dynamic", action="store_true",
                      help="dynamic tables (hbk.HashTable per rank): raw 64-bit ids (Parquet: the "
                           "column values, no modulo; synthetic: the ids hashed), each table "
                           "holding at most its rows (--num-rows for Parquet)")
    data.add_argument("--evict", default="lru", choices=("lru", "lfu", "none"),
                      help="--dynamic: which id a full table evicts")
    data.add_argument("--admit-count", type=at_least(1), default=1,
                      help="--dynamic: an id gets a row in the n-th step that sees it")
    data.add_argument("--capacity-fraction", type=at_least(0.0, float, strictly=True), default=1.0,
                      help="--dynamic: rows a table holds, as a fraction of its rows (<= 1; "
                           "below 1 the tables evict)")
    model = p.add_argument_group("model and training")
    model.add_argument("--steps", type=at_least(1), default=300, help="training steps (global batches)")
    model.add_argument("--epochs", type=at_least(1), default=None,
                       help="Parquet: train this many epochs (sets --steps)")
    model.add_argument("--batch-size", type=at_least(1), default=1024, help="global batch size (all ranks)")
    model.add_argument("--dim", type=at_least(1), default=16, help="embedding and bottom-MLP output width")
    model.add_argument("--bottom", type=int_list, default="64", help="bottom MLP hidden sizes")
    model.add_argument("--top", type=int_list, default="64,32", help="top MLP hidden sizes")
    model.add_argument("--plan", default="auto", help=f"table placement: {', '.join(PLANS)}")
    model.add_argument("--plan-profile", default=None, metavar="FILE",
                       help="a machine profile of 'hbkernels plan --calibrate': the planner ranks "
                            "placements and predicts the sparse step with its constants, for "
                            "Zipf ids scattered over the tables (synthetic --alpha 0: uniform ids) "
                            "(default: built-in ones)")
    model.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                       help="auto: the GPU where CUDA and CuPy work, else the CPU")
    model.add_argument("--cuda-graph", action="store_true",
                       help="capture the training step (sparse forward, dense part, backward, "
                            "update) in a CUDA graph once and replay it: one rank, static tables, "
                            "a GPU (under Numba's simulator the same step runs uncaptured)")
    model.add_argument("--sparse-lr", type=at_least(0.0, float, strictly=True), default=0.05, help="Adagrad rate of the tables")
    model.add_argument("--dense-lr", type=at_least(0.0, float, strictly=True), default=1e-3, help="Adam rate of the MLPs")
    model.add_argument("--seed", type=int, default=0, help="of the data, the tables and the MLPs")
    model.add_argument("--threads", type=threads_option, default="auto",
                       help="threads of Numba's and torch's pools: auto (one per free core, "
                            "re-measured every second; see hbkernels.threads) or a number")
    out = p.add_argument_group("evaluation, checkpoints, output")
    out.add_argument("--eval-every", type=at_least(0), default=0, help="evaluate every N steps (0: at the end)")
    out.add_argument("--eval-bits", type=int_list, default=(), metavar="BITS",
                     help="at the end, evaluate again with the tables quantized to each of these "
                          "bits (8, 4, 2; e.g. 8,4): the serving model's AUC beside the float one")
    out.add_argument("--checkpoint", default=None, metavar="DIR", help="checkpoint directory")
    out.add_argument("--checkpoint-every", type=at_least(0), default=0,
                     help="checkpoint every N steps (0: at the end only)")
    out.add_argument("--resume", action="store_true",
                     help="continue from DIR/latest (a DIR without a checkpoint: start fresh)")
    out.add_argument("--overwrite", action="store_true",
                     help="replace the checkpoint DIR holds; it is removed once this run's "
                          "first checkpoint is written")
    out.add_argument("--metrics", default="hbkernels-train-metrics.json",
                     help="metrics JSON written by rank 0, and beside it a PNG of loss and AUC "
                          "per step")
    p.set_defaults(run=run)


# -- setup ------------------------------------------------------------------------------------
def check_args(args):
    if args.plan not in PLANS:
        raise CLIError(f"unknown plan {args.plan!r}; choose from {', '.join(PLANS)}")
    if args.plan_profile is not None:  # read now: a bad profile is found before any step
        from ..sharding.profile import MachineProfile

        try:
            args.plan_profile = MachineProfile.load(args.plan_profile)
        except ValueError as error:
            raise CLIError(f"--plan-profile: {error}") from None
    if any(size < 1 for size in args.bottom + args.top):
        raise CLIError(f"--bottom and --top sizes must be >= 1, got {args.bottom} and {args.top}")
    # before any step: a bad path is found now, not at the end
    writable_file(args.metrics)
    writable_file(os.path.splitext(args.metrics)[0] + ".png")  # the curve beside it
    for flag in ("resume", "overwrite"):
        if getattr(args, flag) and not args.checkpoint:
            raise CLIError(f"--{flag} needs --checkpoint DIR")
    if args.resume and args.overwrite:
        raise CLIError("--resume continues the checkpoint in DIR, --overwrite replaces it: "
                       "give one of them")
    bad_bits = [b for b in args.eval_bits if b not in BITS]
    if bad_bits:
        raise CLIError(f"--eval-bits takes {', '.join(map(str, BITS))}, got {bad_bits}")
    if args.eval_bits and args.dynamic:
        raise CLIError("--eval-bits: dynamic tables (--dynamic) cannot be quantized")
    if args.cuda_graph and args.dynamic:
        raise CLIError("--cuda-graph captures steps of static tables; --dynamic tables change "
                       "size as ids arrive")
    if args.capacity_fraction > 1:
        raise CLIError(f"--capacity-fraction must be in (0, 1], got {args.capacity_fraction}")
    synthetic = args.data == "synthetic"
    if not synthetic:
        for path in filter(None, (args.data, args.eval_data)):
            if not os.path.exists(path):
                raise CLIError(f"no such file or directory: {path}")
    elif args.epochs is not None or args.eval_data is not None:
        raise CLIError("--epochs and --eval-data need Parquet --data")
    if args.batch_threads and not synthetic:
        raise CLIError("--batch-threads makes synthetic batches; Parquet --data is read as it is")
    if args.tables is None:
        from ..data.__main__ import parse_table

        args.tables = [parse_table(t) for t in DEFAULT_TABLES]
    if args.checkpoint:  # last: the directory is made (and a file written there) once all else passed
        usable_dir(args.checkpoint)
        held = held_checkpoint(args.checkpoint)
        if held and not (args.resume or args.overwrite):
            raise CLIError(f"{args.checkpoint} holds a checkpoint ({held}): --resume continues "
                           f"it, --overwrite replaces it once this run's first one is written")


def held_checkpoint(directory):
    """The step directory a ``train --checkpoint`` directory's ``latest`` names, else the
    first ``step-*`` directory in it, else None."""
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip() or None
    except OSError:
        steps = sorted(n for n in os.listdir(directory) if n.startswith("step-"))
        return steps[0] if steps else None


def resolve_device(requested):
    """'cpu' or 'cuda'; CLIError when ``cuda`` is asked for and there is none."""
    if requested == "cpu":
        return "cpu"
    from .._machine import simulator_enabled

    if requested == "cuda" and simulator_enabled():
        return "cuda"  # the collection on the simulator's CUDA arrays, torch on the CPU
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
    if args.data != "synthetic":  # bad paths, columns, no rows: one line (rank 0's) before MPI starts
        check_clicks(args, parquet_clicks(args, args.data, 0, 1, 0), args.data, "train on")
        if args.eval_data:
            check_clicks(args, parquet_clicks(args, args.eval_data, 0, 1, 0), args.eval_data,
                         "evaluate on")
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
