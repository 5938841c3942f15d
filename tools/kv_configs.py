"""Compare KV configurations (plans with chosen windows, uniform types) on development texts: Δ ppl and
KL against the f16 cache per text, one line per configuration.  How the planner's automatic window
choices (kv_plan.AUTO_WINDOWS) were picked; the held-out check is tools/kv_heldout.py.

    python tools/kv_configs.py [--model PATH] [-c 1024] [--chunks 3] [--texts FILE ...] SPEC [SPEC ...]

SPEC: `plan:BITS[:w=ROWS,wt=TYPE,s=SINKS,calib=FILE,r=STEPS,g=GROUP,types=A/B]` (kv_plan.plan_for with
those choices, the rest automatic) or `uni:K[/V][:w=ROWS,wt=TYPE,s=SINKS]` (one type for every layer;
window type q8_0 unless wt).  Float activations, as `pykv perplexity` runs.  Default texts:
tools/data/kv_dev/*.txt."""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kv_heldout import log_probs, score  # noqa: E402


def _opts(text: str) -> dict:
    return dict(x.split("=", 1) for x in text.split(",") if x)


def apply_spec(m, spec: str):
    """Set the model's cache to SPEC; returns (bits per value, description)."""
    from pykv.api import kv_plan as KP
    cfg, P, L, n = m.config, m.cache.P, m.config.n_layers, m.n_ctx
    parts = spec.split(":")
    kind, arg, o = parts[0], parts[1], _opts(parts[2] if len(parts) > 2 else "")
    if kind == "plan":
        kw = {}
        if "w" in o:
            kw["windows"] = [int(x) for x in o["w"].split("/")]
            kw["window_type"] = o.get("wt", "q8_0")
        elif "wt" in o:
            kw["window_type"] = o["wt"]
        for key, name, conv in (("s", "sinks", int), ("calib", "calib", str), ("r", "refine_steps", int),
                                ("g", "group", int)):
            if key in o:
                kw[name] = conv(o[key])
        if "types" in o:
            kw["types"] = o["types"].split("/")
        plan = KP.plan_for(m, kv_bits=float(arg), **kw)
        KP.apply_plan(m, plan, True)
        nb = KP.plan_bytes(cfg, plan["ctk"], plan["ctv"], n, P, plan["kv_window"], plan["kv_sinks"],
                           plan["kv_window_type"])
        return KP.bits_per_value(cfg, nb), KP.plan_line(plan)
    if kind != "uni":
        raise SystemExit(f"kv_configs: unknown spec {spec!r} (plan:... or uni:...)")
    kt, vt = (arg.split("/") + [arg])[:2]
    w, wt, s = int(o.get("w", 0)), o.get("wt", "q8_0"), int(o.get("s", 4))
    m.set_kv_types(kt, vt, kv_window=w, kv_sinks=s, kv_window_type=wt)
    return KP.bits_per_value(cfg, KP.plan_bytes(cfg, [kt] * L, [vt] * L, n, P, w, s, wt)), ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--model", default=None)
    ap.add_argument("-c", "--ctx", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--texts", nargs="*", default=None)
    a = ap.parse_args(argv)
    import pykv
    texts = a.texts or sorted(glob.glob(os.path.join(HERE, "data", "kv_dev", "*.txt")))
    m = pykv.load(a.model, n_ctx=a.ctx, q8_act=False)
    data = {}
    for t in texts:
        ids = np.asarray(m.tokenize(open(t, encoding="utf-8").read()), np.int64)
        chunks = [ids[c * a.ctx:(c + 1) * a.ctx] for c in range(min(len(ids) // a.ctx, a.chunks))]
        if not chunks:
            print(f"{t}: fewer than {a.ctx} tokens, skipped", file=sys.stderr)
            continue
        m.set_kv_types("f16", "f16", kv_window=0, kv_sinks=4, kv_window_type="f16")
        base = [log_probs(m, c) for c in chunks]
        data[os.path.splitext(os.path.basename(t))[0]] = (chunks, base, score(m, chunks, base))
    print("| config | bits/value | " + " | ".join(f"{n} Δ ppl / KL" for n in data) + " | mean KL | plan |")
    print("|---|---:|" + "---:|" * len(data) + "---:|---|")
    for spec in a.specs:
        t0 = time.perf_counter()
        bits, desc = apply_spec(m, spec)
        res = []
        for chunks, base, f16 in data.values():
            r = score(m, chunks, base)
            res.append((r["ppl"] / f16["ppl"] - 1, r["kl"]))
        print(f"| `{spec}` | {bits:.3f} | " + " | ".join(f"{d:+.2%} / {k:.4f}" for d, k in res)
              + f" | {np.mean([k for _, k in res]):.4f} | {desc} ({time.perf_counter() - t0:.0f} s) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
