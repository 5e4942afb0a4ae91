"""The one-process backend: world size 1, no MPI. Calls still check their input,
apply the wire dtype (so a 1-rank run sees the same rounding as an N-rank run)
and return new arrays in the caller's family."""
import numpy as np

from . import _common
from ._communicator import Communicator


class LocalCommunicator(Communicator):
    backend = "local"
    rank = 0
    world_size = 1

    def _agree(self, op, call, error, deadline):
        return _common.meta_vector(op, call, self._next_seq(), 1, bad=error is not None)[None, :]

    def _moved(self, call):
        """The input as the receiver sees it: through the wire and back, a new array."""
        if call.wire is None:
            return call.x.copy()
        return call.decoded(call.encoded())

    def _alltoallv(self, call, metas, deadline):
        return self._moved(call), call.counts.copy()

    def _allreduce(self, call, metas, deadline):
        return self._moved(call)

    def _allgather(self, call, metas, deadline):
        return self._moved(call).reshape((1,) + call.shape)

    def _allgatherv(self, call, metas, deadline):
        return self._moved(call), np.array([call.shape[0]], np.int64)

    def _broadcast(self, call, metas, deadline):
        return self._moved(call)
