"""``init("torch")`` under mpiexec without torch.distributed's own variables
(``RANK``, ``WORLD_SIZE``, ...), or with ``WORLD_SIZE=1``: a RuntimeError on
every rank naming the launcher's world, never N one-rank torch jobs (the check
reads the environment: no torch import). ``init()`` still connects the ranks
over MPI. Prints ``OK rank r`` at the end."""
import os
import sys

import numpy as np

import hbkernels as hbk
from harness import finish

comm = hbk.dist.init()
W = comm.world_size
assert comm.backend == "mpi" and W > 1, comm

for extra in ({}, {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "29500"}):
    os.environ.update(extra)
    try:
        c = hbk.dist.init("torch")
    except RuntimeError as e:
        text = str(e)
        assert f"backend 'torch': the launcher started {W} ranks (" in text, text
        assert "torch.distributed's environment says this process is alone" in text, text
        assert "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT on every rank" in text, text
    else:
        raise AssertionError(f"init('torch') under mpiexec -n {W} gave {c} with {extra}")
    for k in extra:
        del os.environ[k]
assert "torch" not in sys.modules, "init('torch') imported torch before refusing"
assert hbk.dist.launcher() == "mpi"
assert comm.allreduce(np.ones(1))[0] == W
finish(comm)
