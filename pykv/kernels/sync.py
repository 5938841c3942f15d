"""Atomics for work items shared by the threads of one parallel region (kernels.chain).

    fetch_add(a, i, v)   old a[i], a[i] += v        (atomic, acquire-release)
    load_acquire(a, i)   a[i]                       (atomic load, acquire)
    spin_pause()         x86 `pause` in a spin loop (nothing elsewhere)

a: a 1-D C-contiguous int64 array; like every kernel here no bounds checks (callers pass i < len(a)).
"""
import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _slot(context, builder, aty, arr, idx, ity):
    a = context.make_array(aty)(context, builder, arr)
    i = context.cast(builder, idx, ity, types.int64)
    return builder.gep(a.data, [i], inbounds=True)


def _ok(a, i):
    return (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.int64
            and isinstance(i, types.Integer))


@intrinsic
def fetch_add(typingctx, a, i, v):
    if not (_ok(a, i) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _slot(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", p, val, "acq_rel")
    return types.int64(a, i, v), codegen


@intrinsic
def load_acquire(typingctx, a, i):
    if not _ok(a, i):
        return None

    def codegen(context, builder, sig, args):
        p = _slot(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.load_atomic(p, "acquire", 8)
    return types.int64(a, i), codegen


@intrinsic
def spin_pause(typingctx):
    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen
