"""The simulator's shared-array allocation under thread interleaving (pykv.kernels.cuda._sim_shared_lock).

numba's simulator creates a block's shared array on the first thread's call without a lock; two threads
that reach the line together could each get their own array, and a block reduction then lost a thread's
part (the rare wrong rows once seen in test_cuda_matmul / test_cuda_ops in the full suite)."""
import sys

import numpy as np
import pytest

from numba import cuda

from pykv.kernels import cuda as kc  # installs the lock under the simulator

NT = 64


@cuda.jit
def _sum_kernel(out):
    t = cuda.threadIdx.x
    s = 0.0
    for i in range(200):            # work before the allocation, so threads reach it interleaved
        s += i
    sh = cuda.shared.array(NT, np.float32)
    sh[t] = 1.0 + 0.0 * s
    cuda.syncthreads()
    if t == 0:
        a = 0.0
        for i in range(NT):
            a += sh[i]
        out[cuda.blockIdx.x] = a


@pytest.mark.skipif(not kc.SIM, reason="simulator only")
def test_shared_array_is_one_per_block_under_interleaving():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)      # switch threads as often as Python allows (unlocked: ~1 bad block in 300)
    try:
        bad = 0
        for _ in range(12):
            out = np.zeros(8, np.float32)
            _sum_kernel[8, NT](out)
            bad += int((out != NT).sum())
    finally:
        sys.setswitchinterval(old)
    assert bad == 0
