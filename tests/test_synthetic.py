"""tools/make_synthetic.py: a file of a named shape that pykv loads and runs, and whose forward pass equals
the float64 reference (the big shapes stay in the benchmarks: docs/benchmarks.md)."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import pykv
from pykv.kernels import matmul as mm
from tests.reference import gguf_forward

TOOL = Path(__file__).resolve().parent.parent / "tools" / "make_synthetic.py"


@pytest.mark.parametrize("shape,qtype", [("tiny", "q4_k_m"), ("tiny", "q8_0"), ("tiny-spm", "q4_0")])
def test_synthetic_tiny_shape_matches_reference(tmp_path, shape, qtype):
    out = tmp_path / f"{shape}-{qtype}.gguf"
    r = subprocess.run([sys.executable, str(TOOL), shape, str(out), "--type", qtype], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    if qtype == "q4_k_m":       # llama-quantize's mix: Q4_K, Q6_K for the tied output and some attn_v / ffn_down
        assert types["blk.0.ffn_gate.weight"] == "Q4_K" and types["token_embd.weight"] == "Q6_K"
        assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    m = pykv.load(str(out), n_ctx=64)
    w = m.weights
    assert w.output.qt is not None           # the output product runs on a tile copy
    if shape == "tiny":                      # tied: one weight, one copy, read by get_rows and the product
        assert w.output is w.token_embd
    else:                                    # untied: token_embd is read by get_rows only, and not copied
        assert "output.weight" in types and w.token_embd.qt is None
        assert w.token_embd.nbytes == w.token_embd.raw.nbytes
    ids = m.tokenize("the quick brown fox")
    assert m.detokenize(ids[1:]) == "the quick brown fox"
    want = gguf_forward(str(out), ids)
    mm.set_exact(True)
    try:
        got = pykv.load(str(out), n_ctx=64, n_batch=4).forward(ids)
    finally:
        mm.set_exact(False)
    assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 1e-3


def test_synthetic_refuses_to_overwrite(tmp_path):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"keep")
    r = subprocess.run([sys.executable, str(TOOL), "tiny", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "exists" in r.stderr and out.read_bytes() == b"keep"
