"""Argument handling of the benchmark tools (tools/build_llama_bench.py, tools/requantize.py) and the
ISA-class line of `pykv bench --compare-llamacpp`; nothing is built or quantized here."""
import importlib.util
from pathlib import Path

import pytest

from pykv.tools.bench import format_notes, isa_from_system_info

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("isa, on, off", [
    ("avx2", ["GGML_AVX2=ON", "GGML_FMA=ON", "GGML_F16C=ON"], ["GGML_AVX_VNNI=ON", "GGML_AVX512=ON"]),
    ("avxvnni", ["GGML_AVX2=ON", "GGML_AVX_VNNI=ON"], ["GGML_AVX512=ON", "GGML_AVX512_VNNI=ON"]),
    ("avx512vnni", ["GGML_AVX512=ON", "GGML_AVX512_VNNI=ON"], ["GGML_AVX_VNNI=ON"]),
])
def test_build_llama_bench_class_switches(isa, on, off, tmp_path, capsys):
    b = _tool("build_llama_bench")
    (tmp_path / "CMakeLists.txt").write_text("")
    assert b.main([isa, "--src", str(tmp_path), "--build-dir", str(tmp_path / "b"), "--dry-run"]) == 0
    cmake = capsys.readouterr().out.splitlines()[0].split()
    assert "-DGGML_NATIVE=OFF" in cmake
    assert all(f"-D{f}" in cmake for f in on) and not any(f"-D{f}" in cmake for f in off), cmake
    assert not (tmp_path / "b").exists()          # a dry run builds nothing


def test_build_llama_bench_rejects_bad_arguments(tmp_path):
    b = _tool("build_llama_bench")
    with pytest.raises(SystemExit) as e:
        b.main(["sse4", "--dry-run"])
    assert e.value.code == 2                       # argparse: not a class
    with pytest.raises(SystemExit, match="CMakeLists"):
        b.main(["avx2", "--src", str(tmp_path), "--dry-run"])
    with pytest.raises(SystemExit, match="sdist"):
        b.main(["avx2", "--src", str(tmp_path / "nope.zip"), "--dry-run"])


def test_build_llama_bench_targets_and_server_flag(tmp_path, capsys):
    b = _tool("build_llama_bench")
    assert b.parse_targets("all") == b.ALL_TARGETS
    assert b.parse_targets(" llama-server,all") == ("llama-server", "llama-bench", "llama-quantize",
                                                    "llama-batched-bench")
    assert "-DLLAMA_BUILD_SERVER=OFF" in b.cmake_args("avx2", "s", "b")
    assert "-DLLAMA_BUILD_SERVER=OFF" in b.cmake_args("avx2", "s", "b", ("llama-batched-bench",))
    on = b.cmake_args("avx2", "s", "b", ("llama-server",))
    assert "-DLLAMA_BUILD_SERVER=ON" in on and "-DLLAMA_USE_PREBUILT_UI=OFF" in on and "-DLLAMA_CURL=OFF" in on
    (tmp_path / "CMakeLists.txt").write_text("")
    common = ["avx512vnni", "--src", str(tmp_path), "--build-dir", str(tmp_path / "b"), "--dry-run"]
    assert b.main(common) == 0
    cmake, build = capsys.readouterr().out.splitlines()[:2]
    assert "-DLLAMA_BUILD_SERVER=OFF" in cmake.split()
    assert build.endswith("--target llama-bench llama-quantize")
    assert b.main(common + ["--targets", "all"]) == 0
    cmake, build = capsys.readouterr().out.splitlines()[:2]
    assert "-DLLAMA_BUILD_SERVER=ON" in cmake.split()
    assert build.endswith("--target llama-bench llama-quantize llama-batched-bench llama-server")
    with pytest.raises(SystemExit, match="unknown target"):
        b.main(common + ["--targets", "llama-cli"])


def test_requantize_names_and_refusals(tmp_path):
    r = _tool("requantize")
    assert r.out_path("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "/c", "Q6_K") == "/c/SmolLM2-135M-Instruct.Q6_K.gguf"
    with pytest.raises(SystemExit, match="no model"):
        r.main(["--model", str(tmp_path / "none.gguf"), "--out", str(tmp_path)])
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(SystemExit, match="no llama-quantize"):
        r.main(["--model", str(tmp_path / "m.gguf"), "--quantize", str(tmp_path / "none"), "--out", str(tmp_path)])


def test_isa_class_from_llama_cpp_system_info():
    assert isa_from_system_info("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX_VNNI = 0 | AVX512 = 0 |") == "avx2"
    assert isa_from_system_info("CPU : AVX2 = 1 | AVX_VNNI = 1 | AVX512 = 0 |") == "avxvnni"
    assert isa_from_system_info("CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 |") == "avx512vnni"
    assert isa_from_system_info("CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 0 |") == "avx2"
    assert isa_from_system_info("CPU : NEON = 1 | ARM_FMA = 1 |") == "generic"
    notes = format_notes([{"ctk": "f16", "ctv": "f16", "isa": "avx2", "llamacpp": {"isa": "avxvnni"}}])
    assert "ISA class: pykv avx2 | llama.cpp avxvnni" in notes


def test_compile_note_once_and_compile_time_excluded():
    """First run: one stderr line at the first real compile (never on a cache load, never twice), and
    the compile seconds that generate() subtracts from its tokens/s."""
    import io

    from numba import njit

    from pykv.kernels import jitnote
    old = dict(jitnote._state)
    buf = io.StringIO()
    try:
        jitnote._state["said"] = False
        jitnote.install(buf)
        c0 = jitnote.compile_seconds()

        def f(x):
            return x + 1

        def g(x):
            return x * 2

        assert njit(f)(1) == 2 and njit(g)(2) == 4
        lines = buf.getvalue().splitlines()
        assert len(lines) == 1 and "compiling kernels" in lines[0], lines
        assert jitnote.compile_seconds() > c0
        c1 = jitnote.compile_seconds()
        njit(f)                                   # no compile until called: nothing added
        assert jitnote.compile_seconds() == c1
    finally:
        jitnote._state.update({k: old[k] for k in ("said", "stream")})


def test_cache_save_time_counted_as_compile_time():
    """Numba saves a kernel to its cache after the compile event has ended; that save is compile time
    too (a cold first decode step spent 0.2 s there, counted in its tokens/s), but not when it happens
    inside an outer compile (already in that compile's seconds)."""
    import time

    from numba.core import caching

    from pykv.kernels import jitnote
    assert getattr(caching.Cache.save_overload, "pykv_timed", False)
    assert getattr(caching.Cache.load_overload, "pykv_timed", False)

    slow = jitnote._timed(lambda self, sig, data: time.sleep(0.05))
    c0 = jitnote.compile_seconds()
    slow(None, "sig", "data")
    assert jitnote.compile_seconds() - c0 >= 0.05
    with jitnote._lock:
        jitnote._state["depth"] += 1          # as inside a compile: its own clock runs
        t_in = time.perf_counter()
        jitnote._state["t0"] = t_in
    try:
        c1 = jitnote._state["total"]
        slow(None, "sig", "data")
        assert jitnote._state["total"] == c1
    finally:
        with jitnote._lock:
            jitnote._state["depth"] -= 1


_CACHED_MOD = """
from numba import njit
@njit(cache=True)
def f(x):
    return x * 3 + 1
"""

_LOAD_PROBE = """
import io, sys
sys.path.insert(0, sys.argv[1])
from pykv.kernels import jitnote
buf = io.StringIO()
jitnote.install(buf)
c0 = jitnote.compile_seconds()
import cachedmod
assert cachedmod.f(2) == 7
print(jitnote.compile_seconds() - c0, repr(buf.getvalue()), cachedmod.f.stats.cache_hits.total())
"""


def test_cache_load_time_excluded_without_a_note(tmp_path):
    """A warm run: loading a kernel from Numba's cache prints no compile note, and its seconds are
    excluded from the tokens/s like a compile's (else a warm `pykv run` reported a third of its speed)."""
    import os
    import subprocess
    import sys
    (tmp_path / "cachedmod.py").write_text(_CACHED_MOD)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "nc"))
    run = [sys.executable, "-c", _LOAD_PROBE, str(tmp_path)]
    cold = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    warm = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert cold.returncode == 0 and warm.returncode == 0, cold.stderr + warm.stderr
    secs, note, hits = warm.stdout.split(" ", 2)
    assert hits.strip() == "1"                   # the warm run loaded f from the cache
    assert float(secs) > 0.0 and note == "''"    # timed, and no "compiling" line
    assert "compiling kernels" in cold.stdout     # the cold run compiled it, and said so


def test_literal_kernels_compile_only_their_literal_signature():
    """matmul._call_kind compiles (or loads) a literally() kernel's literal signature directly: a plain
    first call typed it with int64 first (Numba's untyped passes and inlining, ~1 s a kernel in every
    process, warm cache or not) only to retry with the literals."""
    import numpy as np
    from numba import literally, njit
    from numba.core import event

    from pykv.kernels import matmul as M

    @njit
    def k(kind, x):
        literally(kind)
        return x * kind

    seen = []

    class Rec(event.Listener):
        def on_start(self, ev):
            if ev.data["dispatcher"] is k:
                seen.append(ev.data["args"])

        def on_end(self, ev):
            pass

    rec = Rec()
    event.register("numba:compile", rec)
    try:
        assert M._call_kind(k, 3, np.float32(2.0)) == 6.0
        assert M._call_kind(k, 3, np.float32(1.5)) == 4.5      # the kept entry point
    finally:
        event.unregister("numba:compile", rec)
    assert len(seen) == 1 and "Literal[int](3)" in str(seen[0]), seen


ZEN3 = {"avx2", "fma", "f16c"}
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512vnni"}      # LLVM's feature names
ZEN5 = ZEN4 | {"avxvnni"}


def test_class_table_classes_a_host_runs():
    """AVX-VNNI (VEX) is its own CPUID flag: a Zen 4 runs AVX-512 VNNI code but not the avxvnni class's."""
    ct = _tool("class_table")
    assert ct.runnable_classes(ZEN3) == ["avx2"]
    assert ct.runnable_classes(ZEN4) == ["avx2", "avx512vnni"]
    assert ct.runnable_classes(ZEN5) == ["avx2", "avxvnni", "avx512vnni"]
    assert ct.runnable_classes({"avx2"}) == []                 # no FMA / F16C: not even the avx2 class
    assert ct.class_env("avx512vnni", "avx512vnni", {}) == {}  # the host's own class: no override
    assert ct.class_env("avxvnni", "avx512vnni", {"avxvnni": "alderlake"}) == {
        "NUMBA_CPU_NAME": "alderlake", "NUMBA_CPU_FEATURES": ""}


