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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # mixed weight types (a K-quant, a float, the Q4_1 / Q8_0 of SmolLM2); 2 layers; G = 2
    return str(write_tiny_gguf(tmp_path_factory.mktemp("cuda") / "tiny.gguf",
                               {"default": T.Q4_1, "token_embd": T.Q8_0, "attn_q": T.Q4_K, "ffn_down": T.F16},
                               dim=64, ff=64, n_heads=2, n_kv=1, n_layers=2))


def test_greedy_cuda_equals_cpu(tiny, kv="q4_0"):
    """Prefill (T > 1, the smoothing first batch, rotation on for q4_0) then decode steps sampled on the
    device: the same tokens as the CPU in exact (float-activation) mode, logits within float32 tolerance.
    A q4_0 cache: rotation, key smoothing and sink rows on the device too."""
    cuda_or_skip()
    import pykv
    cpu = pykv.load(tiny, n_ctx=64, q8_act=False, kv_type_k=kv, kv_type_v=kv)
    gpu = pykv.load(tiny, n_ctx=64, device="cuda", kv_type_k=kv, kv_type_v=kv)
    assert gpu.rotate == cpu.rotate == (kv != "f16")
    prompt = [256, 72, 101]
    a = cpu.eval(cpu.new_sequence(), prompt)
    b = gpu.eval(gpu.new_sequence(), prompt)
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
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
