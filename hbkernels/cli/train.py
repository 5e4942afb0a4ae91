"""``hbkernels train``: placeholder until built."""


def add_command(subparsers):
    p = subparsers.add_parser("train", help="(not built yet)")
    p.set_defaults(run=lambda args: 1)
