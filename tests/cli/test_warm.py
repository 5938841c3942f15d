"""pykv.tools.warm: on a cold kernel cache the CLI starts a second process that compiles the decode step's
kernels while the first compiles the prompt's; the model waits for it before its first one-token step."""
import json
import os
import shutil
import subprocess
import sys
import types

from gguf import GGMLQuantizationType as T

from pykv.tools import warm
from tests.reference import write_tiny_gguf

# the CLI's run in a process of its own, then what the decode chain's dispatcher did: its one
# signature came from the cache (the helper saved it) and nothing of it compiled here
_RUN = r"""
import sys
from pykv.cli import main
from pykv.kernels import chain, jitnote
rc = main(["run", sys.argv[1], "hello there", "-n", "4", "--temp", "0", "-t", "1"])
st = chain.chain.stats
print("RESULT", rc, sum(st.cache_hits.values()), sum(st.cache_misses.values()), jitnote.compile_seconds())
# the chains loaded above (compiled by the helper, bound there to a stand-in attention: warm.chains_first)
# run the real attention here: one-token steps through them equal the separate calls
import numpy as np
import pykv
m = pykv.load(sys.argv[1], n_ctx=64, threads=1)
ids = [5, 77, 3, 260, 261, 9, 140]
outs = []
for on in (True, False):
    m._chains = None if on else False          # False: Model._decode_chains answers None
    seq = m.new_sequence()
    outs.append(np.concatenate([m.eval(seq, ids[:3])] + [m.eval(seq, [i]) for i in ids[3:]]))
print("CHAINS", m._chains is False and np.array_equal(outs[0], outs[1]) and outs[0][3:].std() > 0)
"""


def _cache_without_the_chain(root):
    """A copy, under root, of the kernel cache this test process uses (what the tests so far compiled), less
    the decode chain module's entries: cold where the helper works (decode_cached() is false), while the
    prompt's kernels load instead of compiling a second time (docs/history.md: the suite's timings)."""
    from numba.core import config
    from pykv import kernels
    src = config.CACHE_DIR                      # .../<kernel source hash>: the same name under root
    for sub in os.listdir(src):
        a, b = os.path.join(src, sub), os.path.join(root, os.path.basename(src), sub)
        if not os.path.isdir(a):
            continue
        os.makedirs(b)
        with kernels.folder_lock(a):
            for f in os.listdir(a):
                if not f.startswith(("chain.", ".pykv")):
                    shutil.copy2(os.path.join(a, f), os.path.join(b, f))


def test_cold_run_loads_the_decode_kernels_the_helper_compiled(tmp_path):
    model = write_tiny_gguf(tmp_path / "q40.gguf", {"default": T.Q4_0})   # integer tiles: a decode chain
    _cache_without_the_chain(tmp_path / "cache")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYKV_COMPILE_HELPER": "1"}
    r = subprocess.run([sys.executable, "-c", _RUN, str(model)], env=env, capture_output=True, text=True,
                       timeout=900)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    rc, hits, misses, _ = line[0].split()[1:]
    assert (rc, misses) == ("0", "0")
    assert int(hits) >= 1
    assert "CHAINS True" in r.stdout, r.stdout[-2000:]


def _fake_model(tmp_path, name="cpu"):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"0" * 1000)
    return types.SimpleNamespace(path=str(p), be=types.SimpleNamespace(name=name))


def test_wanted_only_where_it_pays(tmp_path, monkeypatch):
    m = _fake_model(tmp_path)
    monkeypatch.setenv("PYKV_COMPILE_HELPER", "1")
    monkeypatch.setattr(warm, "decode_cached", lambda: False)
    monkeypatch.setattr(warm, "_cpus", lambda: 2)
    monkeypatch.setattr(warm, "_mem_available", lambda: 1 << 30)
    assert warm.wanted(m, {})
    assert not warm.wanted(_fake_model(tmp_path, "cuda"), {})
    assert not warm.wanted(m, {"kv_bits": 4.5})               # the helper would calibrate again
    monkeypatch.setattr(warm, "_mem_available", lambda: 3000)  # a second copy of the weights must fit
    assert not warm.wanted(m, {})
    monkeypatch.setattr(warm, "_mem_available", lambda: 1 << 30)
    monkeypatch.setattr(warm, "_cpus", lambda: 1)
    assert not warm.wanted(m, {})
    monkeypatch.setattr(warm, "_cpus", lambda: 2)
    monkeypatch.setattr(warm, "decode_cached", lambda: True)
    assert not warm.wanted(m, {})
    monkeypatch.setattr(warm, "decode_cached", lambda: False)
    monkeypatch.setattr(warm.kernels, "cache_locked", lambda: False)   # no flock: processes could corrupt it
    assert not warm.wanted(m, {})
    monkeypatch.setattr(warm.kernels, "cache_locked", lambda: True)
    assert warm.wanted(m, {})
    monkeypatch.setenv("PYKV_COMPILE_HELPER", "0")
    assert not warm.wanted(m, {})


def test_helper_gets_the_callers_kv_settings(tmp_path, monkeypatch):
    """start() passes the caller's load keywords (KV types, rotation, plan ...) but not its context, budget,
    threads or plan output; the helper process runs with one thread and starts no helper itself."""
    m = _fake_model(tmp_path)
    monkeypatch.setattr(warm, "wanted", lambda model, kw: True)
    seen = {}

    class FakePopen:
        def __init__(self, argv, env, **kw):
            seen["argv"], seen["env"] = argv, env

        def poll(self):
            return 0

    monkeypatch.setattr(warm.subprocess, "Popen", FakePopen)
    kw = {"n_ctx": 4096, "kv_type_k": ["q8_0", "q4_0"], "kv_type_v": "q4_0", "kv_rotate": True, "threads": 2,
          "kv_budget": 1 << 20, "kv_plan_out": "p.json", "verbose": True, "kv_plan": None, "device": "cpu"}
    h = warm.start(m, kw)
    assert h is m.compile_helper and h is not None
    spec = json.loads(seen["argv"][-1])
    assert seen["argv"][1:3] == ["-m", "pykv.tools.warm"]
    assert spec == {"path": m.path, "kw": {"kv_type_k": ["q8_0", "q4_0"], "kv_type_v": "q4_0", "kv_rotate": True,
                                          "kv_plan": None, "device": "cpu"}}
    assert seen["env"]["NUMBA_NUM_THREADS"] == "1" and seen["env"]["PYKV_COMPILE_HELPER"] == "0"


def test_helper_wait_counts_as_compile_time_and_stop_kills():
    """The model's wait for its helper is compile time (the printed speeds exclude it); stop() at exit
    ends a helper that is still running."""
    from pykv.kernels import jitnote
    h = warm.Helper(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"]))
    c0 = jitnote.compile_seconds()
    h.wait()
    assert h.proc.returncode == 0
    assert jitnote.compile_seconds() - c0 >= 0.45
    h = warm.Helper(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    h.stop()
    assert h.proc.returncode is not None and h.proc.returncode != 0
