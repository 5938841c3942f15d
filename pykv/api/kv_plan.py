"""Automatic per-layer KV precision: where the KV error comes from, and the cheapest plan under a budget.

* **Sensitivity** (`sensitivity`): KL divergence of the next-token distribution against an f16-cache
  run when only layer l's K (or only its V) is stored in type t, on a short calibration text, with
  float activations (so the two runs differ only in the cache). One model stays loaded; each probe
  swaps the cache (`Model.set_kv_types`) and re-runs only layers l..L-1 from the f16 run's saved
  residual stream (the layers below l see exactly the f16 run's inputs and caches).
  `exact`: one probe per (layer, K|V, type).  Estimate (default): one probe per (layer, K|V) at the
  reference type (the cheapest candidate: its KL stands furthest above the noise) plus one run per
  (K|V, type) with every layer in that type; KL[l, s, t] ~ KL[l, s, ref] * KLall[s, t] / KLall[s, ref]
  (2L + 2T runs instead of 2LT; `tools/kv_auto.py --check-estimate` compares its ranking to exact).
* **Plan** (`solve`): per layer a K type and a V type minimising the summed KL (KL assumed additive over
  layers) with the bytes per token, f16 sink rows, KIVI rings and the token-adaptive window amortised
  over n_ctx included, at most the budget: a multiple-choice knapsack solved exactly by dynamic
  programming over quarter bytes.  `refine` corrects the table with measured K-only / V-only runs of
  the plan and keeps the lowest measured plan (KL compounds across layers, unevenly for K and V).
* **Files**: the plan as a small JSON (`save_plan` / `read_plan`), the sensitivity table cached per
  model fingerprint, calibration ids, types and method (``$PYKV_CACHE`` or ``~/.cache/pykv``).
"""
from __future__ import annotations
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from importlib import resources
import numpy as np
from pykv.files.config import PykvError
from pykv.kv.transform import default_calib_text, fingerprint
from pykv.files.formats import KV_FORMATS, kv_bytes_per_token_head, parse_kv_type

