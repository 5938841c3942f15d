"""Arguments the commands share (model, KV cache, sampling, device) and the model load from them."""
from __future__ import annotations
import argparse
from pykv.files.config import PykvError

KV_HELP = "KV cache type: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl fp8_e4m3 fp8_e5m2 int4 int2 nl4 nl3 nl2 nl3b nl2b tc3b tc2b tc1b, keys only: klt3 klt2"


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
    p.add_argument("--kv-window", type=int, default=None,
                   help="newest tokens each query reads as f16 copies (quantized types; default: none, "
                        "with --kv-bits the planner's choice)")
    p.add_argument("--kv-sinks", type=int, default=4, help="first tokens kept as f16 rows (quantized types)")
    p.add_argument("--kv-window-type", default=None, choices=["f16", "q8_0", "iq4_nl", "nl4"],
                   help="format of the --kv-window rows (q8_0: half the bytes, iq4_nl / nl4: a quarter; default f16, with --kv-bits "
                        "the planner's choice)")
    p.add_argument("--kv-bits", type=float, default=None,
                   help="pick per-layer K/V types minimising measured KL at this many bits per stored value")
    p.add_argument("--kv-calib", default=None, help="calibration text for --kv-bits (default: built-in)")
    p.add_argument("--kv-plan", default=None, help="per-layer K/V types from a plan JSON (--kv-plan-out)")
    p.add_argument("--kv-plan-out", default=None, help="save the chosen per-layer plan as JSON")
    p.add_argument("--verbose", action="store_true", help="print the KV plan's per-layer table")
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
    from pykv.api.kv_plan import load_planned
    if args.threads is not None and args.threads < 1:
        raise PykvError(f"-t/--threads must be >= 1, got {args.threads}")
    rot = {"on": True, "off": False, "auto": None}[args.kv_rotate]
    budget = parse_bytes(args.kv_budget) if args.kv_budget else None
    kw = dict(n_ctx=args.ctx_size, kv_type_k=_kv_types(args.cache_type_k), kv_type_v=_kv_types(args.cache_type_v),
              threads=args.threads, kv_rotate=rot, kv_prerope={"on": True, "off": False, "auto": None}[args.kv_prerope],
              kv_budget=budget, device=args.device, kv_bits=args.kv_bits, kv_plan=args.kv_plan,
              kv_calib=args.kv_calib, kv_plan_out=args.kv_plan_out, verbose=args.verbose, kv_window=args.kv_window,
              kv_sinks=args.kv_sinks, kv_window_type=args.kv_window_type, **kw)
    model = load_planned(model_path, **kw)
    if compile_helper:
        from pykv.tools.warm import start
        start(model, kw)
    return model
