"""numba.cuda twins of the CPU kernel modules (pykv.kernels.{matmul, ops, sampler, kvquant, attention}):
same public names and arguments, device arrays in and out. Picked through kernels.backend.get_backend("cuda").

Reductions: on a GPU, warp sums use shuffles (cuda.shfl_down_sync); under NUMBA_ENABLE_CUDASIM=1 (the
simulator has no shuffles) they go through shared memory instead (SIM below, fixed at import)."""
from numba import config, cuda
import numpy as np

SIM = bool(config.ENABLE_CUDASIM)
# lanes of a "warp" (the threads that share one weight row): 32 on a GPU (shuffle sums); 2 under the
# simulator, which runs every thread as a Python thread (same code, far fewer threads to start and join)
WL = 2 if SIM else 32


@cuda.jit(device=True, inline=True)
def warp_sums(acc, sh, w, lane):
    """acc[i] <- its sum over the WL lanes of warp w, for every i (lane 0 holds the sums; all lanes on a
    GPU). sh: shared float32 (n_warps, len(acc), WL), used only under the simulator (two block barriers
    for the whole array instead of two per element: the simulator's barriers are slow)."""
    if SIM:
        for i in range(acc.shape[0]):
            sh[w, i, lane] = acc[i]
        cuda.syncthreads()
        if lane == 0:
            for i in range(acc.shape[0]):
                s = np.float32(0.0)
                for j in range(WL):
                    s += sh[w, i, j]
                acc[i] = s
        cuda.syncthreads()
        return
    for i in range(acc.shape[0]):
        v = acc[i]
        off = 16
        while off > 0:
            v += cuda.shfl_down_sync(0xFFFFFFFF, v, off)
            off //= 2
        acc[i] = v


@cuda.jit(device=True, inline=True)
def block_sum(v, sh):
    """Sum of v over the whole (1-D, power-of-two sized) block, returned to every thread; sh: shared
    float32 scratch of at least blockDim.x. Tree reduction in shared memory (GPU and simulator)."""
    i = cuda.threadIdx.x
    n = cuda.blockDim.x
    sh[i] = v
    cuda.syncthreads()
    s = n // 2
    while s > 0:
        if i < s:
            sh[i] += sh[i + s]
        cuda.syncthreads()
        s //= 2
    r = sh[0]
    cuda.syncthreads()
    return r


def grid(n, per):
    """Blocks of `per` covering n items."""
    return max(1, -(-int(n) // per))
