"""`pykv bench`: prompt-processing and generation speed per KV cache type and depth, like llama-bench.

    pykv bench [MODEL] -p 512 -n 128 -d 0,1024,4096 -ctk f16,q8_0,q4_0 -t 2 -r 3 [--json] [--compare-llamacpp]

One *cell* is (ctk, ctv, threads, n_prompt, n_gen, depth). For each cell:
  pp: the cache already holds `depth` tokens (an untimed prefill); time a prefill of `n_prompt` tokens;
  tg: the cache already holds `depth` tokens; time `n_gen` single-token decodes.
Each figure is the median tokens/s of `-r` repetitions (the spread is the sample standard deviation).
The depth prefill is done once per depth and shared by the repetitions and by pp and tg: after each
timed run the sequence is rewound to `depth` tokens (later tokens are simply overwritten), exactly
what llama-bench's per-repetition refill produces, without paying for the fill again. Depths are filled
incrementally in ascending order, so the whole sweep pays for one prefill of the largest depth.
Tokens are random ids (seeded), as in llama-bench.

`--compare-llamacpp` runs the same cells through llama-cpp-python (optional extra `pykv[compare]`) with
the same threads and KV types and prints pykv / llama.cpp per cell. `--llama-bench PATH` runs them through
llama.cpp's own llama-bench binary instead (`-o json`), e.g. one built by `tools/build_llama_bench.py CLASS`
for the ISA class pykv compiles for: the same-class peer. llama.cpp needs flash attention for
a quantized V cache; with `-fa auto` (default) quantized-V cells use fa on and float-V cells run both
fa on and off and report the better figure of each test. `-fa` only affects llama.cpp.
`--rounds K` runs pykv then llama.cpp K times in turn (each -r repetitions) and pools each side's samples:
on a shared host whose speed drifts over minutes, both sides then sample the same phases.
"""
from __future__ import annotations
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
import numpy as np
from pykv.files.config import PykvError

FLOAT_V = ("f32", "f16", "bf16")   # llama.cpp V-cache types that work without flash attention


# ---- argument parsing --------------------------------------------------------------------------------
def _csv_list(s, what: str, parse) -> list:
    """A comma list (or a list / an int) -> distinct parsed items in order; parse raises PykvError."""
    items = [s] if isinstance(s, int) else (str(s).split(",") if isinstance(s, str) else list(s))
    out = [parse(str(p).strip()) for p in items if str(p).strip()]
    if not out:
        raise PykvError(f"{what}: empty list")
    return list(dict.fromkeys(out))


def _int_list(s, what: str, minimum: int = 0) -> list[int]:
    def parse(part):
        try:
            v = int(part)
        except ValueError:
            raise PykvError(f"{what}: expected a comma list of integers, got {s!r}") from None
        if v < minimum:
            raise PykvError(f"{what}: values must be >= {minimum}, got {v}")
        return v
    return _csv_list(s, what, parse)


def _kv_list(s, what: str) -> list[str]:
    from pykv.files.formats import parse_kv_type

    def parse(part):
        try:
            return parse_kv_type(part).name
        except ValueError as e:
            raise PykvError(f"{what}: {e}") from None
    return _csv_list(s, what, parse)


def _rotate_flag(v):
    if v is None or isinstance(v, bool):
        return v
    try:
        return {"on": True, "off": False, "auto": None}[str(v).lower()]
    except KeyError:
        raise PykvError(f"--kv-rotate: expected on, off or auto, got {v!r}") from None


def _stats(samples: list[float]):
    if not samples:
        return None, None
    sd = statistics.stdev(samples) if len(samples) > 1 else 0.0
    return statistics.median(samples), sd


def _tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@dataclass
class _Plan:
    pairs: list            # [(ctk, ctv)]
    threads: list          # [int]
    prompts: list          # [int]
    gens: list             # [int]
    depths: list           # ascending [int]
    reps: int

    @property
    def n_warmup(self) -> int:
        return max(2, min(max(self.prompts), 32))

    @property
    def n_ctx(self) -> int:
        return max(max(self.depths) + max(self.prompts) + max(self.gens), self.n_warmup + 1)


