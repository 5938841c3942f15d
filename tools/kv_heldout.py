"""`--kv-bits` plans on text the planner never saw: Δ ppl and KL against the f16 cache, beside every
uniform KV type of the same or fewer bits per value (everything stored counted).

    python tools/kv_heldout.py [--model PATH] [--bits 4.5,3,2.5] [-c 1024] [--chunks 4]
                               [--texts tools/data/kv_eval/*.txt] [--long 4096] [--json-out FILE]
                               [--calib FILE] [--uniform nl4,nl2b]

The plans are what `pykv perplexity MODEL TEXT -c 1024 --kv-bits B` makes (kv_plan.plan_for with the
planner's own choices, calibrated on the built-in text); float activations, as `pykv perplexity`
runs.  Each text is scored in chunks of -c tokens (every position after a chunk's first), the f16
cache's log-probabilities kept per text so that each configuration runs once.  --long N: the same
plans (made at -c) loaded at n_ctx N and scored on one N-token chunk of each text long enough.
Prints markdown tables: per text and configuration, and the summary against the targets."""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = {4.5: 0.005, 3.0: 0.03, 2.5: 0.06}
UNIFORM = "q8_0,q5_1,q5_0,q4_1,q4_0,iq4_nl,nl4,nl3,nl3b,tc3b,nl2,nl2b,tc2b,tc1b,int4,int2,klt3/nl3b,klt2/nl2b"


def log_probs(model, ids):
    from pykv.api.evaluate import log_softmax
    return log_softmax(model.eval(model.new_sequence(), ids, all_logits=True)[:-1]).astype(np.float32)


def score(model, chunks, base) -> dict:
    """ppl, KL(f16 || model) and top-1 agreement over the chunks; base: the f16 cache's log-probs."""
    nll = kl = agree = n = 0.0
    for ids, lb in zip(chunks, base):
        lp = log_probs(model, ids)
        nll -= float(lp[np.arange(len(ids) - 1), ids[1:]].sum())
        kl += float((np.exp(lb) * (lb.astype(np.float64) - lp)).sum())
        agree += int((lb.argmax(1) == lp.argmax(1)).sum())
        n += len(ids) - 1
    return {"ppl": float(np.exp(nll / n)), "kl": kl / n, "top1": agree / n, "n_tokens": int(n)}


def uniform_bits(cfg, kt, vt, n_ctx, P):
    from pykv.api import kv_plan as KP
    L = cfg.n_layers
    return KP.bits_per_value(cfg, KP.plan_bytes(cfg, [kt] * L, [vt] * L, n_ctx, P))


