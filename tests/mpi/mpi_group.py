"""Under ``mpiexec -n 3`` (tests/test_dist_torch.py): ``init(group=...)`` with an
mpi4py communicator uses it instead of ``COMM_WORLD``: a ``Split`` into ranks
{0, 1} (in reversed order) and {2}, and a ``Dup`` of ``COMM_WORLD``; every
collective over them matches a NumPy reference and the world stays in step.
``COMM_NULL``, an intercommunicator and a backend that takes no mpi4py group
are refused. Prints ``OK rank r`` at the end."""
import numpy as np
from mpi4py import MPI

import hbkernels as hbk
from harness import data, finish

world = hbk.dist.init()
R, W = world.rank, world.world_size
assert W == 3 and world.backend == "mpi", world
assert hbk.dist.launcher() == "mpi"


def check(c, members, case):
    """Every collective of ``c`` (group rank -> world rank ``members``) against NumPy."""
    n, me = len(members), c.rank
    assert c.world_size == n and members[me] == R, (members, me, R)
    for dtype in ("float32", "int64"):
        xs = [data(("g", case, dtype, g), (3, 2), dtype) for g in members]
        np.testing.assert_array_equal(c.allgather(xs[me]), np.stack(xs))
        np.testing.assert_array_equal(c.allreduce(xs[me]), np.sum(np.stack(xs), axis=0))
        for root in range(n):
            np.testing.assert_array_equal(c.broadcast(xs[me], root=root), xs[root])
        vs = [data(("v", case, dtype, g), (k, 2), dtype) for k, g in enumerate(members)]
        allv, counts = c.allgatherv(vs[me])
        assert counts.tolist() == list(range(n))
        np.testing.assert_array_equal(allv, np.concatenate(vs))
        cnt = [[(s + 2 * d) % 3 for d in range(n)] for s in range(n)]
        sends = [data(("a", case, dtype, g), (sum(cnt[s]), 2), dtype) for s, g in enumerate(members)]
        recv, rc = c.alltoallv(sends[me], cnt[me])
        assert rc.tolist() == [cnt[s][me] for s in range(n)]
        np.testing.assert_array_equal(
            recv, np.concatenate([sends[s][sum(cnt[s][:me]):sum(cnt[s][:me + 1])] for s in range(n)]))
    c.barrier()


# {0, 1} with keys reversing their order (group rank 0 is world rank 1), and {2} alone
split = MPI.COMM_WORLD.Split(color=0 if R < 2 else 1, key=-R)
sub = hbk.dist.init(group=split)
assert sub.backend == "mpi", sub
check(sub, [1, 0] if R < 2 else [2], "split")
explicit = hbk.dist.init("mpi", group=split)
check(explicit, [1, 0] if R < 2 else [2], "explicit")

dup = MPI.COMM_WORLD.Dup()
check(hbk.dist.init(group=dup), [0, 1, 2], "dup")
check(hbk.dist.init("mpi", group=MPI.COMM_WORLD), [0, 1, 2], "world")

# a rank outside a Split (MPI.UNDEFINED) holds COMM_NULL: refused there
part = MPI.COMM_WORLD.Split(color=MPI.UNDEFINED if R == 2 else 0, key=R)
if R == 2:
    assert part == MPI.COMM_NULL
    try:
        hbk.dist.init(group=part)
    except ValueError as e:
        assert "COMM_NULL" in str(e), e
    else:
        raise AssertionError("init(group=COMM_NULL) was accepted")
else:
    check(hbk.dist.init(group=part), [0, 1], "part")

# an intercommunicator between {0, 1} and {2}: refused on every rank
inter = split.Create_intercomm(0, MPI.COMM_WORLD, 2 if R < 2 else 1, tag=7)
try:
    hbk.dist.init(group=inter)
except ValueError as e:
    assert "intercommunicator" in str(e), e
else:
    raise AssertionError("init(group=<intercommunicator>) was accepted")
inter.Free()

for backend, exc in (("torch", ValueError), ("local", ValueError)):
    try:
        hbk.dist.init(backend, group=dup)
    except exc as e:
        assert "group" in str(e), e
    else:
        raise AssertionError(f"init({backend!r}, group=<mpi4py comm>) was accepted")
for bad in (object(), "world", 3):
    try:
        hbk.dist.init(group=bad)
    except TypeError as e:
        assert "mpi4py communicator" in str(e) and "ProcessGroup" in str(e), e
    else:
        raise AssertionError(f"init(group={bad!r}) was accepted")
assert world.allreduce(np.array([1])).tolist() == [W]  # the world is still in step
finish(world)
