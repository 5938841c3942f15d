"""The CPU-speed issue's done-when table in one command: every ISA class this host can run, every weight
file, `pykv bench ... --llama-bench` against that class's llama-bench, K passes; then one Markdown table
of pykv ÷ llama.cpp ratios per pass and a line per goal saying which cells miss it.

    python tools/class_table.py [--classes avx2,avxvnni,avx512vnni] [--files F,...] [--passes 2]
                                [--rounds 2] [--reps 3] [--threads 2] [--no-depth] [--out DIR] [--dry-run]
                                [--setup [--src SDIST_OR_TREE]]

--setup first makes what is missing, so a fresh host needs this one command: the shipped model (`pykv
pull`), each class's llama-bench and llama-quantize (tools/build_llama_bench.py CLASS --src; without --src
the llama-cpp-python 0.3.36 sdist is fetched with `pip download` into ~/.cache/pykv/llama-src), then the
requantized files (tools/requantize.py with the first class's llama-quantize).  Measured on a 2-core Zen
3 (2026-12-04): the sdist 8 s, a build from it 6.3 min, a requantization 5 s.

Goals (issue: CPU speed on K-quants and AVX2 / AVX-VNNI hosts), each class, 2 threads:
  decode (tg64) at depth 16 >= 1.0x llama.cpp and prefill (pp512) >= 1.0x, for the shipped Q4_1 and the
  Q4_0 / Q8_0 / Q4_K_M / Q5_K_M / Q6_K files of tools/requantize.py;
  decode at depth 4096 with a q8_0 cache >= 1.5x llama.cpp's best there (its f16 and q8_0 caches,
  flash attention on and off), on the shipped model.

Classes default to those this host can execute (LLVM's host features, the names kernels.tiles classifies
by: avx2 + fma + f16c; avxvnni; avx512f + avx512bw + avx512vl + avx512vnni).  A class below the host's own is compiled for with
NUMBA_CPU_NAME (build_llama_bench.NUMBA_CPU, or --cpu-name CLASS=NAME) and NUMBA_CPU_FEATURES="", and
its peer is DIR/CLASS/bin/llama-bench as tools/build_llama_bench.py CLASS builds it (--llama-bench-dir).
Each cell is checked to have run as that class on both sides (bench's `isa` fields).  Passes run
class by class inside each pass, so a slow phase of a shared VM lands on one pass, not on one class.
--out keeps every cell's JSON (pass<k>_<class>_<file>.json) and the table (table.md).
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_llama_bench import NUMBA_CPU  # noqa: E402
from requantize import DEFAULT_MODEL, DEFAULT_OUT, out_path  # noqa: E402

SDIST = "llama-cpp-python==0.3.36"          # the peer's source: its vendor/llama.cpp
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SRC_DIR = os.path.expanduser("~/.cache/pykv/llama-src")

CLASS_ORDER = ("avx2", "avxvnni", "avx512vnni")
FILE_TYPES = ("Q4_1", "Q4_0", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")   # Q4_1: the shipped model itself
DEPTH_GOAL, SHORT_GOAL = 1.5, 1.0


def host_flags() -> set:
    """The host CPU's features as LLVM names them (what kernels.tiles.target_isa reads)."""
    import llvmlite.binding as llvm
    return {k for k, on in llvm.get_host_cpu_features().items() if on}


