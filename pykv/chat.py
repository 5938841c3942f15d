"""Chat: the GGUF's chat template (Jinja2, sandboxed, HF semantics), OpenAI-shaped completion dicts,
and the interactive `pykv chat` command."""
from __future__ import annotations

import functools
import json
import sys
import time
import uuid
from datetime import datetime

from .config import PykvError

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


# ---- `pykv chat` ---------------------------------------------------------------------------------

CHAT_HELP = """commands: /reset (forget the conversation), /save FILE, /load FILE, /kv (cache in use),
/help, /quit (or Ctrl-D). Ctrl-C stops a reply."""


def _line_reader():
    """input(prompt) with line editing and history: readline (the standard library's) where it
    exists, else prompt_toolkit on a terminal, else plain input()."""
    try:
        import readline  # noqa: F401  (input() gets line editing and history)
        return input
    except ImportError:
        pass
    if sys.stdin.isatty() and sys.stdout.isatty():
        try:
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import InMemoryHistory
            return PromptSession(history=InMemoryHistory()).prompt
        except Exception:   # not installed, or no usable terminal
            pass
    return input


def kv_report(session) -> str:
    """One line for /kv: tokens cached, bytes in use (pages + the f16 sink/window rows), pool use."""
    c = session.cache
    return (f"kv: {session.n_cached} tokens cached, {session.kv_bytes():,} bytes in use "
            f"({c.n_pages_held(session.seq)} pages of {c.P} tokens, {c.k_name()}/{c.v_name()}); "
            f"pool {c.n_pages - len(c.free_pages)}/{c.n_pages} pages used")


class _Interrupt:
    """SIGINT while a reply streams: a flag the loop checks between pieces, so a token's forward is
    never cut in half and the session stays consistent."""

    def __init__(self):
        self.hit = False

    def __enter__(self):
        import signal
        self.hit = False
        self._old = signal.signal(signal.SIGINT, self._on)
        return self

    def _on(self, *_):
        self.hit = True

    def __exit__(self, *exc):
        import signal
        signal.signal(signal.SIGINT, self._old)
        return False


def repl(model, session, system, sampling, read=None, out=None) -> None:
    """The chat loop of `pykv chat`: read a line, stream the reply, handle the / commands."""
    from .session import Session
    read = read or _line_reader()
    out = out or sys.stdout
    base = [{"role": "system", "content": system}] if system else []
    if session.messages is None:
        session.messages = list(base)
    while True:
        try:
            line = read("> ")
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:     # Ctrl-C at the prompt clears the line
            from .generate import set_interrupt
            set_interrupt(False)      # handled here: the next reply must not stop at once
            out.write("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            arg = arg.strip()
            try:
                if cmd in ("/quit", "/exit"):
                    return
                elif cmd == "/reset":
                    session.reset()
                    session.messages = list(base)
                    out.write("(conversation reset)\n")
                elif cmd == "/save" and arg:
                    session.save(arg)
                    out.write(f"(saved {len(session.tokens)} tokens to {arg})\n")
                elif cmd == "/load" and arg:
                    new = Session.load(model, arg)
                    session.close()
                    session = new
                    if session.messages is None:
                        session.messages = list(base)
                    out.write(f"(loaded {len(session.tokens)} tokens, {len(session.messages)} messages from {arg})\n")
                elif cmd == "/kv":
                    out.write(kv_report(session) + "\n")
                else:
                    out.write(CHAT_HELP + "\n")
            except PykvError as e:
                out.write(f"error: {e}\n")
            out.flush()
            continue
        msgs = list(session.messages) + [{"role": "user", "content": text}]
        try:
            with _Interrupt() as intr:
                gen = session.chat(msgs, drop_oldest=True, **sampling)
                for piece in gen:
                    out.write(piece)
                    out.flush()
                    if intr.hit:
                        break
                gen.close()
            if intr.hit:
                out.write(" [stopped]")
        except PykvError as e:
            out.write(f"\nerror: {e}")
        out.write("\n")
        out.flush()


def cmd_chat(args) -> int:
    """`pykv chat`: load the model (a pool of two contexts: the chat and a /load), run the loop."""
    from .cli import load_from_args
    from .session import Session
    model = load_from_args(args, args.model, compile_helper=True, max_seqs=2)
    session = Session.load(model, args.load) if args.load else model.session()
    sampling = {"max_tokens": args.n_predict, "temperature": args.temp, "top_k": args.top_k, "top_p": args.top_p,
                "min_p": args.min_p, "repeat_penalty": args.repeat_penalty, "seed": args.seed}
    print(f"pykv chat: {model.path} ({model.cache.k_name()}/{model.cache.v_name()} KV, context {model.n_ctx}). "
          f"/help for commands.", flush=True)
    repl(model, session, args.system, sampling)
    return 0


def register_cli(sub) -> None:
    """Add the `chat` subcommand to pykv's argument parser."""
    from .cli import _model_args, _sampling_args
    p = sub.add_parser("chat", help="interactive chat with streaming replies (/help inside)")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help="GGUF path or registry name")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--load", default=None, metavar="FILE", help="start from a saved session state file")
    _model_args(p)
    _sampling_args(p, n_predict=512, temp=0.7)
    p.set_defaults(func=cmd_chat)
