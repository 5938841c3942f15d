"""Batched decode (Decoder.step) and continuous batching (pykv.api.engine): a sequence's logits in a step
of many equal its own single-sequence run bit for bit (q8 activations); the engine admits by the KV
budget, queues, cancels, and shares prompt pages through its prefix cache."""
import threading

import numpy as np
import pytest

import pykv
from pykv.api.engine import Engine, QueueFull
from pykv.files.config import PykvError
from tests.cuda_util import cuda_or_skip
from tests.reference import write_tiny_gguf

N_NEW = 6


def _single(m, prompt, n_new):
    """Greedy tokens and every sampled step's logits of one sequence through Decoder.eval."""
    seq = m.cache.new_sequence()
    lg, toks, rows = m.eval(seq, prompt), [], []
    for _ in range(n_new):
        rows.append(lg[0].copy())
        toks.append(int(np.argmax(lg[0])))
        lg = m.eval(seq, [toks[-1]])
    m.cache.free_sequence(seq)
    return toks, rows


def _batched(m, prompts, n_new):
    """The same through Decoder.step: prompts cut into the chunks eval would run (chunk_limit), riding
    along with the other sequences' decode tokens, joining one step after another."""
    seqs = [m.cache.new_sequence() for _ in prompts]
    fed, toks, rows = [0] * len(prompts), [[] for _ in prompts], [[] for _ in prompts]
    step = 0
    while any(len(t) < n_new for t in toks):
        work, who, budget = [], [], m.n_batch
        for i, p in enumerate(prompts[:step + 1]):        # sequence i joins at step i
            if len(toks[i]) >= n_new:
                continue
            if fed[i] < len(p):
                n = min(len(p) - fed[i], m.chunk_limit(seqs[i]))
                if n > budget:
                    continue
                work.append((seqs[i], p[fed[i]:fed[i] + n]))
                budget -= n
            else:
                work.append((seqs[i], [toks[i][-1]]))
                n = 0
            who.append((i, n))
        step += 1
        if not work:
            continue
        for (i, n), row in zip(who, m.step(work)):
            fed[i] += n
            if fed[i] < len(prompts[i]):
                continue
            rows[i].append(row)
            toks[i].append(int(np.argmax(row)))
    for s in seqs:
        m.cache.free_sequence(s)
    return toks, rows


@pytest.fixture(scope="module", params=["f16", "q4_0"])
def model(request):
    kv = request.param
    # n_batch 48: the longer prompts are cut into chunks
    return pykv.load(None, n_ctx=256, n_batch=48, max_seqs=16, kv_type_k=kv, kv_type_v=kv)


@pytest.mark.parametrize("n_seq", [1, 3, 16])
def test_step_equals_single_sequence_bit_for_bit(model, n_seq):
    rng = np.random.default_rng(n_seq)
    lens = [2, 9, 130, 5, 61, 17, 3, 33, 48, 49, 7, 96, 11, 4, 26, 70][:n_seq]
    prompts = [[1] + [int(x) for x in rng.integers(200, 40000, n - 1)] for n in lens]
    got_t, got_r = _batched(model, prompts, N_NEW)
    for p, gt, gr in zip(prompts, got_t, got_r):
        want_t, want_r = _single(model, p, N_NEW)
        assert gt == want_t
        for a, b in zip(gr, want_r):
            assert np.array_equal(a, b)


def test_step_rejects_bad_work(model):
    s = model.cache.new_sequence()
    with pytest.raises(PykvError, match="appears twice"):
        model.step([(s, [1]), (s, [2])])
    with pytest.raises(PykvError, match="exceed the step"):
        model.step([(s, list(range(1, model.step_rows + 2)))])
    with pytest.raises(PykvError, match="out of range"):
        model.step([(s, [model.n_vocab])])
    model.cache.free_sequence(s)


def test_step_on_cuda_simulator_matches_single(tmp_path):
    """device="cuda" (the simulator: slow, one tiny layer): three sequences of different lengths in one
    step give the greedy tokens of their own runs."""
    cuda_or_skip()
    from gguf import GGMLQuantizationType as T
    path = write_tiny_gguf(tmp_path / "tiny.gguf", {"default": T.Q8_0}, dim=64, ff=64, n_heads=2, n_kv=1,
                           n_layers=1)
    m = pykv.load(str(path), n_ctx=32, device="cuda", max_seqs=3, kv_type_k="q8_0", kv_type_v="q8_0")
    prompts = [[256, 72, 101, 7], [256, 5, 9, 10, 11, 12], [256, 9, 33, 40, 41]]
    groups, make = [], m.cache.decode_group
    m.cache.decode_group = lambda seqs, w: groups.append(make(seqs, w)) or groups[-1]
    got, _ = _batched(m, prompts, 3)
    assert any(g is not None for g in groups)       # the device twins of the batched kernels ran
    for p, g in zip(prompts, got):
        assert g == _single(m, p, 3)[0]


