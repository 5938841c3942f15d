"""Automatic per-layer KV precision (pykv/kv_plan.py): byte accounting, the budgeted planner, plan files,
the sensitivity probes and the CLI, on a tiny synthetic model (seconds)."""
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import pykv
from pykv.api import kv_plan as KP
from pykv.cli import main
from tests.reference import write_tiny_gguf

IDS = [5, 77, 3, 200, 201, 9, 140, 33, 2, 250, 1, 17, 99, 45, 200, 201, 7, 8, 9, 10, 11, 12, 13, 14,
       15, 16, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("kvp") / "tiny.gguf", {"default": T.F32}, n_layers=3,
                               dim=128, ff=256, n_heads=2, n_kv=1))


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return pykv.load(tiny_path, n_ctx=64, q8_act=False)


@pytest.mark.parametrize("kt,vt", [(["q8_0", "q4_0", "f16"], ["int4", "f16", "iq4_nl"]),
                                   (["int2"] * 3, ["q5_1"] * 3), (["f16"] * 3, ["f16"] * 3),
                                   (["nl2", "int4", "f16"], ["q4_0", "nl3", "int2"])])
@pytest.mark.parametrize("window,sinks,wt", [(0, 4, "f16"), (16, 0, "f16"), (5, 9, "q8_0")])
def test_bits_accounting_matches_the_cache(tiny, kt, vt, window, sinks, wt):
    """plan_bytes * n_ctx equals what the cache really holds for a full context: the pool pages of one
    sequence plus its f16 sink rows, KIVI rings and token-adaptive window rings."""
    tiny.set_kv_types(kt, vt, kv_window=window, kv_sinks=sinks, kv_window_type=wt)
    try:
        seq = tiny.new_sequence()
        c = tiny.cache
        real = c.nbytes() + sum(a.nbytes for a in seq.sink.values()) + sum(a.nbytes for a in seq.residual.values())
    finally:
        tiny.set_kv_types(kv_window=0, kv_sinks=4, kv_window_type="f16")
    assert c.capacity_tokens() == tiny.n_ctx
    nb = KP.plan_bytes(tiny.config, kt, vt, tiny.n_ctx, window=window, n_sink=sinks, window_type=wt)
    assert nb * tiny.n_ctx == pytest.approx(real, rel=1e-12)
    assert KP.plan_bytes(tiny.config, kt, vt, 1 << 40, window=window, n_sink=sinks, window_type=wt) == pytest.approx(
        c.bytes_per_token(), rel=1e-9)


def _table(L, types, k, v):
    return {"types": types, "k": k, "v": v, "method": "exact", "n_tokens": 0}


def test_planner_respects_budget_and_picks_lower_kl(tiny):
    cfg, n = tiny.config, tiny.n_ctx
    types = ["q8_0", "q4_0", "iq4_nl"]
    # layer 1's K is very sensitive; iq4_nl beats q4_0 (same bytes) on layer 2's V only
    k = [[1e-4, 1e-2, 2e-2], [1e-4, 5.0, 5.0], [1e-4, 1e-2, 2e-2]]
    v = [[1e-4, 1e-2, 2e-2], [1e-4, 1e-2, 2e-2], [1e-4, 3e-2, 1e-3]]
    table = _table(3, types, k, v)
    q4 = KP.plan_bytes(cfg, ["q4_0"] * 3, ["q4_0"] * 3, n)
    q8 = KP.side_bytes(cfg, "q8_0", True, n) - KP.side_bytes(cfg, "q4_0", True, n)
    plan = KP.solve(table, cfg, n, q4 + q8)            # room for exactly one q8_0 side
    assert plan["bytes_per_token"] <= q4 + q8
    assert plan["ctk"] == ["q4_0", "q8_0", "q4_0"]
    assert plan["ctv"] == ["q4_0", "q4_0", "iq4_nl"]
    assert plan["kl_estimate"] == pytest.approx(1e-4 + 4e-2 + 1e-3)
    b4 = KP.bits_per_value(cfg, q4)     # 4.5 + the sinks amortised over 64 tokens
    for bits in (b4 + 0.05, b4 + 1, b4 + 2.5, b4 + 4, 16.0):
        p = KP.solve(table, cfg, n, KP.bits_to_bytes(cfg, bits))
        assert p["bits_per_value"] <= bits + 1e-9
        assert p["bytes_per_token"] == pytest.approx(KP.plan_bytes(cfg, p["ctk"], p["ctv"], n))
    assert KP.solve(table, cfg, n, KP.bits_to_bytes(cfg, 16.0))["kl_estimate"] == 0.0   # all f16 fits
    with pytest.raises(pykv.PykvError, match="below the cheapest plan"):
        KP.solve(table, cfg, n, q4 - 1)


