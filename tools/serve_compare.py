"""Serving side-by-side: pykv's server against llama.cpp's under the same concurrent load, plus the batched
and single-sequence decode rates that bound them, in one table.

    python tools/serve_compare.py [MODEL] [--clients 8] [--max-tokens 128] [--prompt-tokens 32] [-c CTX]
                                  [-t THREADS] [--bin-dir DIR] [--skip pykv-serve,llama-server,batched,decode]
                                  [--json]

Rows:
  (a) pykv serve      `pykv bench-serve MODEL -ctk f16 --clients 8 --max-tokens 128`: a local pykv server
                      (--parallel = clients, -c CTX per sequence), 8 streaming clients x 128 new tokens
  (b) llama-server    the same load (pykv.server.bench) against `llama-server -m MODEL -np 8 -c 8*CTX
                      --cont-batching -t THREADS --metrics`, started here on a free loopback port
  (c) batched-bench   `llama-batched-bench -m MODEL -c 4096 -b 2048 -ub 512 -npp 32 -ntg 128 -npl 1,8 -t THREADS`:
                      its S_TG t/s at npl 8 and at npl 1 (llama.cpp's decode ceiling without HTTP)
  (d) pykv decode     `pykv bench MODEL -p 32 -n 128 -ctk f16`: pykv's single-sequence decode tokens/s

MODEL: a GGUF path or registry name (default: pykv's default model, SmolLM2 135M Q4_1). The llama.cpp
binaries come from --bin-dir (default ~/.cache/pykv/llama-bench/CLASS/bin, CLASS the host's ISA class:
avx512vnni, avxvnni or avx2 from /proc/cpuinfo), built by
`python tools/build_llama_bench.py CLASS --targets llama-server,llama-batched-bench`; a missing binary
skips its row with a line saying so. -t THREADS: the threads of every row (pykv serve gets `-t THREADS`
through --serve-args); default: llama.cpp all cores (-t 2 on a 2-core host), pykv its own default.
--json prints the rows as a JSON list instead of the table.

On a host shared with other work the llama.cpp rows can read far low: its threads spin at barriers and
stall when another process takes a core (the load generator itself counts); the script notes a busy host
(1-minute load average over 0.5 at its start). Compare on an idle host.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))           # the repository's pykv, when run from a checkout

STEPS = ("pykv-serve", "llama-server", "batched", "decode")


def isa_class(cpuinfo: str | None = None) -> str:
    """The host's ISA class from /proc/cpuinfo flags (pykv.kernels.tiles names them the same way)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if {"avx512_vnni", "avx512bw", "avx512f"} <= flags:
        return "avx512vnni"
    if {"avx_vnni", "avx2"} <= flags:
        return "avxvnni"
    if "avx2" in flags:
        return "avx2"
    return "generic"


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def parse_batched_bench(text: str) -> dict[int, dict]:
    """llama-batched-bench's markdown table -> {B (npl): {column: value}} (S_TG t/s among them)."""
    rows: dict[int, dict] = {}
    head = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if "B" in cells and "S_TG t/s" in cells:
            head = cells
            continue
        if head is None or len(cells) != len(head) or set(line) <= set("|-: "):
            continue
        try:
            vals = {h: float(c) for h, c in zip(head, cells)}
        except ValueError:
            continue
        rows[int(vals["B"])] = vals
    return rows


def _row(system, workload, **kw):
    base = {"system": system, "workload": workload, "output_tok_s": None, "req_s": None, "ttft_p50_ms": None,
            "ttft_p99_ms": None, "itl_p50_ms": None, "itl_p99_ms": None, "peak_running": None, "errors": None}
    base.update(kw)
    return base


_LOAD_KEYS = ("output_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "peak_running",
              "errors", "completion_tokens", "wall_s")


def step_pykv_serve(a, model) -> dict:
    cmd = [sys.executable, "-m", "pykv", "bench-serve", model, "-ctk", "f16", "--clients", str(a.clients),
           "--max-tokens", str(a.max_tokens), "--prompt-tokens", str(a.prompt_tokens), "--json"]
    if a.ctx:
        cmd += ["-c", str(a.ctx)]
    if a.threads_given:
        cmd += [f"--serve-args=-t {a.threads}"]
    print("serve_compare: " + " ".join(cmd[2:]), file=sys.stderr)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pykv bench-serve exited with {r.returncode}")
    s = json.loads(r.stdout)[0]
    return _row("pykv serve", f"{a.clients} clients x {a.max_tokens} tok (-ctk f16)",
                **{k: s.get(k) for k in _LOAD_KEYS})


def step_llama_server(a, model, binary) -> dict:
    from pykv.server.bench import free_port, load, start_server_process
    port = free_port()
    ctx = a.ctx or 2048
    cmd = [binary, "-m", model, "-np", str(a.clients), "-c", str(a.clients * ctx), "--cont-batching",
           "-t", str(a.threads), "--host", "127.0.0.1", "--port", str(port), "--metrics"]
    print("serve_compare: " + " ".join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd)),
          file=sys.stderr)
    h = start_server_process(cmd, port, name="llama-server")
    try:
        s = load(h.url, clients=a.clients, max_tokens=a.max_tokens, prompt_tokens=a.prompt_tokens,
                 warmup=True).summary()
    finally:
        h.stop()
    return _row("llama-server", f"{a.clients} clients x {a.max_tokens} tok (f16 KV)",
                **{k: s.get(k) for k in _LOAD_KEYS})


