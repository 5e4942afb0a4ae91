"""``hbkernels bench``: placeholder until built."""


def add_command(subparsers):
    p = subparsers.add_parser("bench", help="(not built yet)")
    p.set_defaults(run=lambda args: 1)
