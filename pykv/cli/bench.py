"""`pykv bench`: its arguments and handler."""
from __future__ import annotations
import json
import sys
import numpy as np
from pykv.tools.bench import format_markdown, format_notes, run_bench


# ---- CLI ------------------------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    rows = run_bench(args.model, n_prompt=args.n_prompt, n_gen=args.n_gen, depth=args.n_depth,
                     ctk=args.cache_type_k, ctv=args.cache_type_v, threads=args.threads,
                     reps=args.repetitions, kv_rotate=args.kv_rotate, compare_llamacpp=args.compare_llamacpp,
                     flash_attn=args.flash_attn, device=args.device, llama_bench=args.llama_bench,
                     rounds=args.rounds)
    if args.json:
        print(json.dumps(rows, indent=2, default=_json_default))
    else:
        print(format_markdown(rows))
        notes = format_notes(rows)
        if notes:
            print()
            print(notes)
    sys.stdout.flush()
    return 0


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(type(o).__name__)


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="prompt / generation tokens/s per KV type and depth (like llama-bench)",
        description="Prompt processing (pp) and generation (tg) speed per KV cache type and depth: median "
                    "tokens/s of -r repetitions. List options take comma lists; every combination is one "
                    "row. Depth d: the cache holds d tokens (untimed prefill) before pp (a prefill of -p "
                    "tokens) and before tg (-n single-token decodes).")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF path or registry name (default: the default model)")
    p.add_argument("-p", "--n-prompt", default="512", help="prompt tokens, comma list (default 512; 0 = skip pp)")
    p.add_argument("-n", "--n-gen", default="128", help="generated tokens, comma list (default 128; 0 = skip tg)")
    p.add_argument("-d", "--n-depth", default="0", help="tokens already in the cache, comma list (default 0)")
    p.add_argument("-ctk", "--cache-type-k", default="f16",
                   help="K cache types, comma list (default f16): f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 "
                        "iq4_nl fp8_e4m3 fp8_e5m2 int4 int2")
    p.add_argument("-ctv", "--cache-type-v", default=None,
                   help="V cache types, comma list (default: paired with -ctk, i.e. the same type as K; "
                        "given: every K x V combination)")
    p.add_argument("-t", "--threads", default=None, help="threads, comma list (default: all cores; auto: pykv's default, the cores other work leaves free)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="repetitions per test (default 3; median)")
    p.add_argument("--kv-rotate", choices=["on", "off", "auto"], default="auto",
                   help="pykv Hadamard rotation of K/V (auto: on for 4-bit and lower types)")
    p.add_argument("-fa", "--flash-attn", choices=["on", "off", "auto"], default="auto",
                   help="llama.cpp side only: flash attention (auto: on for a quantized V cache, best of on/off "
                        "for f16/bf16/f32 V)")
    p.add_argument("--compare-llamacpp", action="store_true",
                   help="also run the cells through llama-cpp-python and print pykv ÷ llama.cpp")
    p.add_argument("--llama-bench", metavar="PATH", default=None,
                   help="compare against this llama-bench binary (llama.cpp's own benchmark, e.g. built by "
                        "tools/build_llama_bench.py CLASS for pykv's ISA class) instead of llama-cpp-python; "
                        "implies --compare-llamacpp")
    p.add_argument("--rounds", type=int, default=1,
                   help="with a comparison: run pykv then llama.cpp this many times in turn (-r repetitions "
                        "each) and pool each side's samples, so that a noisy host's slow phases land on both "
                        "sides (default 1)")
    p.add_argument("--json", action="store_true", help="print a JSON list of cells instead of a markdown table")
    from pykv.cli.args import device_arg
    device_arg(p)
    p.set_defaults(func=cmd_bench)


def main(argv=None) -> int:
    """`python -m pykv.tools.bench ...`: the bench subcommand alone, with the CLI's error handling."""
    from pykv.cli import main as cli_main
    argv = list(sys.argv[1:] if argv is None else argv)
    return cli_main(argv if argv[:1] == ["bench"] else ["bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
