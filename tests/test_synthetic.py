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


@pytest.mark.parametrize("qtype", ["q4_k_m", "q8_0"])
def test_synthetic_tiny_shape_matches_reference(tmp_path, qtype):
    out = tmp_path / f"tiny-{qtype}.gguf"
    r = subprocess.run([sys.executable, str(TOOL), "tiny", str(out), "--type", qtype], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    if qtype == "q4_k_m":       # llama-quantize's mix: Q4_K, Q6_K for the tied output and some attn_v / ffn_down
        assert types["blk.0.ffn_gate.weight"] == "Q4_K" and types["token_embd.weight"] == "Q6_K"
        assert types["blk.0.ffn_down.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    m = pykv.load(str(out), n_ctx=64)
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
