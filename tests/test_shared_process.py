"""Several models in one process (an app that holds more than one): each gives the bits it gives alone.

Numba keeps compiled kernels per process and in its on-disk cache; a kernel specialized for one model
must never serve another whose weights, shapes or KV types differ.  The files and the cache folder are
fresh, and every model first runs in a process of its own, so that each one's specializations were
compiled by a different process (the case that mixed them up, issue 38)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pykv import tools as C

from .reference import write_tiny_gguf

FIX = Path(__file__).parent / "data" / "hf_fixtures"
IDS = list(range(1, 40))

# name -> load keywords (the fixture's head_dim, 16, is below the quantized KV types' blocks)
MODELS = {
    "fx-f32": {"kv_type_k": "f16", "kv_type_v": "f16"},                       # transformers' weights, f32
    "fx-q8": {"kv_type_k": "f32", "kv_type_v": "f32"},                        # the same, q8_0 (pykv quantize)
    "tiny-k": {"kv_type_k": "q8_0", "kv_type_v": "q4_1", "q8_act": False},    # another shape, K-quants
}

RUN = textwrap.dedent("""
    import sys, numpy as np, pykv
    out, names, files = sys.argv[1], sys.argv[2].split(","), dict(a.split("=", 1) for a in sys.argv[3:])
    kw = {MODELS_KW}
    res = {}
    for n in names:
        m = pykv.load(files[n], n_ctx=128, threads=2, **kw[n])
        res[n] = np.asarray(m.forward({IDS}))
        seq = m.new_sequence()
        m.eval(seq, {IDS}[:20])
        res[n + "/decode"] = np.concatenate([m.eval(seq, [t]) for t in {IDS}[20:28]])
    np.savez(out, **res)
""")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("shared_process")
    f32 = C.convert_hf(FIX / "tf4_default_untied", d / "fx-f32.gguf", outtype="f32")
    q8 = C.quantize_gguf(f32, d / "fx-q8.gguf", "q8_0")
    from gguf import GGMLQuantizationType as T
    tiny = write_tiny_gguf(d / "tiny-k.gguf", {"default": T.Q4_K, "attn_v": T.Q6_K, "token_embd": T.Q4_0},
                           dim=256, ff=512, n_heads=4, n_kv=1, n_vocab=320, seed=3)
    return d, {"fx-f32": str(f32), "fx-q8": str(q8), "tiny-k": str(tiny)}


def _run(d, names, tag):
    folder, paths = d
    out = folder / f"{tag}.npz"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(folder / "numba"), PYKV_COMPILE_HELPER="0")
    code = RUN.replace("{MODELS_KW}", repr(MODELS)).replace("{IDS}", repr(IDS))
    r = subprocess.run([sys.executable, "-c", code, str(out), ",".join(names)]
                       + [f"{n}={p}" for n, p in paths.items()], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(np.load(out))


@pytest.mark.slow
def test_models_in_one_process_equal_their_own(files):
    alone = {}
    for n in MODELS:                    # each compiles its kernels in a process of its own
        alone.update(_run(files, [n], n))
    for order in (list(MODELS), list(MODELS)[::-1]):   # every pair in both orders
        both = _run(files, order, "-".join(order))
        for k, v in alone.items():
            assert np.array_equal(both[k], v), (order, k, float(np.abs(both[k] - v).max()))
    # the models differ (a leak between equal models would not show)
    assert not np.array_equal(alone["fx-f32"], alone["fx-q8"])
    assert np.isfinite(alone["tiny-k"]).all() and np.abs(alone["tiny-k"]).max() > 0
