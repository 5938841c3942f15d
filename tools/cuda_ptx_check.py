"""Compile the cuda KV and decode-chain kernels (pykv.kernels.cuda.kvquant / attention / chain) to PTX without a GPU.

The simulator runs kernels as Python, so it cannot tell whether a GPU can compile them (numpy calls,
allocation, exceptions in the shared @njit code).  This script can: numba-cuda plus NVIDIA's NVVM are
enough, no driver and no device.  It also checks that the quantizing kernels hold no fused multiply-add
(NVVM fuses mul + add by default; the quantizers keep those products apart with simd.fmul_rn so the GPU's
bytes equal the CPU's).

    pip install --target DIR numba-cuda cuda-bindings cuda-core cuda-pathfinder \
        nvidia-cuda-nvcc-cu12 nvidia-cuda-nvrtc-cu12 --no-deps
    LD_LIBRARY_PATH=DIR/nvidia/cuda_nvrtc/lib:DIR/nvidia/cuda_nvcc/nvvm/lib64 \
    CUDA_HOME=DIR/nvidia/cuda_nvcc python tools/cuda_ptx_check.py --site DIR [kvquant] [attention] [chain]

Prints one line per kernel (PTX size, fma count, compile seconds); exit status 1 on a failure.  Where
ptxas is at hand (the nvidia-cuda-nvcc wheel's, in --site, or --ptxas PATH) each kernel's PTX is also
assembled for the GPU, which checks what only the assembler does: registers, and the 64 KiB of constant
memory a kernel's module-level tables go to ("File uses too much global constant data" on an H200 once).

Every kernel, with the argument types the tests really launch it with (matmul, ops, sampler too):

    PYKV_CUDA_SIGS=/tmp/sigs.pkl python -m pytest tests/test_cuda_*.py      # under the simulator
    ... python tools/cuda_ptx_check.py --site DIR --sigs /tmp/sigs.pkl
"""
from __future__ import annotations

import argparse
import os
import site
import sys
import time

QUANTIZERS = ("_append_kernel", "_residual_kernel", "_page_kernel", "_kpage_kernel")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", default=["kvquant", "attention"])
    ap.add_argument("--site", help="a pip --target folder holding numba-cuda and the CUDA wheels")
    ap.add_argument("--cc", default="9.0", help="compute capability (default 9.0: H100 / H200)")
    ap.add_argument("--sigs", help="compile every kernel launch recorded under the simulator instead: the file "
                    "written by PYKV_CUDA_SIGS=FILE python -m pytest tests/test_cuda_*.py (all cuda modules)")
    ap.add_argument("--ptxas", help="ptxas to assemble each kernel with (default: the --site wheel's, else PATH)")
    a = ap.parse_args()
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        print("cuda_ptx_check: unset NUMBA_ENABLE_CUDASIM (this compiles for a real GPU)")
        return 2
    if a.site:
        site.addsitedir(a.site)          # runs numba-cuda's .pth redirect of numba.cuda
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from numba import cuda
    from numba import types as nt
    import numba.cuda.dispatcher as disp
    cc = tuple(int(v) for v in a.cc.split("."))

    class _Dev:                          # device functions ask the current device for its cc
        compute_capability = cc
    disp.get_current_device = lambda: _Dev()

    I, u8_3, f32_3, i32_1 = nt.int64, nt.uint8[:, :, ::1], nt.float32[:, :, ::1], nt.int32[::1]
    f32_5, u8_4 = nt.float32[:, :, :, :, ::1], nt.uint8[:, :, :, ::1]
    jobs = []
    if a.sigs:
        jobs = recorded(a.sigs)
        a.modules = []
    if "kvquant" in a.modules:
        from pykv.kernels.cuda import kvquant as CK
        jobs += [(CK._append_kernel, (f32_3, u8_3, i32_1, I, I, I, I)),
                 (CK._residual_kernel, (f32_3, u8_3, I, I, I, I)),
                 (CK._unpack_kernel, (u8_3, I, I, I, f32_3, I)),
                 (CK._page_kernel, (f32_3, u8_3, I, I, I, I)),
                 (CK._kpage_kernel, (f32_3, u8_3, I, I))]
    if "attention" in a.modules:
        from pykv.kernels.cuda import attention as CA
        jobs += [(CA._attend_kernel, (f32_3, u8_3, u8_3, u8_3, u8_3, u8_3, u8_3, i32_1) + (I,) * 12 + (f32_5, i32_1, f32_3)),
                 (CA._batch_kernel, (f32_3, u8_3, u8_3, u8_4, u8_4, u8_4, u8_4, nt.int32[:, ::1],
                                     nt.int32[:, ::1]) + (I,) * 6 + (f32_5, i32_1, f32_3))]
    if "chain" in a.modules:        # the fused decode kernels, specialised for SmolLM2's shapes and types
        from pykv.kernels.cuda import chain as CC
        from pykv.kernels.cuda import matmul as CM
        from pykv.kernels.cuda import specialise
        from pykv.kernels.mm_raw import F16, Q4_1, Q8_0
        u8_2, f32_2, f32_1 = nt.uint8[:, ::1], nt.float32[:, ::1], nt.float32[::1]
        W = (u8_2, f32_2)
        jobs += [(specialise(CC._out_kernel, KA=Q4_1, ROT=True, D=576, HD=64), W + (f32_3, f32_1, f32_2)),
                 (specialise(CC._gate_up_kernel, KA=Q4_1, KB=Q4_1, D=576), W * 2 + (f32_2, f32_1, nt.float32, f32_2)),
                 (specialise(CC._down_kernel, KA=F16, FF=1536, FS=1536), W + (f32_2, f32_2)),
                 (specialise(CC._qkv_kernel, KA=Q4_1, KB=Q4_1, KC=Q8_0, D=576), W * 3 + (f32_2, f32_1, nt.float32)
                  + (f32_2,) * 3),
                 (specialise(CM._mm3_kernel, KA=Q4_1, KB=Q4_1, KC=Q8_0), (u8_2, f32_2, I, f32_2) * 3 + (f32_2, I))]
    ptxas = find_ptxas(a.ptxas, a.site)
    print(f"ptxas: {ptxas or 'none found (PTX only)'}")
    bad = 0
    for k, sig in jobs:
        name = k.py_func.__name__
        if a.sigs:
            name += "(" + ", ".join(str(t) for t in sig) + ")"
        t = time.time()
        try:
            ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=cc)
        except Exception as e:           # report every kernel, then fail
            print(f"{name}: FAILED: {type(e).__name__}: {str(e).splitlines()[0]}")
            bad += 1
            continue
        fma = ptx.count("fma.rn.f32")
        ok = not (k.py_func.__name__ in QUANTIZERS and fma)
        asm = assemble(ptxas, ptx, cc) if ptxas else ""
        bad += (not ok) + asm.startswith("FAILED")
        print(f"{name}: {len(ptx)} chars of PTX, {const_bytes(ptx)} B constant data, {fma} fma.rn.f32, "
              f"{time.time() - t:.1f} s" + (f", ptxas {asm}" if asm else "")
              + ("" if ok else "  <- a quantizer with fused multiply-adds: GPU bytes may differ"))
    return 1 if bad else 0