def test_class_table_dry_run_and_refusals(monkeypatch, capsys, tmp_path):
    ct = _tool("class_table")
    monkeypatch.setattr(ct, "host_flags", lambda: ZEN5)
    assert ct.main(["--files", "Q4_1,Q6_K", "--passes", "1", "--dry-run", "--llama-bench-dir", str(tmp_path),
                    "--cpu-name", "avx2=znver3"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 * 3                                  # 3 classes x (2 files + the depth run)
    avx2 = [x for x in lines if " avx2 " in x]
    assert all("NUMBA_CPU_NAME='znver3'" in x and str(tmp_path / "avx2" / "bin" / "llama-bench") in x for x in avx2)
    top = [x for x in lines if " avx512vnni " in x]
    assert top and not any("NUMBA_CPU_NAME" in x for x in top)
    assert any("-d 4096 -ctk f16,q8_0" in x for x in top)
    monkeypatch.setattr(ct, "host_flags", lambda: ZEN3)
    assert ct.main(["--classes", "avxvnni", "--dry-run"]) == 2
    assert "cannot run class avxvnni" in capsys.readouterr().err
    # without --dry-run, missing files and peers are named before anything runs
    assert ct.main(["--files", str(tmp_path / "nope.gguf"), "--llama-bench-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nope.gguf" in err and "llama-bench" in err


def test_class_table_setup_makes_only_what_is_missing(monkeypatch, capsys, tmp_path):
    """--setup on a fresh host: the sdist, each class's peer, the requantized files, in that order, and
    nothing that is already there."""
    ct = _tool("class_table")
    monkeypatch.setattr(ct, "host_flags", lambda: ZEN4)
    monkeypatch.setattr(ct, "SRC_DIR", str(tmp_path / "src"))
    model = tmp_path / "m.Q4_1.gguf"
    model.write_bytes(b"GGUF")
    lb, rq = tmp_path / "lb", tmp_path / "rq"
    args = ["--files", "Q4_1,Q6_K,Q8_0", "--passes", "1", "--no-depth", "--model", str(model), "--llama-bench-dir",
            str(lb), "--requant-dir", str(rq), "--setup", "--dry-run"]
    assert ct.main(args) == 0
    steps = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[setup ")]
    assert [x.split()[1] for x in steps] == ["sdist", "build", "build", "requantize"]
    assert [x.split()[2] for x in steps[1:3]] == ["avx2", "avx512vnni"]       # the classes a Zen 4 runs
    assert "pip download" in steps[0] and "llama-cpp-python==0.3.36" in steps[0]
    assert f"--src {tmp_path / 'src' / ct.SDIST_FILE} " in steps[1]       # the downloaded sdist
    assert f"--build-dir {lb / 'avx512vnni'}" in steps[2] and "--src " in steps[2]
    assert "--types Q6_K,Q8_0" in steps[3] and str(lb / "avx2" / "bin" / "llama-quantize") in steps[3]
    # a given source tree: no download; a built peer and a made file: not again
    for c in ("avx2",):
        (lb / c / "bin").mkdir(parents=True)
        (lb / c / "bin" / "llama-bench").write_text("")
    rq.mkdir()
    (rq / "m.Q6_K.gguf").write_text("")
    assert ct.main(args + ["--src", str(tmp_path)]) == 0
    steps = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[setup ")]
    assert len(steps) == 2 and "build avx512vnni" in steps[0] and f"--src {tmp_path} " in steps[0]
    assert "--types Q8_0 " in steps[1]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / ct.SDIST_FILE).write_text("")            # fetched before: not again
    assert ct.main(args) == 0
    steps = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[setup ")]
    assert [x.split()[1] for x in steps] == ["build", "requantize"]


def test_class_table_ratios_and_misses():
    ct = _tool("class_table")
    deep = [{"ctk": "f16", "tg_tps": 45.0, "llamacpp": {"tg_tps": 32.0}},
            {"ctk": "q8_0", "tg_tps": 63.0, "llamacpp": {"tg_tps": 21.0}}]
    ours, best, r = ct.depth_ratio(deep)
    assert (ours, best) == (63.0, 32.0) and r == pytest.approx(63 / 32)   # against llama.cpp's best cache
    cell = lambda tg, pp: {"tg_ratio": tg, "pp_ratio": pp, "tg_tps": 100.0, "pp_tps": 400.0}  # noqa: E731
    res = {("avx2", "Q4_1"): [cell(1.3, 2.4), cell(1.2, 2.5)], ("avx2", "Q6_K"): [cell(0.97, 1.1), cell(1.05, 1.2)]}
    text = ct.table(res, {"avx2": [(63.0, 32.0, 1.97), (50.0, 40.0, 1.25)]}, ["avx2"], ["Q4_1", "Q6_K"], 2)
    assert "| avx2 | Q6_K | **0.97** / 1.05 | 1.10 / 1.20 |" in text
    assert "decode @ d16 >= 1.0x: missed in avx2 Q6_K 0.97" in text
    assert "prefill pp512 >= 1.0x: met in every cell" in text
    assert "**1.25**" in text and "missed in avx2 1.25" in text


def test_cuda_ptx_check_assembles_and_reports_constant_data(tmp_path):
    """tools/cuda_ptx_check's ptxas step (no GPU and no CUDA here: a stand-in ptxas): a PTX .version newer
    than the assembler is lowered to the one it names and assembled again; the constant-data error an
    H200 gave is reported as a failure; the .const bytes of a module are summed."""
    import shutil
    c = _tool("cuda_ptx_check")
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\n"
                    "src=\"$3\"\n"
                    "if grep -q '^.version 9.0' \"$src\"; then\n"
                    "  echo \"ptxas $src, line 9; fatal   : Unsupported .version 9.0; current version is '8.8'\" >&2; exit 255; fi\n"
                    "if grep -q 'big' \"$src\"; then\n"
                    "  echo 'ptxas error   : File uses too much global constant data (0x111c0 bytes, 0x10000 max)' >&2; exit 255; fi\n"
                    "[ \"$2\" = -arch=sm_90 ] || exit 3\n"
                    "echo 'ptxas info    : Used 118 registers, used 1 barriers, 34112 bytes smem' >&2\n"
                    "echo 'ptxas info    : 0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads' >&2\n"
                    "touch \"$5\"\n")
    fake.chmod(0o755)
    ptx = (".version 9.0\n.target sm_90\n"
           ".const .align 4 .b8 _cudapy_cmem[80] = {0};\n"
           ".const .align 4 .b8 _cudapy_cmem$1[9216] = {0};\n")
    assert c.const_bytes(ptx) == 9296
    assert c.assemble(str(fake), ptx, (9, 0)) == "ok (118 registers, 0 B spill stores, 34112 B shared)"  # .version lowered
    got = c.assemble(str(fake), ptx + "// big\n", (9, 0))
    assert got.startswith("FAILED") and "too much global constant data" in got, got
    assert c.find_ptxas(None, str(tmp_path / "none")) == shutil.which("ptxas")     # no wheel there: PATH's
    assert c.find_ptxas("/x/ptxas", str(tmp_path / "none")) == "/x/ptxas"
    site = tmp_path / "site" / "nvidia" / "cuda_nvcc" / "bin"
    site.mkdir(parents=True)
    (site / "ptxas").write_text("")
    assert c.find_ptxas(None, str(tmp_path / "site")) == str(site / "ptxas")
