"""The planner's former home: :mod:`hbkernels.sharding.plan` (this import path keeps working)."""
from .sharding.plan import (  # noqa: F401 - re-exported
    DEFAULT_BATCH_SIZE, DEFAULT_COST, Placement, Plan, TableEstimate, estimate, make_plan,
)
