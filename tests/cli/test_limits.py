"""Limits with clear errors, for every CLI command that takes the input: one line, exit 2 (a context
above the training context: one warning line, exit 0). pykv.cli.main runs in this process (no
interpreter start per case); the model is a tiny random GGUF (training context 512)."""
import os
import socket

import pytest
from gguf import GGMLQuantizationType as T

from tests.reference import write_tiny_gguf
from tests.cli.test_cli import cli
from tests.util import assert_clean_error

HF = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "hf_fixtures", "tf4_default_untied")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("limits")
    model = write_tiny_gguf(d / "tiny.gguf", {"default": T.Q8_0}, dim=64, ff=128, n_heads=2, n_kv=1)
    (d / "text.txt").write_text("The cat sat on the mat. " * 80)      # > 1024 byte-level tokens
    (d / "short.txt").write_text("The cat sat on the mat.")
    (d / "folder").mkdir()
    sock = socket.socket(socket.AF_UNIX)       # exists, is not a directory, and open() fails even for root
    sock.bind(str(d / "sock"))
    yield {"M": str(model), "TXT": str(d / "text.txt"), "SHORT": str(d / "short.txt"),
           "DIR": str(d / "folder"), "SOCK": str(d / "sock"),
           "MISSING": str(d / "missing.gguf"), "OUT": str(d / "out.gguf"), "OUTDIR": str(d / "hfout"), "HF": HF}
    sock.close()


def expand(args, files):
    return [files.get(a, a) for a in args]


