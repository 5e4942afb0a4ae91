"""Numba CUDA kernels and their launchers, one module per op; each exposes the same
function as its twin in :mod:`hbkernels.cpu`. Imported on first GPU use only."""
