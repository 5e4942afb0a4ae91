"""Under Numba's CUDA simulator a block's threads share each ``cuda.shared.array`` even when
they all make it at once (hbkernels.cuda._launcher.thread_safe_shared)."""
import threading
import time

import numpy as np
import pytest

pytest.importorskip("numba.cuda")


def test_threads_asking_at_once_get_one_array(monkeypatch):
    from numba.cuda.simulator import kernelapi

    from hbkernels.cuda import _launcher

    _launcher.thread_safe_shared()
    shared = kernelapi.FakeCUDAShared(0)
    made = np.empty

    def slowly_made(*args, **kwargs):  # every thread inside the making at once
        time.sleep(0.05)
        return made(*args, **kwargs)

    monkeypatch.setattr(np, "empty", slowly_made)
    got = []
    threads = [threading.Thread(target=lambda: got.append(shared.array(4, np.int32))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(a is got[0] for a in got)
    assert shared.array(4, np.int32) is not got[0]  # another line, another array
    other = kernelapi.FakeCUDAShared(0)  # another block
    assert other.array(4, np.int32) is not got[0]
