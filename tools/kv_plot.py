"""Perplexity increase and KL divergence against bits per value: every uniform KV type, the automatic
per-layer plans and llama.cpp's uniform types, from tools/kv_auto.py's JSON. matplotlib is an optional
extra (`pip install pykv[plot]`); without it the figure is skipped.

    python tools/kv_plot.py kv_auto.json [more.json ...] [-o docs/kv_auto.png]

Several files (one kv_auto run per target) are merged: their uniform rows (by type name, the first
file's row wins), plans and llama.cpp points.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("-o", "--out", default="docs/kv_auto.png")
    a = ap.parse_args()
    d = {"uniform": [], "plans": [], "llamacpp": []}
    for path in a.json:
        with open(path, encoding="utf-8") as f:
            part = json.load(f)
        seen = {r["kv_type"] for r in d["uniform"]}
        d["uniform"] += [r for r in part.get("uniform", []) if r["kv_type"] not in seen]
        d["plans"] += part.get("plans", [])
        d["llamacpp"] = d["llamacpp"] or part.get("llamacpp", [])
        d.setdefault("ctx", part.get("ctx"))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'pykv[plot]'): no figure", file=sys.stderr)
        return 0
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((ax1, "delta", "perplexity increase vs f16 cache (%)"), (ax2, "kl", "KL vs f16 cache")):
        u = d["uniform"]
        scale = 100 if key == "delta" else 1
        ax.scatter([r["bits"] for r in u], [scale * r[key] for r in u], c="tab:blue", label="pykv, uniform type")
        for r in u:
            ax.annotate(r["kv_type"], (r["bits"], scale * r[key]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        p = sorted(d["plans"], key=lambda r: r["bits"])
        ax.plot([r["bits"] for r in p], [scale * r[key] for r in p], "o-", c="tab:red",
                label="pykv, automatic per-layer plan")
        if key == "delta" and d.get("llamacpp"):
            ll = [r for r in d["llamacpp"] if r["kv_type"] != "f16"]
            ax.scatter([r["bits"] for r in ll], [scale * r[key] for r in ll], marker="x", c="k",
                       label="llama.cpp, uniform type")
            for r in ll:
                ax.annotate(r["kv_type"], (r["bits"], scale * r[key]), fontsize=7, xytext=(3, -9),
                            textcoords="offset points")
        if key == "kl":
            ax.set_yscale("log")
        ax.set_xlabel("bits per stored value (scales, sinks, windows included)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M, reference text, ctx {d['ctx']}", fontsize=10)
    fig.tight_layout()
    import os
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
