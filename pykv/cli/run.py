"""`pykv run` and `pykv pull`."""
from __future__ import annotations
import sys
from pykv.files.config import PykvError
from pykv.cli.args import _model_args, _sampling_args, load_from_args


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
    from pykv.models import ModelFetchError, fetch
    try:
        path = fetch(args.name)
    except ModelFetchError as e:
        raise PykvError(str(e)) from None
    print(path)
    return 0


def register_cli(sub) -> None:
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
