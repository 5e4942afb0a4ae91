"""The version of hbkernels (one home: the package and its checkpoints read it)."""
__version__ = "0.1.0"