# ---- the engine ---------------------------------------------------------------------------------

def _collect(engine, reqs):
    """Submit (ids, kwargs) requests, wait for all: their texts and done events."""
    out, left, done = [], [len(reqs)], threading.Event()

    def cb(box):
        def f(ev):
            if ev["type"] == "token":
                box["text"] += ev["text"]
            else:
                box["done"] = ev
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return f
    for ids, kw in reqs:
        box = {"text": "", "done": None}
        out.append(box)
        engine.submit(ids, cb(box), **kw)
    assert done.wait(300)
    return out


def test_engine_greedy_equals_generate():
    m = pykv.load(None, n_ctx=512, max_seqs=6, kv_type_k="q8_0", kv_type_v="q4_0")
    prompts = ["The capital of France is", "def add(a, b):", "Three colors:", "Once upon a time", "Water is",
               "1, 2, 3,"]
    want = ["".join(m.generate(p, max_tokens=12, temperature=0)) for p in prompts]
    e = Engine(m, parallel=6).start()
    try:
        got = _collect(e, [(m.tokenize(p), dict(max_tokens=12, temperature=0)) for p in prompts])
    finally:
        e.stop()
    assert [g["text"] for g in got] == want
    assert e.peak_running > 1                  # they did run together
    assert all(g["done"]["finish_reason"] in ("stop", "length") for g in got)


def test_admission_by_budget_q4_0_holds_3x_f16():
    """The same pool bytes: how many full-context requests run at once (the rest wait in the queue)."""
    admitted = {}
    for kv in ("f16", "q4_0"):
        m = pykv.load(None, n_ctx=256, max_seqs=16, kv_budget=8 << 20, kv_type_k=kv, kv_type_v=kv)
        e = Engine(m, parallel=16, prefix_cache=False)
        for _ in range(16):
            e.submit([1, 2, 3], lambda ev: None, max_tokens=None)
        e._admit()
        admitted[kv] = len(e.running)
        assert len(e.queue) == 16 - admitted[kv]
    assert admitted["f16"] >= 1 and admitted["q4_0"] >= 3 * admitted["f16"], admitted


def test_engine_queue_full_and_never_fits():
    m = pykv.load(None, n_ctx=256, max_seqs=1, kv_budget=1 << 20)
    e = Engine(m, parallel=1, max_queue=2)
    with pytest.raises(PykvError, match="KV budget"):
        e.submit([1, 2], lambda ev: None, max_tokens=250)
    e.submit([1, 2], lambda ev: None, max_tokens=4)
    e.submit([1, 2], lambda ev: None, max_tokens=4)
    with pytest.raises(QueueFull):
        e.submit([1, 2], lambda ev: None, max_tokens=4)


def test_engine_waits_for_room_and_cancel_frees_pages():
    """A pool for two requests at a time: a third waits (never evicting a running one) and completes;
    a cancelled request gives its pages back."""
    m = pykv.load(None, n_ctx=256, max_seqs=4, kv_budget=None, page_tokens=32)
    budget = 2 * 2 * m.cache.bytes_per_page          # two requests of <= 64 tokens
    m = pykv.load(None, n_ctx=256, max_seqs=4, kv_budget=budget)
    e = Engine(m, parallel=4, prefix_cache=False).start()
    try:
        got = _collect(e, [(m.tokenize(p), dict(max_tokens=40, temperature=0))
                           for p in ("Hello", "The sky is", "A list of fruits:")])
        assert all(g["done"]["usage"]["completion_tokens"] > 0 for g in got)
        assert e.peak_running == 2
        first, done = threading.Event(), threading.Event()
        r = e.submit(m.tokenize("Tell me a long story"), lambda ev: (first.set(), ev["type"] == "done" and done.set()),
                     max_tokens=60, temperature=0)
        assert first.wait(60)
        e.cancel(r)
        assert done.wait(60)
        assert len(m.cache.free_pages) == m.cache.n_pages
    finally:
        e.stop()