def test_planner_never_gives_values_a_key_type(tiny):
    """klt types hold keys only: their V entries are None, and even where klt2 is the only cheap option
    the values take another type (or the plan is refused), and the floor counts usable options."""
    cfg, n = tiny.config, tiny.n_ctx
    types = ["q4_0", "klt2"]
    k = [[1e-2, 1e-3]] * 3
    v = [[1e-2, None]] * 3
    table = _table(3, types, k, v)
    budget = KP.plan_bytes(cfg, ["klt2"] * 3, ["q4_0"] * 3, n)
    plan = KP.solve(table, cfg, n, budget)
    assert plan["ctk"] == ["klt2"] * 3 and plan["ctv"] == ["q4_0"] * 3
    assert plan["kl_estimate"] == pytest.approx(3 * 1e-3 + 3 * 1e-2)
    with pytest.raises(pykv.PykvError, match="below the cheapest plan"):
        KP.solve(table, cfg, n, KP.plan_bytes(cfg, ["klt2"] * 3, ["klt2"] * 3, n))


def test_planner_is_optimal_on_random_tables(tiny):
    """The DP's KL equals brute force over every combination (3 layers x 2 sides x 3 options)."""
    import itertools
    cfg, n = tiny.config, tiny.n_ctx
    rng = np.random.default_rng(1)
    types = ["q4_0", "q8_0"]
    opts = types + ["f16"]
    for _ in range(5):
        k, v = rng.random((3, 2)).tolist(), rng.random((3, 2)).tolist()
        budget = rng.uniform(KP.plan_bytes(cfg, ["q4_0"] * 3, ["q4_0"] * 3, n),
                             KP.plan_bytes(cfg, ["f16"] * 3, ["f16"] * 3, n))
        best = np.inf
        for c in itertools.product(range(3), repeat=6):
            kt, vt = [opts[i] for i in c[:3]], [opts[i] for i in c[3:]]
            if KP.plan_bytes(cfg, kt, vt, n) <= budget:
                best = min(best, sum(([*k[l], 0.0][c[l]] + [*v[l], 0.0][c[3 + l]]) for l in range(3)))
        p = KP.solve(_table(3, types, k, v), cfg, n, budget)
        assert p["kl_estimate"] == pytest.approx(best)


def test_plan_round_trip_and_layer_check(tiny, tmp_path):
    table = _table(3, ["q8_0", "q4_0"], [[1e-3, 1e-2]] * 3, [[1e-3, 2e-2]] * 3)
    plan = KP.solve(table, tiny.config, tiny.n_ctx, KP.bits_to_bytes(tiny.config, 6.0))
    f = tmp_path / "plan.json"
    KP.save_plan(f, plan)
    assert KP.read_plan(f, 3) == json.loads(json.dumps(plan))
    with pytest.raises(pykv.PykvError, match="is for 3 layers, the model has 4"):
        KP.read_plan(f, 4)