def _plan(n_prompt, n_gen, depth, ctk, ctv, threads, reps) -> _Plan:
    prompts = _int_list(n_prompt, "-p/--n-prompt")
    gens = _int_list(n_gen, "-n/--n-gen")
    depths = sorted(_int_list(depth, "-d/--n-depth"))
    if max(prompts) == 0 and max(gens) == 0:
        raise PykvError("nothing to measure: -p and -n are both 0")
    ks = _kv_list(ctk, "-ctk/--cache-type-k")
    if ctv is None:   # paired: each K type with the same V type
        pairs = [(k, k) for k in ks]
    else:
        vs = _kv_list(ctv, "-ctv/--cache-type-v")
        pairs = [(k, v) for k in ks for v in vs]
    if threads is None or threads == "" or threads == []:
        ts = [os.cpu_count() or 1]
    else:
        def thread_count(part):     # "auto": pykv's own choice per call (the cores other work leaves free)
            return None if part == "auto" else _int_list(part, "-t/--threads", minimum=1)[0]
        ts = _csv_list(threads, "-t/--threads", thread_count)
    try:
        reps = int(reps)
    except (TypeError, ValueError):
        raise PykvError(f"-r/--repetitions: expected an integer, got {reps!r}") from None
    if reps < 1:
        raise PykvError("-r/--repetitions must be >= 1")
    return _Plan(pairs, ts, prompts, gens, depths, reps)


# ---- the two engines -----------------------------------------------------------------------------------
class _PykvEngine:
    name = "pykv"

    def __init__(self, path, n_ctx, ctk, ctv, threads, kv_rotate, device="cpu"):
        from pykv.api.model import load
        self.m = load(path, n_ctx=n_ctx, kv_type_k=ctk, kv_type_v=ctv, threads=threads, kv_rotate=kv_rotate,
                      device=device)
        self.path = self.m.path
        self.n_vocab = self.m.n_vocab
        self.seq = self.m.new_sequence()

    @property
    def n_tokens(self) -> int:
        return self.seq.n_tokens

    def rewind(self, n: int) -> None:
        # Positions >= n are overwritten by the next eval; KIVI residual rows below n are untouched.
        assert n <= self.seq.n_tokens
        self.seq.n_tokens = n

    def eval(self, ids) -> None:
        self.m.eval(self.seq, ids)

    def info(self) -> dict:
        from pykv.kernels.tiles import ISA
        from pykv.decoder.threads import resolve
        return {"kv_rotate": bool(self.m.rotate), "kv_bytes_per_token": float(self.m.kv_bytes_per_token()),
                "threads_used": resolve(self.m.threads), "isa": ISA}

    def close(self) -> None:
        self.m.new_sequence()
        self.m = None


LLAMA_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20,
               "bf16": 30}


class _LlamaEngine:
    name = "llama.cpp"

    def __init__(self, path, n_ctx, ctk, ctv, threads, flash_attn: bool):
        import llama_cpp
        for t in (ctk, ctv):
            if t not in LLAMA_TYPES:
                raise PykvError(f"llama.cpp has no {t} KV cache type")
        if not flash_attn and ctv not in FLOAT_V:
            raise PykvError(f"llama.cpp needs flash attention for a {ctv} V cache")
        tk = getattr(llama_cpp, f"GGML_TYPE_{ctk.upper()}", LLAMA_TYPES[ctk])
        tv = getattr(llama_cpp, f"GGML_TYPE_{ctv.upper()}", LLAMA_TYPES[ctv])
        try:
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=int(n_ctx), n_threads=int(threads),
                                       n_threads_batch=int(threads), n_batch=512, n_ubatch=512,
                                       flash_attn=bool(flash_attn), type_k=tk, type_v=tv,
                                       logits_all=False, verbose=False)
        except Exception as e:   # llama-cpp-python raises ValueError on a failed context
            raise PykvError(f"llama.cpp could not load the model with K {ctk}, V {ctv}, "
                            f"fa {'on' if flash_attn else 'off'}: {e}") from None
        self.n_vocab = int(self.llm.n_vocab())

    @property
    def n_tokens(self) -> int:
        return int(self.llm.n_tokens)

    def rewind(self, n: int) -> None:
        # Llama.eval removes cache positions >= n_tokens before decoding (kv_cache_seq_rm).
        assert n <= self.llm.n_tokens
        self.llm.n_tokens = n

    def eval(self, ids) -> None:
        self.llm.eval([int(i) for i in ids])

    def info(self) -> dict:
        import llama_cpp
        try:
            sysinfo = llama_cpp.llama_print_system_info()
        except Exception:            # pragma: no cover - older bindings
            return {"isa": "unknown"}
        if isinstance(sysinfo, bytes):
            sysinfo = sysinfo.decode("utf-8", "replace")
        return {"isa": isa_from_system_info(sysinfo)}


