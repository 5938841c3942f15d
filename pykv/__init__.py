"""pykv: GGUF LLaMA inference in Python + Numba with a quantized block-format KV cache."""
__version__ = "0.1.0"

from pykv.files.config import Config, PykvError  # noqa: E402


def load(path=None, *, n_ctx=2048, kv_type_k="f16", kv_type_v="f16", threads=None, **kw):
    """Load a GGUF LLaMA model (path=None: the default SmolLM2-135M-Instruct Q4_1, fetched on first use).
    Keywords of pykv.api.model.Model: kv_rotate, page_tokens, n_batch, kv_budget, kv_smooth, q8_act, max_seqs,
    device ("cpu" | "cuda"). kv_bits=4.5: per-layer K/V types chosen to minimise measured KL at that many
    bits per stored value (kv_calib: a calibration text file, default built-in); kv_plan=FILE: the types
    from a saved plan."""
    from pykv.api.kv_plan import load_planned as _load
    return _load(path, n_ctx=n_ctx, kv_type_k=kv_type_k, kv_type_v=kv_type_v, threads=threads, **kw)


# module paths before the package was split into layers (cli, tools, api, decoder, kv, kernels, files):
# importing one still works, with a DeprecationWarning, and gives the module that holds its code now
_MOVED = {
    "pykv.config": "pykv.files.config", "pykv.formats": "pykv.files.formats", "pykv.gguf_io": "pykv.files.gguf_io",
    "pykv.validate": "pykv.files.validate", "pykv.tokenizer": "pykv.files.tokenizer", "pykv.hf": "pykv.files.hf",
    "pykv.kv_cache": "pykv.kv.cache", "pykv.kv_transform": "pykv.kv.transform",
    "pykv.sampler": "pykv.decoder.sampler", "pykv.threads": "pykv.decoder.threads", "pykv.model": "pykv.api.model",
    "pykv.generate": "pykv.api.generate", "pykv.session": "pykv.api.session", "pykv.chat": "pykv.api.chat",
    "pykv.evaluate": "pykv.api.evaluate", "pykv.kv_plan": "pykv.api.kv_plan", "pykv.bench": "pykv.tools.bench",
    "pykv.convert": "pykv.tools", "pykv.quant_plan": "pykv.tools.quant_plan", "pykv.warm": "pykv.tools.warm",
}


class _MovedFinder:
    """sys.meta_path finder for the _MOVED names: the old name is an alias of the new module."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        new = _MOVED.get(name)
        if new is None:
            return None
        import importlib.util
        import warnings
        warnings.warn(f"{name} is deprecated: import {new}", DeprecationWarning, stacklevel=3)
        return importlib.util.spec_from_loader(name, _MovedFinder)

    @staticmethod
    def create_module(spec):
        import importlib
        return importlib.import_module(_MOVED[spec.name])

    @staticmethod
    def exec_module(module):
        pass


import sys as _sys  # noqa: E402
if _MovedFinder not in _sys.meta_path:
    _sys.meta_path.append(_MovedFinder)


def __getattr__(name):
    if name == "Session":           # pykv.Session, imported on first use (keeps `import pykv` light)
        from pykv.api.session import Session
        return Session
    raise AttributeError(f"module 'pykv' has no attribute {name!r}")


__all__ = ["load", "Config", "PykvError", "Session", "__version__"]