DEFAULT_TYPES = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "nl4", "nl3", "nl3b", "nl2", "nl2b")
# what an automatic plan (--kv-bits alone) tries, by the target's bits per value: the candidates the
# runs of docs/kv-formats.md chose from at 4.5, 3 and 2.5 bits (tools/kv_auto.py, tools/kv_configs.py),
# then the same where the device runs no CPU-only type (the trellis-coded tc types; None: the same)
AUTO_TYPES = ((5.0, ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl", "nl4", "nl3b"), None),
              (4.0, ("q4_0", "iq4_nl", "nl4", "tc3b", "tc2b"), ("q4_0", "iq4_nl", "nl4", "nl3", "nl3b", "nl2b")),
              (2.75, ("tc2b", "tc3b", "nl4"), ("nl3", "nl3b", "nl2", "nl2b")),
              (0.0, ("tc1b", "tc2b", "tc3b"), ("nl2", "nl2b")))
# its token-adaptive window, by the same bits: (floor, rows, row type); at most an eighth of the
# context, fewer rows when the cheapest candidate in every layer plus the window no longer fits.
AUTO_WINDOWS = ((4.0, 64, "q8_0"), (2.75, 32, "q8_0"), (0.0, 48, "q8_0"))
AUTO_GROUPS = 6           # sensitivity probes per side: layers in runs of L / 6
AUTO_REFINE = 1
CALIB_TOKENS = 512   # kv-sensitivity's default; plans calibrate at the model's context (plan_for)
PLAN_VERSION = 5     # 2: query-aware key smoothing, pre-RoPE keys; 3: klt keys probed per layer group;
                     # 4: KL over a stride of positions (KL_POSITIONS); 5: trellis-coded types
KL_POSITIONS = 256   # a probe's KL is the mean over about this many positions, evenly spaced
N_SINK = 4           # kv_cache.N_SINK (the default sink rows)
_UNIT = 4          # knapsack cost unit: 1/4 byte per token


# ---- bytes per token, per layer and side ------------------------------------------------------

def side_bytes(cfg, fmt, is_key: bool, n_ctx: int, page_tokens: int = 32, window: int = 0,
               n_sink: int = N_SINK, window_type: str = "f16") -> float:
    """Bytes one token costs in ONE layer's K (is_key) or V: the pool rows of every KV head plus the
    sequence's fixed f16 rows of that layer and side (sinks, KIVI ring, the token-adaptive window)
    amortised over n_ctx."""
    from pykv.kv.cache import seq_overhead_bytes
    fmt, f16 = parse_kv_type(fmt), KV_FORMATS["f16"]
    one = dataclasses.replace(cfg, n_layers=1)
    kf, vf = (fmt, f16) if is_key else (f16, fmt)
    fixed = seq_overhead_bytes(one, kf, vf, page_tokens, window, n_sink, window_type)
    return cfg.n_kv_heads * kv_bytes_per_token_head(fmt, cfg.head_dim, page_tokens, is_key) + fixed / n_ctx


def plan_bytes(cfg, k_types, v_types, n_ctx: int, page_tokens: int = 32, window: int = 0,
               n_sink: int = N_SINK, window_type: str = "f16") -> float:
    """Bytes per token of a per-layer plan, everything stored counted (see side_bytes)."""
    return sum(side_bytes(cfg, k, True, n_ctx, page_tokens, window, n_sink, window_type)
               + side_bytes(cfg, v, False, n_ctx, page_tokens, window, n_sink, window_type)
               for k, v in zip(k_types, v_types))


def bits_per_value(cfg, nbytes: float) -> float:
    """Bits per stored K/V value for `nbytes` per token."""
    return 8.0 * nbytes / (2 * cfg.n_layers * cfg.kv_dim)


def bits_to_bytes(cfg, bits: float) -> float:
    return bits * 2 * cfg.n_layers * cfg.kv_dim / 8.0


# ---- fingerprints, calibration text, cache ------------------------------------------------------

def read_text(path) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PykvError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def _cache_dir() -> str:
    base = os.environ.get("PYKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pykv")
    return os.path.join(base, "kv_sensitivity")


def _write_json(path, obj) -> None:
    """Write to a temp file in the same folder, then rename."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# ---- sensitivity ----------------------------------------------------------------------------------

def _log_softmax(x):
    from pykv.api.evaluate import log_softmax
    return log_softmax(x)


class _Prober:
    """One float-activation model, the f16 run's logits and its residual stream at every layer input
    (per batch), so a probe of layer l re-runs layers l..L-1 only."""

    def __init__(self, model, ids, window: int = 0, sinks: int = N_SINK, window_type: str = "f16"):
        self.m, self.ids = model, np.asarray(ids, np.int64)
        self.opts = {"kv_window": int(window), "kv_sinks": int(sinks), "kv_window_type": window_type}  # every probe
        if len(self.ids) > model.n_ctx:
            raise PykvError(f"calibration: {len(self.ids)} tokens exceed the context {model.n_ctx}")
        L = model.config.n_layers
        model.set_kv_types("f16", "f16", kv_rotate=True)   # rotation as every quantized plan runs it
        step = max(1, len(self.ids) // KL_POSITIONS)          # the head and KL on every step-th position only:
        self.pos = np.arange(step - 1, len(self.ids), step)   # each probe's cost is then mostly its layers
        self.snap = []   # per batch: (x (L, T, D), o (L, T, D)) at each layer's input
        self.base = self._run(0, record=True)              # (len(pos), V) log-probabilities
        self.L = L
        self.tick = None    # called after each kl() (planning progress)

    def _batches(self):
        s, n = 0, len(self.ids)
        while s < n:
            e = min(s + self.m.n_batch, n)
            yield s, e
            s = e

    def _run(self, l0: int, record: bool = False) -> np.ndarray:
        """Log-probabilities of the calibration ids through the current cache, from layer l0 on."""
        from pykv.kernels import matmul as mm
        from pykv.kernels.ops import rmsnorm
        m, st, L = self.m, self.m.state, self.m.config.n_layers
        seq = m.new_sequence()
        out = np.zeros((len(self.pos), m.n_vocab), np.float32)
        for b, (s, e) in enumerate(self._batches()):
            T = e - s
            m.cache.reserve(seq, T)
            if record:
                x, o = np.zeros((L, T, m.config.dim), np.float32), np.zeros((L, T, m.config.dim), np.float32)
                mm.get_rows(m.weights.token_embd, self.ids[s:e], st.x[:T])
                self.snap.append((x, o))
            else:
                st.x[:T], st.o[:T] = self.snap[b][0][l0], self.snap[b][1][l0]
            for li in range(l0, L):
                if record:
                    x[li], o[li] = st.x[:T], st.o[:T]
                m._layer(li, [(seq, 0, T, m.cache.chunk_for(seq.n_tokens + T, T, m.be.workers()))], T)
            seq.n_tokens += T
            # the output head, as Model._batch computes it, at the scored positions of this batch
            a, z = np.searchsorted(self.pos, [s, e])
            if z > a:
                n = int(z - a)
                rmsnorm(np.ascontiguousarray(st.x[self.pos[a:z] - s]), m.weights.output_norm, m.config.norm_eps,
                        st.h[:n])
                st.act_d.set(st.h[:n])
                mm.matmul(m.weights.output, st.act_d, st.logits[:n])
                out[a:z] = st.logits[:n]
        return _log_softmax(out)

    def kl(self, k_types, v_types, l0: int = 0) -> float:
        """Mean KL(f16 || this plan) over the scored positions; l0: the first layer whose types differ from f16."""
        m = self.m
        m.set_kv_types(k_types, v_types, kv_rotate=True, **self.opts)
        if m.cache.kivi_batch_limit(0) is not None:   # KIVI batches stop at pages: a whole ordinary run
            lp = _log_softmax(m.eval(m.new_sequence(), self.ids, all_logits=True)[self.pos])
        else:
            lp = self._run(l0)
        lb = self.base
        if self.tick is not None:
            self.tick()
        return float(max(0.0, (np.exp(lb) * (lb - lp)).sum(1).mean()))


def _one(L, l, t, rest="f16"):
    return [t if i == l else rest for i in range(L)]


def measure(model, ids, types=DEFAULT_TYPES, exact: bool = False, progress=None, window: int = 0,
            sinks: int = N_SINK, group: int = 1, window_type: str = "f16", prober=None) -> dict:
    """The sensitivity table: {"types", "k": [[KL per type] per layer], "v": ..., "method", "uniform",
    "kv_window", "kv_sinks"}. `model` runs with float activations and n_ctx >= len(ids); every probe
    runs with that window and sink count.  group > 1 (estimate only): one probe per run of `group`
    consecutive layers at the reference type, its KL shared evenly by them (fewer runs, coarser)."""
    types = [parse_kv_type(t).name for t in types]
    if not types:
        raise PykvError("kv-sensitivity: no candidate types")
    pr = _Prober(model, ids, window, sinks, window_type) if prober is None else prober
    L = pr.L
    fr = {"k": lambda l, t: (_one(L, l, t), "f16"), "v": lambda l, t: ("f16", _one(L, l, t))}
    group = 1 if exact else max(1, int(group))
    starts = list(range(0, L, group))
    n_runs = _n_runs(L, types, exact, group)
    done = 0

    def tick():
        nonlocal done
        done += 1
        if progress:
            progress(done, n_runs)

    table = {"types": types, "n_tokens": len(pr.ids), "method": "exact" if exact else "estimate",
             "kv_window": int(window), "kv_sinks": int(sinks), "kv_window_type": window_type, "group": group}

    def usable(s, t):       # klt types hold keys only: their V entries are None (never chosen)
        return s == "k" or parse_kv_type(t).kind != "klt"
    if exact:
        for s in ("k", "v"):
            rows = []
            for l in range(L):
                row = []
                for t in types:
                    row.append(pr.kl(*fr[s](l, t), l0=l) if usable(s, t) else None)
                    tick()
                rows.append(row)
            table[s] = rows
        return table
    both = [t for t in types if usable("v", t)] or types
    ref = max(both, key=lambda t: -side_bytes(model.config, t, True, 1 << 20))   # the cheapest
    table["ref"] = ref
    uni = {}
    for s in ("k", "v"):
        uni[s] = []
        for t in types:
            uni[s].append(pr.kl(t if s == "k" else "f16", t if s == "v" else "f16") if usable(s, t) else None)
            tick()
        u_ref = uni[s][types.index(ref)]
        ratio = [None if u is None else (u / u_ref if u_ref > 0 else 0.0) for u in uni[s]]
        rows = []
        own = [j for j, t in enumerate(types) if s == "k" and parse_kv_type(t).kind == "klt"]
        for l0 in starts:
            g = range(l0, min(l0 + group, L))
            ts = [ref if i in g else "f16" for i in range(L)]
            a = pr.kl(ts if s == "k" else "f16", ts if s == "v" else "f16", l0=l0) / len(g)
            tick()
            row = [None if r is None else a * r for r in ratio]
            for j in own:   # klt keys help some layers and hurt others: probed, not scaled from ref
                row[j] = pr.kl([types[j] if i in g else "f16" for i in range(L)], "f16", l0=l0) / len(g)
                tick()
            rows += [list(row) for _ in g]
        table[s] = rows
    table["uniform"] = uni
    return table


def sensitivity(model_path, ids, types=DEFAULT_TYPES, exact: bool = False, use_cache: bool = True,
                progress=None, model=None, window: int = 0, sinks: int = N_SINK, group: int = 1,
                window_type: str = "f16", prober=None) -> dict:
    """The sensitivity table for this model and calibration ids, from the cache when it was measured
    before (keyed by model fingerprint, ids, types, method, window and sinks)."""
    from pykv.api.model import load
    from pykv.kv import cache as kv_cache
    types = [parse_kv_type(t).name for t in types]
    pre = None if model is None else model._kv_opts.get("k_prerope")   # None: the default (on, CPU)
    key = hashlib.sha256(json.dumps([PLAN_VERSION, fingerprint(model_path), list(map(int, ids)), types,
                                     bool(exact), int(window), int(sinks), int(group), window_type,
                                     kv_cache.SMOOTH_MODE, pre, KL_POSITIONS, _codebooks()]).encode()).hexdigest()[:24]
    path = os.path.join(_cache_dir(), key + ".json")
    if use_cache and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
    if model is None:
        model = load(model_path, n_ctx=max(len(ids), 32), q8_act=False)
    table = measure(model, ids, types, exact=exact, progress=progress, window=window, sinks=sinks, group=group,
                    window_type=window_type, prober=prober)
    table["fingerprint"] = fingerprint(model_path)
    if use_cache:
        try:
            _write_json(path, table)
        except OSError:
            pass
    return table


# ---- the plan -------------------------------------------------------------------------------------

def solve(table: dict, cfg, n_ctx: int, budget_bytes: float, page_tokens: int = 32) -> dict:
    """Per-layer K and V types minimising the summed KL of `table` with plan_bytes <= budget_bytes.
    f16 (KL 0) is always an option. Multiple-choice knapsack, exact DP over quarter bytes (costs rounded
    up, so the plan never exceeds the budget)."""
    L = cfg.n_layers
    if len(table["k"]) != L or len(table["v"]) != L:
        raise PykvError(f"the sensitivity table has {len(table['k'])} layers, the model {L}")
    types = list(table["types"]) + (["f16"] if "f16" not in table["types"] else [])
    win, ns = int(table.get("kv_window", 0)), int(table.get("kv_sinks", N_SINK))
    wt = table.get("kv_window_type", "f16")
    items = []   # (cost units per option, KL per option) for each (layer, side)
    for s, is_key in (("k", True), ("v", False)):
        cost = np.array([int(np.ceil(side_bytes(cfg, t, is_key, n_ctx, page_tokens, win, ns, wt) * _UNIT - 1e-9))
                         for t in types], np.int64)
        for l in range(L):
            row = list(table[s][l]) + ([0.0] if len(types) > len(table["types"]) else [])
            kl = np.nan_to_num(np.maximum(np.array(row, np.float64), 0.0), nan=np.inf)   # None: not usable
            c = cost.copy()
            c[~np.isfinite(kl)] = cost[np.isfinite(kl)].min()     # the floor counts usable options only
            items.append((c, kl))
    B = int(np.floor(budget_bytes * _UNIT + 1e-9))
    floor = sum(int(c.min()) for c, _ in items)
    if B < floor:
        cheapest = sum(c.min() for c, _ in items) / _UNIT
        raise PykvError(f"KV budget {budget_bytes:.0f} B/token ({bits_per_value(cfg, budget_bytes):.2f} bits/value) "
                        f"is below the cheapest plan of these types ({cheapest:.0f} B/token, "
                        f"{bits_per_value(cfg, cheapest):.2f} bits)")
    W = B - floor + 1           # DP over the cost above every item's cheapest option
    best = np.zeros(W)          # best[w]: least KL of the items so far using <= w extra units
    choice = np.zeros((len(items), W), np.int8)
    for i, (cost, kl) in enumerate(items):
        extra = cost - cost.min()
        nxt = np.full(W, np.inf)
        arg = np.zeros(W, np.int8)
        for j in range(len(cost)):
            e = int(extra[j])
            if e >= W or not np.isfinite(kl[j]):
                continue
            cand = np.full(W, np.inf)
            cand[e:] = best[:W - e] + kl[j]
            better = cand < nxt
            nxt[better], arg[better] = cand[better], j
        best, choice[i] = nxt, arg
    w = W - 1
    pick = [0] * len(items)
    for i in range(len(items) - 1, -1, -1):
        j = int(choice[i, w])
        pick[i] = j
        w -= int(items[i][0][j] - items[i][0].min())
    k_types = [types[j] for j in pick[:L]]
    v_types = [types[j] for j in pick[L:]]
    nbytes = plan_bytes(cfg, k_types, v_types, n_ctx, page_tokens, win, ns, wt)
    return {"version": PLAN_VERSION, "n_layers": L, "n_ctx": int(n_ctx), "ctk": k_types, "ctv": v_types,
            "kv_window": win, "kv_sinks": ns, "kv_window_type": wt, "bytes_per_token": nbytes, "bits_per_value": bits_per_value(cfg, nbytes),
            "budget_bytes_per_token": float(budget_bytes), "kl_estimate": float(best[-1])}


def _counts(ts) -> str:
    return " ".join(f"{t} x{ts.count(t)}" for t in dict.fromkeys(ts))


def plan_line(plan: dict) -> str:
    """The plan in one line: bits and bytes, window, sinks, and how many layers take each type."""
    kl = (f"KL {plan['kl_measured']:.4f}" if "kl_measured" in plan
          else f"KL ~{plan.get('kl_estimate', float('nan')):.4f}")
    w = plan.get("kv_window", 0)
    win = f"window {w} {plan.get('kv_window_type', 'f16')}" if w else "no window"
    return (f"KV plan: {plan['bits_per_value']:.3f} bits/value ({plan['bytes_per_token']:.0f} B/token at ctx "
            f"{plan['n_ctx']}), {win}, sinks {plan.get('kv_sinks', N_SINK)}; K {_counts(plan['ctk'])}; "
            f"V {_counts(plan['ctv'])}; {kl} on {plan.get('calib', 'the calibration text')}"
            + (" (cached)" if plan.get("cached") else ""))


def plan_table(plan: dict) -> str:
    """The per-layer table (--verbose)."""
    rows = ["layer  K        V"]
    rows += [f"{l:5d}  {k:<8s} {v}" for l, (k, v) in enumerate(zip(plan["ctk"], plan["ctv"]))]
    return "\n".join(rows)


def plan_summary(plan: dict) -> str:
    """plan_line, then the per-layer types of each side as comma lists."""
    return (plan_line(plan) + f"\n  K: [{','.join(plan['ctk'])}]\n  V: [{','.join(plan['ctv'])}]")


def save_plan(path, plan: dict) -> None:
    _write_json(path, {k: v for k, v in plan.items() if k != "cached"})


def read_plan(path, n_layers: int) -> dict:
    """A plan JSON written by save_plan, checked against the model's layer count."""
    try:
        with open(path, encoding="utf-8") as f:
            plan = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise PykvError(f"cannot read KV plan {path}: {getattr(e, 'strerror', None) or e}") from None
    except ValueError as e:
        raise PykvError(f"KV plan {path} is not JSON: {e}") from None
    if not isinstance(plan, dict) or not isinstance(plan.get("ctk"), list) or not isinstance(plan.get("ctv"), list):
        raise PykvError(f"KV plan {path} has no ctk / ctv lists")
    if len(plan["ctk"]) != n_layers or len(plan["ctv"]) != n_layers:
        raise PykvError(f"KV plan {path} is for {len(plan['ctk'])} layers, the model has {n_layers}")
    for t in plan["ctk"] + plan["ctv"]:
        try:
            parse_kv_type(t)
        except ValueError as e:
            raise PykvError(f"KV plan {path}: {e}") from None
    for f, d in (("kv_window", 0), ("kv_sinks", N_SINK)):
        v = plan.setdefault(f, d)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise PykvError(f"KV plan {path}: {f} must be a non-negative integer, got {v!r}")
    from pykv.kv.cache import WINDOW_TYPES
    if plan.setdefault("kv_window_type", "f16") not in WINDOW_TYPES:
        raise PykvError(f"KV plan {path}: kv_window_type must be one of {', '.join(WINDOW_TYPES)}, "
                        f"got {plan['kv_window_type']!r}")
    return plan


def calib_ids(model, calib=None, n_tokens: int | None = CALIB_TOKENS):
    """The first n_tokens ids of the calibration text (a path; None: the built-in text); n_tokens None:
    the model's context (calibrate at the target context), as far as the text reaches."""
    text = default_calib_text() if calib is None else read_text(calib)
    ids = model.tokenize(text)[:model.n_ctx if n_tokens is None else n_tokens]
    if len(ids) < 16:
        raise PykvError(f"calibration text has {len(ids)} tokens; at least 16 are needed")
    return ids


def _side_sums(table, plan):
    """The table's summed one-layer KL of a plan's K types and of its V types."""
    types = list(table["types"])
    tot = {}
    for s, ts in (("k", plan["ctk"]), ("v", plan["ctv"])):
        tot[s] = sum(table[s][l][types.index(t)] or 0.0 for l, t in enumerate(ts) if t in types)
    return tot


def refine(pr, table, cfg, n_ctx, budget_bytes, page_tokens: int = 32, steps: int = 2):
    """The knapsack plan corrected for what the summed one-layer table gets wrong: KL compounds
    across layers, and unevenly for K and V.  Each step measures the plan with only its K types
    (V f16) and only its V types, rescales the table's K and V entries so their sums match those
    measurements, and solves again; every plan met is measured in full on the calibration text
    (pr: a _Prober), and the lowest measured one is kept (plan["kl_measured"], plan["refine"])."""
    import copy
    t = copy.deepcopy(table)
    plan = solve(t, cfg, n_ctx, budget_bytes, page_tokens)
    seen, best, log = set(), None, []
    for it in range(steps + 1):
        key = (tuple(plan["ctk"]), tuple(plan["ctv"]))
        if key in seen:
            break
        seen.add(key)
        plan["kl_measured"] = pr.kl(plan["ctk"], plan["ctv"])
        log.append({"kl_estimate": plan["kl_estimate"], "kl_measured": plan["kl_measured"]})
        if best is None or plan["kl_measured"] < best["kl_measured"]:
            best = plan
        if it == steps:
            break
        sums = _side_sums(t, plan)
        real = {"k": pr.kl(plan["ctk"], "f16"), "v": pr.kl("f16", plan["ctv"])}
        log[-1].update(k_measured=real["k"], v_measured=real["v"], k_table=sums["k"], v_table=sums["v"])
        for s in ("k", "v"):
            if sums[s] > 0 and real[s] > 0:
                f = real[s] / sums[s]
                t[s] = [[None if x is None else x * f for x in row] for row in t[s]]
        plan = solve(t, cfg, n_ctx, budget_bytes, page_tokens)
    best = dict(best)
    best["refine"] = log
    return best


def auto_types(bits: float, device: str = "cpu") -> tuple:
    """The candidate types of an automatic plan at this many bits per value on this device (AUTO_TYPES)."""
    for floor, ts, other in AUTO_TYPES:
        if bits >= floor or floor == AUTO_TYPES[-1][0]:
            return ts if device == "cpu" or other is None else other


def auto_window_kind(bits: float) -> tuple:
    """(rows, row type) of an automatic plan's window at this many bits per value (AUTO_WINDOWS)."""
    for floor, rows, wt in AUTO_WINDOWS:
        if bits >= floor or floor == AUTO_WINDOWS[-1][0]:
            return rows, wt


def auto_window(cfg, n_ctx: int, budget_bytes: float, types, page_tokens: int = 32, sinks: int = N_SINK,
                rows=None, window_type: str = "q8_0") -> int:
    """The window rows of an automatic plan: `rows` (None: an eighth of the context, at most), fewer
    until the cheapest candidate in every layer plus the window fits the budget (0: none fits).
    Chosen on the development texts (tools/kv_configs.py, docs/kv-formats.md): at 3 bits 32 q8_0 rows
    beat 48 and 64 (the bytes buy 3-bit keys, which matter more), at 2.5 bits 48 q8_0 rows beat 16, 32,
    64 and 71 iq4_nl rows."""
    L = cfg.n_layers
    cheap = min(types, key=lambda t: plan_bytes(cfg, [t] * L, [t] * L, n_ctx, page_tokens, 0, sinks))
    lo, hi = 0, n_ctx // 8 if rows is None else min(int(rows), n_ctx // 8)
    while lo < hi:                     # the most rows that fit: bytes grow with rows
        mid = (lo + hi + 1) // 2
        if plan_bytes(cfg, [cheap] * L, [cheap] * L, n_ctx, page_tokens, mid, sinks, window_type) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _n_runs(L: int, types, exact: bool, group: int) -> int:
    """Probe runs measure() makes for a table (the f16 base run not counted)."""
    if exact:
        return 2 * L * len(types)
    n_klt = sum(parse_kv_type(t).kind == "klt" for t in types)
    starts = len(range(0, L, group))
    return 2 * starts + 2 * len(types) + n_klt * starts


def _codebooks() -> str:
    """A digest of the trellis codebooks (pykv/data/trellis.npz): retrained ones make cached tables stale."""
    from pykv.kernels.blocks import TC_TABLE
    return hashlib.sha256(TC_TABLE.tobytes()).hexdigest()[:12]


def _plan_cache_path(key_parts) -> str:
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:24]
    return os.path.join(os.path.dirname(_cache_dir()), "kv_plans", key + ".json")