def isa_from_system_info(text: str) -> str:
    """The ISA class (kernels.tiles.ISA_CLASSES) of a ggml build from its system-info line
    ("AVX2 = 1 | AVX_VNNI = 0 | AVX512 = 1 | AVX512_VNNI = 1 | ...")."""
    import re
    on = {m.group(1).upper() for m in re.finditer(r"([A-Za-z0-9_]+)\s*=\s*1\b", text)}
    if {"AVX512", "AVX512_VNNI"} <= on:
        return "avx512vnni"
    if {"AVX2", "AVX_VNNI"} <= on:
        return "avxvnni"
    if "AVX2" in on:
        return "avx2"
    return "generic"

    def close(self) -> None:
        try:
            self.llm.close()
        except Exception:
            pass
        self.llm = None


def _measure(eng, plan: _Plan, rng, log, label: str) -> dict:
    """{(p, n, depth): (pp_samples, tg_samples)} for one loaded engine."""
    out = {}
    V = eng.n_vocab
    # warmup (JIT compile, thread pools, caches): a short prefill and one decode, then clear
    eng.eval(rng.integers(0, V, plan.n_warmup))
    eng.eval(rng.integers(0, V, 1))
    eng.rewind(0)
    for d in plan.depths:
        if d > eng.n_tokens:
            log(f"{label}: filling the cache to depth {d} ...")
            eng.eval(rng.integers(0, V, d - eng.n_tokens))
        for p in plan.prompts:
            for n in plan.gens:
                pp, tg = [], []
                for _ in range(plan.reps if p else 0):
                    eng.rewind(d)
                    ids = rng.integers(0, V, p)
                    t0 = time.perf_counter()
                    eng.eval(ids)
                    pp.append(p / max(time.perf_counter() - t0, 1e-9))
                for _ in range(plan.reps if n else 0):
                    eng.rewind(d)
                    ids = rng.integers(0, V, n)
                    t0 = time.perf_counter()
                    for i in range(n):
                        eng.eval(ids[i:i + 1])
                    tg.append(n / max(time.perf_counter() - t0, 1e-9))
                eng.rewind(d)
                out[(p, n, d)] = (pp, tg)
                msg = [f"{label} d{d}:"]
                if p:
                    msg.append(f"pp{p} {_stats(pp)[0]:.2f} t/s")
                if n:
                    msg.append(f"tg{n} {_stats(tg)[0]:.2f} t/s")
                log(" ".join(msg))
    return out


def _keep_better(cell: dict, name: str, samples: list, fa_s: str) -> None:
    """cell's `name` ("pp" / "tg") figures become these samples' (run with flash attention fa_s) when their
    median is the better one so far."""
    med, sd = _stats(samples)
    if med is not None and (cell[f"{name}_tps"] is None or med > cell[f"{name}_tps"]):
        cell.update({f"{name}_tps": med, f"{name}_tps_sd": sd, f"{name}_samples": samples, f"{name}_fa": fa_s})


def _fa_settings(fa_mode: str, ctv: str) -> list[bool]:
    """llama.cpp's flash-attention settings to try: -fa on / off, or auto (both for a float V cache,
    on for a quantized one, which needs it)."""
    return {"on": [True], "off": [False]}.get(fa_mode, [True, False] if ctv in FLOAT_V else [True])


def _llama_cells(path, plan, ctk, ctv, t, fa_mode, rng, log) -> tuple[dict, str | None]:
    """{(p, n, d): {pp_tps, tg_tps, pp_fa, tg_fa, ...}} for llama.cpp, best of the fa settings tried."""
    fas = _fa_settings(fa_mode, ctv)
    best: dict = {}
    errors = []
    for fa in fas:
        fa_s = "on" if fa else "off"
        try:
            eng = _LlamaEngine(path, plan.n_ctx, ctk, ctv, t, fa)
        except PykvError as e:
            errors.append(str(e))
            continue
        try:
            isa = eng.info()["isa"]
            res = _measure(eng, plan, rng, log, f"llama.cpp {ctk}/{ctv} t{t} fa {fa_s}")
        finally:
            eng.close()
        for key, (pp, tg) in res.items():
            cell = best.setdefault(key, {"pp_tps": None, "tg_tps": None, "pp_fa": None, "tg_fa": None, "isa": isa})
            for name, samples in (("pp", pp), ("tg", tg)):
                _keep_better(cell, name, samples, fa_s)
    return best, ("; ".join(errors) if errors and not best else None)