def test_plan_window_and_sinks_round_trip(tiny, tmp_path):
    """A table measured with a window and a sink count gives a plan that carries them (bytes counted
    with them), through the JSON file and back into the cache."""
    cfg, n = tiny.config, tiny.n_ctx
    table = {**_table(3, ["q8_0", "nl2"], [[1e-3, 1e-2]] * 3, [[1e-3, 2e-2]] * 3), "kv_window": 8, "kv_sinks": 2,
             "kv_window_type": "q8_0"}
    plan = KP.solve(table, cfg, n, KP.bits_to_bytes(cfg, 5.0))
    assert (plan["kv_window"], plan["kv_sinks"], plan["kv_window_type"]) == (8, 2, "q8_0")
    assert plan["bytes_per_token"] == pytest.approx(KP.plan_bytes(cfg, plan["ctk"], plan["ctv"], n, window=8, n_sink=2,
                                                                  window_type="q8_0"))
    assert plan["bytes_per_token"] > KP.plan_bytes(cfg, plan["ctk"], plan["ctv"], n, window=0, n_sink=2)
    f = tmp_path / "plan.json"
    KP.save_plan(f, plan)
    back = KP.read_plan(f, 3)
    assert back == json.loads(json.dumps(plan))
    KP.apply_plan(tiny, back)
    try:
        assert (tiny.cache.W, tiny.cache.NS, tiny.cache.wfmt.name) == (8, 2, "q8_0")
    finally:
        tiny.set_kv_types(kv_window=0, kv_sinks=4, kv_window_type="f16")
    old = {k: v for k, v in plan.items() if k not in ("kv_window", "kv_sinks", "kv_window_type")}   # a plan from before
    KP.save_plan(f, old)
    back = KP.read_plan(f, 3)
    assert (back["kv_window"], back["kv_sinks"], back["kv_window_type"]) == (0, 4, "f16")
    KP.save_plan(f, {**plan, "kv_window": -1})
    with pytest.raises(pykv.PykvError, match="kv_window must be a non-negative integer"):
        KP.read_plan(f, 3)
    KP.save_plan(f, {**plan, "kv_window_type": "iq4_nl"})          # the planner's 2.5-bit window rows
    assert KP.read_plan(f, 3)["kv_window_type"] == "iq4_nl"
    KP.save_plan(f, {**plan, "kv_window_type": "q4_1"})
    with pytest.raises(pykv.PykvError, match="kv_window_type must be one of"):
        KP.read_plan(f, 3)


def test_refine_keeps_the_lowest_measured_plan(tiny):
    """refine measures every plan it meets on the calibration ids and returns the lowest; its
    kl_measured is a real full run of the returned types."""
    pr = KP._Prober(tiny, IDS)
    cfg, n = tiny.config, tiny.n_ctx
    types = ["q4_0", "nl2"]
    # a table that has V's cost badly wrong (100x too low): the measured K/V split corrects it
    table = {"types": types, "method": "exact", "n_tokens": len(IDS),
             "k": [[pr.kl(KP._one(3, l, t), "f16", l0=l) for t in types] for l in range(3)],
             "v": [[pr.kl("f16", KP._one(3, l, t), l0=l) / 100 for t in types] for l in range(3)]}
    budget = KP.plan_bytes(cfg, ["q4_0"] * 3, ["nl2"] * 3, n) + 1
    first = KP.solve(table, cfg, n, budget)
    plan = KP.refine(pr, table, cfg, n, budget, steps=2)
    assert plan["bytes_per_token"] <= budget
    assert plan["kl_measured"] == pytest.approx(pr.kl(plan["ctk"], plan["ctv"]), rel=1e-9)
    assert plan["kl_measured"] <= pr.kl(first["ctk"], first["ctv"]) + 1e-12
    assert plan["refine"][0]["kl_measured"] == pytest.approx(pr.kl(first["ctk"], first["ctv"]), rel=1e-9)


