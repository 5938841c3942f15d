"""The automatic KV plan against uniform types, on the reference text at ctx 1024, calibrated on the
built-in text (or --calib): ppl increase and KL vs the f16 cache per bits per value (everything stored
counted: pool rows, scales, f16 sink rows and KIVI windows amortised over the context), with llama.cpp's
uniform types from ../shared/reference. Writes JSON for tools/kv_plot.py and prints the table of docs/kv-formats.md.

    python tools/kv_auto.py [--model PATH] [--bits 4.5,3,2.5] [--types ...] [--json-out kv_auto.json]
                            [--additivity]   # also the plans' measured KL on the calibration text
                            [--windows 0,16,32] [--refine 2]   # planner: window sizes tried, refine steps
    python tools/kv_auto.py --sweep nl2,nl3,q4_0 --sweep-windows 0,16,32,64 --sweep-sinks 0,4,8,16
                            # the cache levers alone: uniform types x window x sink rows, then exit
"""
import argparse
import json
import os
import sys

import numpy as np

import pykv
from pykv.api import kv_plan as KP
from pykv.api.evaluate import log_softmax

UNIFORM = "q8_0,q5_1,q5_0,q4_1,q4_0,iq4_nl,nl4,int4,nl3,int2,nl2"


def score(lp, lb, ids):
    n = len(ids) - 1
    return {"ppl": float(np.exp(-lp[np.arange(n), ids[1:]].mean())),
            "kl": float((np.exp(lb) * (lb - lp)).sum(1).mean()),
            "top1": float((lb.argmax(1) == lp.argmax(1)).mean())}


