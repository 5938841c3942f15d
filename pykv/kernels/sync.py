"""Atomics for work items shared by the threads of one parallel region (kernels.chain).

    fetch_add(a, i, v)   old a[i], a[i] += v        (atomic, acquire-release)
    load_acquire(a, i)   a[i]                       (atomic load, acquire)
    spin_pause()         x86 `pause` in a spin loop (nothing elsewhere)
    cpu_yield()          sched_yield(2): the core to another runnable thread (POSIX; a pause elsewhere)
    wait_until(a, i, v)  until a[i] >= v: SPIN pauses, then yielding (a thread that waits for one the OS
                         descheduled gives its core away instead of spinning through its time slice)

a: a 1-D C-contiguous int64 array; like every kernel here no bounds checks (callers pass i < len(a)).
"""
import platform
import sys

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_POSIX = sys.platform != "win32"
SPIN = 2000          # pauses before a waiting thread starts yielding (tens of microseconds)


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


@intrinsic
def cpu_yield(typingctx):
    def codegen(context, builder, sig, args):
        if _POSIX:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
            builder.call(fn, [])
        elif _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(cache=True, nogil=True)
def wait_until(a, i, v):
    """Returns once a[i] >= v (an acquire load): SPIN pauses first (the usual wait, a few microseconds),
    then sched_yield between looks, so that under load the waiting thread does not hold a core the
    thread it waits for, or another process, could run on."""
    k = 0
    while load_acquire(a, i) < v:
        if k < SPIN:
            spin_pause()
            k += 1
        else:
            cpu_yield()
