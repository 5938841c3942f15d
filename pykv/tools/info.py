"""`pykv info`: a GGUF's architecture, tensors, types and what its KV cache costs per token."""
from __future__ import annotations
import numpy as np
from pykv.files.formats import KV_FORMATS, bytes_per_token
from pykv.tools.common import KV_INFO_TYPES, _field_value, _open_gguf, _tensor_shape, gguf_metadata


# ----------------------------------------------------------------------------
# info
# ----------------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def info(path) -> str:
    r = _open_gguf(path)
    md = gguf_metadata(r)
    lines = [f"file: {path}", f"GGUF version: {_field_value(r.fields['GGUF.version']) if 'GGUF.version' in r.fields else '?'}",
             "", "metadata:"]
    for k, v in md.items():
        if isinstance(v, list):
            head = ", ".join(repr(x) for x in v[:4])
            s = f"[{len(v)} items] {head}{', ...' if len(v) > 4 else ''}"
        elif isinstance(v, str) and (len(v) > 120 or "\n" in v):
            s = repr(v[:100]) + f"... ({len(v)} chars)"
        else:
            s = repr(v)
        lines.append(f"  {k} = {s}")
    lines += ["", "tensors:", f"  {'name':<28} {'type':<6} {'shape (rows x cols)':<20} {'bytes':>12}"]
    total_b = total_p = 0
    by_type: dict[str, int] = {}
    for t in r.tensors:
        shape = _tensor_shape(t)
        n = int(np.prod(shape))
        total_p += n
        total_b += int(t.n_bytes)
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + 1
        lines.append(f"  {t.name:<28} {t.tensor_type.name:<6} {'x'.join(map(str, shape)):<20} {int(t.n_bytes):>12}")
    lines += ["", f"totals: {len(r.tensors)} tensors, {total_p:,} parameters, {total_b:,} bytes "
                  f"({_fmt_bytes(total_b)}), {8 * total_b / max(total_p, 1):.2f} bits/weight",
              "  tensor types: " + ", ".join(f"{k}={v}" for k, v in sorted(by_type.items()))]
    arch = md.get("general.architecture", "llama")
    n_layer = md.get(f"{arch}.block_count")
    n_head = md.get(f"{arch}.attention.head_count")
    n_embd = md.get(f"{arch}.embedding_length")
    if n_layer and n_head and n_embd:
        n_kv = md.get(f"{arch}.attention.head_count_kv") or n_head
        kd = md.get(f"{arch}.attention.key_length") or n_embd // n_head
        vd = md.get(f"{arch}.attention.value_length") or n_embd // n_head
        n_ctx = md.get(f"{arch}.context_length")
        lines += ["", f"KV cache per token ({n_layer} layers x {n_kv} KV heads x (K {kd} + V {vd})):"]
        for kvt in KV_INFO_TYPES:
            try:
                per_tok = bytes_per_token(kvt, kvt, n_layer, n_kv, kd, head_dim_v=vd)
            except ValueError:          # head size not a whole number of blocks: the table's nominal rate
                per_tok = n_layer * n_kv * (kd + vd) * KV_FORMATS[kvt].bits / 8
            extra = f"   ({_fmt_bytes(per_tok * n_ctx)} at n_ctx={n_ctx})" if n_ctx else ""
            bits = 8 * per_tok / (n_layer * n_kv * (kd + vd))
            lines.append(f"  {kvt:<9} {per_tok:>10.1f} bytes  {bits:5.2f} bits/value{extra}")
        lines.append("  (klt types hold keys only: their rows count the values in the nl type of the same bits;"
                     " int4 / int2 add their f16 window of the newest tokens)")
    return "\n".join(lines)
