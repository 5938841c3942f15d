"""`pykv chat`: the interactive chat loop (readline or prompt_toolkit), its slash commands and Ctrl-C."""
from __future__ import annotations
import sys
from pykv.files.config import PykvError


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
    from pykv.api.session import Session
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
            from pykv.api.generate import set_interrupt
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
    from pykv.cli.args import load_from_args
    from pykv.api.session import Session
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
    from pykv.cli.args import _model_args, _sampling_args
    p = sub.add_parser("chat", help="interactive chat with streaming replies (/help inside)")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help="GGUF path or registry name")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--load", default=None, metavar="FILE", help="start from a saved session state file")
    _model_args(p)
    _sampling_args(p, n_predict=512, temp=0.7)
    p.set_defaults(func=cmd_chat)
