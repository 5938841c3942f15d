"""The whole decoder on the cuda backend (simulator): greedy generation equals the CPU's tokens on a
tiny synthetic model; `--device cuda` without a GPU is a one-line error with exit code 2."""
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tests.cuda_util import cuda_or_skip
from tests.reference import write_tiny_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # mixed weight types (Q5_1, F16 and the Q4_1 / Q8_0 of SmolLM2; K-quants need 256 columns); G = 2
    return str(write_tiny_gguf(tmp_path_factory.mktemp("cuda") / "tiny.gguf",
                               {"default": T.Q4_1, "token_embd": T.Q8_0, "attn_q": T.Q5_1, "ffn_down": T.F16},
                               dim=64, ff=64, n_heads=2, n_kv=1, n_layers=1))


def test_greedy_cuda_equals_cpu(tiny, kv="q4_0"):
    """Prefill (T > 1, the key-smoothing first batch) then a decode step sampled on the device, through a
    q4_0 cache (rotation, key smoothing and sink rows on the device too): the same tokens as the CPU in
    exact (float-activation) mode. The simulator is slow (a Python thread per CUDA thread): one layer."""
    cuda_or_skip()
    import pykv
    cpu = pykv.load(tiny, n_ctx=64, q8_act=False, kv_type_k=kv, kv_type_v=kv)
    gpu = pykv.load(tiny, n_ctx=64, device="cuda", kv_type_k=kv, kv_type_v=kv)
    assert gpu.rotate == cpu.rotate == (kv != "f16")
    prompt = [256, 72, 101]
    a = cpu.eval(cpu.new_sequence(), prompt)
    b = gpu.eval(gpu.new_sequence(), prompt)
    # float32 rounding upstream can move a q4_0 code by one step: 1e-3 of the logits measured
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-2 * np.abs(a).max())
    want = list(cpu.generate(prompt, max_tokens=2, temperature=0))
    got = list(gpu.generate(prompt, max_tokens=2, temperature=0))
    assert got == want and gpu.last_stats["gen_tokens"] == cpu.last_stats["gen_tokens"] == 2


def test_device_cuda_without_gpu_is_one_line_exit_2(tiny):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=ROOT)
    env.pop("PYKV_REAL_GPU", None)
    code = "from numba import cuda; import sys; sys.exit(0 if cuda.is_available() else 1)"
    if subprocess.run([sys.executable, "-c", code], env=env).returncode == 0:
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, "-m", "pykv", "run", tiny, "hi", "-n", "1", "--device", "cuda"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "device cuda" in lines[0] and "Traceback" not in r.stderr, r.stderr


def _count_launches():
    """Wrap the simulator's kernel call: returns a list that grows by one name per kernel launch."""
    from numba.cuda.simulator import kernel as simk
    seen, call = [], simk.FakeCUDAKernel.__call__

    def counted(self, *args):
        if not self._device:
            seen.append(self.fn.__name__)
        return call(self, *args)
    return seen, counted


def test_fused_decode_chain_equals_separate_launches(tmp_path, monkeypatch):
    """cuda.chain's four fused launches per layer boundary (wo + residual, norm + gate/up + SwiGLU, down +
    residual, norm + Q/K/V) give the separate launches' logits bit for bit, with the rotated q4_0 cache
    (the attention output is rotated back inside the fused kernel); with RoPE + append and attention +
    merge one launch each, a decode token is at most 6 launches per layer."""
    cuda_or_skip()
    import pykv
    from numba.cuda.simulator import kernel as simk
    path = str(write_tiny_gguf(tmp_path / "t2.gguf", {"default": T.Q4_1, "token_embd": T.Q8_0, "attn_v": T.Q8_0,
                                                      "ffn_down": T.F16}, dim=64, ff=96, n_heads=2, n_kv=1,
                               n_layers=2))
    m = pykv.load(path, n_ctx=64, device="cuda", kv_type_k="q4_0", kv_type_v="q4_0")
    assert m.rotate
    prompt, steps = [256, 72, 101, 33], [7, 99, 3]
    runs = {}
    for fuse in ("0", "1"):
        monkeypatch.setenv("PYKV_CUDA_FUSE", fuse)
        seq = m.new_sequence()
        m.eval(seq, prompt)
        seen, counted = _count_launches()
        monkeypatch.setattr(simk.FakeCUDAKernel, "__call__", counted)
        out = [m.eval(seq, [t]).copy() for t in steps]
        monkeypatch.undo()
        runs[fuse] = (out, len(seen) // len(steps), set(seen))
    (a, na, _), (b, nb, names) = runs["0"], runs["1"]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert {"_out_kernel", "_gate_up_kernel", "_down_kernel", "_qkv_kernel", "_prep_append_kernel",
            "_seqs_kernel"} <= names
    L = 2
    assert nb == na - 4 * L - 1, (na, nb)     # eight launches per layer become four (and the last add goes)
    # per layer: norm + Q/K/V, RoPE + K/V append, attention + merge, out + residual, norm + gate/up + SwiGLU,
    # down + residual; per token: the embedding row, the output norm, its activation row and the head
    assert nb <= 6 * L + 4, (nb, sorted(names))
