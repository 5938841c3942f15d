"""`pykv` command line: run, chat, pull, perplexity, plan, bench, and the model-file tools.  Each command
lives in its own module here (its arguments and its handler); this one builds the parser and runs a
command with the one-line error and exit-code promises."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from pykv.cli import bench, bench_serve, chat, convert, evaluate, kv_plan, run, serve
from pykv.files.config import PykvError

COMMANDS = (run, evaluate, kv_plan, bench, bench_serve, convert, chat, serve)     # in `pykv --help` order


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pykv", description="GGUF LLaMA inference with a quantized KV cache")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for m in COMMANDS:
        m.register_cli(sub)
    return ap


EXIT_USAGE = 2      # a user error (bad argument, file, model or budget): argparse's code too
EXIT_INTERRUPT = 130


def _warn_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"pykv: warning: {message}", file=sys.stderr)


def _on_sigint(signum, frame):
    from pykv.api.generate import set_interrupt
    set_interrupt(True)          # remembered, in case the exception below is swallowed (generate.set_interrupt)
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    import signal
    import threading
    from pykv.api.generate import set_interrupt
    from pykv.kernels import jitnote
    # one line on stderr when kernels compile (a cold cache), terminal or not: a first run piped into a
    # file would otherwise wait a minute without a word (llama.cpp logs its loading either way)
    jitnote.install("stderr")
    own = (threading.current_thread() is threading.main_thread()
           and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if own:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")            # each warning once per command
            # but not ResourceWarning (hidden by Python's own defaults): a Ctrl-C that lands between a
            # library's open() and its `with` (Numba loading a cached kernel) leaves an unclosed file
            # behind, and "pykv: warning: unclosed file ..." is not the user's business
            warnings.simplefilter("ignore", ResourceWarning)
            warnings.showwarning = _warn_one_line       # one line too, not file:line + source
            return _run(args)
    finally:
        if own:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            set_interrupt(False)


def _run(args) -> int:
    try:
        return int(args.func(args) or 0)
    except PykvError as e:
        print(f"pykv: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pykv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPT
    except BrokenPipeError:   # stdout closed early (e.g. `| head`): exit quietly, as llama.cpp does
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except Exception as e:   # other known one-line failures (convert tool, OS errors)
        name = type(e).__name__
        if name in ("ConvertError", "ModelFetchError") or isinstance(e, (OSError, ValueError)):
            print(f"pykv: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        raise
