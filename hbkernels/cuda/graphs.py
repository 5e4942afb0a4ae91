"""What a step captured into a CUDA graph needs from the device's pending checks: the
checked calls of the capture keep their error slots, and are noted again after each
replay (:func:`hbkernels.cuda._pending.capture`)."""
from ._pending import Captured, capture as capture_checks

__all__ = ["Captured", "capture_checks"]
