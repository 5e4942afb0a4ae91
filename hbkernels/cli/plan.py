"""``hbkernels plan --calibrate``: measure the constants of a model of the sparse step on
this machine and these ranks, and write them as a profile; ``hbkernels plan --simulate``:
predict each placement of some tables on a cluster with a profile.

    hbkernels plan --calibrate --out profile.json
    mpiexec -n 2 hbkernels plan --calibrate --out profile.json   # the collectives too
    hbkernels plan --simulate --shape mlperf-dcnv2 --profile h100-node --world-size 64 --ranks-per-node 8

Times ``embedding_bag`` and the optimizer's ``fused_step`` per id and per bag for each table width and
id layout, and the fixed cost of a call; at more than one rank, the latency and the
bandwidth of an ``alltoallv``. Rank 0 prints each constant with its
spread and writes the profile (JSON, :class:`hbkernels.sharding.profile.MachineProfile`).
CPU tables only.
"""
from ._errors import CLIError, writable_file


def add_command(subparsers):
    from ._help import HelpFormatter, plain
    from .train import int_list
    from ..bench.calibrate import OPTIMIZERS
    from ..data.__main__ import at_least
    from ..bench.common import LAYOUTS
    from ..sharding.plan import EXCHANGES

    p = subparsers.add_parser(
        "plan", help="measure the constants of the planner's model (--calibrate), or predict "
                     "a cluster's placements with them (--simulate)",
        description=plain(__doc__.split("\n\n")[0]), formatter_class=HelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--calibrate", action="store_true", help="measure this machine and these ranks")
    mode.add_argument("--simulate", action="store_true",
                      help="print each placement of --table tables on --world-size ranks: its "
                           "predicted step, memory per rank and bytes within and across nodes")
    p.add_argument("--out", default="hbkernels-profile.json", metavar="FILE",
                   help="--calibrate: where rank 0 writes the profile")
    sim = p.add_argument_group("--simulate")
    sim.add_argument("--world-size", type=at_least(1), default=8, help="ranks")
    sim.add_argument("--ranks-per-node", type=at_least(1), default=None, help="ranks of a node (default: all)")
    sim.add_argument("--profile", default=None, metavar="FILE",
                     help="a profile of --calibrate, or one shipped with hbkernels: h100-node "
                          "(default: the built-in rates)")
    sim.add_argument("--shape", choices=("mlperf-dcnv2",), default=None,
                     help="a named set of tables and its global batch (instead of --tables)")
    sim.add_argument("--table", dest="tables", action="append", type=spec_of,
                     metavar="NAME:ROWS:DIM[:HOTNESS]", help="a table more (repeat)")
    sim.add_argument("--id-layout", choices=LAYOUTS, default="scattered", help="how the ids are numbered")
    sim.add_argument("--exchange", choices=EXCHANGES, default="auto",
                     help="the sharded tables' exchange (auto: hierarchical where nodes hold several ranks)")
    sim.add_argument("--memory-per-rank", type=at_least(0.0, float, strictly=True), default=None,
                     metavar="BYTES", help="what a rank may hold")
    p.add_argument("--widths", type=int_list, default="16,64,128", metavar="D,...",
                   help="table widths; a collection's own costs are measured at the first")
    p.add_argument("--layouts", default=",".join(LAYOUTS), metavar="L,...",
                   help=f"id layouts, of {', '.join(LAYOUTS)}")
    p.add_argument("--rows", type=at_least(1), default=1_000_000, help="rows of each table measured")
    p.add_argument("--bags", type=at_least(4), default=4096, help="bags of a batch")
    p.add_argument("--hotness", type=at_least(2), default=8, help="ids of a bag")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="Adagrad",
                   help="the optimizer whose fused_step is timed")
    p.add_argument("--reps", type=at_least(1), default=15, help="repeats of each measurement")
    p.add_argument("--tables", dest="tables", nargs="+", action="extend", type=spec_of, default=None,
                   metavar="NAME:ROWS:DIM[:HOTNESS]",
                   help="--calibrate: the tables a collection's own costs are measured on (default: "
                        "8 of ROWS/8 rows); --simulate: the tables (default: hbkernels train's)")
    p.add_argument("--batch-size", type=at_least(1), default=None,
                   help="global batch (default: --simulate 1024; --calibrate BAGS/4 per rank)")
    p.set_defaults(run=run)


def spec_of(text):
    """``NAME:ROWS:DIM[:HOTNESS]`` -> :class:`hbkernels.TableSpec`."""
    import argparse

    from ..types import TableSpec

    parts = text.split(":")
    try:
        if len(parts) not in (3, 4) or not parts[0]:
            raise ValueError
        rows, dim = int(parts[1]), int(parts[2])
        hotness = float(parts[3]) if len(parts) == 4 else 1.0
        if min(rows, dim) < 1 or not hotness > 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected NAME:ROWS:DIM[:HOTNESS] with ROWS, DIM >= 1 and HOTNESS > 0, got {text!r}") from None
    return TableSpec(parts[0], num_rows=rows, dim=dim, hotness=hotness)


