"""Thin framework front ends over the kernels: ``hbkernels.adapters.torch``,
``.jax`` and ``.tf``. Each hands the framework's arrays to the kernels through
DLPack / the CUDA array interface without copies where the framework allows,
and registers the gradient with the framework's autograd. Importing this
package imports no framework; import the submodule you need."""