def llama_bench_isa(exe: str) -> str:
    """The ISA class a llama-bench binary's ggml CPU backend was compiled for, from the ggml_cpu_has_*
    functions of the libggml-cpu.so beside it ("unknown" when there is none, e.g. a static build)."""
    import ctypes
    lib = os.path.join(os.path.dirname(os.path.realpath(exe)), "libggml-cpu.so")
    try:
        cpu = ctypes.CDLL(lib)
        has = {k: bool(getattr(cpu, f"ggml_cpu_has_{k}")()) for k in ("avx2", "avx_vnni", "avx512", "avx512_vnni")}
    except (OSError, AttributeError):
        return "unknown"
    return isa_from_system_info(" | ".join(f"{k.upper()} = {int(v)}" for k, v in has.items()))


def llama_bench_cmd(exe, path, plan, ctk, ctv, t, fas) -> list[str]:
    """llama-bench's command line for one (ctk, ctv, threads) group of cells: every pp and tg test at every
    depth, each flash-attention setting in fas."""
    def csv(v):
        return ",".join(str(x) for x in v)
    return [str(exe), "-m", str(path), "-p", csv(plan.prompts), "-n", csv(plan.gens), "-d", csv(plan.depths),
            "-t", str(t), "-r", str(plan.reps), "-ctk", ctk, "-ctv", ctv,
            "-fa", csv("on" if fa else "off" for fa in fas), "-o", "json"]


