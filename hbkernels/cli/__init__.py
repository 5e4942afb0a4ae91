"""The ``hbkernels`` command line (also ``python -m hbkernels``)::

    hbkernels info                                   # versions, devices, backends
    hbkernels check                                  # the CUDA path works here: compile, run, errors
    hbkernels bench --device cpu --out DIR           # op benchmarks vs peers: table, CSV, JSON, PNG
    hbkernels train --steps 200                      # DLRM-style CTR model on synthetic data
    mpiexec -n 2 hbkernels train --steps 200         # the same on 2 ranks
    hbkernels data convert criteo SRC DST            # text -> Parquet (also: data synthetic)
    hbkernels warmup [--device cuda]                 # compile the kernels once, into the cache
    hbkernels quantize CKPT --bits 4 --out DIR       # a checkpoint's tables quantized for serving
    hbkernels compact CKPT --out DIR                 # a chain of incremental saves as one full save
    hbkernels plan --calibrate --out profile.json    # the constants of the planner's model, measured

Each subcommand lives in its own module (``info.py``, ``check.py``, ``bench.py``,
``train.py``, ``warmup.py``, ``quantize.py``, ``compact.py``, ``plan.py``) with ``add_command(subparsers)``, which sets ``run(args) -> int``
as the parser's default. Errors a user can cause (a missing file, a bad column,
an unknown plan, no GPU for ``--device cuda``, a missing optional dependency)
(a malformed option included) print one line ``hbkernels <command>: error: <why>``
and exit 1;
``HBK_DEBUG=1`` shows the traceback instead. Any other exception is a bug and
shows its traceback. Output cut short by its reader (``hbkernels info | head``)
ends the command quietly.
"""
import os
import sys

from ._errors import USER_ERRORS, ArgumentParser, CLIError, error_line  # noqa: F401 - their home


def build_parser():
    from . import bench, check, compact, info, plan, quantize, train, warmup
    from ..data.__main__ import add_commands as add_data_commands

    from .._version import __version__

    parser = ArgumentParser(
        prog="hbkernels",
        description="Embedding kernels for recommender systems: info, benchmarks, training.")
    parser.add_argument("--version", action="version", version=f"hbkernels {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    info.add_command(commands)
    check.add_command(commands)
    bench.add_command(commands)
    train.add_command(commands)
    warmup.add_command(commands)
    quantize.add_command(commands)
    compact.add_command(commands)
    plan.add_command(commands)
    data = commands.add_parser("data", help="convert CTR datasets to Parquet, write synthetic data")
    add_data_commands(data.add_subparsers(dest="data_command", required=True, metavar="command"))
    return parser


def launcher_rank():
    """This process's rank as an MPI launcher set it, or None outside one."""
    from ..dist import LAUNCHER_ENV_VARS

    for var in LAUNCHER_ENV_VARS:
        if var in os.environ and os.environ[var].isdigit():
            return int(os.environ[var])
    return None


def main(argv=None):
    """Run one subcommand; returns the exit status (0 ok, 1 error; a usage error exits 1
    from the parser)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"hbkernels {args.command}"
    try:
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:  # the reader closed the pipe: nothing more to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's exit flush then writes nowhere
        return 0
    except USER_ERRORS as exc:
        if os.environ.get("HBK_DEBUG"):
            raise
        if launcher_rank() in (None, 0):  # under mpiexec every rank meets it: rank 0 says it
            print(f"{prog}: error: {error_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0 if status is None else int(status)
