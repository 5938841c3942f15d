"""The backend seam: one object, picked once when a model loads, that names the kernel modules and
the array helpers the forward pass uses.

    cpu   pykv.kernels.{matmul, ops, kvquant, attention, sampler, chain}       numpy arrays, @njit(parallel=True)
    cuda  pykv.kernels.cuda.{matmul, ops, kvquant, attention, sampler, chain}  numba.cuda device arrays

Twin modules have the same function names and arguments, so `model.py` and `kv_cache.py` call
`be.ops.rmsnorm_act(...)` and never branch on the device. Arrays a backend hands out (`zeros`,
`to_device`) live where its kernels run; `to_host` copies one back (a numpy array on the CPU is
returned as is). Under NUMBA_ENABLE_CUDASIM=1 the cuda backend runs on numba's CUDA simulator.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import numpy as np

from ..config import PykvError

DEVICES = ("cpu", "cuda")
KERNEL_MODULES = ("matmul", "ops", "kvquant", "attention", "sampler", "chain")


class Backend:
    """name: "cpu" | "cuda"; matmul, ops, kvquant, attention, sampler, chain: the kernel modules of that
    device (sampler.pick: a token id from a logits row of this device; chain.bind: a decode step's
    products between two attentions as one call, or None where the device runs them one by one)."""

    name: str
    matmul: ModuleType
    ops: ModuleType
    kvquant: ModuleType
    attention: ModuleType
    sampler: ModuleType
    chain: ModuleType

    def __init__(self, name: str, package: str):
        self.name = name
        for m in KERNEL_MODULES:
            setattr(self, m, importlib.import_module(f"{package}.{m}"))

    def zeros(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype)

    def to_device(self, a: np.ndarray):
        return np.ascontiguousarray(a)

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def synchronize(self) -> None:
        pass

    def workers(self) -> int:
        """Parallel workers the attention split aims at (KVCache.chunk_for): the CPUs this process may run
        on, read once, and not the threads in use, since the chunks' partial sums are merged in chunk
        order and the bits must not depend on the thread count (nor on the load, which picks it)."""
        if not hasattr(self, "_cpus"):
            try:
                self._cpus = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                self._cpus = os.cpu_count() or 1
        return self._cpus

    @property
    def max_workers(self) -> int:
        return self.workers()


class CudaBackend(Backend):
    def __init__(self):
        from numba import cuda
        self.cuda = cuda
        super().__init__("cuda", "pykv.kernels.cuda")

    def zeros(self, shape, dtype=np.float32):
        a = self.cuda.device_array(shape, dtype)
        self.ops.fill_zero(a)
        return a

    def to_device(self, a: np.ndarray):
        return self.cuda.to_device(np.ascontiguousarray(a))

    def to_host(self, a) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else a.copy_to_host()

    def synchronize(self) -> None:
        self.cuda.synchronize()

    def workers(self) -> int:
        """The GPU's streaming multiprocessors (1 under the simulator)."""
        return self.max_workers

    @property
    def max_workers(self) -> int:
        if not hasattr(self, "_sms"):
            try:
                self._sms = int(self.cuda.get_current_device().MULTIPROCESSOR_COUNT)
            except Exception:     # the simulator's device has no attributes
                self._sms = 1
        return self._sms


_CACHE: dict = {}


def cuda_error() -> str | None:
    """Why the cuda backend cannot run here (one line), or None when it can."""
    try:
        from numba import cuda
    except Exception as e:   # numba without its CUDA target, or numba-cuda missing
        return f"device cuda needs the CUDA extra (pip install 'pykv[cuda]'): {type(e).__name__}: {e}"
    try:
        ok = cuda.is_available()
    except Exception as e:
        return f"device cuda: the CUDA driver failed to start: {e}"
    if not ok:
        return "device cuda: no NVIDIA GPU or CUDA driver found on this machine (use --device cpu)"
    return None


def get_backend(device: str = "cpu") -> Backend:
    """The backend for "cpu" or "cuda"; a PykvError (one line) when it cannot run here."""
    device = (device or "cpu").lower()
    if device not in DEVICES:
        raise PykvError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if device not in _CACHE:
        if device == "cuda":
            err = cuda_error()
            if err:
                raise PykvError(err)
            _CACHE[device] = CudaBackend()
        else:
            _CACHE[device] = Backend("cpu", "pykv.kernels")
    return _CACHE[device]
