"""`pykv kv-sensitivity`: the per-layer KV sensitivity table, its arguments and handler."""
from __future__ import annotations
import json
import sys
from pykv.files.config import PykvError
from pykv.files.formats import parse_kv_type
from pykv.api.kv_plan import _bar, CALIB_TOKENS, DEFAULT_TYPES, read_text, sensitivity


# ---- CLI: pykv kv-sensitivity ---------------------------------------------------------------------

def cmd_sensitivity(args) -> int:
    from pykv.api.model import load
    if not 1 <= len(args.args) <= 2:
        raise PykvError("usage: pykv kv-sensitivity [MODEL] TEXTFILE")
    model_path, textfile = args.args if len(args.args) == 2 else (None, args.args[0])
    text = read_text(textfile)
    types = [t for t in args.types.split(",") if t.strip()]
    try:
        types = [parse_kv_type(t).name for t in types]
    except ValueError as e:
        raise PykvError(str(e)) from None
    model = load(model_path, n_ctx=args.ctx_size, threads=args.threads, q8_act=False, device=args.device,
                 kv_window=args.kv_window or 0, kv_sinks=args.kv_sinks, kv_window_type=args.kv_window_type or "f16")
    ids = model.tokenize(text)[:args.ctx_size]
    if len(ids) < 16:
        raise PykvError(f"{textfile} has {len(ids)} tokens; at least 16 are needed")
    table = sensitivity(model.path, ids, types, exact=args.exact, use_cache=not args.no_cache,
                        progress=_bar(), model=model, window=args.kv_window or 0, sinks=args.kv_sinks,
                        window_type=args.kv_window_type or "f16")
    if args.json:
        print(json.dumps(table))
        return 0
    L = model.config.n_layers
    print(f"KL vs the f16 cache when only one layer's K or V is quantized ({table['method']}, "
          f"{table['n_tokens']} tokens of {textfile})")
    print("| layer | " + " | ".join(f"K {t}" for t in table["types"]) + " | "
          + " | ".join(f"V {t}" for t in table["types"]) + " |")
    print("|---:|" + "---:|" * (2 * len(table["types"])))
    for l in range(L):
        print(f"| {l} | " + " | ".join(_cell(x) for x in table["k"][l]) + " | "
              + " | ".join(_cell(x) for x in table["v"][l]) + " |")
    return 0


def _cell(x) -> str:
    return "—" if x is None else f"{x:.5f}"


def register_cli(sub) -> None:
    from pykv.cli.args import _model_args
    p = sub.add_parser("kv-sensitivity",
                       help="KL vs the f16 cache per layer when only that layer's K or V is quantized")
    p.add_argument("args", nargs="+", metavar="[MODEL] TEXTFILE")
    _model_args(p)
    p.set_defaults(ctx_size=CALIB_TOKENS)
    p.add_argument("--types", default=",".join(DEFAULT_TYPES), help="candidate KV types (comma list)")
    p.add_argument("--exact", action="store_true",
                   help="one run per (layer, K|V, type) instead of the per-layer x per-type estimate")
    p.add_argument("--no-cache", action="store_true", help="measure again even when the table is cached")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_sensitivity)
