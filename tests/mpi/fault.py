"""A peer dies: the survivors raise CommError within HBK_COMM_TIMEOUT (5 s).

``fault.py before``: the last rank exits (``os._exit``) instead of calling
alltoallv; the survivors time out in the metadata exchange.
``fault.py during``: the last rank dies inside alltoallv, after the metadata
exchange; the survivors time out in the data transfer.

Run under ``mpiexec -disable-auto-cleanup`` so that the launcher does not kill
the survivors when the victim exits. The survivors print ``OK rank r`` and
leave with ``os._exit(0)``: MPI_Finalize could wait forever for the dead rank.
"""
import os
import sys
import time

import numpy as np

import hbkernels as hbk
from harness import Timer, finish

mode = sys.argv[1] if len(sys.argv) > 1 else "before"
assert mode in ("before", "during"), mode
comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
TIMEOUT = float(os.environ["HBK_COMM_TIMEOUT"])
assert comm.timeout == TIMEOUT == 5.0, comm.timeout

# a late peer (well within the timeout) is waited for, not an error
if R == 1:
    time.sleep(1.0)
with Timer() as t:
    total = comm.allreduce(np.array([1.0]))
assert total[0] == W
if R != 1:
    assert t.s > 0.8, f"allreduce returned after {t.s:.2f} s, before the late rank arrived"
recv, _ = comm.alltoallv(np.zeros((W, 3)), [1] * W)

victim = W - 1
if R == victim:
    if mode == "before":
        print(f"DYING rank {R}", flush=True)
        os._exit(3)

    def die(*args, **kwargs):  # after the metadata exchange, before any data moves
        print(f"DYING rank {R}", flush=True)
        os._exit(3)

    comm._alltoallv = die

with Timer() as t:
    try:
        comm.alltoallv(np.ones((2 * W, 4), np.float32), [2] * W)
    except hbk.dist.CommError as e:
        err = str(e)
    else:
        raise AssertionError(f"rank {R}: alltoallv completed although rank {victim} is dead")
print(f"rank {R}: CommError after {t.s:.2f} s: {err}", flush=True)
assert TIMEOUT - 0.5 <= t.s <= TIMEOUT + 2.0, f"CommError after {t.s:.2f} s, timeout {TIMEOUT}"
assert f"not complete after {TIMEOUT:g} s" in err, err
where = "alltoallv (metadata exchange)" if mode == "before" else "alltoallv:"
assert err.startswith(where), err

# the communicator is now unusable: later calls fail at once
with Timer() as t:
    try:
        comm.allreduce(np.array([1.0]))
    except hbk.dist.CommError as e:
        assert "unusable" in str(e), e
    else:
        raise AssertionError("a broken communicator accepted a call")
assert t.s < 0.5, t.s

finish(comm, hard=True)  # a rank is dead: MPI_Finalize would wait for it
