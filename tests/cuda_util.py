"""Helpers of the CUDA twin tests: skip without a CUDA target, device round trips."""
import numpy as np
import pytest


def cuda_or_skip():
    from pykv.kernels.backend import cuda_error
    err = cuda_error()
    if err:
        pytest.skip(err)
    from numba import cuda
    return cuda


def dev(a):
    from numba import cuda
    return cuda.to_device(np.ascontiguousarray(a))


def host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)
