"""pykv: GGUF LLaMA inference in Python + Numba with a quantized block-format KV cache."""
__version__ = "0.1.0"

from .config import Config, PykvError  # noqa: E402


def load(path=None, *, n_ctx=2048, kv_type_k="f16", kv_type_v="f16", threads=None, **kw):
    """Load a GGUF LLaMA model (path=None: the default SmolLM2-135M-Instruct Q4_1, fetched on first use).
    Keywords of pykv.model.Model: kv_rotate, page_tokens, n_batch, kv_budget, kv_smooth, q8_act, max_seqs,
    device ("cpu" | "cuda"). kv_bits=4.5: per-layer K/V types chosen to minimise measured KL at that many
    bits per stored value (kv_calib: a calibration text file, default built-in); kv_plan=FILE: the types
    from a saved plan."""
    from .kv_plan import load_planned as _load
    return _load(path, n_ctx=n_ctx, kv_type_k=kv_type_k, kv_type_v=kv_type_v, threads=threads, **kw)


def __getattr__(name):
    if name == "Session":           # pykv.Session, imported on first use (keeps `import pykv` light)
        from .session import Session
        return Session
    raise AttributeError(f"module 'pykv' has no attribute {name!r}")


__all__ = ["load", "Config", "PykvError", "Session", "__version__"]
