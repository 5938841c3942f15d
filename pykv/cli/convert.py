"""`pykv convert`, `quantize`, `export` and `info`: their arguments and handlers."""
from __future__ import annotations
import sys
from typing import Any, Callable
from pykv.tools.common import WEIGHT_TYPES
from pykv.tools.convert import convert_hf
from pykv.tools.quantize import quantize_gguf
from pykv.tools.export import export_hf
from pykv.tools.info import info


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------

def _run(fn: Callable[[], Any]) -> int:
    """Run a subcommand; a ConvertError reaches pykv.cli.main, the one place that formats errors."""
    res = fn()
    if isinstance(res, str):
        print(res)
    return 0


def _cmd_convert(a) -> int:
    def go():
        p = convert_hf(a.hf_dir, a.out, outtype=a.outtype, force=a.force)
        print(f"wrote {p}", file=sys.stderr)
    return _run(go)


def _cmd_quantize(a) -> int:
    def go():
        p = quantize_gguf(a.input, a.out, a.type, output_type=a.output_type,
                          token_embedding_type=a.token_embedding_type, force=a.force, imatrix=a.imatrix)
        print(f"wrote {p}", file=sys.stderr)
    return _run(go)


def _cmd_export(a) -> int:
    def go():
        p = export_hf(a.input, a.out_dir, dtype=a.dtype, force=a.force)
        print(f"wrote {p}", file=sys.stderr)
    return _run(go)


def _cmd_info(a) -> int:
    return _run(lambda: info(a.model))


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("convert", help="convert a HF LLaMA checkpoint to GGUF",
                              description="Convert a HF LLaMA/Mistral checkpoint (config.json + safetensors + "
                                          "tokenizer) to GGUF, as llama.cpp's converter writes it.")
    p.add_argument("hf_dir", help="HF model folder")
    p.add_argument("out", help="output .gguf")
    p.add_argument("--outtype", default="f16", type=str.lower, choices=list(WEIGHT_TYPES),
                   help="type of the 2-D weights (default f16; norms stay f32)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.set_defaults(func=_cmd_convert)

    from pykv.tools.quant_plan import MIXES
    p = subparsers.add_parser("quantize", help="requantize the 2-D weights of a GGUF",
                              description="Requantize the 2-D weights of a GGUF model: a plain type (every "
                                          f"weight in it: {', '.join(n for n, m in MIXES.items() if m.pure)}) "
                                          "or a llama-quantize mix (q3_k_m, q4_k_s, q4_k_m, q5_k_m, q6_k), "
                                          "with llama.cpp's per-tensor choices and fallbacks.")
    p.add_argument("input", help="input .gguf")
    p.add_argument("out", help="output .gguf")
    p.add_argument("type", type=str.lower, choices=list(MIXES), help="target type or mix")
    p.add_argument("--imatrix", help="importance matrix written by llama-imatrix (GGUF or legacy .dat)")
    p.add_argument("--output-type", "--output-tensor-type", dest="output_type", type=str.lower,
                   choices=list(WEIGHT_TYPES), help="type for output.weight")
    p.add_argument("--token-embedding-type", dest="token_embedding_type", type=str.lower,
                   choices=list(WEIGHT_TYPES), help="type for token_embd.weight")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.set_defaults(func=_cmd_quantize)

    p = subparsers.add_parser("export", help="export a GGUF back to a HF folder",
                              description="Export a GGUF LLaMA model to HF format (config.json, "
                                          "model.safetensors, tokenizer files).")
    p.add_argument("input", help="input .gguf")
    p.add_argument("out_dir", help="output folder")
    p.add_argument("--dtype", default="f16", type=str.lower, choices=["f16", "f32", "bf16"],
                   help="safetensors dtype (default f16)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=_cmd_export)

    p = subparsers.add_parser("info", help="show GGUF metadata, tensors and KV cache sizes")
    p.add_argument("model", help=".gguf file")
    p.set_defaults(func=_cmd_info)
