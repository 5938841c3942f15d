"""Every ISA class of the integer-dot tiles (kernels.tiles) equals the q8 emulation.

The class this host compiles for is covered through the matmul API (test_matmul).  Each other class is
compiled in a subprocess under NUMBA_CPU_NAME (NUMBA_CPU_FEATURES empty: the named CPU's own features),
and its kernels also run there when this host has that class's instructions; otherwise the test
checks that the class was selected and that every tile kernel compiles for it.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pykv.kernels import tiles

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = r'''
import sys
import llvmlite.binding as llvm
import numba
import numpy as np
from numba import njit
sys.path.insert(0, sys.argv[3])
from test_matmul import GT, M, llama_vec_dot_k, make_weight, q8_emulate
from pykv.kernels import tiles as K

expected, run = sys.argv[1], sys.argv[2] == "1"
assert K.ISA == expected, (K.ISA, expected)
if not run:     # compile only: the weights' parallel K repack is machine code of the class too; numpy's layout is the same
    from pykv.kernels import mm_tiles
    mm_tiles.repack_ktile_nb = lambda fmt, blk, n_tiles: None


@njit(nogil=True)
def t32(kind, qt, sc, xq, xd, xs, out):
    R = qt.shape[3]
    for tile in range(qt.shape[0]):
        o = out[tile * R:(tile + 1) * R]
        if kind == 0:
            K.dot_tile_q4(qt[tile], sc[tile], xq, xd, xs, xd.shape[0], o)
        elif kind == 1:
            K.dot_tile_q5(qt[tile], sc[tile], xq, xd, xs, xd.shape[0], o)
        elif kind == 3:
            K.dot_tile_q40(qt[tile], sc[tile], xq, xd, xs, xd.shape[0], o)
        elif kind == 4:
            K.dot_tile_q50(qt[tile], sc[tile], xq, xd, xs, xd.shape[0], o)
        elif kind == 5:
            K.dot_tile_iq4(qt[tile], sc[tile], xq, xd, xs, xd.shape[0], o)
        else:
            K.dot_tile_q8(qt[tile], sc[tile], xq, xd, xs, xd.shape[0], o)


@njit(nogil=True)
def tk(kind, qt, xq, xd, xb, out):
    R = K.KTILE_ROWS
    for tile in range(qt.shape[0]):
        o = out[tile * R:(tile + 1) * R]
        if kind == 0:
            K.dot_ktile_q4k(qt[tile], xq, xd, xb, xd.shape[0], o)
        elif kind == 1:
            K.dot_ktile_q5k(qt[tile], xq, xd, xb, xd.shape[0], o)
        elif kind == 3:
            K.dot_ktile_q2k(qt[tile], xq, xd, xb, xd.shape[0], o)
        elif kind == 4:
            K.dot_ktile_q3k(qt[tile], xq, xd, xb, xd.shape[0], o)
        else:
            K.dot_ktile_q6k(qt[tile], xq, xd, xb, xd.shape[0], o)


k4_0, k4_1, k4_2, k4_3, k4_4 = [K._ktile_dot(f, 4) for f in ("q4k", "q5k", "q6k", "q2k", "q3k")]   # kinds of tk
i4_0, i4_1, i4_2, i4_3, i4_4, i4_5 = [K.intrinsic(K._tile_dot(f, 4)) for f in ("q4", "q5", "q8", "q40", "q50", "iq4")]


@njit(nogil=True)
def t32x4(kind, qt, sc, xq, xd, xs, out):
    """The 4-token tile dot (prefill): xq, xd, xs, out with 4 rows."""
    R = qt.shape[3]
    for tile in range(qt.shape[0]):
        o = out[:, tile * R:(tile + 1) * R]
        if kind == 0:
            i4_0(qt[tile], sc[tile], xq, xd, xs, xd.shape[1], o)
        elif kind == 1:
            i4_1(qt[tile], sc[tile], xq, xd, xs, xd.shape[1], o)
        elif kind == 3:
            i4_3(qt[tile], sc[tile], xq, xd, xs, xd.shape[1], o)
        elif kind == 4:
            i4_4(qt[tile], sc[tile], xq, xd, xs, xd.shape[1], o)
        elif kind == 5:
            i4_5(qt[tile], sc[tile], xq, xd, xs, xd.shape[1], o)
        else:
            i4_2(qt[tile], sc[tile], xq, xd, xs, xd.shape[1], o)


@njit(nogil=True)
def tk4(kind, qt, xq, xd, xb, out):
    """The 4-token K tile dot (prefill): xq, xd, xb, out with 4 rows."""
    R = K.KTILE_ROWS
    for tile in range(qt.shape[0]):
        o = out[:, tile * R:(tile + 1) * R]
        if kind == 0:
            k4_0(qt[tile], xq, xd, xb, xd.shape[1], o)
        elif kind == 1:
            k4_1(qt[tile], xq, xd, xb, xd.shape[1], o)
        elif kind == 3:
            k4_3(qt[tile], xq, xd, xb, xd.shape[1], o)
        elif kind == 4:
            k4_4(qt[tile], xq, xd, xb, xd.shape[1], o)
        else:
            k4_2(qt[tile], xq, xd, xb, xd.shape[1], o)


rng = np.random.default_rng(3)
rows = 40
cases = [(GT.Q4_1, 0, 256), (GT.Q4_0, 3, 256), (GT.Q5_0, 4, 256), (GT.Q5_1, 1, 256), (GT.Q8_0, 2, 256),
         (GT.IQ4_NL, 5, 256),
         (GT.Q4_K, 0, 512), (GT.Q5_K, 1, 512), (GT.Q6_K, 2, 512), (GT.Q2_K, 3, 512), (GT.Q3_K, 4, 512)]
compiled = set()
for gt, kind, cols in cases:
    data, ref_w = make_weight(gt, rows, cols, rng, jit_free=True)
    w = M.prepare_weight(int(gt), data, rows, cols)
    assert w.int_dot and w.qt is not None, w
    x = rng.standard_normal((1, cols)).astype(np.float32)
    out = np.zeros(rows + 64, np.float32)
    k = cols == 512
    xq = np.zeros(cols, np.int8)
    xd = np.zeros((1, cols // (256 if k else 32)), np.float32)
    xs = np.zeros((1, cols // (16 if k else 32)), np.int32)
    args = (kind, w.qt, xq, xd[0], xs[0], out) if k else (kind, w.qt, w.sc, xq, xd[0], xs[0], out)
    fn = tk if k else t32
    # and four tokens in one call (prefill)
    x4 = rng.standard_normal((4, cols)).astype(np.float32)
    xq4, xd4, xs4 = np.zeros((4, cols), np.int8), np.zeros((4, xd.shape[1]), np.float32), np.zeros((4, xs.shape[1]), np.int32)
    out4 = np.zeros((4, rows + 64), np.float32)
    args4 = (kind, w.qt, xq4, xd4, xs4, out4) if k else (kind, w.qt, w.sc, xq4, xd4, xs4, out4)
    fn4 = tk4 if k else t32x4
    if not run:
        for f, a in ((fn, args), (fn4, args4)):
            sig = tuple(numba.typeof(v) for v in a)
            if (f, sig) not in compiled:
                f.compile(sig)
                compiled.add((f, sig))
        continue
    if k:
        M.quantize_act_q8k(x4, 4, xq4, xd4, xs4)
    else:
        M.quantize_act_q8(x4, 4, xq4, xd4, xs4, np.zeros_like(xd4))
    fn4(*args4)
    for i in range(4):       # each token as a one-token call: bit for bit (no fast-math here)
        fn(*((kind, w.qt, xq4[i], xd4[i], xs4[i], out) if k else (kind, w.qt, w.sc, xq4[i], xd4[i], xs4[i], out)))
        assert np.array_equal(out4[i, :rows], out[:rows]), (gt.name, i)
    if k:
        M.quantize_act_q8k(x, 1, xq.reshape(1, -1), xd, xs)
    else:
        M.quantize_act_q8(x, 1, xq.reshape(1, -1), xd, xs, np.zeros_like(xd))
    fn(*args)
    ref = q8_emulate(x, w.act_block)[0] @ ref_w.T
    err = np.abs(out[:rows] - ref).max()
    assert err <= 1e-5 * np.abs(ref).max(), (gt.name, err)
    if gt in (GT.Q2_K, GT.Q3_K):    # and llama.cpp's integer dot, tightly
        blk = np.ascontiguousarray(data).view(np.uint8).reshape(rows, cols // 256, -1)
        ref, scale = llama_vec_dot_k(gt, blk, xq, xd[0])
        assert np.all(np.abs(out[:rows] - ref) <= 1e-6 * scale + 1e-30), gt.name
print("ok", K.ISA, "ran" if run else "compiled")
'''

# NUMBA_CPU_NAME -> the class it selects
CLASSES = {"ivybridge": "generic", "haswell": "avx2", "alderlake": "avxvnni", "sapphirerapids": "avx512vnni"}
_NEEDS = {"generic": (), "avx2": ("avx2",), "avxvnni": ("avx2", "avxvnni"),
          "avx512vnni": ("avx512f", "avx512bw", "avx512vnni")}


# what a named CPU's code needs beyond its class: sapphirerapids lowers f16 -> f32 with AVX512-FP16's
# vcvtph2psx, which AVX-512 hosts without FP16 (Zen 4, Ice Lake) fault on (SIGILL)
_NEEDS_CPU = {"sapphirerapids": ("avx512fp16",)}


def _host_runs(cpu):
    import llvmlite.binding as llvm
    f = llvm.get_host_cpu_features()
    return all(f.get(k) for k in _NEEDS[CLASSES[cpu]] + _NEEDS_CPU.get(cpu, ()))


def run_in_class(cpu, script, host_test):
    """Run `script` (argv: class, "1" to run / "0" to compile only, the tests folder) under
    NUMBA_CPU_NAME=cpu in a subprocess; skipped where cpu's class is this host's (host_test covers it)."""
    cls = CLASSES[cpu]
    if cls == tiles.ISA and os.environ.get("NUMBA_CPU_NAME") is None:
        pytest.skip(f"{cls} is this host's class: {host_test} runs it")
    run = _host_runs(cpu)
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES="", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script, cls, "1" if run else "0", str(Path(__file__).resolve().parent)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0 and "ok" in r.stdout, (r.stdout[-2000:], r.stderr[-4000:])
    if not run:     # the class's code compiled, but this host cannot run it: not counted as a pass
        pytest.skip(f"{cls} ({cpu}): compiled only, this host lacks its instructions")


@pytest.mark.parametrize("cpu", sorted(CLASSES, key=lambda c: tiles.ISA_CLASSES.index(CLASSES[c])))
def test_isa_class_tiles(cpu):
    run_in_class(cpu, _SCRIPT, "test_matmul")


def test_target_isa_follows_numba_cpu_override():
    """The class is what Numba compiles for: the probe reads the (cpu, features) pair, so a named CPU
    with its own features selects its class even on a host of another class."""
    assert tiles._probe("sapphirerapids", "") == "avx512vnni"
    assert tiles._probe("alderlake", "") == "avxvnni"
    assert tiles._probe("znver3", "") == "avx2"
    assert tiles._probe("alderlake", "-avxvnni") == "avx2"
