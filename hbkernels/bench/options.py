"""The options of a benchmark run, shared by every op script and ``hbkernels bench``
(a module without side effects: the command line imports it to build its parser)."""
import argparse


def add_run_arguments(p):
    """The options of a benchmark run: of every op script (:func:`parser`) and of
    ``hbkernels bench``."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: NumPy arrays (Numba CPU kernels); cuda: CuPy arrays (Numba CUDA "
                        "kernels), needs a GPU (default: cpu)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes and two repetitions: proves the benchmarks run")
    p.add_argument("--reps", type=_positive, default=None,
                   help="timed repetitions per provider (default: fill about a second)")
    p.add_argument("--warmup", type=_positive, default=None, help="untimed calls before timing")
    p.add_argument("--providers", default=None,
                   help="comma-separated providers to time, e.g. hbkernels,torch "
                        "(hbkernels is still verified against a peer)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated data")


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
