"""Perplexity, KL divergence and top-1 agreement against the f16 cache for every KV type, on the
reference text at ctx 1024 (SmolLM2 by default), as the markdown table of docs/kv-formats.md.

    python tools/kv_table.py [--model PATH] [--ctx 1024] [--types q8_0,q4_0,nl3/f16] [--rotate flip]
                             [--prerope on|off|auto] [--smooth qk|std] [--window W] [--window-type f16|q8_0]
                             [--json]

A type "K/V" gives keys and values different types.  bits/value counts everything stored per token
(pool rows with their scales, f16 sink rows, KIVI windows and the --window ring amortised over --ctx:
kv_plan.plan_bytes).
"""
import argparse
import json
import sys

import numpy as np

import pykv
from pykv.api.evaluate import log_softmax
from pykv.kv import cache as kv_cache
from pykv.files.formats import KV_FORMATS
from pykv.api.kv_plan import bits_per_value, plan_bytes

LLAMACPP = {  # llama.cpp (llama-cpp-python 0.3.36) on the same text, from ../shared/reference
    "f16": 19.345, "q8_0": 19.316, "q4_0": 20.553, "q4_1": 20.479, "q5_0": 20.081, "iq4_nl": 19.705}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default="tests/data/eval-gpl3.txt")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--types", default=",".join(KV_FORMATS))
    ap.add_argument("--rotate", choices=["auto", "flip"], default="auto",
                    help="flip: each type with the opposite of its default rotation (to check the default)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--prerope", choices=["on", "off", "auto"], default="auto",
                    help="keys stored before RoPE with query-aware smoothing (auto: the model's default, off)")
    ap.add_argument("--smooth", choices=["qk", "std"], default=kv_cache.SMOOTH_MODE,
                    help="post-RoPE key smoothing scale: query-aware (qk) or std(k)^0.5 (std)")
    ap.add_argument("--window", type=int, default=0, help="token-adaptive window (--kv-window) for every type")
    ap.add_argument("--window-type", choices=["f16", "q8_0"], default="f16", help="format of the window rows")
    ap.add_argument("--q8-act", action="store_true", help="8-bit activations, as `pykv run` (default: float)")
    a = ap.parse_args()
    kv_cache.SMOOTH_MODE = a.smooth
    pre = {"on": True, "off": False, "auto": None}[a.prerope]
    base_m = pykv.load(a.model, n_ctx=a.ctx, q8_act=a.q8_act)
    ids = np.asarray(base_m.tokenize(open(a.text, encoding="utf-8").read())[:a.ctx])
    n = len(ids) - 1
    lb = log_softmax(base_m.forward(ids)[:-1])
    base_ppl = float(np.exp(-lb[np.arange(n), ids[1:]].mean()))
    win = {"kv_window": a.window, "kv_window_type": a.window_type}
    rows = []
    for t in a.types.split(","):
        kt, vt = (t.split("/") + [t])[:2]
        m = pykv.load(a.model, n_ctx=a.ctx, kv_type_k=kt, kv_type_v=vt, q8_act=a.q8_act, kv_prerope=pre,
                      **win)
        if a.rotate == "flip":
            m = pykv.load(a.model, n_ctx=a.ctx, kv_type_k=kt, kv_type_v=vt, kv_rotate=not m.rotate,
                          q8_act=a.q8_act, kv_prerope=pre, **win)
        cfg = m.config
        nb = plan_bytes(cfg, [kt] * cfg.n_layers, [vt] * cfg.n_layers, a.ctx, m.cache.P, a.window,
                        window_type=a.window_type)
        lp = log_softmax(m.forward(ids)[:-1])
        ppl = float(np.exp(-lp[np.arange(n), ids[1:]].mean()))
        rows.append({"kv_type": t, "ppl": ppl, "delta": ppl / base_ppl - 1,
                     "kl": float((np.exp(lb) * (lb - lp)).sum(1).mean()),
                     "top1": float((lb.argmax(1) == lp.argmax(1)).mean()), "rotate": m.rotate,
                     "prerope": any(m.cache.k_pre), "smooth": a.smooth,
                     "window": a.window, "window_type": a.window_type,
                     "bytes_per_token": m.kv_bytes_per_token(), "bits_per_value": bits_per_value(cfg, nb)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps({"base_ppl": base_ppl, "rows": rows}))
        return
    lf = LLAMACPP["f16"]
    print(f"f16-cache perplexity {base_ppl:.4f} over {n} tokens (ctx {a.ctx})\n")
    print("| KV type | bits/value | bytes/token | rotation | pre-RoPE K | ppl | Δ ppl vs f16 | KL vs f16 | top-1 agree "
          "| llama.cpp Δ ppl |")
    print("|---|---:|---:|:-:|:-:|---:|---:|---:|---:|---:|")
    for r in rows:
        ll = f"{100 * (LLAMACPP[r['kv_type']] / lf - 1):+.2f}%" if r["kv_type"] in LLAMACPP else "—"
        print(f"| {r['kv_type']} | {r['bits_per_value']:.3f} | {r['bytes_per_token']:,.0f} | "
              f"{'on' if r['rotate'] else 'off'} | {'on' if r['prerope'] else 'off'} | {r['ppl']:.4f} | "
              f"{100 * r['delta']:+.2f}% | {r['kl']:.5f} | {100 * r['top1']:.2f}% | {ll} |")


if __name__ == "__main__":
    main()
