"""`pykv perplexity` and `pykv plan`: their arguments and handlers."""
from __future__ import annotations
import json
import os
from pykv.files.config import PykvError
from pykv.api.evaluate import perplexity, plan_rows


def cmd_perplexity(args) -> int:
    from pykv.cli.args import load_from_args
    model_path, textfile = (args.args if len(args.args) == 2 else (None, args.args[0]))
    if len(args.args) > 2:
        raise PykvError("usage: pykv perplexity [MODEL] TEXTFILE")
    try:
        with open(textfile, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise PykvError(f"cannot read {textfile}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise PykvError(f"cannot read {textfile}: not UTF-8 text") from None
    model = load_from_args(args, model_path, q8_act=args.q8_act)
    ids = model.tokenize(text)
    base = None
    if args.kl_base:
        from pykv.api.model import load
        base = load(model.path, n_ctx=args.ctx_size, kv_type_k=args.kl_base, kv_type_v=args.kl_base,
                    threads=args.threads, kv_rotate=False, q8_act=args.q8_act, device=args.device)
    res = perplexity(model, ids, args.ctx_size, base=base, max_chunks=args.chunks)
    if args.json:
        print(json.dumps(res))
    else:
        line = (f"ctk {res['ctk']} ctv {res['ctv']} rotate {'on' if res['kv_rotate'] else 'off'}: "
                f"ppl {res['ppl']:.4f} over {res['n_tokens']} tokens, "
                f"KV {res['kv_bytes_per_token']:.0f} B/token")
        if base is not None:
            line += f", KL {res['kl']:.5f}, top-1 agreement {100 * res['top1']:.2f}% vs {args.kl_base}"
        print(line)
    return 0


def cmd_plan(args) -> int:
    from pykv.cli.args import parse_bytes
    from pykv.models import ModelFetchError, resolve_model
    try:      # an existing path is opened as it is (a folder or a socket gets the file's own error)
        path = args.model if args.model and os.path.exists(args.model) else str(resolve_model(args.model))
    except ModelFetchError as e:
        raise PykvError(str(e)) from None
    memory = parse_bytes(args.memory)
    info, rows = plan_rows(path, memory)
    if info["kv_memory"] <= 0:
        raise PykvError(f"--memory {args.memory} ({memory:,} bytes) does not hold the weights "
                        f"({info['weights_bytes']:,} bytes), let alone a KV cache")
    if args.json:
        print(json.dumps({**info, "rows": rows}))
        return 0
    gib = 1024 ** 3
    print(f"model {path}: weights {info['weights_bytes'] / 2**20:.1f} MiB; memory {memory / gib:.2f} GiB; "
          f"KV memory {info['kv_memory'] / gib:.2f} GiB; {info['n_layers']} layers x {info['n_kv_heads']} KV heads "
          f"x head_dim {info['head_dim']}; trained context {info['n_ctx_train']}")
    print("| KV type | bits/value | bytes/token | fixed f16 bytes/seq | max context (1 seq) | "
          f"seqs of {info['n_ctx_train']} tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_type']} | {r['bits_per_value']:.2f} | {r['bytes_per_token']:,.0f} | "
              f"{r['seq_fixed_bytes']:,} | {r['max_context']:,} | {r['full_context_seqs']:,} |")
    return 0


def register_cli(sub) -> None:
    from pykv.cli.args import _model_args
    p = sub.add_parser("perplexity", help="perplexity through the (quantized) KV cache, KL vs an f16 cache")
    p.add_argument("args", nargs="+", metavar="[MODEL] TEXTFILE")
    _model_args(p)
    p.set_defaults(ctx_size=1024)
    p.add_argument("--kl-base", default=None, help="KV type of the baseline run for KL / top-1 (e.g. f16)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--q8-act", action="store_true",
                   help="8-bit activations as `pykv run` uses them (default: float activations, so the "
                        "comparison measures the KV cache and not q8 rounding flips)")
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("plan", help="bytes per token and what fits in a memory budget, for every KV type")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--memory", default="8GiB", help="memory for weights + KV cache (default 8GiB)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
