"""Chat: the GGUF's chat template (Jinja2, sandboxed, HF semantics), OpenAI-shaped completion dicts,
and the interactive `pykv chat` command."""
from __future__ import annotations
import functools
import json
import time
import uuid
from datetime import datetime
from pykv.files.config import PykvError

# Used when the GGUF has no tokenizer.chat_template: ChatML (HF's former default template, and
# llama-cpp-python's "chatml" format). Replies end at "<|im_end|>", which is also a stop string then.
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                   "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                   "{% endif %}")
CHATML_STOP = "<|im_end|>"


def _raise_exception(message):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's filter: plain json.dumps (Jinja's own tojson escapes HTML characters)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """A chat template compiled as transformers compiles it: Jinja2's ImmutableSandboxedEnvironment
    with trim_blocks and lstrip_blocks, the loop-controls extension, and the globals templates use
    (raise_exception, strftime_now, a tojson filter that does not escape HTML)."""
    try:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise PykvError("chat templates need jinja2 (pip install 'jinja2>=3.1.6')") from None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise PykvError(f"chat template does not compile: {e}") from None


def _plain(value):
    """What the template sees: plain JSON-like data only (no objects with methods to call)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for t in (bool, int, float, str):
        if isinstance(value, t):
            return t(value)
    raise PykvError(f"chat messages hold plain data only, got a {type(value).__name__}")


def render(source: str, messages, add_generation_prompt: bool = True, tools=None, special_tokens=None,
           **kwargs) -> str:
    """Render a chat template as transformers' apply_chat_template(tokenize=False) does: the template
    sees `messages`, `add_generation_prompt`, `tools`, `documents` (None), the special-token strings
    (bos_token, eos_token, unk_token, pad_token) and any extra keyword. A template's
    raise_exception(...) becomes a one-line PykvError."""
    import jinja2
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise PykvError("messages must be a list of dicts with 'role' and 'content'")
    ctx = dict(special_tokens or {})
    ctx.update(_plain(kwargs))
    try:
        return compile_template(source).render(messages=_plain(list(messages)), tools=_plain(tools), documents=None,
                                               add_generation_prompt=bool(add_generation_prompt), **ctx)
    except jinja2.TemplateError as e:
        raise PykvError(f"chat template: {e}") from None


def special_tokens(tokenizer, metadata) -> dict:
    """bos_token / eos_token / unk_token / pad_token strings from the GGUF's token ids."""
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        tid = metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(tid, int) and 0 <= tid < len(tokenizer.tokens):
            out[name] = tokenizer.tokens[tid]
    return out


def fit_messages(render_ids, messages, n_ctx: int, max_tokens, drop_oldest: bool):
    """Token ids of the rendered conversation, and the messages they came from, such that the prompt
    plus max_tokens fit the context (prompt < n_ctx when max_tokens is None). Too long: a PykvError,
    or with drop_oldest the oldest turns go first (leading system messages stay; a dropped user
    message takes the replies after it along)."""
    msgs = list(messages)
    while True:
        ids = render_ids(msgs)
        need = len(ids) + (max_tokens if max_tokens is not None else 1)
        if need <= n_ctx:
            return ids, msgs
        first = next((i for i, m in enumerate(msgs) if m.get("role") != "system"), len(msgs))
        if not drop_oldest or len(msgs) - first <= 1:
            what = f" + max_tokens {max_tokens}" if max_tokens is not None else ""
            hint = "" if drop_oldest else ", or drop_oldest=True"
            raise PykvError(f"context full: {len(ids)} prompt tokens{what} exceed the context size {n_ctx} "
                            f"(use a larger n_ctx / -c, fewer max_tokens{hint})")
        del msgs[first]
        while len(msgs) - first > 1 and msgs[first].get("role") not in ("user", "system"):
            del msgs[first]


# ---- OpenAI-shaped results (as llama-cpp-python's create_completion / create_chat_completion) ----

def _usage(stats) -> dict:
    p, c = int(stats["prompt_tokens"]), int(stats["gen_tokens"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_result(pieces, stats, model_name: str, chat: bool, stream: bool, prefix: str = ""):
    """A completion dict, or with stream an iterator of chunk dicts, from a text-piece iterator and the
    stats dict it fills (prompt_tokens, gen_tokens, finish_reason). The last chunk carries the
    finish reason and the usage counts."""
    cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    head = {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model_name}
    if not stream:
        text = prefix + "".join(pieces)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else \
            {"text": text, "index": 0}
        choice.update(logprobs=None, finish_reason=stats["finish_reason"])
        return {**head, "choices": [choice], "usage": _usage(stats)}

    def chunk(body, finish=None):
        c = {**head, "choices": [{"index": 0, **body, "logprobs": None, "finish_reason": finish}]}
        if chat:
            c["object"] = "chat.completion.chunk"
        return c

    def chunks():
        if chat:
            yield chunk({"delta": {"role": "assistant"}})
        if prefix:
            yield chunk({"text": prefix})
        for piece in pieces:
            yield chunk({"delta": {"content": piece}} if chat else {"text": piece})
        last = chunk({"delta": {}} if chat else {"text": ""}, stats["finish_reason"])
        last["usage"] = _usage(stats)
        yield last

    return chunks()
