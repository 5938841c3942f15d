"""`pykv` command line: run, chat, pull, perplexity, plan, bench, and the model-file tools."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from .config import PykvError

KV_HELP = "KV cache type: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl fp8_e4m3 fp8_e5m2 int4 int2 nl4 nl3 nl2 nl3b nl2b, keys only: klt3 klt2"


def _model_args(p: argparse.ArgumentParser, with_prompt: bool = False) -> None:
    if with_prompt:
        p.add_argument("args", nargs="*", metavar="[MODEL] PROMPT",
                       help="optional GGUF path or registry name, then the prompt (none with -f)")
    p.add_argument("-c", "--ctx-size", type=int, default=2048, help="context size in tokens (default 2048)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", help=KV_HELP + " (comma list = per layer)")
    p.add_argument("-ctv", "--cache-type-v", default="f16", help=KV_HELP + " (comma list = per layer)")
    p.add_argument("--kv-rotate", choices=["on", "off", "auto"], default="auto",
                   help="Hadamard rotation of K/V before quantization (auto: on for quantized types)")
    p.add_argument("--kv-prerope", choices=["on", "off", "auto"], default="auto",
                   help="store block-quantized keys before RoPE, roped inside attention, with query-aware "
                        "smoothing (CPU only; auto: off for now)")
    p.add_argument("--kv-budget", default=None, help="cap the KV pool, e.g. 64MiB")
    p.add_argument("--kv-window", type=int, default=0,
                   help="newest tokens each query reads as f16 copies (quantized types; 0: none)")
    p.add_argument("--kv-sinks", type=int, default=4, help="first tokens kept as f16 rows (quantized types)")
    p.add_argument("--kv-window-type", default="f16", choices=["f16", "q8_0"],
                   help="format of the --kv-window rows (q8_0: half the bytes)")
    p.add_argument("--kv-bits", type=float, default=None,
                   help="pick per-layer K/V types minimising measured KL at this many bits per stored value")
    p.add_argument("--kv-calib", default=None, help="calibration text for --kv-bits (default: built-in)")
    p.add_argument("--kv-plan", default=None, help="per-layer K/V types from a plan JSON (--kv-plan-out)")
    p.add_argument("--kv-plan-out", default=None, help="save the chosen per-layer plan as JSON")
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: the cores that other work leaves free, read at each call)")
    device_arg(p)


def device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu",      # checked by kernels.backend.get_backend: one-line error
                   help="where the model runs: cpu, or cuda (an NVIDIA GPU through numba.cuda; pip install "
                        "'pykv[cuda]')")


def _sampling_args(p: argparse.ArgumentParser, n_predict: int = 128, temp: float = 0.8) -> None:
    p.add_argument("-n", "--n-predict", type=int, default=n_predict,
                   help=f"tokens to generate (default {n_predict}; -1: until the end of generation)")
    p.add_argument("--temp", type=float, default=temp)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def parse_bytes(s: str) -> int:
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
             "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
    t = s.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):].strip()
    try:
        value = float(num)
    except ValueError:
        raise PykvError(f"bad size {s!r} (e.g. 8GiB, 512MiB, 1e9)") from None
    if unit not in units or value < 0:
        raise PykvError(f"bad size {s!r} (e.g. 8GiB, 512MiB, 1e9)")
    return int(value * units[unit])


def _kv_types(s: str):
    parts = [p.strip() for p in s.split(",") if p.strip()]
    return parts if len(parts) > 1 else parts[0]


def load_from_args(args, model_path, compile_helper=False, **kw):
    from .kv_plan import load_planned
    if args.threads is not None and args.threads < 1:
        raise PykvError(f"-t/--threads must be >= 1, got {args.threads}")
    rot = {"on": True, "off": False, "auto": None}[args.kv_rotate]
    budget = parse_bytes(args.kv_budget) if args.kv_budget else None
    kw = dict(n_ctx=args.ctx_size, kv_type_k=_kv_types(args.cache_type_k), kv_type_v=_kv_types(args.cache_type_v),
              threads=args.threads, kv_rotate=rot, kv_prerope={"on": True, "off": False, "auto": None}[args.kv_prerope],
              kv_budget=budget, device=args.device, kv_bits=args.kv_bits, kv_plan=args.kv_plan,
              kv_calib=args.kv_calib, kv_plan_out=args.kv_plan_out, verbose=True, kv_window=args.kv_window,
              kv_sinks=args.kv_sinks, kv_window_type=args.kv_window_type, **kw)
    model = load_planned(model_path, **kw)
    if compile_helper:
        from .warm import start
        start(model, kw)
    return model


def cmd_run(args) -> int:
    pos = args.args
    if args.file:            # the prompt comes from the file: a positional argument is the model
        if len(pos) > 1:
            raise PykvError("usage: pykv run [MODEL] -f FILE (no prompt argument with -f)")
        model_path = pos[0] if pos else None
        try:
            with open(args.file, encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise PykvError(f"cannot read prompt file {args.file}: {getattr(e, 'strerror', None) or e}") from None
    else:
        if not 1 <= len(pos) <= 2:
            raise PykvError("usage: pykv run [MODEL] PROMPT (quote the prompt)")
        model_path, prompt = pos if len(pos) == 2 else (None, pos[0])
    if args.n_predict < -1:
        raise PykvError(f"-n/--n-predict must be -1 (until the end of generation) or >= 0, got {args.n_predict}")
    model = load_from_args(args, model_path, compile_helper=True)
    n_predict = args.n_predict
    if n_predict == -1:     # as llama.cpp: until an end-of-generation token, or the context is full
        n_predict = max(0, model.n_ctx - len(model.tokenize(prompt)))
    out = sys.stdout
    if args.echo:
        out.write(prompt)
    for piece in model.generate(prompt, max_tokens=n_predict, temperature=args.temp, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                                seed=args.seed, stop=args.stop or ()):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    s = model.last_stats
    pp = s["prompt_tokens"] / s["prompt_s"] if s["prompt_s"] else 0.0
    tg = (s["gen_tokens"] - 1) / s["gen_s"] if s["gen_s"] and s["gen_tokens"] > 1 else 0.0
    print(f"prompt: {s['prompt_tokens']} tokens, {pp:.1f} tokens/s | decode: {s['gen_tokens']} tokens, "
          f"{tg:.1f} tokens/s | KV {model.cache.k_name()}/{model.cache.v_name()} "
          f"{model.kv_bytes_per_token():.0f} B/token", file=sys.stderr)
    return 0


def cmd_pull(args) -> int:
    from .models import ModelFetchError, fetch
    try:
        path = fetch(args.name)
    except ModelFetchError as e:
        raise PykvError(str(e)) from None
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pykv", description="GGUF LLaMA inference with a quantized KV cache")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="generate text from a prompt")
    _model_args(p, with_prompt=True)
    _sampling_args(p)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("-f", "--file", help="read the prompt from a file")
    p.add_argument("--echo", action="store_true", help="print the prompt before the continuation")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("pull", help="fetch a registry model (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("name", nargs="?", default=None)
    p.set_defaults(func=cmd_pull)

    for mod in ("evaluate", "kv_plan", "bench", "convert", "chat"):
        try:
            m = __import__(f"pykv.{mod}", fromlist=["register_cli"])
        except ImportError:
            continue
        m.register_cli(sub)
    return ap


EXIT_USAGE = 2      # a user error (bad argument, file, model or budget): argparse's code too
EXIT_INTERRUPT = 130


def _warn_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"pykv: warning: {message}", file=sys.stderr)


def _on_sigint(signum, frame):
    from .generate import set_interrupt
    set_interrupt(True)          # remembered, in case the exception below is swallowed (generate.set_interrupt)
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    import signal
    import threading
    from .generate import set_interrupt
    from .kernels import jitnote
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
