"""Token generation: prompt prefill, sampling loop, streaming text, stop strings, timing."""
from __future__ import annotations

import time


from .config import PykvError
from .kernels.jitnote import compile_seconds
from .sampler import Sampler, SamplerParams
from .tokenizer import StreamDecoder


def _stop_cut(text: str, stops) -> tuple[int, bool]:
    """How much of `text` is safe to emit: (n_chars, stopped). Holds back a tail that may begin a stop string."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best):
            best = i
    if best is not None:
        return best, True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return len(text) - hold, False


def generate(model, prompt, max_tokens=128, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
             repeat_penalty=1.0, seed=None, stop=()):
    """Stream text pieces. `prompt` is a str (tokenized with special tokens) or a list of ids.
    Statistics land in model.last_stats (prompt/decode token counts and seconds)."""
    ids = model.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    if not ids:
        raise PykvError("empty prompt")
    if len(ids) >= model.n_ctx:
        raise PykvError(f"prompt is {len(ids)} tokens, longer than the context size {model.n_ctx} (use -c)")
    stops = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
    sampler = Sampler(SamplerParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    repeat_penalty=repeat_penalty, seed=seed), model.n_vocab)
    stats = model.last_stats = {"prompt_tokens": len(ids), "prompt_s": 0.0, "gen_tokens": 0, "gen_s": 0.0}

    def run():
        seq = model.new_sequence()
        c0 = compile_seconds()
        t0 = time.perf_counter()
        logits = model.eval(seq, ids)[0]
        stats["prompt_s"] = time.perf_counter() - t0 - (compile_seconds() - c0)     # speeds exclude JIT compiles
        history = list(ids)
        dec = StreamDecoder(model.tokenizer)
        pending = ""
        c0 = compile_seconds()
        t0 = time.perf_counter()
        for _ in range(max_tokens):
            tid = sampler.sample(logits, history)
            if model.tokenizer.is_eog(tid):
                break
            history.append(tid)
            stats["gen_tokens"] += 1
            pending += dec.feed(tid)
            n, stopped = _stop_cut(pending, stops)
            if n:
                yield pending[:n]
            pending = pending[n:]
            if stopped:
                pending = ""
                break
            if seq.n_tokens >= model.n_ctx:
                break
            logits = model.eval(seq, [tid])[0]
            stats["gen_s"] = time.perf_counter() - t0 - (compile_seconds() - c0)
        else:
            stats["gen_s"] = time.perf_counter() - t0 - (compile_seconds() - c0)
        pending += dec.flush()
        n, _ = _stop_cut(pending, stops)
        if pending[:n]:
            yield pending[:n]

    return run()