def llamacpp_points(ref_dir):
    path = os.path.join(ref_dir, "llamacpp-dev.npz")
    if not os.path.exists(path):
        return []
    d = np.load(path)
    f16 = float(np.exp(-d["text_logprob_f16"].mean()))
    bits = {"f16": 16.0, "q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "iq4_nl": 4.5}
    return [{"kv_type": t, "bits": bits[t], "ppl": float(np.exp(-d[f"text_logprob_{t}"].mean())),
             "delta": float(np.exp(-d[f"text_logprob_{t}"].mean())) / f16 - 1}
            for t in bits if f"text_logprob_{t}" in d.files]


def spearman(a, b):
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def check_estimate(path, ids, table, layers):
    """Exact probes of a few layers against the estimated table: the rank correlation over types
    within each (layer, side), and over every measured (layer, side, type) entry."""
    cm = pykv.load(path, n_ctx=max(len(ids), 32), q8_act=False)
    pr = KP._Prober(cm, ids)
    L, types = cm.config.n_layers, table["types"]
    est, exact, per = [], [], []
    for l in (int(x) for x in layers.split(",")):
        for s in ("k", "v"):
            ex = []
            for t in types:
                kt, vt = (KP._one(L, l, t), "f16") if s == "k" else ("f16", KP._one(L, l, t))
                ex.append(pr.kl(kt, vt, l0=l))
            per.append({"layer": l, "side": s, "exact": ex, "estimate": table[s][l],
                        "spearman": spearman(ex, table[s][l])})
            print(json.dumps(per[-1]), file=sys.stderr, flush=True)
            est += table[s][l]
            exact += ex
    return {"types": types, "rows": per, "spearman_all": spearman(exact, est),
            "median_ratio": float(np.median(np.array(est) / np.maximum(exact, 1e-12)))}


def sweep(m, ids, lb, base, a, log):
    """Uniform types with each window size (sinks 4) and each sink count (window 0)."""
    cfg, rows = m.config, []
    if ":" in a.sweep:      # explicit TYPE:WINDOW:SINKS[:WINDOW_TYPE] entries
        combos = [(e.split(":")[0], int(e.split(":")[1]), int(e.split(":")[2]), (e.split(":") + ["f16"])[3])
                  for e in a.sweep.split(",")]
    else:
        combos = [(t, int(w), 4, "f16") for t in a.sweep.split(",") for w in a.sweep_windows.split(",")]
        combos += [(t, 0, int(n), "f16") for t in (a.sweep_sink_types or a.sweep).split(",")
                   for n in a.sweep_sinks.split(",") if int(n) != 4]
    for t, w, ns, wt in combos:
        m.set_kv_types(t, t, kv_window=w, kv_sinks=ns, kv_window_type=wt)
        nb = KP.plan_bytes(cfg, [t] * cfg.n_layers, [t] * cfg.n_layers, a.ctx, window=w, n_sink=ns, window_type=wt)
        r = {"kv_type": t, "window": w, "sinks": ns, "window_type": wt, **score(log_softmax(m.forward(ids)[:-1]), lb, ids),
             "bytes_per_token": nb, "bits": KP.bits_per_value(cfg, nb)}
        r["delta"] = r["ppl"] / base["ppl"] - 1
        rows.append(r)
        log(r)
    m.set_kv_types("f16", "f16", kv_window=0, kv_sinks=4, kv_window_type="f16")
    print("| KV type | window | sinks | bits/value | ppl | Δ ppl | KL vs f16 | top-1 agree |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_type']} | {r['window']} {r['window_type']} | {r['sinks']} | {r['bits']:.3f} | {r['ppl']:.4f} | "
              f"{100 * r['delta']:+.2f}% | {r['kl']:.5f} | {100 * r['top1']:.2f}% |")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--text", default="tests/data/eval-gpl3.txt")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--calib", default=None, help="calibration text (default: pykv's built-in)")
    ap.add_argument("--bits", default="4.5,3,2.5")
    ap.add_argument("--uniform", default=UNIFORM)
    ap.add_argument("--types", default=",".join(KP.DEFAULT_TYPES), help="planner candidates")
    ap.add_argument("--exact", action="store_true", help="exact sensitivity table (2 L T runs)")
    ap.add_argument("--additivity", action="store_true",
                    help="measure each plan's KL on the calibration text too (vs the summed table)")
    ap.add_argument("--check-estimate", default=None, metavar="LAYERS",
                    help="also measure these layers exactly (e.g. 0,9,19,29) and compare the estimate's ranking")
    ap.add_argument("--ref", default="../shared/reference")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--windows", default="0", help="token-adaptive window sizes the planner tries")
    ap.add_argument("--sinks", type=int, default=4, help="f16 sink rows of the plans")
    ap.add_argument("--window-type", default="f16", help="format of the window rows (f16, q8_0)")
    ap.add_argument("--refine", type=int, default=2, help="measured refinement steps (0: the table's plan)")
    ap.add_argument("--calib-tokens", type=int, default=None, help="calibration tokens (default: --ctx)")
    ap.add_argument("--group", type=int, default=1, help="layers per sensitivity probe (estimate)")
    ap.add_argument("--sweep-sink-types", default=None, help="types of the sink sweep (default: --sweep)")
    ap.add_argument("--sweep", default=None, help="only the cache levers: these uniform types ...")
    ap.add_argument("--sweep-windows", default="0,16,32,64")
    ap.add_argument("--sweep-sinks", default="0,4,8,16")
    a = ap.parse_args()

    m = pykv.load(a.model, n_ctx=a.ctx, q8_act=False)
    cfg = m.config
    ids = np.asarray(m.tokenize(open(a.text, encoding="utf-8").read())[:a.ctx])
    lb = log_softmax(m.forward(ids)[:-1])
    base = score(lb, lb, ids)
    log = lambda r: print(json.dumps(r), file=sys.stderr, flush=True)   # noqa: E731
    if a.sweep:
        out = {"ctx": a.ctx, "base_ppl": base["ppl"], "sweep": sweep(m, ids, lb, base, a, log)}
        if a.json_out:
            with open(a.json_out, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)
        return
    rows = []
    for t in a.uniform.split(","):        # "K/V" for different key and value types (klt2/nl2)
        kt, vt = (t.split("/") + [t])[:2]
        m.set_kv_types(kt, vt)
        r = {"kv_type": t, **score(log_softmax(m.forward(ids)[:-1]), lb, ids),
             "bytes_per_token": KP.plan_bytes(cfg, [kt] * cfg.n_layers, [vt] * cfg.n_layers, a.ctx)}
        r.update(bits=KP.bits_per_value(cfg, r["bytes_per_token"]), delta=r["ppl"] / base["ppl"] - 1)
        rows.append(r)
        log(r)
    calib_ids = KP.calib_ids(m, a.calib, a.calib_tokens)
    windows = [int(w) for w in a.windows.split(",")]
    plans = []
    for bits in (float(b) for b in a.bits.split(",")):
        plan = KP.plan_for(m, kv_bits=bits, calib=a.calib, types=a.types.split(","), exact=a.exact,
                           n_tokens=a.calib_tokens, windows=windows, sinks=a.sinks, refine_steps=a.refine,
                           group=a.group, window_type=a.window_type)
        KP.apply_plan(m, plan)
        r = {"target_bits": bits, **score(log_softmax(m.forward(ids)[:-1]), lb, ids),
             "bytes_per_token": plan["bytes_per_token"], "bits": plan["bits_per_value"],
             "kl_estimate_calib": plan["kl_estimate"], "kl_measured_calib": plan.get("kl_measured"),
             "refine": plan.get("refine"), "method": plan["method"], "kv_window": plan["kv_window"], "kv_sinks": plan["kv_sinks"],
             "kv_window_type": plan["kv_window_type"],
             "ctk": plan["ctk"], "ctv": plan["ctv"]}
        r["delta"] = r["ppl"] / base["ppl"] - 1
        dearer = [u for u in rows if u["bytes_per_token"] >= r["bytes_per_token"]]
        r["uniform_same_or_more_bytes"] = [u["kv_type"] for u in dearer]
        r["not_beaten_by_plan"] = [u["kv_type"] for u in dearer if u["kl"] <= r["kl"]]
        plans.append(r)
        log(r)
    m.set_kv_types("f16", "f16", kv_window=0, kv_sinks=4)
    if a.additivity:
        cm = pykv.load(m.path, n_ctx=max(len(calib_ids), 32), q8_act=False)
        pr = KP._Prober(cm, calib_ids)
        for r in plans:
            r["kl_measured_calib"] = pr.kl(r["ctk"], r["ctv"])
            log({"target_bits": r["target_bits"], "kl_estimate_calib": r["kl_estimate_calib"],
                 "kl_measured_calib": r["kl_measured_calib"]})
    check = None
    if a.check_estimate:
        table = KP.sensitivity(m.path, calib_ids, a.types.split(","), exact=a.exact)
        check = check_estimate(m.path, calib_ids, table, a.check_estimate)
    out = {"check_estimate": check, "ctx": a.ctx, "base_ppl": base["ppl"], "method": plans[0]["method"] if plans else None,
           "windows": windows, "refine": a.refine, "calib_tokens": len(calib_ids),
           "uniform": rows, "plans": plans, "llamacpp": llamacpp_points(a.ref)}
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    print(f"f16-cache perplexity {base['ppl']:.4f} (ctx {a.ctx}, {len(ids) - 1} tokens)\n")
    print("| KV cache | bits/value | bytes/token | ppl | Δ ppl | KL vs f16 | top-1 agree |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows + plans, key=lambda r: -r["bits"]):
        name = r.get("kv_type") or f"**auto ≤ {r['target_bits']:g} bits** (window {r['kv_window']}, sinks {r['kv_sinks']})"
        print(f"| {name} | {r['bits']:.3f} | {r['bytes_per_token']:,.1f} | {r['ppl']:.4f} | {100 * r['delta']:+.2f}% | "
              f"{r['kl']:.5f} | {100 * r['top1']:.2f}% |")
    for p in out["llamacpp"]:
        print(f"| llama.cpp {p['kv_type']} | {p['bits']:.3f} | | {p['ppl']:.4f} | {100 * p['delta']:+.2f}% | | |")


if __name__ == "__main__":
    main()