def run(args):
    if args.simulate:
        return run_simulate(args)
    import hbkernels as hbk
    from ..bench.calibrate import calibrate
    from ..bench.common import LAYOUTS

    if not args.widths or min(args.widths) < 1:
        raise CLIError(f"--widths takes widths >= 1, got {','.join(map(str, args.widths))!r}")
    layouts = args.layouts.split(",")
    unknown = [lay for lay in layouts if lay not in LAYOUTS]
    if unknown:
        raise CLIError(f"--layouts takes some of {', '.join(LAYOUTS)}, got {args.layouts!r}")
    comm = hbk.dist.init()
    if comm.rank == 0:
        writable_file(args.out)
    batch = None if args.batch_size is None else max(1, args.batch_size // comm.world_size)
    profile = calibrate(comm, args.widths, layouts, rows=args.rows, bags=args.bags, hotness=args.hotness,
                        optimizer=args.optimizer, reps=args.reps, tables=args.tables, batch=batch)
    if comm.rank == 0:
        print(report(profile), flush=True)
        profile.save(args.out)
        print(f"profile -> {args.out}", flush=True)
    return 0


def report(profile):
    """The profile's constants as lines: median [20th, 80th percentile] of the repeats."""
    m = profile.machine
    lines = [f"{m['cpu']}, {m['cores']} cores, {m['world_size']} rank(s) ({m['backend']}) of "
             f"{m['threads']} thread(s), "
             f"{m['rows']:,}-row tables, {m['bags']} bags of {m['hotness']} ids, "
             f"{m['optimizer']}, {m['reps']} repeats",
             f"{'width':>5}  {'layout':<10} {'lookup ns/id':>22} {'ns/bag':>22} "
             f"{'update ns/id':>22} {'ns/bag':>22}"]

    def spread(s, digits=2):
        return f"{s.median:.{digits}f} [{s.low:.{digits}f}, {s.high:.{digits}f}]"

    for key in sorted(profile.lookup_ns_per_id):
        lines.append(f"{key[0]:>5}  {key[1]:<10} " + " ".join(
            f"{spread(getattr(profile, field)[key]):>22}" for field in
            ("lookup_ns_per_id", "lookup_ns_per_bag", "update_ns_per_id", "update_ns_per_bag")))
    lines.append("unique, ns/id: " + ", ".join(f"{lay} {spread(s)}"
                                               for lay, s in sorted(profile.unique_ns_per_id.items())))
    lines.append("per call, µs: " + ", ".join(f"{k} {spread(s, 1)}" for k, s in sorted(profile.call_us.items())))
    lines.append("a collection's step of one id, µs: " + ", ".join(
        f"{kind} {spread(profile.step_us[kind], 1)} + {spread(profile.table_us[kind], 1)} a table more"
        for kind in sorted(profile.step_us)))
    lines.append("a collection's own cost beyond its kernels, ns: " + ", ".join(
        f"{kind} {spread(profile.host_ns_per_id[kind])}/id {spread(profile.host_ns_per_bag[kind])}/bag"
        for kind in sorted(profile.host_ns_per_id)))
    if profile.measured_collectives:
        gb = profile.network_bytes_per_s
        lines.append(f"collectives: alltoallv latency {spread(profile.collective_latency_us, 1)} µs, "
                     f"alltoallv {gb.median / 1e9:.2f} [{gb.low / 1e9:.2f}, {gb.high / 1e9:.2f}] GB/s sent")
    else:
        lines.append(f"collectives: not measured at one rank; assumed latency "
                     f"{profile.collective_latency_us.median:g} µs, "
                     f"{profile.network_bytes_per_s.median / 1e9:g} GB/s")
    return "\n".join(lines)


def run_simulate(args):
    from .. import optim
    from ..sharding.profile import as_profile
    from ..sharding.simulate import SHAPES, simulate, table
    from ..types import TableSpec
    from ..data.__main__ import parse_table
    from .train import DEFAULT_TABLES

    try:
        profile = as_profile(args.profile, "--profile")
    except ValueError as error:
        raise CLIError(str(error)) from None
    batch_size = args.batch_size
    if args.shape is not None:
        if args.tables:
            raise CLIError("give --shape or --tables, not both")
        make, shape_batch = SHAPES[args.shape]
        tables, batch_size = make(), batch_size or shape_batch
    else:
        tables = args.tables or [TableSpec(t.name, num_rows=t.num_rows, dim=16, hotness=t.hotness)
                                 for t in map(parse_table, DEFAULT_TABLES)]
    n, batch_size = args.world_size, batch_size or 1024
    per_rank = max(1, batch_size // n)
    slots = optim.Adagrad(lr=0.05).slots
    per_row = sum(1 for _, row in slots if row)
    try:
        runs = simulate(tables, n, ranks_per_node=args.ranks_per_node, profile=profile,
                        batch_size_hint=per_rank, id_layout=args.id_layout,
                        state_floats_per_element=len(slots) - per_row, state_floats_per_row=per_row,
                        memory_per_rank=args.memory_per_rank, exchange=args.exchange)
    except ValueError as error:
        raise CLIError(str(error)) from None
    g = args.ranks_per_node or n
    nodes = -(-n // g)
    made = next((s for s in runs if not s.refused), None)
    label = made.step.label() if made else "no plan could be made"
    if profile is not None and profile.machine.get("world_size") not in (None, n):
        label += f"; predicting {n} ranks"
    exchange = made.plan.assumptions["exchange"] if made else args.exchange
    print(f"{n} ranks ({nodes} node(s) of {g}), {len(tables)} tables, global batch {batch_size} "
          f"({per_rank} per rank), ids {args.id_layout}, {exchange} exchange, Adagrad; {label}")
    print("\n".join(table(runs)), flush=True)
    return 0
