"""The interface every placement kind implements (as TorchRec's ``EmbeddingSharding``)."""


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
