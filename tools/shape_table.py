"""Decode and prefill of big-shape files beside llama-bench, each against the DRAM bandwidth of its own minute.

    python tools/shape_table.py FILE [FILE ...] --llama-bench PATH [--rounds 2] [-r 3] [-t 2] [--json OUT]

The DRAM limit of a shared VM moves within the hour (39 -> 70 GB/s seen in one), so a fraction of a limit
measured at another time says little.  Each round here runs `tools/membw.py`'s stream (2 threads), then
`pykv bench FILE -p 512 -n 64 -d 16` and llama-bench in turn (`run_bench(rounds=1)`), then the stream
again; each side's decode GB/s is divided by the higher of the two stream readings around it.  Prints
one markdown row per file: pp512 and tg64 @ d16 for both engines (median of the pooled samples), ratios,
GB/s and the fraction of the limit, and the limit's range.  Bytes a decode token reads: every tensor of
the file, less an untied token_embd (one row of it is read).  Files come from `tools/make_synthetic.py`."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def decode_bytes(path: str) -> int:
    """Bytes one decode token reads from the weights: all tensors, less an untied token_embd but one row."""
    from pykv.files.gguf_io import GGUFFile
    g = GGUFFile(path)
    total = sum(t.nbytes for t in g.tensors.values())
    emb = g.tensors.get("token_embd.weight")
    if emb is not None and "output.weight" in g.tensors:
        total -= emb.nbytes - emb.nbytes // emb.shape[1]
    return total


def membw(threads: int = 2) -> float:
    """One reading of tools/membw.py (1 GiB, best of 3) in a fresh process, GB/s."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "membw.py"), "--mib", "1024", "--threads",
                          str(threads), "--reps", "3", "--json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)["gb_s"][str(threads)])


def measure(path: str, exe: str, rounds: int, reps: int, threads: int) -> dict:
    from pykv.tools.bench import run_bench
    nbytes = decode_bytes(path)
    cols = {k: [] for k in ("pp", "tg", "lpp", "ltg")}
    rounds_out = []
    for rd in range(rounds):
        bw0 = membw(threads)
        row = run_bench(path, n_prompt="512", n_gen="64", depth="16", threads=str(threads), reps=reps,
                        llama_bench=exe, rounds=1, progress=False)[0]
        bw1 = membw(threads)
        lc = row["llamacpp"]
        cols["pp"] += row["pp_samples"]
        cols["tg"] += row["tg_samples"]
        cols["lpp"] += lc.get("pp_samples") or [lc["pp_tps"]]
        cols["ltg"] += lc.get("tg_samples") or [lc["tg_tps"]]
        lim = max(bw0, bw1)
        r = {"bw": (bw0, bw1), "tg": row["tg_tps"], "ltg": lc["tg_tps"],
             "frac": row["tg_tps"] * nbytes / 1e9 / lim, "lfrac": lc["tg_tps"] * nbytes / 1e9 / lim}
        rounds_out.append(r)
        print(f"  {os.path.basename(path)} round {rd + 1}: membw {bw0:.1f}/{bw1:.1f} GB/s, tg pykv "
              f"{r['tg']:.2f} ({r['frac']:.0%}) llama.cpp {r['ltg']:.2f} ({r['lfrac']:.0%}), pp "
              f"{row['pp_tps']:.1f} / {lc['pp_tps']:.1f}", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in cols.items()}
    return {"file": os.path.basename(path), "gb": nbytes / 1e9, **med, "rounds": rounds_out,
            "frac": statistics.median(r["frac"] for r in rounds_out),
            "lfrac": statistics.median(r["lfrac"] for r in rounds_out),
            "bw_min": min(min(r["bw"]) for r in rounds_out), "bw_max": max(max(r["bw"]) for r in rounds_out)}


def table(rows: list[dict]) -> str:
    out = ["| file (GB a token reads) | pykv pp512 | llama.cpp pp512 | ÷ | pykv tg64 @ d16 | llama.cpp tg64 | ÷ "
           "| pykv GB/s (of limit) | llama.cpp GB/s (of limit) | limit GB/s |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['file']} ({r['gb']:.2f}) | {r['pp']:.1f} | {r['lpp']:.1f} | {r['pp'] / r['lpp']:.2f} "
                   f"| {r['tg']:.2f} | {r['ltg']:.2f} | {r['tg'] / r['ltg']:.2f} "
                   f"| {r['tg'] * r['gb']:.1f} ({r['frac']:.0%}) | {r['ltg'] * r['gb']:.1f} ({r['lfrac']:.0%}) "
                   f"| {r['bw_min']:.1f}-{r['bw_max']:.1f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    from pykv.tools.bench import cpu_model
    from pykv.kernels.tiles import ISA
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {ISA} ({cpu_model()}), {a.threads} threads", file=sys.stderr)
    rows = [measure(f, a.llama_bench, a.rounds, a.reps, a.threads) for f in a.files]
    print(table(rows))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
