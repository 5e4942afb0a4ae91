"""The interface every placement kind implements (as TorchRec's ``EmbeddingSharding``)."""
import numpy as np


class EmbeddingSharding:
    """How one placement kind lays a table out over the ranks and moves its ids and rows.

    * layout: :meth:`holders` says which ranks hold which rows of a column slice;
    * input distribution: :meth:`route_ids` sends each distinct id of a sharded
      kind to its owner, as a row of the owner's fused array (the rows then come
      back through the collection's one coalesced exchange per fused array: the
      lookup and output distribution are shared by every sharded kind);
      a ``replicated`` kind looks its ids up locally and all-gathers gradients;
    * whole tables: :meth:`gather` assembles a table (or its optimizer state)
      from every rank's shards, on every rank.
    """

    kind = None
    replicated = False

    def holders(self, spec, place, slice_index, world_size):
        """``[(rank, row_start, row_step, num_rows)]``: the ranks holding column slice
        ``slice_index`` of table ``spec`` placed as ``place``, and their rows."""
        raise NotImplementedError

    def route_ids(self, xp, ids, route, world_size):
        """``(dest, key)`` for distinct table ids ``ids`` of ``route``'s slice: the rank
        holding each, and its row in that rank's fused array (int64 ``xp`` arrays)."""
        raise NotImplementedError

    def gather(self, comm, spec, shards, pick, per_column, dtype, xp):
        """Table ``spec``'s array made of ``pick(shard)`` (this rank's rows of a shard
        it holds: ``[rows, cols]`` when ``per_column``, else ``[rows]``), whole and the
        same on every rank of ``comm``. Collective."""
        raise NotImplementedError


def gather_interleaved(comm, spec, shards, pick, per_column, dtype, xp):
    """:meth:`EmbeddingSharding.gather` of a placement whose slices are cut by rows among
    their holders (a shard holds rows ``row_start + row_step·k``): each slice all-gathered
    from its holders and its rows put in place; slices side by side."""
    pieces = []
    for s in sorted({shard.slice for shard in shards}):
        held = [shard for shard in shards if shard.slice == s]
        mine = [shard for shard in held if shard.rank == comm.rank]
        shape = (0, held[0].c1 - held[0].c0) if per_column else (0,)
        local = pick(mine[0]) if mine else xp.zeros(shape, dtype)
        blocks, counts = (local.copy(), [local.shape[0]]) if comm.world_size == 1 else comm.allgatherv(local)
        counts = np.asarray(counts).tolist()
        starts = np.cumsum([0] + counts).tolist()
        out = xp.empty((spec.num_rows,) + tuple(local.shape[1:]), dtype)
        for shard in held:
            out[shard.row_start::shard.row_step] = blocks[starts[shard.rank]:starts[shard.rank]
                                                          + counts[shard.rank]]
        pieces.append(out)
    return pieces[0] if len(pieces) == 1 else xp.concatenate(pieces, axis=1)
