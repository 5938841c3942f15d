"""The CPU kernels' @njit functions called from CUDA kernels: one source for both devices.

numba.cuda compiles an @njit function that a kernel calls for the GPU (a "CPU dispatcher" call; the
function must keep to the CUDA-compatible subset: scalars, array indexing, kernels.simd's intrinsics,
no allocation and no numpy calls).  The simulator (NUMBA_ENABLE_CUDASIM=1) runs kernels as Python,
where arrays are wrapper objects an @njit function cannot take: there `dev(fn)` unwraps them and
calls the compiled CPU function, so the simulator runs exactly the CPU's code for these pieces."""
from numba import config

SIM = bool(config.ENABLE_CUDASIM)


def dev(fn):
    """fn itself on a GPU; under the simulator, fn with simulator arrays unwrapped to numpy."""
    if not SIM:
        return fn
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray, FakeWithinKernelCUDAArray

    def host(a):
        if isinstance(a, FakeWithinKernelCUDAArray):
            a = a._item
        return a._ary if isinstance(a, FakeCUDAArray) else a

    def call(*args):
        return fn(*[host(a) for a in args])
    call.__name__ = getattr(fn, "__name__", "dev")
    return call


def blocks_for(n: int, per: int) -> int:
    """Blocks of `per` threads covering n items (at least one)."""
    return max(1, -(-int(n) // per))
