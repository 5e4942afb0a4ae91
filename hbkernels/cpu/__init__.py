"""Numba CPU kernels, one module per op; each exposes the same function as its twin in
:mod:`hbkernels.cuda`."""