def step_batched(a, model, binary) -> list[dict]:
    npl = sorted({1, a.clients})
    cmd = [binary, "-m", model, "-c", "4096", "-b", "2048", "-ub", "512", "-npp", "32", "-ntg", str(a.max_tokens),
           "-npl", ",".join(map(str, npl)), "-t", str(a.threads)]
    print("serve_compare: " + " ".join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd)),
          file=sys.stderr)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"llama-batched-bench exited with {r.returncode}: {tail}")
    table = parse_batched_bench(r.stdout + "\n" + r.stderr)
    rows = []
    for n in sorted(npl, reverse=True):
        if n in table:
            rows.append(_row("llama-batched-bench", f"npl {n}: S_TG (pp 32, tg {a.max_tokens})",
                             output_tok_s=table[n]["S_TG t/s"]))
    if not rows:
        raise RuntimeError("llama-batched-bench printed no table")
    return rows


def step_decode(a, model) -> dict:
    cmd = [sys.executable, "-m", "pykv", "bench", model, "-p", "32", "-n", str(a.max_tokens), "-ctk", "f16",
           "-r", "3", "--json"]
    if a.threads_given:
        cmd += ["-t", str(a.threads)]
    print("serve_compare: " + " ".join(cmd[2:]), file=sys.stderr)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pykv bench exited with {r.returncode}")
    tg = [c["tg_tps"] for c in json.loads(r.stdout) if c.get("tg_tps")]
    if not tg:
        raise RuntimeError("pykv bench reported no tg figure")
    return _row("pykv bench", f"1 sequence: tg{a.max_tokens}", output_tok_s=round(float(tg[0]), 2))


COLUMNS = (("system", "system"), ("workload", "workload"), ("output_tok_s", "output tok/s"), ("req_s", "req/s"),
           ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"), ("itl_p50_ms", "ITL p50 ms"),
           ("itl_p99_ms", "ITL p99 ms"), ("peak_running", "peak running"), ("errors", "errors"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="serve_compare", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="GGUF path or registry name (default: the default model)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients / llama-server slots (default 8)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt words per request (default 32)")
    ap.add_argument("-c", "--ctx", type=int, default=2048,
                    help="context per sequence: pykv serve -c CTX, llama-server -c clients*CTX (default 2048)")
    ap.add_argument("-t", "--threads", type=int, default=None,
                    help="threads of every row (default: llama.cpp all cores, pykv its own default: the cores "
                         "other work leaves free)")
    ap.add_argument("--bin-dir", default=None, help="llama.cpp binaries (default ~/.cache/pykv/llama-bench/CLASS/bin)")
    ap.add_argument("--skip", default="", help=f"comma list of steps to skip: {', '.join(STEPS)}")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    a = ap.parse_args(argv)
    a.threads_given = a.threads is not None
    if a.threads is None:
        a.threads = os.cpu_count() or 1
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    bad = skip - set(STEPS)
    if bad:
        ap.error(f"--skip: unknown step(s) {', '.join(sorted(bad))}; steps: {', '.join(STEPS)}")

    from pykv.models import resolve_model
    from pykv.server.bench import format_table
    isa = isa_class()
    model = str(resolve_model(a.model))
    bin_dir = os.path.expanduser(a.bin_dir or f"~/.cache/pykv/llama-bench/{isa}/bin")
    rows, notes = [], []
    load0 = _loadavg()
    if load0 is not None and load0 > 0.5:
        notes.append(f"host busy: 1-minute load average {load0:.2f} at the start; llama.cpp's -t {a.threads} "
                     "threads spin at their barriers and stall when another process takes a core, so its rows "
                     "may read far low (rerun on an idle host)")

    def binary(name):
        path = os.path.join(bin_dir, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
        notes.append(f"skipped {name}: not found at {path} (build it: python tools/build_llama_bench.py {isa} "
                     f"--targets {name})")
        print(f"serve_compare: {notes[-1]}", file=sys.stderr)
        return None

    def attempt(label, fn, *args):
        try:
            out = fn(*args)
            rows.extend(out if isinstance(out, list) else [out])
        except Exception as e:      # one failed step leaves the others' rows
            notes.append(f"{label} failed: {type(e).__name__}: {e}")
            print(f"serve_compare: {notes[-1]}", file=sys.stderr)

    if "pykv-serve" not in skip:
        attempt("pykv serve", step_pykv_serve, a, model)
    if "llama-server" not in skip and (b := binary("llama-server")):
        attempt("llama-server", step_llama_server, a, model, b)
    if "batched" not in skip and (b := binary("llama-batched-bench")):
        attempt("llama-batched-bench", step_batched, a, model, b)
    if "decode" not in skip:
        attempt("pykv bench", step_decode, a, model)

    by = {r["system"]: r for r in rows}
    p, l = by.get("pykv serve"), by.get("llama-server")
    if p and l and p.get("output_tok_s") and l.get("output_tok_s"):
        notes.append(f"pykv serve / llama-server output tok/s: {p['output_tok_s'] / l['output_tok_s']:.2f}")
    if a.json:
        print(json.dumps({"isa": isa, "model": os.path.basename(model),
                          "threads": a.threads if a.threads_given else None, "rows": rows,
                          "notes": notes}, indent=2))
        return 0
    thr = f"{a.threads} threads" if a.threads_given else f"llama.cpp {a.threads} threads, pykv its default"
    print(f"ISA class {isa}, model {os.path.basename(model)}, {thr}, {a.clients} clients x "
          f"{a.max_tokens} new tokens, prompts of about {a.prompt_tokens} words")
    print()
    print(format_table(rows, COLUMNS))
    for n in notes:
        print(f"- {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