def runnable_classes(flags: set) -> list:
    """The ISA classes whose code this host can execute, lowest first."""
    out = []
    if {"avx2", "fma", "f16c"} <= flags:
        out.append("avx2")
        if "avxvnni" in flags:
            out.append("avxvnni")
        if {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= flags:
            out.append("avx512vnni")
    return out


def class_env(isa: str, top: str, names: dict) -> dict:
    """Environment overrides that make Numba compile pykv for class isa on a host whose best is top."""
    if isa == top:
        return {}
    return {"NUMBA_CPU_NAME": names.get(isa, NUMBA_CPU[isa]), "NUMBA_CPU_FEATURES": ""}


def peer(bench_dir: str, isa: str) -> str:
    """That class's llama-bench, where tools/build_llama_bench.py CLASS puts it."""
    return os.path.join(bench_dir, isa, "bin", "llama-bench")


def file_for(t: str, model: str, requant_dir: str) -> str:
    return model if t == "Q4_1" else out_path(model, requant_dir, t)


def setup_cmds(a, classes, files) -> list:
    """The commands that make what the table needs and is missing: (what, argv) in order.  A missing
    sdist is fetched first; "SRC" in a build command stands for its path (known once fetched)."""
    tools = os.path.dirname(os.path.abspath(__file__))
    cmds = []
    if not os.path.isfile(a.model) and a.model == DEFAULT_MODEL:
        cmds.append(("model", [sys.executable, "-m", "pykv", "pull"]))
    builds = [c for c in classes if not os.path.isfile(peer(a.llama_bench_dir, c))]
    if builds and not a.src and not os.path.isfile(os.path.join(SRC_DIR, SDIST_FILE)):
        cmds.append(("sdist", [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               SDIST, "-d", SRC_DIR]))
    for c in builds:
        cmds.append((f"build {c}", [sys.executable, os.path.join(tools, "build_llama_bench.py"), c, "--src",
                                    a.src or "SRC", "--build-dir", os.path.join(a.llama_bench_dir, c)]))
    need = [t for t, p in files if t != "Q4_1" and not os.path.isfile(p)]
    if need:
        quantize = os.path.join(a.llama_bench_dir, classes[0], "bin", "llama-quantize")
        cmds.append(("requantize", [sys.executable, os.path.join(tools, "requantize.py"), "--model", a.model,
                                    "--types", ",".join(need), "--out", a.requant_dir, "--quantize", quantize]))
    return cmds


def run_setup(cmds, dry_run) -> int:
    """Run setup_cmds' commands in order (dry_run: print them); 0, or 1 with one line naming the failure."""
    src = os.path.join(SRC_DIR, SDIST_FILE)         # where the "sdist" step puts it
    for what, cmd in cmds:
        cmd = [src if x == "SRC" else x for x in cmd]
        print(f"[setup {what} {time.strftime('%H:%M:%S')}] {' '.join(cmd)}", file=sys.stderr, flush=True)
        if dry_run:
            continue
        r = subprocess.run(cmd)
        if r.returncode != 0:
            print(f"class_table: setup step '{what}' failed (exit {r.returncode})", file=sys.stderr)
            return 1
    return 0


def bench_cmd(path, lb, a, depth_run=False) -> list:
    base = [sys.executable, "-m", "pykv", "bench", path, "-t", str(a.threads), "--rounds", str(a.rounds),
            "--llama-bench", lb, "--json"]
    if depth_run:
        return base + ["-p", "0", "-n", "32", "-d", "4096", "-ctk", "f16,q8_0", "-r", "2"]
    return base + ["-p", "512", "-n", "64", "-d", "16", "-r", str(a.reps)]


def run_cells(cmd, env, isa) -> list:
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()[-400:]}")
    cells = json.loads(r.stdout)
    for c in cells:
        got = (c.get("isa"), (c.get("llamacpp") or {}).get("isa"))
        if got != (isa, isa):
            raise RuntimeError(f"asked for class {isa}, ran pykv {got[0]} | llama.cpp {got[1]} ({cmd[4]})")
    return cells


def depth_ratio(cells) -> tuple:
    """(pykv q8_0 tg, llama.cpp's best tg over its caches, ratio) of a depth-4096 run's cells."""
    ours = [c["tg_tps"] for c in cells if c["ctk"] == "q8_0"]
    best = max(c["llamacpp"]["tg_tps"] for c in cells)
    return ours[0], best, ours[0] / best


def fmt_ratios(vals, goal) -> str:
    return " / ".join(("**%.2f**" if v < goal else "%.2f") % v for v in vals)