def test_prefix_cache_shares_pages_and_keeps_the_answer():
    m = pykv.load(None, n_ctx=512, max_seqs=2)
    system = m.tokenize("You are a helpful assistant. " * 20)
    a, b = system + m.tokenize(" Q: two plus two?", special=False), system + m.tokenize(" Q: sky?", special=False)
    want = ["".join(m.generate(ids, max_tokens=8, temperature=0)) for ids in (a, b)]
    e = Engine(m, parallel=2).start()
    try:
        first = _collect(e, [(a, dict(max_tokens=8, temperature=0))])[0]
        second = _collect(e, [(b, dict(max_tokens=8, temperature=0))])[0]
    finally:
        e.stop()
    assert first["done"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["done"]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(system) // m.cache.P) * m.cache.P > 0
    assert [first["text"], second["text"]] == want      # an f16 cache: the shared pages are exact
    assert e.counters["prefix_hits"] == 1
    e.prefix.clear()
    assert len(m.cache.free_pages) == m.cache.n_pages - m.cache.n_pages_held(m.seq)


def test_engine_fails_a_request_pages_held_elsewhere_leave_no_room_for():
    """Pages the engine does not own (the model's own sequence here) can leave a request that passed
    submit's check no room ever: it ends with an error instead of blocking the queue behind it, and a
    request cancelled while it waits leaves the queue."""
    m = pykv.load(None, n_ctx=256, max_seqs=2, kv_budget=4 * 32 * 23040)
    assert m.cache.n_pages == 4
    "".join(m.generate("Hi", max_tokens=2, temperature=0))          # holds a page
    e = Engine(m, parallel=2, prefix_cache=False).start()
    try:
        ids = m.tokenize("Once upon a time")
        big = _collect(e, [(ids, dict(max_tokens=128 - len(ids), temperature=0))])[0]
        assert big["done"]["finish_reason"] == "error" and "cannot hold" in big["done"]["error"]
        small = _collect(e, [(ids, dict(max_tokens=4, temperature=0))])[0]
        assert small["done"]["finish_reason"] in ("stop", "length") and small["text"]
    finally:
        e.stop()
    e2 = Engine(m, parallel=1, prefix_cache=False)
    events = []
    e2.submit(ids, events.append, max_tokens=4)
    r = e2.submit(ids, events.append, max_tokens=4)
    e2.cancel(r)
    e2._reap()
    assert len(e2.queue) == 1 and events[-1]["finish_reason"] == "cancelled"


def test_engine_runs_the_model_on_its_thread_with_the_models_thread_count():
    """Every step runs on the engine thread, with the model's threads= in force around its kernels."""
    import numba
    m = pykv.load(None, n_ctx=256, max_seqs=2, threads=1)
    seen, run = [], m._run

    def spy(work, rows):
        seen.append((threading.current_thread().name, numba.get_num_threads()))
        return run(work, rows)
    m._run = spy
    e = Engine(m, parallel=2).start()
    try:
        _collect(e, [(m.tokenize(p), dict(max_tokens=3, temperature=0)) for p in ("Hi", "Hello there")])
    finally:
        e.stop()
    assert seen and set(seen) == {("pykv-engine", 1)}


def test_engine_logits_processor_per_request():
    """A request's logits processor sees its own rows only; one that fails ends its own request."""
    m = pykv.load(None, n_ctx=256, max_seqs=3)
    ids = m.tokenize("Once upon a time")
    plain = "".join(m.generate(ids, max_tokens=6, temperature=0))
    banned = int(np.argmax(m.eval(m.new_sequence(), ids)[0]))      # greedy's first token
    first = m.detokenize([banned])

    def ban(history, row):
        row[banned] = -np.inf
        return row

    def boom(history, row):
        raise RuntimeError("no")
    e = Engine(m, parallel=3).start()
    try:
        seen = []
        got = _collect(e, [(ids, dict(max_tokens=6, temperature=0,
                                      logits_processor=lambda h, row: (seen.append(len(h)), ban(h, row))[1])),
                           (ids, dict(max_tokens=6, temperature=0)),
                           (ids, dict(max_tokens=6, temperature=0, logits_processor=boom))])
    finally:
        e.stop()
    assert got[1]["text"] == plain and plain.startswith(first)     # the others: untouched
    assert not got[0]["text"].startswith(first) and got[0]["text"]
    assert seen[0] == len(ids) and len(seen) == 6
    assert got[2]["done"]["finish_reason"] == "error" and "RuntimeError" in got[2]["done"]["error"]
