"""Codes shared by the optimizer front end (:mod:`hbkernels.optim`) and the
``sparse_update`` kernels of both backends."""
SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM, FTRL = range(5)

# slots of the float64 hyper-parameter vector handed to the kernels
LR, EPS, BETA1, BETA2, L1, L2, LR_POWER, STEP_SIZE = range(8)
NUM_HYPER = 8
