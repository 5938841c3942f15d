"""Build llama.cpp's llama-bench (and llama-quantize) for one ISA class: the same-class peer of pykv's
kernels (kernels.tiles.ISA) in `pykv bench` comparisons.  For benchmarks only; never a pykv dependency.

    python tools/build_llama_bench.py CLASS [--src PATH] [--build-dir DIR] [--jobs N] [--targets LIST] [--dry-run]

CLASS: avx2 | avxvnni | avx512vnni | native.  --src: a llama.cpp source tree, or the llama-cpp-python
sdist (llama_cpp_python-0.3.36.tar.gz: its vendor/llama.cpp is used).  The build has GGML_NATIVE=OFF
and exactly the class's GGML_* instruction switches (native: GGML_NATIVE=ON), so it runs on any host
of the class; the binaries land in DIR/bin (default ~/.cache/pykv/llama-bench/CLASS).  Run the pykv
side of a comparison with the matching NUMBA_CPU_NAME (e.g. haswell, alderlake, sapphirerapids) and
NUMBA_CPU_FEATURES="" when the host is of a higher class.  Building the two targets took 4.5-6.3 min on a
2-core Zen 3 (2026-12-03, 12-04).

--targets: a comma list of llama-bench, llama-quantize, llama-batched-bench, llama-server (the last two are
peers for batched/serving benchmarks), or `all` for the four; default llama-bench,llama-quantize.  Only when
llama-server is among them is LLAMA_BUILD_SERVER=ON, with LLAMA_USE_PREBUILT_UI=OFF (no download at build
time; the server has no embedded web UI).  Rerunning with more targets on the same DIR reuses its cmake
tree, so only the new targets compile.
"""
import argparse
import os
import shlex
import subprocess
import sys
import tarfile

DEFAULT_SRC = "/work/llama.cpp"
_AVX2 = {"GGML_AVX": "ON", "GGML_AVX2": "ON", "GGML_FMA": "ON", "GGML_F16C": "ON", "GGML_BMI2": "ON",
         "GGML_AVX_VNNI": "OFF", "GGML_AVX512": "OFF", "GGML_AVX512_VNNI": "OFF", "GGML_AVX512_VBMI": "OFF",
         "GGML_AVX512_BF16": "OFF"}
CLASSES = {
    "avx2": _AVX2,
    "avxvnni": {**_AVX2, "GGML_AVX_VNNI": "ON"},
    "avx512vnni": {**_AVX2, "GGML_AVX512": "ON", "GGML_AVX512_VNNI": "ON"},
    "native": {},
}
# the NUMBA_CPU_NAME that makes pykv compile for the same class
NUMBA_CPU = {"avx2": "haswell", "avxvnni": "alderlake", "avx512vnni": "sapphirerapids", "native": "host"}
TARGETS = ("llama-bench", "llama-quantize")                       # the default --targets
ALL_TARGETS = TARGETS + ("llama-batched-bench", "llama-server")   # --targets all


def parse_targets(spec: str) -> tuple[str, ...]:
    """The --targets comma list (`all`: ALL_TARGETS), in order, without repeats."""
    out: list[str] = []
    for t in (x.strip() for x in spec.split(",")):
        for name in ALL_TARGETS if t == "all" else (t,):
            if name not in ALL_TARGETS:
                raise SystemExit(f"build_llama_bench: unknown target {name!r}; one of {', '.join(ALL_TARGETS)}, all")
            if name not in out:
                out.append(name)
    return tuple(out)


def cmake_args(isa: str, src: str, build: str, targets=TARGETS) -> list[str]:
    if isa not in CLASSES:
        raise SystemExit(f"build_llama_bench: unknown ISA class {isa!r}; one of {', '.join(CLASSES)}")
    server = "llama-server" in targets
    flags = {"CMAKE_BUILD_TYPE": "Release", "GGML_NATIVE": "ON" if isa == "native" else "OFF",
             "GGML_CPU_ALL_VARIANTS": "OFF", "GGML_BACKEND_DL": "OFF", "LLAMA_CURL": "OFF",
             "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_SERVER": "ON" if server else "OFF",
             **({"LLAMA_USE_PREBUILT_UI": "OFF"} if server else {}), **CLASSES[isa]}
    return ["cmake", "-S", src, "-B", build] + [f"-D{k}={v}" for k, v in flags.items()]


def resolve_src(src: str, build: str, dry_run: bool) -> str:
    """A source tree for `src`: itself, or the sdist's vendor/llama.cpp extracted under build/src."""
    if os.path.isdir(src):
        if not os.path.exists(os.path.join(src, "CMakeLists.txt")):
            raise SystemExit(f"build_llama_bench: {src} has no CMakeLists.txt")
        return src
    if not (src.endswith((".tar.gz", ".tgz")) and os.path.isfile(src)):
        raise SystemExit(f"build_llama_bench: --src must be a llama.cpp tree or a .tar.gz sdist, got {src}")
    out = os.path.join(build, "src")
    with tarfile.open(src) as tf:
        top = tf.getnames()[0].split("/")[0]
        if not dry_run:
            tf.extractall(out, filter="data")
    return os.path.join(out, top, "vendor", "llama.cpp")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("isa", choices=sorted(CLASSES), help="ISA class to build for")
    ap.add_argument("--src", default=DEFAULT_SRC, help="llama.cpp tree or llama-cpp-python sdist (.tar.gz)")
    ap.add_argument("--build-dir", default=None, help="default ~/.cache/pykv/llama-bench/CLASS")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help=f"comma list of {', '.join(ALL_TARGETS)}, or all (default %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error("--jobs must be >= 1")
    targets = parse_targets(a.targets)
    build = a.build_dir or os.path.expanduser(f"~/.cache/pykv/llama-bench/{a.isa}")
    src = resolve_src(a.src, build, a.dry_run)
    cmds = [cmake_args(a.isa, src, build, targets),
            ["cmake", "--build", build, "--config", "Release", "-j", str(a.jobs), "--target", *targets]]
    for c in cmds:
        print("+", shlex.join(c), flush=True)
        if not a.dry_run:
            r = subprocess.run(c)
            if r.returncode:
                raise SystemExit(f"build_llama_bench: {c[0]} failed (exit {r.returncode})")
    print(f"# binaries: {os.path.join(build, 'bin')}; pykv side: NUMBA_CPU_NAME={NUMBA_CPU[a.isa]}"
          + ("" if a.isa == "native" else " NUMBA_CPU_FEATURES=''"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
