"""Reference models built on the kernels (PyTorch dense parts): :class:`DLRM`."""
from .dlrm import DLRM

__all__ = ["DLRM"]
