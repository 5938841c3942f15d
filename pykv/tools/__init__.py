"""Offline tools on model files: convert (Hugging Face -> GGUF), quantize, export (GGUF -> Hugging Face),
info, and the benchmark and compile helpers.  The names below are the model-file tools' API in one place."""
from pykv.tools.common import (FILE_TYPES, K_QUANT_TYPES, QUANT_TYPES, WEIGHT_TYPES, ConvertError, decode, encode,
                               gguf_metadata, parse_type, permute_qk, quantize_backend, unpermute_qk)
from pykv.tools.convert import RopeSpec, convert_hf, llama3_rope_factors, read_rope
from pykv.tools.export import export_hf, rope_from_gguf
from pykv.tools.info import info
from pykv.tools.quantize import parse_quant_type, quantize_gguf, quantize_plan

__all__ = ["FILE_TYPES", "K_QUANT_TYPES", "QUANT_TYPES", "WEIGHT_TYPES", "ConvertError", "decode", "encode",
           "gguf_metadata", "parse_type", "permute_qk", "quantize_backend", "unpermute_qk", "RopeSpec", "convert_hf",
           "llama3_rope_factors", "read_rope", "export_hf", "rope_from_gguf", "info", "parse_quant_type",
           "quantize_gguf", "quantize_plan"]
