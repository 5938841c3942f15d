"""pykv and llama.cpp side by side while other work keeps the CPU busy (issue 38's table).

    python tools/load_bench.py [MODEL] --llama-bench PATH [--loads idle,busy2,pykv2] [--runs 3]
                               [--pykv-threads auto,1,2] [--llama-threads 1,2] [--env K=V ...] [--json OUT]

For each load it starts the load, then runs, one after another, `pykv bench -p 512 -n 64 -d 16 -r 1`
at each --pykv-threads setting (auto: pykv's default) and `llama-bench` at each --llama-threads count,
--runs times in turn, and keeps each one's best run (prefill 512 and decode at depth 16, tokens/s).
Loads:
    idle   nothing
    busy2  two single-threaded Python busy loops
    pykv2  one other pykv process decoding (2 threads) the same model
    build  a parallel C++ build (make -j N of a generated tree of translation units), N = cores
The host's ISA class (kernels.tiles.ISA) and CPU model head the table."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

PYKV2 = textwrap.dedent("""
    import sys, pykv
    m = pykv.load(sys.argv[1] or None, n_ctx=2048, threads=2)
    s = m.new_sequence()
    while True:
        if s.n_tokens > 1900:
            s = m.new_sequence()
        m.eval(s, [1 + s.n_tokens % 1000])
""")


def _busy():
    return [sys.executable, "-c", "while True: pass"]


def _make_build_tree(d: str, n: int = 400) -> None:
    for i in range(n):
        with open(os.path.join(d, f"u{i}.cpp"), "w") as f:
            f.write("#include <map>\n#include <string>\n#include <vector>\n#include <algorithm>\n"
                    f"int f{i}(int x) {{ std::map<std::string, std::vector<int>> m; "
                    f"for (int k = 0; k < x; ++k) m[std::to_string(k)].push_back(k); "
                    "int s = 0; for (auto &p : m) s += std::accumulate(p.second.begin(), p.second.end(), 0); "
                    "return s; }\n")
    objs = " ".join(f"u{i}.o" for i in range(n))
    with open(os.path.join(d, "Makefile"), "w") as f:
        f.write(f"all: {objs}\n%.o: %.cpp\n\tg++ -O2 -c $< -o $@ -include numeric\n"
                "clean:\n\trm -f *.o\n")


class Load:
    def __init__(self, kind: str, model: str):
        self.kind, self.model, self.procs, self.tmp = kind, model, [], None

    def __enter__(self):
        k = self.kind
        if k == "busy2":
            self.procs = [subprocess.Popen(_busy()) for _ in range(2)]
        elif k == "pykv2":
            self.procs = [subprocess.Popen([sys.executable, "-c", PYKV2, self.model or ""],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
            time.sleep(20)          # its load and first tokens
        elif k == "build":
            self.tmp = tempfile.mkdtemp(prefix="pykv-build-load-")
            _make_build_tree(self.tmp)
            loop = f"while true; do make -s -j{os.cpu_count()} -C {self.tmp} >/dev/null 2>&1; " \
                   f"make -s -C {self.tmp} clean >/dev/null; done"
            self.procs = [subprocess.Popen(["bash", "-c", loop], start_new_session=True)]
        elif k != "idle":
            raise SystemExit(f"load_bench: unknown load {k!r}")
        time.sleep(2)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL) if self.kind == "build" else p.kill()
            except OSError:
                pass
            p.wait()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


def pykv_run(model, threads: str, env) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "pykv", "bench", "-p", "512", "-n", "64", "-d", "16", "-r", "1", "-t", threads,
           "--json"] + ([model] if model else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"pykv bench failed: {r.stderr.strip()[-500:]}")
    row = json.loads(r.stdout)[0]
    return row["pp_tps"], row["tg_tps"]


def llama_run(exe, model, threads: int) -> tuple[float, float]:
    cmd = [exe, "-m", model, "-p", "512", "-n", "64", "-d", "16", "-r", "1", "-t", str(threads), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"llama-bench failed: {r.stderr.strip()[-500:]}")
    pp = tg = None
    for e in json.loads(r.stdout):
        if e["n_gen"] == 0:
            pp = e["avg_ts"]
        else:
            tg = e["avg_ts"]
    return pp, tg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--llama-bench", default=None, help="a llama-bench binary (tools/build_llama_bench.py)")
    ap.add_argument("--loads", default="idle,busy2,pykv2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pykv-threads", default="auto,1,2")
    ap.add_argument("--llama-threads", default="1,2")
    ap.add_argument("--env", action="append", default=[], help="K=V for the pykv runs (repeatable)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    from pykv.tools.bench import cpu_model
    from pykv.kernels.tiles import ISA
    from pykv.models import resolve_model
    model = str(resolve_model(a.model))
    env = dict(os.environ)
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    cols = [("pykv", t) for t in a.pykv_threads.split(",")]
    if a.llama_bench:
        cols += [("llama.cpp", t) for t in a.llama_threads.split(",")]
    results = {}
    for load in a.loads.split(","):
        best = {c: [0.0, 0.0] for c in cols}
        with Load(load, model):
            for _ in range(a.runs):
                for c in cols:
                    pp, tg = pykv_run(model, c[1], env) if c[0] == "pykv" else llama_run(a.llama_bench, model,
                                                                                           int(c[1]))
                    best[c] = [max(best[c][0], pp or 0), max(best[c][1], tg or 0)]
                    print(f"  {load} {c[0]} -t {c[1]}: pp512 {pp:.1f}  tg64 {tg:.1f}", file=sys.stderr, flush=True)
        results[load] = {f"{k} -t {t}": v for (k, t), v in best.items()}
    head = f"ISA class {ISA}, {cpu_model()}, {os.cpu_count()} CPUs; best of {a.runs} runs, tokens/s " \
           f"(pp512 / tg64 at depth 16)"
    names = list(next(iter(results.values())))
    print(head)
    print("| load | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for load, r in results.items():
        print(f"| {load} | " + " | ".join(f"{r[n][0]:.0f} / {r[n][1]:.1f}" for n in names) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"header": head, "results": results, "env": a.env}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
