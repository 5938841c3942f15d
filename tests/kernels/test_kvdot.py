"""kernels.kvdot (integer-dot scores and value sums over q8_0 cache rows, read in place) against a
numpy emulation, in every ISA class: this host's in process, the others compiled in a subprocess under
NUMBA_CPU_NAME and run there where this host has the instructions (as test_tiles_isa does for the
weight tiles).

The emulation is exact arithmetic on what the kernels see: the keys' int8 codes times their f16 scales,
the query's int16 form (attention._quant_q16, reference.q16_query).  Rows outside the segment hold
bytes that decode to NaN, so a kernel that read one would fail.
"""
import numpy as np
import pytest

from pykv.kernels import tiles

from .test_tiles_isa import CLASSES, run_in_class


def run_checks():
    """Every (HD, n, R) case; raises AssertionError on a mismatch.  Returns the case count."""
    from numba import njit

    from pykv.kernels.attention import _quant_q16
    from pykv.kernels.kvdot import accum_q8_0_1, accum_q8_0_3, scores_q8_0_1, scores_q8_0_3

    @njit(nogil=True)
    def run(src, o0, rb, n, xq, xd, s, acc):
        R = xq.shape[0]
        x = 0
        while x + 3 <= R:
            scores_q8_0_3(src, o0, rb, n, xq, xd, s, x)
            accum_q8_0_3(src, o0, rb, n, s, x, acc)
            x += 3
        while x < R:
            scores_q8_0_1(src, o0, rb, n, xq, xd, s, x)
            accum_q8_0_1(src, o0, rb, n, s, x, acc)
            x += 1

    rng = np.random.default_rng(5)
    cases = 0
    for HD in (64, 128):
        nb = HD // 32
        for n in (1, 5, 16, 17, 32):
            for R in (1, 3, 4, 7):
                P, first = 40, 3
                rb = nb * 34 + 6                    # a row stride wider than the row: offsets must use rb
                page = np.full(P * rb, 0x7F, np.uint8)      # f16 0x7F7F = NaN: rows never written
                kq = rng.integers(-127, 128, (n, nb, 32)).astype(np.int8)
                kd = (rng.random((n, nb)) * 0.1 + 0.01).astype(np.float16)
                for r in range(n):
                    for b in range(nb):
                        o = (first + r) * rb + 34 * b
                        page[o:o + 2] = np.frombuffer(kd[r, b].tobytes(), np.uint8)
                        page[o + 2:o + 34] = kq[r, b].view(np.uint8)
                q = (rng.standard_normal((R, HD)) * rng.uniform(0.1, 3.0, (1, HD))).astype(np.float32)
                xq = np.zeros((R, HD), np.int16)
                xd = np.zeros((R, nb), np.float32)
                _quant_q16(q, xq, xd)
                k = (kq.astype(np.float64) * kd.astype(np.float64)[..., None]).reshape(n, HD)
                qr = (xq.reshape(R, nb, 32).astype(np.float64) * xd[..., None]).reshape(R, HD)
                # the int16 query is the float one to 2**-16 of each block's amax
                blk_max = np.abs(q.reshape(R, nb, 32)).max(axis=2, keepdims=True)
                assert np.all(np.abs(qr.reshape(R, nb, 32) - q.reshape(R, nb, 32)) <= blk_max * 2.0 ** -15.9)
                s = np.full((R, 32), np.nan, np.float32)
                acc0 = rng.standard_normal((R, HD)).astype(np.float32)
                acc = acc0.copy()
                run(page, first * rb, rb, n, xq, xd, s, acc)
                ref = qr @ k.T
                err = np.abs(s[:, :n] - ref).max()
                assert err <= 1e-5 * np.abs(ref).max(), ("scores", HD, n, R, err)
                refv = acc0 + s[:, :n].astype(np.float64) @ k
                err = np.abs(acc - refv).max()
                assert err <= 1e-5 * np.abs(refv).max(), ("accum", HD, n, R, err)
                cases += 1
    return cases


_SCRIPT = r'''
import sys
sys.path.insert(0, sys.argv[3])
from pykv.kernels import tiles
assert tiles.ISA == sys.argv[1], (tiles.ISA, sys.argv[1])
if sys.argv[2] == "1":
    from tests.kernels.test_kvdot import run_checks
    print("ok", tiles.ISA, "ran", run_checks())
else:      # compile only: this host lacks the class's instructions
    import numba
    from pykv.kernels import kvdot
    u8, i16, f32 = numba.types.uint8[::1], numba.types.int16[:, ::1], numba.types.float32[:, ::1]
    i = numba.types.int64
    for fn in (kvdot.scores_q8_0_1, kvdot.scores_q8_0_3):
        numba.njit(lambda a, b, c, d, e, f, g, h: fn(a, b, c, d, e, f, g, h)).compile((u8, i, i, i, i16, f32, f32, i))
    for fn in (kvdot.accum_q8_0_1, kvdot.accum_q8_0_3):
        numba.njit(lambda a, b, c, d, e, f, g: fn(a, b, c, d, e, f, g)).compile((u8, i, i, i, f32, i, f32))
    print("ok", tiles.ISA, "compiled")
'''


def test_kvdot_this_host():
    assert run_checks() == 2 * 5 * 4


@pytest.mark.parametrize("cpu", sorted(CLASSES, key=lambda c: tiles.ISA_CLASSES.index(CLASSES[c])))
def test_kvdot_isa_class(cpu):
    run_in_class(cpu, _SCRIPT, "test_kvdot_this_host")