def parse_llama_bench(text: str, plan, isa: str) -> dict:
    """llama-bench's `-o json` output -> {(p, n, d): cell} as _llama_cells returns, the better flash-attention
    setting of each test.  A pp test is llama-bench's n_prompt=p, n_gen=0; a tg test n_prompt=0, n_gen=n."""
    try:
        tests = json.loads(text)
        if not isinstance(tests, list):
            raise TypeError(f"a JSON {type(tests).__name__}, not a list of tests")
        got = {}
        for e in tests:
            fa = e.get("flash_attn")
            fa_s = {1: "on", 0: "off", -1: "auto"}.get(fa, str(fa))      # 1 / 0 (true / false); -1: auto
            key = (int(e["n_prompt"]), int(e["n_gen"]), int(e.get("n_depth", 0)))
            got.setdefault(key, []).append((fa_s, [float(x) for x in e["samples_ts"]]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PykvError(f"llama-bench printed no readable JSON ({type(e).__name__}: {e})") from None
    best = {}
    for p in plan.prompts:
        for n in plan.gens:
            for d in plan.depths:
                cell = {"pp_tps": None, "tg_tps": None, "pp_fa": None, "tg_fa": None, "isa": isa}
                for name, key in (("pp", (p, 0, d)), ("tg", (0, n, d))):
                    if not key[0] and not key[1]:
                        continue
                    for fa_s, samples in got.get(key, []):
                        _keep_better(cell, name, samples, fa_s)
                if cell["pp_tps"] is not None or cell["tg_tps"] is not None:
                    best[(p, n, d)] = cell
    return best


def _llama_bench_cells(exe, path, plan, ctk, ctv, t, fa_mode, log) -> tuple[dict, str | None]:
    """_llama_cells through a llama-bench binary (one run for every cell of this ctk/ctv/threads group)."""
    import subprocess
    for ty in (ctk, ctv):
        if ty not in LLAMA_TYPES:
            return {}, f"llama.cpp has no {ty} KV cache type"
    fas = _fa_settings(fa_mode, ctv)
    cmd = llama_bench_cmd(exe, path, plan, ctk, ctv, t, fas)
    log("llama-bench: " + " ".join(cmd[1:]))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        return {}, f"could not run {exe}: {e.strerror or e}"
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or [""])[-1]
        return {}, f"llama-bench exited with {r.returncode}: {tail}"
    try:
        return parse_llama_bench(r.stdout, plan, llama_bench_isa(exe)), None
    except PykvError as e:
        return {}, str(e)


def _pool_llama(into: dict, got: dict) -> None:
    """Add one round's llama.cpp cells (got) to the earlier rounds' (into): samples pooled, median recomputed
    (each round's flash-attention setting is that round's better one)."""
    for key, cell in got.items():
        old = into.get(key)
        if old is None:
            into[key] = dict(cell)
            continue
        for name in ("pp", "tg"):
            samples = (old.get(f"{name}_samples") or []) + (cell.get(f"{name}_samples") or [])
            med, sd = _stats(samples)
            fas = {f for c in (old, cell) for f in (c.get(f"{name}_fa") or "").split(",") if f}
            old.update({f"{name}_tps": med, f"{name}_tps_sd": sd, f"{name}_samples": samples,
                        f"{name}_fa": ",".join(sorted(fas)) or None})



def cpu_model() -> str:
    """The host's CPU model name (/proc/cpuinfo), "unknown" where there is none: benchmark tables name it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"

# ---- the benchmark ---------------------------------------------------------------------------------------
def run_bench(model=None, *, n_prompt="512", n_gen="128", depth="0", ctk="f16", ctv=None, threads=None,
              reps: int = 3, kv_rotate=None, compare_llamacpp: bool = False, flash_attn: str = "auto",
              progress=None, seed: int = 1234, device: str = "cpu", llama_bench: str | None = None,
              rounds: int = 1) -> list[dict]:
    """Run the benchmark; returns one dict per cell (see the module docstring).
    rounds: with a comparison, run pykv then llama.cpp this many times in turn (-r repetitions each) and
    pool each side's samples, so that a slow phase of a shared host lands on both sides.

    List arguments take a comma string or a list. progress: None = print to stderr when it is a TTY.
    llama_bench: a llama-bench binary to compare against (implies compare_llamacpp; no llama-cpp-python).
    """
    plan = _plan(n_prompt, n_gen, depth, ctk, ctv, threads, reps)
    rot = _rotate_flag(kv_rotate)
    if flash_attn not in ("on", "off", "auto"):
        raise PykvError(f"-fa: expected on, off or auto, got {flash_attn!r}")
    if llama_bench is not None:
        llama_bench = os.path.expanduser(str(llama_bench))
        if not (os.path.isfile(llama_bench) and os.access(llama_bench, os.X_OK)):
            raise PykvError(f"--llama-bench: {llama_bench} is not an executable file")
        compare_llamacpp = True
    elif compare_llamacpp:
        try:
            import llama_cpp  # noqa: F401  (availability check)
        except ImportError:
            raise PykvError("--compare-llamacpp needs llama-cpp-python: pip install 'pykv[compare]'") from None
    if progress is None:
        progress = _tty()

    def log(msg: str) -> None:
        if progress:
            print(f"bench: {msg}", file=sys.stderr, flush=True)

    if not isinstance(rounds, int) or rounds < 1:
        raise PykvError(f"--rounds: expected an integer >= 1, got {rounds!r}")
    rows = []
    path = model
    for ctk_, ctv_ in plan.pairs:
        for t in plan.threads:
            rng = np.random.default_rng(seed)
            res, llama, llama_err = {}, {}, None
            for rd in range(rounds):      # pykv, then llama.cpp, then pykv again ...: both see the host's slow phases
                eng = _PykvEngine(path, plan.n_ctx, ctk_, ctv_, t, rot, device)
                path = eng.path            # resolved once (registry name -> file)
                info = eng.info()
                try:
                    for key, (pp, tg) in _measure(eng, plan, rng, log, f"pykv {ctk_}/{ctv_} t{t}").items():
                        res.setdefault(key, ([], []))
                        res[key][0].extend(pp)
                        res[key][1].extend(tg)
                finally:
                    eng.close()
                    del eng
                if compare_llamacpp:
                    if llama_bench is not None:
                        got, llama_err = _llama_bench_cells(llama_bench, path, plan, ctk_, ctv_, t or os.cpu_count(),
                                                            flash_attn, log)
                    else:
                        got, llama_err = _llama_cells(path, plan, ctk_, ctv_, t or os.cpu_count(), flash_attn,
                                                      np.random.default_rng(seed + rd), log)
                    if llama_err:
                        log(f"llama.cpp {ctk_}/{ctv_}: {llama_err}")
                    _pool_llama(llama, got)
            for p in plan.prompts:
                for n in plan.gens:
                    for d in plan.depths:
                        pp, tg = res[(p, n, d)]
                        pp_m, pp_sd = _stats(pp)
                        tg_m, tg_sd = _stats(tg)
                        row = {"model": os.path.basename(str(path)), "model_path": str(path),
                               "depth": d, "n_prompt": p, "n_gen": n, "ctk": ctk_, "ctv": ctv_,
                               "threads": "auto" if t is None else t,
                               "reps": plan.reps, "rounds": rounds, **info,
                               "pp_tps": pp_m, "pp_tps_sd": pp_sd, "pp_samples": pp,
                               "tg_tps": tg_m, "tg_tps_sd": tg_sd, "tg_samples": tg}
                        if compare_llamacpp:
                            lc = llama.get((p, n, d))
                            if lc is None:
                                lc = {"pp_tps": None, "tg_tps": None, "error": llama_err or "not run"}
                            row["llamacpp"] = lc
                            for name in ("pp", "tg"):
                                a, b = row[f"{name}_tps"], lc.get(f"{name}_tps")
                                row[f"{name}_ratio"] = (a / b) if a and b else None
                        rows.append(row)
    return rows


# ---- output -------------------------------------------------------------------------------------------------
def _fmt_tps(med, sd) -> str:
    if med is None:
        return "-"
    if sd:
        return f"{med:.2f} ± {sd:.2f}"
    return f"{med:.2f}"


def _fmt_ratio(r) -> str:
    return "-" if r is None else f"{r:.2f}"


def format_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    ps = sorted({r["n_prompt"] for r in rows})
    ns = sorted({r["n_gen"] for r in rows})
    one_p, one_n = len(ps) == 1, len(ns) == 1
    compare = any("llamacpp" in r for r in rows)
    show_pp = any(r["n_prompt"] for r in rows)
    show_tg = any(r["n_gen"] for r in rows)
    pp_h = f"pp{ps[0]}" if one_p else "pp"
    tg_h = f"tg{ns[0]}" if one_n else "tg"
    head = ["model", "threads", "ctk", "ctv", "rot", "depth"]
    if not one_p:
        head.append("n_prompt")
    if not one_n:
        head.append("n_gen")
    metrics = [m for m, show in (("pp", show_pp), ("tg", show_tg)) if show]
    hname = {"pp": pp_h, "tg": tg_h}
    for m in metrics:
        head.append(f"{hname[m]} t/s" if not compare else f"pykv {hname[m]} t/s")
    if compare:
        for m in metrics:
            head.append(f"llama.cpp {hname[m]} t/s")
        for m in metrics:
            head.append(f"{hname[m]} pykv ÷ llama.cpp")
    align = ["---"] * 5 + ["---:"] * (len(head) - 5)
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    for r in rows:
        cells = [r["model"], str(r["threads"]), r["ctk"], r["ctv"], "on" if r.get("kv_rotate") else "off",
                 str(r["depth"])]
        if not one_p:
            cells.append(str(r["n_prompt"]))
        if not one_n:
            cells.append(str(r["n_gen"]))
        for m in metrics:
            cells.append(_fmt_tps(r[f"{m}_tps"], r[f"{m}_tps_sd"]))
        if compare:
            lc = r["llamacpp"]
            for m in metrics:
                s = _fmt_tps(lc.get(f"{m}_tps"), lc.get(f"{m}_tps_sd"))
                if lc.get(f"{m}_fa") and lc.get(f"{m}_tps") is not None:
                    s += f" (fa {lc[f'{m}_fa']})"
                cells.append(s)
            for m in metrics:
                cells.append(_fmt_ratio(r.get(f"{m}_ratio")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_notes(rows: list[dict]) -> str:
    errs = dict.fromkeys(f"llama.cpp {r['ctk']}/{r['ctv']}: {r['llamacpp']['error']}"
                         for r in rows if "llamacpp" in r and r["llamacpp"].get("error"))
    isa = dict.fromkeys(f"ISA class: pykv {r.get('isa', 'unknown')}"
                        + (f" | llama.cpp {r['llamacpp'].get('isa', 'unknown')}" if "llamacpp" in r else "")
                        for r in rows)
    return "\n".join(list(isa) + list(errs))