def plan_for(model, kv_bits=None, budget_bytes=None, calib=None, types=None, exact: bool = False,
             n_tokens: int | None = None, progress=None, windows=None, sinks=None, refine_steps=None,
             group=None, window_type=None, use_cache: bool = True) -> dict:
    """The plan for a loaded model's n_ctx under kv_bits (bits per value) or budget_bytes (per token),
    calibrated on the first n_tokens of the text (None: the model's context).

    What is left None the planner chooses (what `--kv-bits` alone runs): types by the target
    (auto_types), a token-adaptive window (auto_window_kind, auto_window), probes of L / AUTO_GROUPS layers at once,
    AUTO_REFINE refine steps, the model's sink rows.  windows: window sizes to try, each with its own
    table; with several, or with refine steps, plans are measured in full on the calibration text
    (refine) and the lowest measured KL wins, its window bytes counted like every other byte.
    The plan is cached per model fingerprint, calibration ids, target and choices (use_cache), so a
    second load plans at once; progress(i, n) is called as runs finish."""
    from pykv.api.model import load
    from pykv.kv import cache as kv_cache
    cfg = model.config
    L = cfg.n_layers
    if budget_bytes is None:
        if kv_bits is None or not kv_bits > 0:
            raise PykvError(f"--kv-bits must be a positive number, got {kv_bits}")
        budget_bytes = bits_to_bytes(cfg, float(kv_bits))
    opts = getattr(model, "_kv_opts", {})
    sinks = opts.get("kv_sinks", N_SINK) if sinks is None else int(sinks)
    device = getattr(model, "device", "cpu")
    types = auto_types(bits_per_value(cfg, budget_bytes), device) if types is None else tuple(types)
    types = [parse_kv_type(t).name for t in types]
    P = model.cache.P
    if windows is None:                   # the planner's own window (AUTO_WINDOWS) unless told otherwise
        rows, wt = auto_window_kind(bits_per_value(cfg, budget_bytes))
        wt = wt if window_type is None else window_type
        windows = [auto_window(cfg, model.n_ctx, budget_bytes, types, P, sinks, rows, wt)
                   if device == "cpu" else 0]
    else:
        wt = opts.get("kv_window_type", "f16") if window_type is None else window_type
        windows = [int(w) for w in windows]
    group = 1 if exact else (max(1, L // AUTO_GROUPS) if group is None else max(1, int(group)))
    refine_steps = AUTO_REFINE if refine_steps is None else int(refine_steps)
    ids = calib_ids(model, calib, n_tokens)
    pre = opts.get("k_prerope")
    cache_path = _plan_cache_path([PLAN_VERSION, fingerprint(model.path), list(map(int, ids)), types, bool(exact),
                                   windows, sinks, wt, group, refine_steps, round(float(budget_bytes), 6),
                                   int(model.n_ctx), int(P), kv_cache.SMOOTH_MODE, pre, KL_POSITIONS, _codebooks()])
    if use_cache and os.path.exists(cache_path):
        try:
            plan = read_plan(cache_path, L)
            if kv_bits is not None:
                plan["kv_bits"] = float(kv_bits)
            return {**plan, "cached": True}
        except PykvError:
            pass
    # probes run with q8 activations (what pykv run uses; several times faster than float activations,
    # whose products dominate a plan's wall): the model itself, or a q8 copy of a float-activation one
    probe = model if model.q8_act and model.n_ctx >= len(ids) and model.device == "cpu" else None
    if probe is None:
        probe = load(model.path, n_ctx=max(len(ids), 32), q8_act=True)
    n_est = len(windows) * (_n_runs(L, types, exact, group) + (1 + 3 * refine_steps if refine_steps or len(windows) > 1
                                                               else 0))
    done = 0

    def tick(*_):
        nonlocal done
        done += 1
        if progress:
            progress(min(done, n_est), n_est)
    best = table = None
    for w in windows:
        pr = _Prober(probe, ids, w, sinks, wt)
        table = sensitivity(model.path, ids, types, exact=exact, progress=tick, model=probe, window=w,
                            sinks=sinks, group=group, window_type=wt, prober=pr)
        try:
            if refine_steps or len(windows) > 1:
                pr.tick = tick
                plan = refine(pr, table, cfg, model.n_ctx, budget_bytes, P, steps=refine_steps)
            else:
                plan = solve(table, cfg, model.n_ctx, budget_bytes, P)
        except PykvError:
            if w == windows[-1] and best is None:
                raise
            continue     # this window's bytes leave no plan under the budget
        if best is None or plan.get("kl_measured", 0.0) < best.get("kl_measured", 0.0):
            best = plan
    if progress:
        progress(n_est, n_est)
    plan = best
    plan.update(fingerprint=table.get("fingerprint"), method=table["method"], calib=calib or "built-in",
                calib_tokens=len(ids))
    if kv_bits is not None:
        plan["kv_bits"] = float(kv_bits)
    if use_cache:
        try:
            _write_json(cache_path, plan)
        except OSError:
            pass
    return plan


def apply_plan(model, plan: dict, kv_rotate=None) -> None:
    model.set_kv_types(plan["ctk"], plan["ctv"], kv_rotate, kv_window=plan.get("kv_window", 0),
                       kv_sinks=plan.get("kv_sinks", N_SINK), kv_window_type=plan.get("kv_window_type", "f16"))


def load_planned(path=None, *, kv_bits=None, kv_plan=None, kv_calib=None, kv_plan_out=None, kv_exact=False,
                 verbose=False, **kw):
    """pykv.load with an automatic per-layer KV plan: kv_plan (a plan JSON) or kv_bits (bits per value,
    everything stored counted) measured on kv_calib (a text file; None: the built-in text).  The plan
    is printed on stderr in one line, with verbose its per-layer table too.  kv_window / kv_window_type
    left None: 0 / f16 without a plan, the planner's choice with kv_bits."""
    from pykv.api.model import load
    if kv_bits is not None and kv_plan is not None:
        raise PykvError("give --kv-bits or --kv-plan, not both")
    if (kv_bits is not None or kv_plan is not None) and (kw.get("kv_type_k", "f16"), kw.get("kv_type_v", "f16")) != ("f16", "f16"):
        raise PykvError("--kv-bits / --kv-plan choose the per-layer types: drop -ctk / -ctv")
    window, wtype = kw.get("kv_window"), kw.get("kv_window_type")
    kw["kv_window"], kw["kv_window_type"] = window or 0, wtype or "f16"
    model = load(path, **kw)
    if kv_plan is None and kv_bits is None:
        return model
    if kv_plan is not None:
        plan = read_plan(kv_plan, model.config.n_layers)
    else:
        bar = _bar(f"KV plan for {kv_bits:g} bits/value")
        plan = plan_for(model, kv_bits=kv_bits, calib=kv_calib, exact=kv_exact, progress=bar,
                        windows=None if window is None else [window], window_type=wtype)
    apply_plan(model, plan, kw.get("kv_rotate"))
    nbytes = plan_bytes(model.config, plan["ctk"], plan["ctv"], model.n_ctx, model.cache.P,
                        plan.get("kv_window", 0), plan.get("kv_sinks", N_SINK), plan.get("kv_window_type", "f16"))
    plan = {**plan, "n_ctx": model.n_ctx, "bytes_per_token": nbytes,
            "bits_per_value": bits_per_value(model.config, nbytes)}   # this model's context
    model.kv_plan = plan
    print(plan_line(plan), file=sys.stderr)
    if verbose:
        print(plan_table(plan), file=sys.stderr)
    if kv_plan_out:
        save_plan(kv_plan_out, plan)
    return model


def _bar(desc: str = "KV sensitivity"):
    """Progress of runs on stderr: tqdm on a terminal; otherwise one line when the work starts."""
    state = {}

    def show(i, n):
        if "started" not in state:
            state["started"] = True
            if not sys.stderr.isatty():
                print(f"pykv: {desc}: {n} calibration runs (cached for the next load)", file=sys.stderr, flush=True)
                return
            from tqdm import tqdm
            state["bar"] = tqdm(total=n, desc=desc, unit="run", file=sys.stderr, leave=False)
        bar = state.get("bar")
        if bar is not None:
            bar.total = n
            bar.update(i - bar.n)
            if i >= n:
                bar.close()
                state["bar"] = None
    return show