def run_texts(model, texts, n_ctx, max_chunks, configs, log):
    """{text: {config name: score}}; configs: [(name, apply(model))]; the first config must be f16."""
    from pykv.api import kv_plan as KP  # noqa: F401
    out = {}
    for path in texts:
        name = os.path.splitext(os.path.basename(path))[0]
        ids = np.asarray(model.tokenize(open(path, encoding="utf-8").read()), np.int64)
        n = min(len(ids) // n_ctx, max_chunks or 10 ** 9)
        if n < 1:
            log(f"{name}: {len(ids)} tokens, fewer than one chunk of {n_ctx}; skipped")
            continue
        chunks = [ids[c * n_ctx:(c + 1) * n_ctx] for c in range(n)]
        model.set_kv_types("f16", "f16", kv_window=0, kv_sinks=4, kv_window_type="f16")
        base = [log_probs(model, c) for c in chunks]
        res = {"_tokens": int(len(ids)), "_chunks": n}
        f16 = score(model, chunks, base)
        res["f16"] = {**f16, "bits": 16.0}
        for cname, apply_fn, bits in configs:
            apply_fn(model)
            t = time.perf_counter()
            r = score(model, chunks, base)
            r.update(bits=bits, delta=r["ppl"] / f16["ppl"] - 1, seconds=time.perf_counter() - t)
            res[cname] = r
            log(f"{name} {cname}: {bits:.3f} bits, ppl {r['ppl']:.4f} ({r['delta']:+.2%}), KL {r['kl']:.5f}, "
                f"top-1 {r['top1']:.2%}")
        out[name] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--bits", default="4.5,3,2.5")
    ap.add_argument("-c", "--ctx", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=4, help="at most this many chunks per text")
    ap.add_argument("--texts", nargs="*", default=None)
    ap.add_argument("--uniform", default=UNIFORM, help="uniform types to compare (K/V for a pair)")
    ap.add_argument("--long", type=int, default=0, help="also score the plans at this context")
    ap.add_argument("--calib", default=None, help="the planner's calibration text (default: built-in)")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    import pykv
    from pykv.api import kv_plan as KP
    from pykv.kernels.tiles import ISA

    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    texts = a.texts or sorted(glob.glob(os.path.join(HERE, "data", "kv_eval", "*.txt")))
    m = pykv.load(a.model, n_ctx=a.ctx, q8_act=False)
    cfg, P = m.config, m.cache.P
    plans, configs = {}, []
    for b in (float(x) for x in a.bits.split(",")):
        t = time.perf_counter()
        plan = KP.plan_for(m, kv_bits=b, calib=a.calib, progress=None)
        sec = time.perf_counter() - t
        nb = KP.plan_bytes(cfg, plan["ctk"], plan["ctv"], a.ctx, P, plan["kv_window"], plan["kv_sinks"],
                           plan["kv_window_type"])
        plan.update(bytes_per_token=nb, bits_per_value=KP.bits_per_value(cfg, nb), n_ctx=a.ctx, plan_seconds=sec)
        plans[b] = plan
        log(f"plan {b:g} ({sec:.1f} s{', cached' if plan.get('cached') else ''}): {KP.plan_line(plan)}")
        configs.append((f"plan {b:g}", lambda mm, p=plan: KP.apply_plan(mm, p), plan["bits_per_value"]))
    top = max(p["bits_per_value"] for p in plans.values())
    for u in a.uniform.split(","):
        kt, vt = (u.split("/") + [u])[:2]
        bits = uniform_bits(cfg, kt, vt, a.ctx, P)
        if bits <= top + 1e-9:
            configs.append((u, lambda mm, kt=kt, vt=vt: mm.set_kv_types(kt, vt, kv_window=0, kv_sinks=4,
                                                                      kv_window_type="f16"), bits))
    res = run_texts(m, texts, a.ctx, a.chunks, configs, log)
    long_res = {}
    if a.long:
        del m
        ml = pykv.load(a.model, n_ctx=a.long, q8_act=False)
        lconf = []
        for b, p in plans.items():
            nb = KP.plan_bytes(cfg, p["ctk"], p["ctv"], a.long, P, p["kv_window"], p["kv_sinks"], p["kv_window_type"])
            lconf.append((f"plan {b:g}", lambda mm, p=p: KP.apply_plan(mm, p), KP.bits_per_value(cfg, nb)))
        long_res = run_texts(ml, texts, a.long, 1, lconf, log)

    print(f"{time.strftime('%Y-%m-%d')}, {ISA}, ctx {a.ctx}, float activations, f16-cache baseline\n")
    for name, r in res.items():
        print(f"**{name}** ({r['_tokens']} tokens, {r['_chunks']} chunks; f16 ppl {r['f16']['ppl']:.4f})\n")
        print("| KV | bits/value | ppl | Δ ppl | KL | top-1 |\n|---|---:|---:|---:|---:|---:|")
        for cname, _, _ in configs:
            c = r[cname]
            print(f"| {cname} | {c['bits']:.3f} | {c['ppl']:.4f} | {c['delta']:+.2%} | {c['kl']:.5f} | {c['top1']:.2%} |")
        print()
    print("| target | plan bits | " + " | ".join(f"Δ ppl {n}" for n in res) + " | goal | KL below every uniform type of ≤ its bits |")
    print("|---|---:|" + "---:|" * len(res) + "---:|---|")
    summary = {}
    for b, p in plans.items():
        name = f"plan {b:g}"
        beaten = []
        for u, _, ub in configs:
            if u.startswith("plan ") or ub > p["bits_per_value"] + 1e-9:
                continue
            if any(r[u]["kl"] <= r[name]["kl"] for r in res.values()):
                beaten.append(u)
        deltas = [r[name]["delta"] for r in res.values()]
        summary[b] = {"deltas": deltas, "not_beaten_by": beaten, "bits": p["bits_per_value"]}
        smaller = [u for u, _, ub in configs if not u.startswith("plan ") and ub <= p["bits_per_value"] + 1e-9]
        print(f"| {b:g} | {p['bits_per_value']:.3f} | " + " | ".join(f"{d:+.2%}" for d in deltas)
              + f" | ≤ +{TARGETS.get(b, float('nan')):.1%} | "
              + ("yes (" + ", ".join(smaller) + ")" if not beaten else "no: " + ", ".join(beaten)) + " |")
    if long_res:
        print(f"\nThe same plans at ctx {a.long} (one {a.long}-token chunk per text):\n")
        print("| plan | bits at ctx %d | " % a.long + " | ".join(f"Δ ppl {n}" for n in long_res) + " |")
        print("|---|---:|" + "---:|" * len(long_res))
        for cname, _, bits in lconf:
            print(f"| {cname} | {bits:.3f} | " + " | ".join(f"{r[cname]['delta']:+.2%}" for r in long_res.values()) + " |")
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump({"plans": {str(k): v for k, v in plans.items()}, "texts": res, "long": long_res,
                       "summary": {str(k): v for k, v in summary.items()}, "isa": ISA}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
