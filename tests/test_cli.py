"""The command line end to end, bad inputs included (one-line error, non-zero exit, no traceback)."""

import numpy as np

from tests.reference import write_tiny_gguf
from tests.util import assert_clean_error, run_module


def pykv(*args, timeout=600):
    return run_module("pykv", *args, timeout=timeout)


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
    name = b"blk.0.attn_q.weight"
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
    assert_clean_error(pykv("run", "hello there", "--kv-budget", "1KiB", "-n", "2"), "budget")


def test_bad_kv_type():
    assert_clean_error(pykv("run", "hello", "-ctk", "q3_z"), "q3_z")
