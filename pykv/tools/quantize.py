"""`pykv quantize`: a GGUF re-quantized to another type or llama-quantize mix (K-quants byte-identical with llama-quantize)."""
from __future__ import annotations
from pathlib import Path
import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from pykv.tools.common import ConvertError, WEIGHT_TYPES, _PlannedTensor, _check_out, _copy_field, _field_value, _keeps_f32, _open_gguf, _tensor_shape, _write_gguf, decode, encode, parse_type


# ----------------------------------------------------------------------------
# quantize GGUF -> GGUF
# ----------------------------------------------------------------------------

def parse_quant_type(name: str) -> str:
    """A `pykv quantize` target: a plain type (every weight in it) or a llama-quantize mix name."""
    from pykv.tools.quant_plan import MIXES
    n = str(name).strip().lower()
    if n not in MIXES:
        raise ConvertError(f"unsupported type {name!r} (choose from {', '.join(MIXES)})")
    return n


def quantize_plan(r: gguf.GGUFReader, qtype: str, output_type=None, token_embedding_type=None) -> dict[str, QT]:
    """{tensor name: ggml type} that `pykv quantize` writes (llama-quantize's choice for a mix)."""
    from pykv.tools.quant_plan import MIXES, plan_types
    mix = MIXES[parse_quant_type(qtype)]
    otype = WEIGHT_TYPES[parse_type(output_type, "--output-type")] if output_type else None
    etype = WEIGHT_TYPES[parse_type(token_embedding_type, "--token-embedding-type")] if token_embedding_type else None
    arch = _field_value(r.fields["general.architecture"]) if "general.architecture" in r.fields else "?"
    f = r.fields.get(f"{arch}.block_count")
    n_layer = int(_field_value(f)) if f is not None else 0
    weights = [(rt.name, _tensor_shape(rt)) for rt in r.tensors
               if not _keeps_f32(rt.name, len(_tensor_shape(rt)))]
    plan = {rt.name: QT.F32 for rt in r.tensors}
    plan.update(zip([n for n, _ in weights], plan_types(weights, mix, n_layer, otype, etype)))
    return plan


def quantize_gguf(in_path, out_path, qtype, output_type=None, token_embedding_type=None,
                  force: bool = False, progress=None, imatrix=None) -> Path:
    """Requantize a llama GGUF to a plain type or a llama-quantize mix (see pykv.tools.quant_plan);
    imatrix: a llama-imatrix file whose per-column weights steer the K / q4_0..q5_1 quantizers."""
    from pykv.tools.quant_plan import MIXES, ImatrixError, imatrix_for, read_imatrix
    in_path, out_path = Path(in_path), Path(out_path)
    qtype = parse_quant_type(qtype)
    _check_out(out_path, force, [in_path] + ([imatrix] if imatrix else []))
    r = _open_gguf(in_path)
    arch = _field_value(r.fields["general.architecture"]) if "general.architecture" in r.fields else "?"
    if arch != "llama":
        raise ConvertError(f"unsupported architecture {arch!r} (only llama)")
    plan = quantize_plan(r, qtype, output_type, token_embedding_type)
    try:
        imat = read_imatrix(imatrix) if imatrix is not None else None
        qws = {rt.name: imatrix_for(imat, rt.name, _tensor_shape(rt)[-1]) for rt in r.tensors
               if plan[rt.name] != QT.F32}
    except ImatrixError as e:
        raise ConvertError(str(e)) from None
    if imat is not None and not any(w is not None for w in qws.values()):
        raise ConvertError(f"imatrix {imatrix} has no entry for any tensor of {in_path.name}")

    planned: list[_PlannedTensor] = []
    for rt in r.tensors:
        shape = _tensor_shape(rt)
        want = plan[rt.name]
        src = rt.tensor_type

        def produce(rt=rt, src=src, want=want, shape=shape, qw=qws.get(rt.name)):
            if src == want:
                return np.ascontiguousarray(rt.data)
            return encode(decode(rt.data, src).reshape(shape), want, qw=qw)
        planned.append(_PlannedTensor(rt.name, shape, want, produce))

    def setup(w: gguf.GGUFWriter) -> None:
        for key, f in r.fields.items():
            if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type",
                                                   "general.quantization_version"):
                continue
            if key == "general.alignment":
                continue
            _copy_field(w, key, f)
            if key == f"{arch}.rope.dimension_count":
                pass
        w.add_file_type(int(MIXES[qtype].file_type))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    return _write_gguf(out_path, setup, arch, planned, force, progress, "quantize")
