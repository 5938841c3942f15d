"""Argument handling of the benchmark tools (tools/build_llama_bench.py, tools/requantize.py) and the
ISA-class line of `pykv bench --compare-llamacpp`; nothing is built or quantized here."""
import importlib.util
from pathlib import Path

import pytest

from pykv.bench import format_notes, isa_from_system_info

TOOLS = Path(__file__).resolve().parent.parent / "tools"


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
