"""Command line of :mod:`hbkernels.data`::

    python -m hbkernels.data convert {criteo,avazu,movielens} SRC DST [--num-buckets N]
    python -m hbkernels.data synthetic DST --rows N --table NAME:ROWS:HOTNESS[:var] ...
                                       [--alpha A] [--seed S] [--dense K]

:func:`add_commands` adds these subcommands to any argparse subparsers, so a
larger command line (``hbkernels data ...``) carries them; each sets
``run(args)``, which prints the :class:`WriteSummary` and returns 0.
"""
import argparse
import math
import sys

from ..errors import DataError, MissingDependencyError
from ._io import ROW_GROUP_SIZE

CONVERTERS = ("criteo", "avazu", "movielens")


def at_least(minimum, kind=int, *, strictly=False):
    """An argparse type: a finite ``kind`` number >= ``minimum`` (> with ``strictly``)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or not (value > minimum if strictly else value >= minimum):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>' if strictly else '>='} {minimum:g}, got {text}")
        return value
    return parse


def add_commands(subparsers):
    """Add the ``convert`` and ``synthetic`` subcommands to ``subparsers``."""
    from ..cli._help import HelpFormatter

    convert = subparsers.add_parser("convert", help="convert a CTR dataset's text to Parquet",
                                    formatter_class=HelpFormatter)
    convert.add_argument("dataset", choices=CONVERTERS)
    convert.add_argument("src", help="input text file (.gz / .bz2 are read as such)")
    convert.add_argument("dst", help="output Parquet file")
    convert.add_argument("--num-buckets", type=at_least(1), default=None,
                         help="reduce hashed ids modulo N (default: full 63-bit ids)")
    convert.add_argument("--row-group-size", type=at_least(1), default=ROW_GROUP_SIZE,
                         help="rows per Parquet row group")
    convert.set_defaults(run=run_convert)

    synthetic = subparsers.add_parser("synthetic", help="write Zipf-distributed synthetic data",
                                      formatter_class=HelpFormatter)
    synthetic.add_argument("dst", help="output Parquet file")
    synthetic.add_argument("--rows", type=at_least(0), required=True, help="rows to write")
    synthetic.add_argument("--table", dest="tables", type=parse_table, action="append",
                           required=True, metavar="NAME:ROWS:HOTNESS[:var]",
                           help="an id column (repeat for more); ':var' for variable bags")
    synthetic.add_argument("--alpha", type=at_least(0.0, float), default=1.05, help="Zipf exponent")
    synthetic.add_argument("--seed", type=int, default=0, help="of the ids and values")
    synthetic.add_argument("--dense", type=at_least(0), default=0, help="dense float columns")
    synthetic.add_argument("--row-group-size", type=at_least(1), default=ROW_GROUP_SIZE,
                           help="rows per Parquet row group")
    synthetic.set_defaults(run=run_synthetic)


def parse_table(text):
    """``NAME:ROWS:HOTNESS[:var]`` -> :class:`~hbkernels.data.synthetic.SyntheticTable`."""
    from .synthetic import SyntheticTable

    parts = text.split(":")
    try:
        if (len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] != "var")
                or min(int(parts[1]), int(parts[2])) < 1):
            raise ValueError
        return SyntheticTable(parts[0], int(parts[1]), int(parts[2]), len(parts) == 4)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected NAME:ROWS:HOTNESS[:var] with ROWS, HOTNESS >= 1, got {text!r}") from None


def run_convert(args):
    from . import convert

    converter = getattr(convert, f"convert_{args.dataset}")
    print(converter(args.src, args.dst, num_buckets=args.num_buckets,
                    row_group_size=args.row_group_size))
    return 0


def run_synthetic(args):
    from .synthetic import write_synthetic

    print(write_synthetic(args.dst, args.rows, args.tables, alpha=args.alpha, seed=args.seed,
                          row_group_size=args.row_group_size, dense=args.dense))
    return 0


def main(argv=None):
    """Run the command line; prints the summary, returns the exit status."""
    from ..cli._errors import ArgumentParser

    parser = ArgumentParser(
        prog="python -m hbkernels.data",
        description="Convert CTR datasets to Parquet, or write synthetic data.")
    add_commands(parser.add_subparsers(required=True, metavar="command"))
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (DataError, MissingDependencyError, OSError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