# (command line with placeholders, fragment of the one error line); a row per bad input per command
ERRORS = {
    # prompt tokens + max tokens > n_ctx (perplexity: the text is shorter than one context)
    "run-ctx": (["run", "M", "hello world", "-c", "16", "-n", "20"], "exceed the context size 16"),
    "perplexity-ctx": (["perplexity", "M", "SHORT", "-c", "64"], "fewer than one chunk of -c 64"),
    # a KV budget too small for one page (plan: a memory that does not hold the weights)
    "run-budget": (["run", "M", "hi", "--kv-budget", "1KiB", "-n", "1", "-c", "256"], "cannot hold one page"),
    "perplexity-budget": (["perplexity", "M", "TXT", "-c", "64", "--kv-budget", "1KiB"], "cannot hold one page"),
    "plan-budget": (["plan", "M", "--memory", "1KiB"], "does not hold the weights"),
    # threads < 1
    "run-threads": (["run", "M", "hi", "-t", "0", "-n", "1", "-c", "256"], "threads must be >= 1"),
    "perplexity-threads": (["perplexity", "M", "TXT", "-t", "0", "-c", "256"], "threads must be >= 1"),
    "bench-threads": (["bench", "M", "-t", "0", "-r", "1"], "-t/--threads: values must be >= 1"),
    # unknown KV type
    "run-kv": (["run", "M", "hi", "-ctk", "q9_9", "-c", "256"], "unknown KV cache type 'q9_9'"),
    "perplexity-kv": (["perplexity", "M", "TXT", "-ctv", "q9_9", "-c", "256"], "unknown KV cache type 'q9_9'"),
    "perplexity-klbase": (["perplexity", "M", "TXT", "-c", "64", "--chunks", "1", "--kl-base", "q9_9"],
                          "unknown KV cache type 'q9_9'"),
    "bench-kv": (["bench", "M", "-ctk", "q9_9", "-r", "1"], "unknown KV cache type 'q9_9'"),
    # unknown registry name
    "run-registry": (["run", "no-such-model", "hi"], "model not found: no-such-model"),
    "perplexity-registry": (["perplexity", "no-such-model", "TXT"], "model not found: no-such-model"),
    "bench-registry": (["bench", "no-such-model", "-r", "1"], "model not found: no-such-model"),
    "plan-registry": (["plan", "no-such-model"], "model not found: no-such-model"),
    "pull-registry": (["pull", "no-such-model"], "model not found: no-such-model"),
    # a missing file
    "run-missing": (["run", "MISSING", "hi"], "not found"),
    "run-missing-prompt": (["run", "M", "-f", "MISSING"], "cannot read prompt file"),
    "perplexity-missing": (["perplexity", "MISSING", "TXT"], "not found"),
    "perplexity-missing-text": (["perplexity", "M", "MISSING"], "cannot read"),
    "bench-missing": (["bench", "MISSING", "-r", "1"], "not found"),
    "plan-missing": (["plan", "MISSING"], "not found"),
    "info-missing": (["info", "MISSING"], "not found"),
    "export-missing": (["export", "MISSING", "OUTDIR"], "not found"),
    "convert-missing": (["convert", "MISSING", "OUT"], "HF model folder not found"),
    "quantize-missing": (["quantize", "MISSING", "OUT", "q8_0"], "not found"),
    "quantize-missing-imatrix": (["quantize", "M", "OUT", "q4_k_m", "--imatrix", "MISSING"], "MISSING"),
    # an unreadable file (a socket: it exists, and open() fails even for root)
    "run-unreadable": (["run", "SOCK", "hi"], "not a regular file"),
    "run-unreadable-prompt": (["run", "M", "-f", "SOCK"], "cannot read prompt file"),
    "perplexity-unreadable": (["perplexity", "SOCK", "TXT"], "not a regular file"),
    "perplexity-unreadable-text": (["perplexity", "M", "SOCK"], "cannot read"),
    "bench-unreadable": (["bench", "SOCK", "-r", "1"], "not a regular file"),
    "plan-unreadable": (["plan", "SOCK"], "not a regular file"),
    "info-unreadable": (["info", "SOCK"], "not a regular file"),
    "export-unreadable": (["export", "SOCK", "OUTDIR"], "not a regular file"),
    "convert-unreadable": (["convert", "SOCK", "OUT"], "expected a HF model folder"),
    "quantize-unreadable": (["quantize", "SOCK", "OUT", "q8_0"], "not a regular file"),
    # a directory where a file is expected
    "run-dir": (["run", "DIR", "hi"], "is a directory"),
    "run-dir-prompt": (["run", "M", "-f", "DIR"], "is a directory"),
    "perplexity-dir": (["perplexity", "DIR", "TXT"], "is a directory"),
    "perplexity-dir-text": (["perplexity", "M", "DIR"], "is a directory"),
    "bench-dir": (["bench", "DIR", "-r", "1"], "is a directory"),
    "plan-dir": (["plan", "DIR"], "is a directory"),
    "info-dir": (["info", "DIR"], "is a directory"),
    "export-dir": (["export", "DIR", "OUTDIR"], "is a directory"),
    "export-out-file": (["export", "M", "TXT"], "not a folder"),
    "convert-out-dir": (["convert", "HF", "DIR"], "is a directory"),
    "quantize-dir": (["quantize", "DIR", "OUT", "q8_0"], "is a directory"),
    "quantize-out-dir": (["quantize", "M", "DIR", "q8_0"], "is a directory"),
    "quantize-dir-imatrix": (["quantize", "M", "OUT", "q4_k_m", "--imatrix", "DIR"], "DIR"),
    # unknown device (and cuda where no GPU is: tests/cuda/test_cuda_model.py)
    "run-device": (["run", "M", "hi", "--device", "tpu", "-n", "1", "-c", "256"], "unknown device 'tpu'"),
    "perplexity-device": (["perplexity", "M", "TXT", "--device", "tpu", "-c", "256"], "unknown device 'tpu'"),
    "bench-device": (["bench", "M", "--device", "tpu", "-r", "1"], "unknown device 'tpu'"),
    "chat-device": (["chat", "M", "--device", "tpu"], "unknown device 'tpu'"),
    "kv-sensitivity-device": (["kv-sensitivity", "M", "TXT", "--types", "q8_0", "--device", "tpu"], "unknown device 'tpu'"),
    # pykv chat: the same rows (its loop never starts)
    "chat-budget": (["chat", "M", "--kv-budget", "1KiB", "-c", "256"], "cannot hold one page"),
    "chat-threads": (["chat", "M", "-t", "0"], "threads must be >= 1"),
    "chat-kv": (["chat", "M", "-ctk", "q9_9", "-c", "256"], "unknown KV cache type 'q9_9'"),
    "chat-registry": (["chat", "no-such-model"], "model not found: no-such-model"),
    "chat-missing": (["chat", "MISSING"], "not found"),
    "chat-missing-state": (["chat", "M", "--load", "MISSING", "-c", "256"], "MISSING"),
    "chat-unreadable": (["chat", "SOCK"], "not a regular file"),
    "chat-dir": (["chat", "DIR"], "is a directory"),
    # pykv kv-sensitivity
    "kv-sensitivity-threads": (["kv-sensitivity", "M", "TXT", "-t", "0"], "threads must be >= 1"),
    "kv-sensitivity-kv": (["kv-sensitivity", "M", "TXT", "--types", "q9_9", "--no-cache"], "q9_9"),
    "kv-sensitivity-registry": (["kv-sensitivity", "no-such-model", "TXT"], "model not found: no-such-model"),
    "kv-sensitivity-missing": (["kv-sensitivity", "MISSING", "TXT"], "not found"),
    "kv-sensitivity-missing-text": (["kv-sensitivity", "M", "MISSING"], "MISSING"),
    "kv-sensitivity-dir": (["kv-sensitivity", "DIR", "TXT"], "is a directory"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_one_line_exit_2(case, files, capsys):
    args, fragment = ERRORS[case]
    r = cli(capsys, *expand(args, files))
    assert_clean_error(r, files.get(fragment, fragment))
    assert not os.path.exists(files["OUT"])          # no output appeared


# a context above the model's training context (512): one warning line, and the command still runs
WARNINGS = {
    "run": ["run", "M", "hi", "-c", "1024", "-n", "1", "--temp", "0"],
    "perplexity": ["perplexity", "M", "TXT", "-c", "1024", "--chunks", "1"],
    "bench": ["bench", "M", "-p", "600", "-n", "1", "-r", "1", "-t", "1"],
}


@pytest.mark.parametrize("cmd", list(WARNINGS))
def test_context_above_training_warns(cmd, files, capsys):
    r = cli(capsys, *expand(WARNINGS[cmd], files))
    assert r.returncode == 0, r.stderr
    warn = [l for l in r.stderr.splitlines() if "warning" in l]
    assert len(warn) == 1 and warn[0].startswith("pykv: warning: context size "), r.stderr
    assert warn[0].endswith("is above the model's training context 512: quality may drop past it")
    assert "Traceback" not in r.stderr
