"""Under ``torchrun`` with HBK_COMM_TIMEOUT=5 (tests/test_dist_torch.py): the
last rank leaves (``os._exit(0)``, so that torchrun does not end the others)
before alltoallv (``exit``) or stays alive without calling it (``hang``); the
survivors raise CommError within the timeout, and the communicator is unusable
afterwards. Prints ``OK rank r`` on the survivors."""
import os
import sys
import time

import numpy as np

import hbkernels as hbk
from harness import Timer, finish

mode = sys.argv[1] if len(sys.argv) > 1 else "exit"
assert mode in ("exit", "hang"), mode
comm = hbk.dist.init()
R, W = comm.rank, comm.world_size
TIMEOUT = float(os.environ["HBK_COMM_TIMEOUT"])
assert comm.backend == "torch" and comm.timeout == TIMEOUT == 5.0, comm

# a late peer (well within the timeout) is waited for, not an error
if R == 1:
    time.sleep(1.0)
with Timer() as t:
    total = comm.allreduce(np.array([1.0]))
assert total[0] == W
if R != 1:
    assert t.s > 0.8, f"allreduce returned after {t.s:.2f} s, before the late rank arrived"

victim = W - 1
if R == victim:
    print(f"DYING rank {R}", flush=True)
    if mode == "hang":
        time.sleep(TIMEOUT + 4)
    os._exit(0)

with Timer() as t:
    try:
        comm.alltoallv(np.ones((2 * W, 4), np.float32), [2] * W)
    except hbk.dist.CommError as e:
        err = str(e)
    else:
        raise AssertionError(f"rank {R}: alltoallv completed although rank {victim} is gone")
print(f"rank {R}: CommError after {t.s:.2f} s: {err}", flush=True)
assert t.s <= TIMEOUT + 2.0, f"CommError after {t.s:.2f} s, timeout {TIMEOUT}"
assert err.startswith("alltoallv"), err
if mode == "hang":
    assert t.s >= TIMEOUT - 0.5 and f"not complete after {TIMEOUT:g} s" in err, (t.s, err)
try:
    comm.allreduce(np.array([1.0]))
except hbk.dist.CommError as e:
    assert "unusable" in str(e), e
else:
    raise AssertionError("a broken communicator was used again")
finish(comm, hard=True)
