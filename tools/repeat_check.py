"""How far apart the results are where the repeatability promise does not reach (docs/repeatability.md):
ISA classes on one host (NUMBA_CPU_NAME), and the CPU against the numba.cuda backend.

    python tools/repeat_check.py [MODEL] [--classes avx512vnni,avxvnni,avx2] [--n 512] [--ctx 512]
                                 [--cuda-tiny] [--json OUT]

Per class, in a process of its own compiled for that class: the logits of the first --n ids of the
reference text (q8 activations, and float activations), and the perplexity of the text's first 4 windows
of --ctx tokens with an f16 and a q4_0 cache (float activations, as `pykv perplexity`).  Each class's
figures are printed against the first class's.  --cuda-tiny: a tiny synthetic model's logits on the CPU
(float activations) and on the cuda backend (a GPU, or numba's simulator where there is none).
--rotation-seeds N: the q4_0 cache's perplexity change (the same windows) under N Hadamard rotation sign
seeds, each an equally valid rotation: the spread of that figure from rounding draws alone.
Classes this host cannot run are skipped."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CPU_NAME = {"avx2": "haswell", "avxvnni": "alderlake", "avx512vnni": "sapphirerapids"}

CHILD = r'''
import json, sys, numpy as np, pykv
from pykv.api.evaluate import perplexity
from pykv.kernels.tiles import ISA
model, out, n, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
text = open(sys.argv[5], encoding="utf-8").read()
res = {"isa": ISA}
m = pykv.load(model, n_ctx=max(n, ctx) + 8)
ids = m.tokenize(text)
arr = {"q8": m.forward(ids[:n])}
f = pykv.load(model, n_ctx=max(n, ctx) + 8, q8_act=False, kv_rotate=False)
arr["float"] = f.forward(ids[:n])
for kv in ("f16", "q4_0"):
    f.set_kv_types(kv, kv, kv_rotate=None)
    res["ppl_" + kv] = perplexity(f, ids[:4 * ctx], ctx)["ppl"]
np.savez(out, **arr)
json.dump(res, open(out + ".json", "w"))
'''

SEEDS_CHILD = r'''
import sys, numpy as np, pykv, pykv.decoder.model as PM
from pykv.api.evaluate import perplexity
model, ctx, n_seeds, text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
f = pykv.load(model, n_ctx=ctx + 8, q8_act=False, kv_rotate=False)
ids = f.tokenize(open(text, encoding="utf-8").read())[:4 * ctx]
base = perplexity(f, ids, ctx)["ppl"]
for seed in range(n_seeds):
    PM.ROTATE_SEED = 0x5EED + seed
    m = pykv.load(model, n_ctx=ctx + 8, q8_act=False, kv_type_k="q4_0", kv_type_v="q4_0")
    print(100 * (perplexity(m, ids, ctx)["ppl"] / base - 1), flush=True)
'''

CUDA_CHILD = r'''
import sys, numpy as np, pykv
sys.path.insert(0, sys.argv[3])
from tests.reference import write_tiny_gguf
from gguf import GGMLQuantizationType as T
path = write_tiny_gguf(sys.argv[1], {"default": T.Q4_0, "token_embd": T.Q8_0}, dim=128, ff=256, n_kv=2)
ids = [3, 70, 140, 9, 33, 200, 5, 17, 88, 101, 7, 260]
cpu = pykv.load(str(path), n_ctx=32, q8_act=False).forward(ids)
gpu = pykv.load(str(path), n_ctx=32, device="cuda").forward(ids)
np.savez(sys.argv[2], cpu=cpu, gpu=gpu)
'''


def host_classes() -> list[str]:
    from pykv.kernels.tiles import ISA
    order = ["avx2", "avxvnni", "avx512vnni"]
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    ok = {"avx2": " avx2" in flags, "avxvnni": " avx_vnni" in flags, "avx512vnni": " avx512_vnni" in flags}
    return [c for c in order if ok[c] and order.index(c) <= order.index(ISA)][::-1] or [ISA]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--classes", default=None)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--text", default=str(ROOT / "tests" / "data" / "eval-gpl3.txt"))
    ap.add_argument("--cuda-tiny", action="store_true")
    ap.add_argument("--rotation-seeds", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from pykv.models import resolve_model
    model = str(resolve_model(a.model))
    classes = a.classes.split(",") if a.classes else host_classes()
    tmp = tempfile.mkdtemp(prefix="pykv-repeat-")
    got = {}
    from pykv.kernels.tiles import ISA
    for c in classes:
        # the host's own class: the host's CPU (a named CPU of the class can have instructions this one lacks)
        env = dict(os.environ) if c == ISA else dict(os.environ, NUMBA_CPU_NAME=CPU_NAME[c], NUMBA_CPU_FEATURES="")
        out = os.path.join(tmp, c)
        r = subprocess.run([sys.executable, "-c", CHILD, model, out, str(a.n), str(a.ctx), a.text], env=env,
                           capture_output=True, text=True)
        if r.returncode:
            print(f"{c}: failed (exit {r.returncode}): {r.stderr.strip()[-400:]}", file=sys.stderr)
            continue
        info = json.load(open(out + ".json"))
        if info["isa"] != c:
            print(f"{c}: compiled for {info['isa']} instead; skipped", file=sys.stderr)
            continue
        got[c] = (dict(np.load(out + ".npz")), info)
    report = {}
    if got:
        base = next(iter(got))
        b_arr, b_info = got[base]
        print(f"against {base}: max |dlogit| / max |logit|, top-1 agreement, perplexity f16 / q4_0 cache (+change)")
        for c, (arr, info) in got.items():
            row = {}
            for k in ("q8", "float"):
                d = float(np.abs(arr[k] - b_arr[k]).max() / np.abs(b_arr[k]).max())
                top1 = float((arr[k].argmax(-1) == b_arr[k].argmax(-1)).mean())
                row[k] = {"max_rel": d, "top1": top1, "bit_equal": bool(np.array_equal(arr[k], b_arr[k]))}
            row["ppl_f16"], row["ppl_q4_0"] = info["ppl_f16"], info["ppl_q4_0"]
            row["q4_0_change_pct"] = 100 * (info["ppl_q4_0"] / info["ppl_f16"] - 1)
            report[c] = row
            print(f"  {c:10s} q8: {row['q8']['max_rel']:.2e} top1 {row['q8']['top1']:.3f} | float: "
                  f"{row['float']['max_rel']:.2e} top1 {row['float']['top1']:.3f} | ppl {row['ppl_f16']:.4f} / "
                  f"{row['ppl_q4_0']:.4f} ({row['q4_0_change_pct']:+.2f} %)")
    if a.cuda_tiny:
        out = os.path.join(tmp, "cuda.npz")
        from pykv.kernels.backend import cuda_error
        env = dict(os.environ)
        if cuda_error() is not None:        # no GPU here: numba's simulator
            env["NUMBA_ENABLE_CUDASIM"] = "1"
        r = subprocess.run([sys.executable, "-c", CUDA_CHILD, os.path.join(tmp, "tiny.gguf"), out, str(ROOT)],
                           capture_output=True, text=True, env=env)
        if r.returncode:
            print(f"cuda: failed: {r.stderr.strip()[-400:]}", file=sys.stderr)
        else:
            z = np.load(out)
            d = float(np.abs(z["gpu"] - z["cpu"]).max() / np.abs(z["cpu"]).max())
            report["cuda_tiny"] = {"max_rel": d, "top1": float((z["gpu"].argmax(-1) == z["cpu"].argmax(-1)).mean())}
            where = "simulator" if env.get("NUMBA_ENABLE_CUDASIM") == "1" else "GPU"
            print(f"cuda ({where}; tiny model, float activations) against the CPU: max |dlogit| / max |logit| {d:.2e}, "
                  f"top-1 agreement {report['cuda_tiny']['top1']:.3f}")
    if a.rotation_seeds:
        r = subprocess.run([sys.executable, "-c", SEEDS_CHILD, model, str(a.ctx), str(a.rotation_seeds), a.text],
                           capture_output=True, text=True)
        if r.returncode:
            print(f"rotation seeds: failed: {r.stderr.strip()[-400:]}", file=sys.stderr)
        else:
            ch = [float(x) for x in r.stdout.split()]
            report["rotation_seeds"] = ch
            print(f"q4_0 cache perplexity change over {len(ch)} rotation seeds: {min(ch):+.2f} .. {max(ch):+.2f} % "
                  f"(mean {np.mean(ch):+.2f}, sd {np.std(ch, ddof=1) if len(ch) > 1 else 0:.2f} points)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
