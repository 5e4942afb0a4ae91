"""Under ``torchrun --nproc-per-node 3`` (tests/test_dist_torch.py): ``init()``
picks the torch backend from torchrun's environment; ``init(group=...)`` joins
``torch.distributed.group.WORLD`` and a ``new_group`` of some ranks (in a
different order than the world's) without initialising anything again, and
every collective over them matches a NumPy reference; a group this rank is not
a member of is refused. Prints ``OK rank r`` at the end."""
import os

import numpy as np
import torch.distributed as tdist

import hbkernels as hbk
from harness import data, finish

comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
assert (comm.backend, R, W) == ("torch", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])), comm
assert hbk.dist.launcher() == "torch"
assert W == 3, "run with --nproc-per-node 3"
assert tdist.is_initialized() and tdist.get_backend() == "gloo"
assert f"rank {R} of {W}" in repr(comm)

# a second init joins the same default group: no second init_process_group
again = hbk.dist.init("torch")
assert (again.backend, again.rank, again.world_size) == ("torch", R, W)
assert again.allreduce(np.array([R], np.int64)).tolist() == [sum(range(W))]

world = hbk.dist.init(group=tdist.group.WORLD)
assert (world.backend, world.rank, world.world_size) == ("torch", R, W)


def check(c, members, case):
    """Every collective of ``c`` (group ranks -> global ranks ``members``) against NumPy."""
    n, me = len(members), c.rank
    assert members[me] == R, (members, me, R)
    for dtype in ("float32", "int64", "float16", "uint16"):
        xs = [data(("g", case, dtype, g), (3, 2), dtype) for g in members]
        out = c.allgather(xs[me])
        np.testing.assert_array_equal(out, np.stack(xs))
        red = c.allreduce(xs[me], op="max")
        np.testing.assert_array_equal(red, np.max(np.stack(xs), axis=0))
        for root in range(n):
            b = c.broadcast(xs[me], root=root)
            np.testing.assert_array_equal(b, xs[root])
        vs = [data(("v", case, dtype, g), (k, 2), dtype) for k, g in enumerate(members)]
        allv, counts = c.allgatherv(vs[me])
        assert counts.tolist() == list(range(n))
        np.testing.assert_array_equal(allv, np.concatenate(vs))
        cnt = [[(s + 2 * d) % 3 for d in range(n)] for s in range(n)]  # zero counts included
        sends = [data(("a", case, dtype, g), (sum(cnt[s]), 2), dtype) for s, g in enumerate(members)]
        recv, rc = c.alltoallv(sends[me], cnt[me])
        assert rc.tolist() == [cnt[s][me] for s in range(n)]
        blocks = [sends[s][sum(cnt[s][:me]):sum(cnt[s][:me + 1])] for s in range(n)]
        np.testing.assert_array_equal(recv, np.concatenate(blocks))
    c.barrier()


check(world, list(range(W)), "world")
# ranks 2 and 0, in that order as given: group ranks follow the global order (0 -> 0, 2 -> 1)
sub_pg = tdist.new_group([2, 0])
if R in (0, 2):
    sub = hbk.dist.init("auto", group=sub_pg)
    assert (sub.backend, sub.world_size) == ("torch", 2)
    check(sub, [0, 2], "sub")
else:
    try:
        hbk.dist.init(group=sub_pg)
    except ValueError as e:
        assert "not a member" in str(e), e
    else:
        raise AssertionError("init(group=...) accepted a group this rank is not in")
# the world is still in step after the subgroup's calls
assert comm.allreduce(np.array([1.0])).tolist() == [float(W)]
for bad in ("mpi", "nccl", "local"):
    try:
        hbk.dist.init(bad, group=tdist.group.WORLD)
    except ValueError as e:
        assert "group" in str(e), e
    else:
        raise AssertionError(f"init({bad!r}, group=<torch group>) was accepted")
comm.barrier()  # every rank done with the groups before one tears them down
tdist.destroy_process_group()  # gloo's threads joined here, not left to the interpreter's exit
finish(comm)