def table(results, depth, classes, types, passes) -> str:
    """results[(isa, t)] = [cell per pass]; depth[isa] = [(ours, best, ratio) per pass]."""
    per = "" if passes == 1 else f" (passes 1–{passes})"
    lines = [f"| class | weights | tg64 @ d16 pykv ÷ llama.cpp{per} | pp512 @ d16 ÷{per} | pykv tg / pp t/s (last pass) |",
             "|---|---|---|---|---|"]
    misses = {"tg": [], "pp": [], "depth": []}
    for isa in classes:
        for t in types:
            cells = results.get((isa, t), [])
            if not cells:
                continue
            tg = [c["tg_ratio"] for c in cells]
            pp = [c["pp_ratio"] for c in cells]
            misses["tg"] += [f"{isa} {t} {v:.2f}" for v in tg if v < SHORT_GOAL]
            misses["pp"] += [f"{isa} {t} {v:.2f}" for v in pp if v < SHORT_GOAL]
            last = cells[-1]
            lines.append(f"| {isa} | {t} | {fmt_ratios(tg, SHORT_GOAL)} | {fmt_ratios(pp, SHORT_GOAL)} | "
                         f"{last['tg_tps']:.0f} / {last['pp_tps']:.0f} |")
    if depth:
        lines += ["", "| class | depth 4096, q8_0 cache: pykv t/s ÷ llama.cpp's best t/s, per pass |", "|---|---|"]
        for isa in classes:
            runs = depth.get(isa, [])
            if runs:
                misses["depth"] += [f"{isa} {r:.2f}" for _, _, r in runs if r < DEPTH_GOAL]
                lines.append(f"| {isa} | " + "; ".join(
                    ("%.1f / %.1f = " + ("**%.2f**" if r < DEPTH_GOAL else "%.2f")) % (o, b, r)
                    for o, b, r in runs) + " |")
    lines.append("")
    for key, goal in (("tg", "decode @ d16 >= 1.0x"), ("pp", "prefill pp512 >= 1.0x"),
                      ("depth", "q8_0 cache @ d4096 >= 1.5x llama.cpp's best")):
        if key == "depth" and not depth:
            continue
        m = misses[key]
        lines.append(f"- {goal}: " + ("met in every cell of every pass" if not m else "missed in " + ", ".join(m)))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--classes", default=None, help="comma list (default: every class this host runs)")
    ap.add_argument("--files", default=",".join(FILE_TYPES),
                    help="weight types (Q4_1 = the shipped model; others from tools/requantize.py) or paths")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the shipped model (default: pykv's cache)")
    ap.add_argument("--requant-dir", default=DEFAULT_OUT)
    ap.add_argument("--llama-bench-dir", default=os.path.expanduser("~/.cache/pykv/llama-bench"))
    ap.add_argument("--cpu-name", action="append", default=[], metavar="CLASS=NAME",
                    help="NUMBA_CPU_NAME for a class below the host's (default: build_llama_bench's)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-depth", action="store_true", help="skip the depth-4096 q8_0 run")
    ap.add_argument("--out", default=None, help="folder for each cell's JSON and table.md")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--setup", action="store_true",
                    help="first fetch / build / requantize whatever is missing (see above)")
    ap.add_argument("--src", default=None, help="--setup: llama.cpp tree or llama-cpp-python sdist (.tar.gz)")
    a = ap.parse_args(argv)

    can = runnable_classes(host_flags())
    if not can:
        print("class_table: this host has no AVX2 (+FMA, F16C): no class to measure", file=sys.stderr)
        return 2
    classes = a.classes.split(",") if a.classes else can
    for isa in classes:
        if isa not in CLASS_ORDER:
            print(f"class_table: unknown class {isa!r} (one of {', '.join(CLASS_ORDER)})", file=sys.stderr)
            return 2
        if isa not in can:
            print(f"class_table: this host cannot run class {isa} (it runs {', '.join(can)})", file=sys.stderr)
            return 2
    names = dict(x.split("=", 1) for x in a.cpu_name)
    top = can[-1]
    files = []
    for t in a.files.split(","):
        path = t if os.path.sep in t or t.endswith(".gguf") else file_for(t, a.model, a.requant_dir)
        label = t if path != t else os.path.basename(t)
        files.append((label, path))
    if a.setup and run_setup(setup_cmds(a, classes, files), a.dry_run):
        return 1
    missing = [p for _, p in files if not os.path.isfile(p)]
    missing += [peer(a.llama_bench_dir, c) for c in classes if not os.path.isfile(peer(a.llama_bench_dir, c))]
    if missing and not a.dry_run:
        print("class_table: missing " + ", ".join(missing) + " (tools/requantize.py, tools/build_llama_bench.py CLASS)",
              file=sys.stderr)
        return 2
    if a.out:
        os.makedirs(a.out, exist_ok=True)

    results, depth = {}, {}
    for k in range(1, a.passes + 1):
        for isa in classes:
            env = class_env(isa, top, names)
            lb = peer(a.llama_bench_dir, isa)
            jobs = [(label, path, False) for label, path in files]
            if not a.no_depth:
                jobs.append(("d4096", a.model, True))
            for label, path, deep in jobs:
                cmd = bench_cmd(path, lb, a, deep)
                envs = " ".join(f"{k_}={v!r}" for k_, v in env.items())
                print(f"[pass {k} {isa} {label} {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] "
                      f"{envs + ' ' if envs else ''}python {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
                if a.dry_run:
                    continue
                try:
                    cells = run_cells(cmd, env, isa)
                except (RuntimeError, ValueError) as e:      # a failed or wrong-class run: one line, exit 1
                    print(f"class_table: {e}", file=sys.stderr)
                    return 1
                if a.out:
                    with open(os.path.join(a.out, f"pass{k}_{isa}_{label}.json"), "w") as f:
                        json.dump(cells, f, indent=1)
                if deep:
                    depth.setdefault(isa, []).append(depth_ratio(cells))
                else:
                    results.setdefault((isa, label), []).append(cells[0])
    if a.dry_run:
        return 0
    text = table(results, depth, classes, [label for label, _ in files], a.passes)
    print(text)
    if a.out:
        with open(os.path.join(a.out, "table.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
