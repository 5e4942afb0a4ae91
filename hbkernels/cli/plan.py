"""``hbkernels plan --calibrate``: measure the constants of a model of the sparse step on
this machine and these ranks, and write them as a profile.

    hbkernels plan --calibrate --out profile.json
    mpiexec -n 2 hbkernels plan --calibrate --out profile.json   # the collectives too

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

    p = subparsers.add_parser(
        "plan", help="measure the constants of the planner's model (--calibrate)",
        description=plain(__doc__.split("\n\n")[0]), formatter_class=HelpFormatter)
    p.add_argument("--calibrate", action="store_true", required=True,
                   help="measure this machine and these ranks")
    p.add_argument("--out", default="hbkernels-profile.json", metavar="FILE",
                   help="where rank 0 writes the profile")
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
    p.set_defaults(run=run)


def run(args):
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
    profile = calibrate(comm, args.widths, layouts, rows=args.rows, bags=args.bags, hotness=args.hotness,
                        optimizer=args.optimizer, reps=args.reps)
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
