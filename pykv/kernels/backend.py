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

from pykv.files.config import PykvError

DEVICES = ("cpu", "cuda")
KERNEL_MODULES = ("matmul", "ops", "kvquant", "attention", "sampler", "chain")


# The twins' public functions (pykv.kernels.X and pykv.kernels.cuda.X, X in KERNEL_MODULES) are the same
# names but for these, each with the reason it has no twin (tests/kernels/test_twins.py checks it):
CPU_ONLY = {
    "attention": {"item_cres": "the CPU decode chain's attention stage calls it; the GPU chain leaves attention to the cache",
                  "merge_row": "a row helper the CPU chain inlines"},
    "chain": {name: "the CPU chain's one parallel region and its attention stages: the GPU's Chain is four "
                    "fused launches, the attention stays with the cache" for name in
              ("AttnFn", "AttnFnType", "ChainArgs", "ChainArgsType", "attention_stand_in", "attn_fn",
               "chain", "code")},
    "kvquant": {name: "host-side quantizers and scalar helpers (convert, tests, CPU kernels inline them)" for name in
                ("bf16_bits", "dequantize_row", "f16_next_down", "f16_next_up", "f32_to_f16_bits", "fp8_encode",
                 "kivi_code", "kivi_kpage_group", "kivi_params", "kivi_quantize_kpage", "nl_e8_floor", "pow2f",
                 "quantize_block", "quantize_row", "quantize_row_iq4_nl", "quantize_rows", "roundf_away",
                 "row_units", "wr_f16", "wr_f32", "wr_u16")},
    "matmul": {"Bound": "bind()'s result type: the GPU's bind returns a functools.partial",
               "Fused": "fuse()'s result type: the GPU's fuse returns the weights' tuple",
               "check_weight": "the shared validation: the GPU's prepare_weight calls the CPU's",
               "set_exact": "the GPU always runs float activations"},
    "ops": {"rope_tables": "host-side tables (numpy), moved to the device by the caller",
            "rope_yarn_corr_dims": "host-side, part of rope_tables",
            "exp_neg": "an inlined scalar helper of the CPU kernels",
            "rmsnorm_act_row": "a row helper the CPU chain inlines", "add_rmsnorm_act_row": "as rmsnorm_act_row",
            "swiglu_act_row": "as rmsnorm_act_row", "attn_out_act_row": "as rmsnorm_act_row"},
    "sampler": {},
}
GPU_ONLY = {
    "ops": {"fill_zero": "device arrays are zeroed by a kernel (numpy's zeros on the CPU)"},
}


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

    def copy_span(self, dev, host: np.ndarray, lo: int, hi: int) -> None:
        """dev[lo:hi] = host[lo:hi] for a backend array dev of host's shape (1-D)."""
        dev[lo:hi] = host[lo:hi]

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

    def copy_span(self, dev, host: np.ndarray, lo: int, hi: int) -> None:
        dev[lo:hi].copy_to_device(np.ascontiguousarray(host[lo:hi]))

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
