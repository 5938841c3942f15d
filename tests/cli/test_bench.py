"""`pykv bench`: cells, keys and output shape on a tiny synthetic model (speeds are never asserted)."""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reference import write_tiny_gguf
from tests.util import assert_clean_error, run_module, error_lines

KEYS = {"depth", "ctk", "ctv", "threads", "pp_tps", "tg_tps", "n_prompt", "n_gen", "reps", "model",
        "kv_rotate", "pp_samples", "tg_samples"}


def bench(*args, timeout=600):
    return run_module("pykv", "bench", *args, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gguf import GGMLQuantizationType as T
    return str(write_tiny_gguf(tmp_path_factory.mktemp("bench") / "tiny.gguf", {"default": T.Q8_0}))


def table_rows(text):
    lines = [l for l in text.splitlines() if l.startswith("|")]
    assert len(lines) >= 2 and set(lines[1].replace("|", "").split()) <= {"---", "---:"}, text
    return lines[0], lines[2:]


def test_json_cells(tiny):
    r = bench(tiny, "-p", "8", "-n", "3", "-d", "0,16", "-ctk", "f16,q8_0,q4_0", "-t", "1", "-r", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert error_lines(r.stderr) == []      # progress only on a TTY (a cold cache's compile note aside)
    rows = json.loads(r.stdout)
    assert isinstance(rows, list)
    cells = [(c["ctk"], c["ctv"], c["depth"]) for c in rows]
    assert sorted(cells) == sorted((k, k, d) for k in ("f16", "q8_0", "q4_0") for d in (0, 16))
    for c in rows:
        assert KEYS <= set(c), set(c)
        assert c["threads"] == 1 and c["n_prompt"] == 8 and c["n_gen"] == 3 and c["reps"] == 1
        assert c["pp_tps"] > 0 and c["tg_tps"] > 0
        assert len(c["pp_samples"]) == 1 and len(c["tg_samples"]) == 1
        assert "llamacpp" not in c
    rot = {c["ctk"]: c["kv_rotate"] for c in rows}
    assert rot["q4_0"] is True and rot["f16"] is False      # auto: on for 4-bit types


def test_markdown_one_row_per_cell(tiny):
    r = bench(tiny, "-p", "8", "-n", "2", "-d", "0,8,24", "-ctk", "q8_0", "-ctv", "f16,q4_0", "-t", "1",
              "-r", "2", "--kv-rotate", "off")
    assert r.returncode == 0, r.stderr
    head, rows = table_rows(r.stdout)
    assert "pp8 t/s" in head and "tg2 t/s" in head and "depth" in head
    assert len(rows) == 2 * 3                     # K q8_0 x V {f16, q4_0} x 3 depths
    seen = set()
    for row in rows:
        cols = [c.strip() for c in row.strip("|").split("|")]
        assert cols[2] == "q8_0" and cols[3] in ("f16", "q4_0") and cols[4] == "off"
        seen.add((cols[3], int(cols[5])))
        for fig in cols[6:8]:
            assert float(fig.split("±")[0]) > 0
    assert seen == {(v, d) for v in ("f16", "q4_0") for d in (0, 8, 24)}


def test_skip_pp_or_tg_and_lists(tiny):
    from pykv.tools.bench import format_markdown, run_bench
    rows = run_bench(tiny, n_prompt="0", n_gen=[2], depth="4", ctk="q8_0", threads="1", reps=2, progress=False)
    assert len(rows) == 1 and rows[0]["pp_tps"] is None and rows[0]["tg_tps"] > 0
    assert len(rows[0]["tg_samples"]) == 2
    head, body = table_rows(format_markdown(rows))
    assert "tg2" in head and "pp" not in head and len(body) == 1
    rows = run_bench(tiny, n_prompt="4,8", n_gen="0", depth="0", ctk="f16", threads=[1], reps=1, progress=False)
    assert [(r["n_prompt"], r["tg_tps"]) for r in rows] == [(4, None), (8, None)]
    assert all(r["pp_tps"] > 0 for r in rows)
    head, body = table_rows(format_markdown(rows))
    assert "n_prompt" in head and len(body) == 2


@pytest.mark.parametrize("args, fragment", [
    (["-ctk", "q9_9"], "q9_9"),
    (["-ctk", "f16", "-ctv", "nope"], "nope"),
    (["-d", "abc"], "-d"),
    (["-p", "-5"], "-p"),
    (["-t", "0"], "threads"),
    (["-r", "0"], "repetitions"),
    (["-p", "0", "-n", "0"], "nothing to measure"),
])
def test_bad_input_one_line_error(tiny, args, fragment):
    assert_clean_error(bench(tiny, *args, "-r", "1") if "-r" not in args else bench(tiny, *args), fragment)


def test_missing_model_one_line_error():
    assert_clean_error(bench("/nonexistent/model.gguf", "-p", "4", "-n", "1", "-r", "1"), "not found")


def test_register_cli_wires_subcommand():
    from pykv.cli.bench import cmd_bench, register_cli
    ap = argparse.ArgumentParser(prog="pykv")
    register_cli(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(["bench", "m.gguf", "-p", "512", "-n", "128", "-d", "0,1024,4096", "-ctk", "f16,q8_0,q4_0",
                       "-t", "2", "--json", "--compare-llamacpp", "-fa", "on", "--kv-rotate", "on"])
    assert a.func is cmd_bench and a.model == "m.gguf" and a.n_depth == "0,1024,4096" and a.repetitions == 3
    assert a.cache_type_k == "f16,q8_0,q4_0" and a.cache_type_v is None and a.json and a.compare_llamacpp
    assert a.flash_attn == "on" and a.kv_rotate == "on" and a.threads == "2"


def test_compare_llamacpp_missing_or_unloadable(tiny):
    """Without llama-cpp-python: a one-line error; with it: pykv figures still come back, the llama.cpp
    side of a model it cannot load is reported, not fatal."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert_clean_error(bench(tiny, "-p", "4", "-n", "1", "-r", "1", "--compare-llamacpp"), "llama-cpp-python")
        return
    r = bench(tiny, "-p", "4", "-n", "1", "-r", "1", "-t", "1", "--compare-llamacpp", "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert row["pp_tps"] > 0 and "llamacpp" in row


def test_compare_llamacpp_real_model(smollm2_path):
    pytest.importorskip("llama_cpp")
    r = bench(smollm2_path, "-p", "8", "-n", "2", "-d", "0,8", "-ctk", "f16,q4_0", "-t", "1", "-r", "1",
              "--compare-llamacpp", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(c["ctk"], c["depth"]) for c in rows] == [("f16", 0), ("f16", 8), ("q4_0", 0), ("q4_0", 8)]
    for c in rows:
        lc = c["llamacpp"]
        assert lc["pp_tps"] > 0 and lc["tg_tps"] > 0 and c["pp_ratio"] > 0 and c["tg_ratio"] > 0
        if c["ctv"] == "q4_0":
            assert lc["pp_fa"] == lc["tg_fa"] == "on"   # llama.cpp: a quantized V cache needs fa
        else:
            assert lc["pp_fa"] in ("on", "off")
    r = bench(smollm2_path, "-p", "8", "-n", "2", "-ctk", "q8_0", "-t", "1", "-r", "1", "--compare-llamacpp",
              "-fa", "off")
    assert r.returncode == 0, r.stderr
    head, body = table_rows(r.stdout)
    assert "llama.cpp" in head and len(body) == 1
    assert "flash attention" in r.stdout             # the note on why the llama.cpp cell is empty


def test_pykv_cli_bench_subcommand(tiny):
    r = subprocess.run([sys.executable, "-m", "pykv", "bench", tiny, "-p", "4", "-n", "1", "-r", "1", "-t", "1",
                        "-ctk", "q8_0", "--json"], capture_output=True, text=True, timeout=600,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    assert row["ctk"] == row["ctv"] == "q8_0" and row["pp_tps"] > 0 and row["tg_tps"] > 0


# ---- --llama-bench: llama.cpp's own benchmark binary as the peer ------------------------------------------------
# tests/data/llama_bench_smollm2.json: what llama-bench (llama.cpp of the llama-cpp-python 0.3.36 sdist, built by
# tools/build_llama_bench.py avx2) printed for `-m SmolLM2-135M-Instruct.Q4_1.gguf -p 16 -n 4 -d 0,8 -t 1 -r 2
# -ctk f16 -ctv f16 -fa on,off -o json`.
LLAMA_BENCH_JSON = Path(__file__).parents[1] / "data" / "llama_bench_smollm2.json"


def test_parse_llama_bench_real_output():
    """Each cell takes llama-bench's pp test (n_prompt=p, n_gen=0) and tg test (n_prompt=0, n_gen=n) at its depth,
    the better flash-attention setting of each, as the median of its samples."""
    import statistics
    from pykv.tools.bench import _plan, parse_llama_bench
    tests = json.loads(LLAMA_BENCH_JSON.read_text())
    assert {(e["n_prompt"], e["n_gen"], e["n_depth"]) for e in tests} == {(16, 0, 0), (0, 4, 0), (16, 0, 8), (0, 4, 8)}
    plan = _plan("16", "4", "0,8", "f16", None, "1", 2)
    cells = parse_llama_bench(LLAMA_BENCH_JSON.read_text(), plan, "avx2")
    assert sorted(cells) == [(16, 4, 0), (16, 4, 8)]
    for (p, n, d), c in cells.items():
        for name, key in (("pp", (p, 0, d)), ("tg", (0, n, d))):
            runs = [e for e in tests if (e["n_prompt"], e["n_gen"], e["n_depth"]) == key]
            assert len(runs) == 2                                         # fa on and off
            best = max(runs, key=lambda e: statistics.median(e["samples_ts"]))
            assert c[f"{name}_tps"] == pytest.approx(statistics.median(best["samples_ts"]))
            assert c[f"{name}_samples"] == best["samples_ts"]
            assert c[f"{name}_fa"] == ("on" if best["flash_attn"] else "off")
        assert c["isa"] == "avx2"


@pytest.mark.parametrize("text", ["", "not json", '[{"n_prompt": 1}]', "{}"])
def test_parse_llama_bench_garbage_is_a_clean_error(text):
    from pykv.tools.bench import _plan, parse_llama_bench
    from pykv.files.config import PykvError
    with pytest.raises(PykvError, match="llama-bench"):
        parse_llama_bench(text, _plan("16", "4", "0", "f16", None, "1", 1), "avx2")


def _fake_llama_bench(folder, body):
    exe = folder / "llama-bench"
    exe.write_text(f"#!{sys.executable}\n{body}\n")
    exe.chmod(0o755)
    return exe


def test_llama_bench_option_runs_the_binary(tiny, tmp_path):
    """--llama-bench PATH: one llama-bench run per K/V pair and thread count, with llama-bench's own flags; its
    figures land in the cells; a failing binary is a note, not a failure; a missing one a one-line error."""
    log = tmp_path / "argv.jsonl"
    exe = _fake_llama_bench(tmp_path, f"import json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                                      f"sys.stdout.write(open({str(LLAMA_BENCH_JSON)!r}).read())")
    r = bench(tiny, "-p", "16", "-n", "4", "-d", "0,8", "-ctk", "f16,q8_0", "-t", "1", "-r", "1", "--json",
              "--llama-bench", str(exe))
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    argvs = [json.loads(l) for l in log.read_text().splitlines()]
    assert len(argvs) == 2
    for argv, ctk, fa in zip(argvs, ("f16", "q8_0"), ("on,off", "on")):
        opts = dict(zip(argv[::2], argv[1::2]))
        assert opts == {"-m": tiny, "-p": "16", "-n": "4", "-d": "0,8", "-t": "1", "-r": "1", "-ctk": ctk, "-ctv": ctk,
                        "-fa": fa, "-o": "json"}
    from pykv.tools.bench import _plan, parse_llama_bench
    want = parse_llama_bench(LLAMA_BENCH_JSON.read_text(), _plan("16", "4", "0,8", "f16", None, "1", 1), "unknown")
    for row in rows:
        lc = row["llamacpp"]
        assert lc["tg_tps"] == pytest.approx(want[(16, 4, row["depth"])]["tg_tps"])
        assert lc["isa"] == "unknown"                 # no libggml-cpu.so beside the fake binary
        assert row["tg_ratio"] == pytest.approx(row["tg_tps"] / lc["tg_tps"])
    (tmp_path / "bad").mkdir()
    bad = _fake_llama_bench(tmp_path / "bad", "import sys\nsys.stderr.write('error: failed to load model\\n')\nsys.exit(1)")
    r = bench(tiny, "-p", "4", "-n", "1", "-t", "1", "-r", "1", "--llama-bench", str(bad))
    assert r.returncode == 0, r.stderr
    assert "llama-bench exited with 1: error: failed to load model" in r.stdout
    assert_clean_error(bench(tiny, "-p", "4", "-n", "1", "-r", "1", "--llama-bench", str(tmp_path / "none")),
                       "not an executable file")


def test_llama_bench_isa_of_a_real_build():
    """The class read from a real build's libggml-cpu.so (skipped where tools/build_llama_bench.py has not run)."""
    import os
    from pykv.tools.bench import llama_bench_isa
    found = False
    for isa in ("avx2", "avxvnni", "avx512vnni"):
        exe = os.path.expanduser(f"~/.cache/pykv/llama-bench/{isa}/bin/llama-bench")
        if os.path.exists(exe):
            found = True
            assert llama_bench_isa(exe) == isa
    if not found:
        pytest.skip("no llama-bench built by tools/build_llama_bench.py on this host")


def test_rounds_alternate_and_pool_samples(tiny, tmp_path):
    """--rounds K: pykv then llama-bench, K times in turn; each side's samples pooled over the rounds (the
    figure is their median); --rounds 0 is a one-line error."""
    log = tmp_path / "argv.jsonl"
    exe = _fake_llama_bench(tmp_path, f"import json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                                      f"sys.stdout.write(open({str(LLAMA_BENCH_JSON)!r}).read())")
    r = bench(tiny, "-p", "16", "-n", "4", "-d", "0", "-t", "1", "-r", "2", "--rounds", "3", "--json",
              "--llama-bench", str(exe))
    assert r.returncode == 0, r.stderr
    assert len(log.read_text().splitlines()) == 3          # one llama-bench run a round
    (row,) = json.loads(r.stdout)
    assert row["rounds"] == 3
    assert len(row["pp_samples"]) == len(row["tg_samples"]) == 6         # 3 rounds x -r 2
    assert row["tg_tps"] == pytest.approx(statistics.median(row["tg_samples"]))
    from pykv.tools.bench import _plan, parse_llama_bench
    one = parse_llama_bench(LLAMA_BENCH_JSON.read_text(), _plan("16", "4", "0", "f16", None, "1", 1), "unknown")[(16, 4, 0)]
    lc = row["llamacpp"]
    assert lc["tg_samples"] == one["tg_samples"] * 3
    assert lc["tg_tps"] == pytest.approx(statistics.median(one["tg_samples"] * 3))
    assert lc["tg_fa"] == one["tg_fa"]                     # the same setting won every round: named once
    from pykv.tools.bench import _pool_llama
    cells = {}
    for fa in ("off", "on", "on"):
        _pool_llama(cells, {(1, 1, 0): {"pp_tps": None, "tg_tps": 1.0, "tg_samples": [1.0], "tg_fa": fa}})
    assert cells[(1, 1, 0)]["tg_fa"] == "off,on" and cells[(1, 1, 0)]["tg_samples"] == [1.0] * 3
    assert_clean_error(bench(tiny, "-p", "4", "-n", "1", "-r", "1", "--rounds", "0", "--llama-bench", str(exe)),
                       "--rounds")
