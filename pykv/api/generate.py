"""Token generation: prompt prefill, sampling loop, streaming text, stop strings, timing."""
from __future__ import annotations

import time

from pykv.files.config import PykvError
from pykv.kernels.jitnote import compile_seconds
from pykv.decoder.sampler import Sampler, SamplerParams
from pykv.files.tokenizer import StreamDecoder


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


class StopText:
    """A token stream's text with stop strings: feed(tid) -> (text safe to emit now, stopped), holding
    back a tail that may begin a stop string (they match across token boundaries); flush() -> what is
    left at the end.  Used by sample_loop and by the engine's requests."""

    def __init__(self, tokenizer, stops):
        self.dec, self.stops, self.pending = StreamDecoder(tokenizer), stops, ""

    def feed(self, tid: int) -> tuple[str, bool]:
        self.pending += self.dec.feed(tid)
        n, stopped = _stop_cut(self.pending, self.stops)
        out = self.pending[:n]
        self.pending = "" if stopped else self.pending[n:]
        return out, stopped

    def flush(self) -> str:
        self.pending += self.dec.flush()
        n, _ = _stop_cut(self.pending, self.stops)
        out, self.pending = self.pending[:n], ""
        return out


def stop_list(stop) -> list[str]:
    """`stop` as a list of non-empty strings (a str, a sequence of str, or None)."""
    return [s for s in ([stop] if isinstance(stop, str) else (stop or ())) if s]


def make_sampler(model, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, seed=None):
    """A Sampler for the model's vocabulary (temperature <= 0: greedy)."""
    return Sampler(SamplerParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                 repeat_penalty=repeat_penalty, seed=seed), model.n_vocab)


_INTERRUPT = [False]    # set by the CLI's SIGINT handler (cli._on_sigint), checked once per token


def set_interrupt(flag: bool) -> None:
    """Ask every running sample_loop to stop with KeyboardInterrupt at its next token (flag True), or
    forget a request that was handled (False). The CLI's SIGINT handler sets it as well as raising
    KeyboardInterrupt: a KeyboardInterrupt that lands in Python code Numba's C dispatcher calls (argument
    typing) is cleared there, so one Ctrl-C could be lost; the flag is not."""
    _INTERRUPT[0] = bool(flag)


def sample_loop(model, seq, feed, history, sampler, max_tokens, stops, stats):
    """The sampling loop of Model.generate and of sessions: run `feed` (the prompt, or what the cache
    lacks of it) through `seq`, sample a token where the logits are (Model.next_token: on a GPU only
    the id comes down), append it to `history` (an end-of-generation token too), and feed it through
    `seq` only when another token follows, so the last sampled id is never run (a session keeps it
    pending). Yields text pieces, holding back a tail that may begin a stop string (stop strings match
    across token boundaries). Sets stats['prompt_s'] (feed and first sample), stats['gen_tokens']
    (excluding an end-of-generation token), stats['gen_s'] and stats['finish_reason']: 'stop'
    (end-of-generation token or stop string) or 'length' (max_tokens, or the context is full)."""
    text, finish = StopText(model.tokenizer, stops), "length"
    c0, t0 = compile_seconds(), time.perf_counter()

    def took():   # seconds since t0, Numba compiles excluded (speeds report the kernels, not the JIT)
        return time.perf_counter() - t0 - (compile_seconds() - c0)

    for i in range(max_tokens):
        if _INTERRUPT[0]:
            raise KeyboardInterrupt
        if i:
            if seq.n_tokens >= model.n_ctx:
                break
            tid = model.next_token(seq, [history[-1]], sampler, history)
            stats["gen_s"] = took()
        else:
            tid = model.next_token(seq, feed, sampler, history)
            stats["prompt_s"] = took()
            c0, t0 = compile_seconds(), time.perf_counter()
        history.append(tid)
        if model.tokenizer.is_eog(tid):
            finish = "stop"
            break
        stats["gen_tokens"] += 1
        piece, stopped = text.feed(tid)
        if piece:
            yield piece
        if stopped:
            finish = "stop"
            break
    if max_tokens <= 0 and len(feed):    # nothing to sample: still run the prompt into the cache
        model.eval(seq, feed)
        stats["prompt_s"] = took()
    else:
        stats["gen_s"] = took()
    stats["finish_reason"] = finish
    piece = text.flush()
    if piece:
        yield piece


def generate(model, prompt, max_tokens=128, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
             repeat_penalty=1.0, seed=None, stop=()):
    """Stream text pieces from a fresh sequence. `prompt` is a str (tokenized with special tokens) or a
    list of ids. Statistics land in model.last_stats (prompt/decode token counts and seconds, finish
    reason). A prompt plus max_tokens longer than the context is refused before anything runs."""
    ids = model.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    if not ids:
        raise PykvError("empty prompt")
    if len(ids) >= model.n_ctx:
        raise PykvError(f"prompt is {len(ids)} tokens, longer than the context size {model.n_ctx} (use -c)")
    if len(ids) + max_tokens > model.n_ctx:
        raise PykvError(f"prompt ({len(ids)} tokens) + max tokens ({max_tokens}) = {len(ids) + max_tokens} exceed "
                        f"the context size {model.n_ctx} (use a larger -c or a smaller -n)")
    stops = stop_list(stop)
    sampler = make_sampler(model, temperature, top_k, top_p, min_p, repeat_penalty, seed)
    stats = model.last_stats = {"prompt_tokens": len(ids), "prompt_s": 0.0, "gen_tokens": 0, "gen_s": 0.0}

    def run():
        seq = model.new_sequence()
        yield from sample_loop(model, seq, ids, list(ids), sampler, max_tokens, stops, stats)

    return run()