def test_cli_refuses_plan_with_wrong_layer_count(tiny_path, tmp_path, capsys):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"ctk": ["q4_0"] * 5, "ctv": ["q4_0"] * 5}))
    text = tmp_path / "t.txt"
    text.write_text("the the the " * 40)
    rc = main(["perplexity", tiny_path, str(text), "-c", "32", "--kv-plan", str(f)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"pykv: error: KV plan {f} is for 5 layers, the model has 3"]


def test_sensitivity_probe_matches_full_run(tiny):
    """A probe that re-runs layers l.. from the saved residual stream gives the KL of a whole run."""
    from pykv.api.evaluate import log_softmax
    pr = KP._Prober(tiny, IDS)
    kt = ["f16", "q4_0", "f16"]
    fast = pr.kl(kt, "f16", l0=1)
    tiny.set_kv_types(kt, "f16", kv_rotate=True)
    lp = log_softmax(tiny.eval(tiny.new_sequence(), IDS, all_logits=True))
    full = float((np.exp(pr.base) * (pr.base - lp)).sum(1).mean())
    assert fast > 0
    assert fast == pytest.approx(full, rel=1e-4, abs=1e-9)


def test_kv_bits_load_uses_cached_table(tiny_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYKV_CACHE", str(tmp_path / "cache"))
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog. " * 6)
    m = pykv.load(tiny_path, n_ctx=64, kv_bits=6.0, kv_calib=str(calib), q8_act=False)
    plan = m.kv_plan
    assert plan["bits_per_value"] <= 6.0
    assert [l.k_fmt.name for l in m.cache.layers] == plan["ctk"]
    assert [l.v_fmt.name for l in m.cache.layers] == plan["ctv"]
    files = list((tmp_path / "cache" / "kv_sensitivity").glob("*.json"))
    assert len(files) == 1
    t = json.loads(files[0].read_text())
    t["k"] = [[9.0] * len(t["types"])] * 3   # a changed cached table changes the next plan: it is used
    files[0].write_text(json.dumps(t))
    plans = list((tmp_path / "cache" / "kv_plans").glob("*.json"))
    assert len(plans) == 1                   # the plan itself is cached: the next load measures nothing
    m1 = pykv.load(tiny_path, n_ctx=64, kv_bits=6.0, kv_calib=str(calib), q8_act=False)
    assert m1.kv_plan["cached"] and (m1.kv_plan["ctk"], m1.kv_plan["ctv"]) == (plan["ctk"], plan["ctv"])
    plans[0].unlink()
    m2 = pykv.load(tiny_path, n_ctx=64, kv_bits=6.0, kv_calib=str(calib), q8_act=False)
    assert m2.kv_plan["kl_estimate"] != plan["kl_estimate"]
    assert not m2.kv_plan.get("cached")


def test_probe_scores_a_stride_of_positions(tiny, monkeypatch):
    """With fewer scored positions than tokens, a probe's KL is the full run's KL at exactly those
    positions (every third one here)."""
    from pykv.api.evaluate import log_softmax
    monkeypatch.setattr(KP, "KL_POSITIONS", 16)
    pr = KP._Prober(tiny, IDS)
    assert list(pr.pos) == list(range(2, len(IDS), 3))
    kt = ["f16", "nl2", "q4_0"]
    fast = pr.kl(kt, "f16", l0=1)
    tiny.set_kv_types("f16", "f16", kv_rotate=True)
    lb = log_softmax(tiny.eval(tiny.new_sequence(), IDS, all_logits=True))[pr.pos]
    tiny.set_kv_types(kt, "f16", kv_rotate=True)
    lp = log_softmax(tiny.eval(tiny.new_sequence(), IDS, all_logits=True))[pr.pos]
    full = float((np.exp(lb) * (lb - lp)).sum(1).mean())
    assert fast > 0
    assert fast == pytest.approx(full, rel=1e-4, abs=1e-9)


def test_auto_choices_follow_the_budget(tiny):
    """--kv-bits alone: the candidates narrow with the target (no CPU-only type where the device runs
    none), and the window shrinks until the cheapest candidate in every layer plus the window fits the
    budget (none when nothing is left); rows None: every byte left, up to an eighth of the context."""
    from pykv.files.formats import KV_FORMATS
    cfg, n = tiny.config, 512
    assert KP.auto_types(4.5) == KP.AUTO_TYPES[1][1] and KP.auto_types(2.5) == ("tc1b", "tc2b", "tc3b")
    assert KP.auto_types(2.5, "cuda") == ("nl2", "nl2b") and KP.auto_types(0.5) == KP.auto_types(2.5)
    assert "tc3b" in KP.auto_types(4.5) and "tc3b" in KP.auto_types(3.0) and "nl3b" in KP.auto_types(3.0, "cuda")
    for bits in (8.0, 4.5, 3.0, 2.5):
        assert not any(KV_FORMATS[t].tc_len or KV_FORMATS[t].kind == "klt" for t in KP.auto_types(bits, "cuda"))
    assert "q8_0" in KP.auto_types(6.0) and "q8_0" not in KP.auto_types(3.0)
    assert KP.auto_window_kind(3.0) == (32, "q8_0") and KP.auto_window_kind(2.5) == (48, "q8_0")
    types = ("nl2", "nl2b")
    L = cfg.n_layers
    floor = KP.plan_bytes(cfg, ["nl2b"] * L, ["nl2b"] * L, n)
    assert KP.auto_window(cfg, n, KP.bits_to_bytes(cfg, 8.0), types, rows=32, window_type="q8_0") == 32
    assert KP.auto_window(cfg, n, KP.bits_to_bytes(cfg, 8.0), types) == n // 8
    for wt in ("q8_0", "iq4_nl"):
        assert KP.auto_window(cfg, n, floor, types, window_type=wt) == 0
        assert KP.auto_window(cfg, n, floor, types + ("tc1b",), window_type=wt) > 0   # bytes above tc1b
        row = KP.plan_bytes(cfg, ["nl2b"] * L, ["nl2b"] * L, n, window=1, window_type=wt) - floor
        w = KP.auto_window(cfg, n, floor + 10.5 * row, types, window_type=wt)
        assert w == 10
        assert KP.plan_bytes(cfg, ["nl2b"] * L, ["nl2b"] * L, n, window=w, window_type=wt) <= floor + 10.5 * row
    q8 = KP.plan_bytes(cfg, ["nl2b"] * L, ["nl2b"] * L, n, window=1, window_type="q8_0") - floor
    assert KP.auto_window(cfg, n, floor + 10.5 * q8, types, window_type="iq4_nl") > 10   # more rows, same bytes


def test_cli_prints_the_plan_in_one_line_and_the_table_with_verbose(tiny_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYKV_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "t.txt"
    text.write_text("the theory of the thing, then the other, " * 20)
    calib = tmp_path / "calib.txt"
    calib.write_text("a cat sat on a mat and then the dog ran off. " * 8)
    args = ["perplexity", tiny_path, str(text), "-c", "64", "--kv-bits", "4.5", "--kv-calib", str(calib)]
    assert main(args) == 0
    err = capsys.readouterr().err.splitlines()
    plan_lines = [e for e in err if e.startswith("KV plan:")]
    assert len(plan_lines) == 1 and "bits/value" in plan_lines[0] and "window" in plan_lines[0]
    assert any(e.startswith("pykv: KV plan for 4.5 bits/value:") and "calibration runs" in e for e in err)  # piped
    assert not any(e.startswith("layer") for e in err)
    assert main(args + ["--verbose"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "(cached)" in [e for e in err if e.startswith("KV plan:")][0]
    i = err.index("layer  K        V")
    assert [e.split()[0] for e in err[i + 1:i + 4]] == ["0", "1", "2"]


def test_cli_kv_sensitivity_estimate(tiny_path, tmp_path, capsys, monkeypatch):
    """The estimate's reference column (the cheapest type) is the measured one-layer KL; every other
    column is it times the all-layers ratio; --exact measures each entry."""
    monkeypatch.setenv("PYKV_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "t.txt"
    text.write_text("the theory of the thing, then the other, " * 8)
    assert main(["kv-sensitivity", tiny_path, str(text), "-c", "48", "--types", "q8_0,nl2", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["method"] == "estimate" and est["ref"] == "nl2" and len(est["k"]) == 3
    assert main(["kv-sensitivity", tiny_path, str(text), "-c", "48", "--types", "q8_0,nl2", "--json",
                 "--exact"]) == 0
    ex = json.loads(capsys.readouterr().out)
    for s in ("k", "v"):
        e, x = np.array(est[s]), np.array(ex[s])
        np.testing.assert_allclose(e[:, 1], x[:, 1], rtol=1e-5, atol=1e-12)
        u = est["uniform"][s]
        np.testing.assert_allclose(e[:, 0], e[:, 1] * u[0] / u[1], rtol=1e-9)
        assert (x[:, 0] < x[:, 1]).all()     # q8_0 costs less KL than nl2 in every layer


def test_kv_bits_with_explicit_types_is_refused(tiny_path):
    with pytest.raises(pykv.PykvError, match="drop -ctk / -ctv"):
        pykv.load(tiny_path, n_ctx=64, kv_bits=4.5, kv_type_k="q4_0")