def const_bytes(ptx):
    """Bytes of the .const arrays a PTX module declares (ptxas allows 64 KiB)."""
    import re
    return sum(int(n) for n in re.findall(r"^\.const\s.*?\[(\d+)\]", ptx, re.M))


def find_ptxas(given, site_dir):
    import shutil
    if given:
        return given
    if site_dir:
        p = os.path.join(site_dir, "nvidia", "cuda_nvcc", "bin", "ptxas")
        if os.path.exists(p):
            return p
    return shutil.which("ptxas")


def assemble(ptxas, ptx, cc):
    """'ok' or 'FAILED: <ptxas's first error line>'.  A PTX .version newer than this ptxas knows (NVVM and
    ptxas from different CUDA releases) is lowered to the one ptxas names and assembled again."""
    import re
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        for _ in range(2):
            with open(src, "w") as f:
                f.write(ptx)
            r = subprocess.run([ptxas, "-v", f"-arch=sm_{cc[0]}{cc[1]}", src, "-o", os.path.join(d, "k.cubin")],
                               capture_output=True, text=True)
            if r.returncode == 0:          # -v: registers, spills, shared memory of each kernel
                info = []
                for pat, unit in ((r"Used (\d+) registers", " registers"), (r"(\d+) bytes spill stores", " B spill stores"),
                                  (r"(\d+) bytes smem", " B shared")):
                    found = re.findall(pat, r.stderr)
                    if found:
                        info.append(f"{max(map(int, found))}{unit}")
                return "ok" + (f" ({', '.join(info)})" if info else "")
            m = re.search(r"current version is '([\d.]+)'", r.stderr)
            if not m:
                break
            ptx = re.sub(r"^\.version\s+[\d.]+", ".version " + m.group(1), ptx, count=1, flags=re.M)
        err = [ln for ln in r.stderr.splitlines() if "error" in ln or "fatal" in ln] or r.stderr.splitlines() or ["?"]
        return "FAILED: " + err[0].strip()


def recorded(path):
    """(kernel, signature) for each distinct launch in the pickle stream at path (see
    pykv.kernels.cuda._sim_record_signatures); simulator-only kernels of the tests are skipped."""
    import importlib
    import pickle
    seen = set()
    with open(path, "rb") as f:
        while True:
            try:
                seen.update(pickle.load(f))
            except EOFError:
                break
    jobs = []
    for mod, name, sig in sorted(seen, key=str):
        if not mod.startswith("pykv."):
            continue
        jobs.append((getattr(importlib.import_module(mod), name), sig))
    return jobs


if __name__ == "__main__":
    sys.exit(main())
