"""hbk.dist on two (or more) ranks: each rank asks the owners of the ids it needs
for their rows, as a row-wise sharded embedding lookup does, and checks the answer.

    mpiexec -n 2 python -m mpi4py examples/collectives_two_ranks.py

Rank r owns the rows ``id % world_size == r`` of a 100 x 4 table whose row ``i``
is ``[i, i, i, i]`` (so every rank can check what it receives). Each rank:

1. groups its ids by owner (``hbk.partition``) and sends them there (``alltoallv``);
2. looks the received ids up in its shard and sends the rows back (``alltoallv``
   with the counts it received, in reverse);
3. restores its own order (``Partitioned.order``) and checks every row.

It prints ``OK rank r`` on success. Outside ``mpiexec`` it runs as one rank.
"""
import numpy as np

import hbkernels as hbk

comm = hbk.dist.init()  # "mpi" under mpiexec (without GPUs), "local" outside it
n, me = comm.world_size, comm.rank
NUM_ROWS, DIM = 100, 4

# my shard: global rows me, me + n, me + 2n, ... stored as local rows 0, 1, 2, ...
global_rows = np.arange(me, NUM_ROWS, n)
shard = np.repeat(global_rows.astype(np.float32)[:, None], DIM, axis=1)

# the ids this rank needs (different on every rank, some wanted twice)
wanted = np.random.default_rng(me).integers(0, NUM_ROWS, size=10 + 3 * me)

# 1. ids to their owners
parts = hbk.partition(wanted, n)  # owner = id % n, ids grouped by owner, stable
ids_in, counts_in = comm.alltoallv(parts.ids, parts.counts)

# 2. the owners answer with their rows, in the order the ids came
rows_out = hbk.lookup(shard, ids_in // n)  # global id -> local row
rows_back, counts_back = comm.alltoallv(rows_out, counts_in)
assert counts_back.tolist() == parts.counts.tolist()

# 3. back to the order of `wanted`
rows = np.empty_like(rows_back)
rows[parts.order] = rows_back
assert np.array_equal(rows[:, 0], wanted.astype(np.float32)), (me, rows[:, 0], wanted)
assert np.array_equal(rows, np.repeat(wanted.astype(np.float32)[:, None], DIM, axis=1))

# the same rows over a 2-byte wire: ids < 256 are exact in float16
half, _ = comm.alltoallv(rows_out, counts_in, wire_dtype="float16")
assert half.dtype == np.float32 and np.array_equal(half, rows_back)

total = comm.allreduce(np.array([len(wanted)]), op="sum")
assert int(total[0]) == sum(10 + 3 * r for r in range(n))
comm.barrier()
print(f"OK rank {me} of {n} ({comm.backend}): {len(wanted)} rows fetched, "
      f"{int(total[0])} in all", flush=True)
