"""`pykv export`: a GGUF back to a Hugging Face directory (safetensors, tokenizer files, config)."""
from __future__ import annotations
import math
import os
from pathlib import Path
from typing import Any, Callable
import numpy as np
from pykv.files import hf
from pykv.tools.common import ConvertError, _Bar, _LAYER_MAP, _LAYER_REQUIRED, _open_gguf, _same_file, _tensor_f32, _tensor_shape, _test_pause, _tmp_path, _want_progress, gguf_metadata, gguf_to_hf_name, unpermute_qk
from pykv.tools.convert import RopeSpec, _TT, llama3_rope_factors


# ----------------------------------------------------------------------------
# export GGUF -> HF
# ----------------------------------------------------------------------------

def _tokenizer_files(md: dict, n_vocab: int) -> dict[str, Any]:
    """Build HF tokenizer files from GGUF tokenizer metadata. Returns {filename: json-obj|bytes}."""
    model = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ConvertError("GGUF has no tokenizer.ggml.tokens")
    tokens = [t if isinstance(t, str) else t.decode("utf-8", "replace") for t in tokens]
    types = md.get("tokenizer.ggml.token_type") or [int(_TT.NORMAL)] * len(tokens)
    ids = {k: md.get(f"tokenizer.ggml.{key}_token_id")
           for k, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    add_bos = md.get("tokenizer.ggml.add_bos_token")
    add_eos = md.get("tokenizer.ggml.add_eos_token")
    add_space = md.get("tokenizer.ggml.add_space_prefix")
    files: dict[str, Any] = {}

    special_ids = {i for i, t in enumerate(types) if t == _TT.CONTROL}
    special_ids |= {v for v in ids.values() if v is not None and 0 <= v < len(tokens)}
    user_ids = {i for i, t in enumerate(types) if t == _TT.USER_DEFINED}

    def added_entry(i: int) -> dict:
        return {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": i not in special_ids, "special": i in special_ids}

    added_ids = sorted(special_ids | user_ids)
    tcfg: dict[str, Any] = {
        "added_tokens_decoder": {str(i): {k: v for k, v in added_entry(i).items() if k != "id"}
                                 for i in added_ids},
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get("llama.context_length") or 2048),
    }
    for k in ("bos", "eos", "unk", "pad"):
        if ids[k] is not None and 0 <= ids[k] < len(tokens):
            tcfg[f"{k}_token"] = tokens[ids[k]]
    if add_bos is not None:
        tcfg["add_bos_token"] = bool(add_bos)
    if add_eos is not None:
        tcfg["add_eos_token"] = bool(add_eos)
    if add_space is not None:
        tcfg["add_prefix_space"] = bool(add_space)
    if md.get("tokenizer.chat_template"):
        tcfg["chat_template"] = md["tokenizer.chat_template"]

    if model == "gpt2":
        merges = md.get("tokenizer.ggml.merges") or []
        merges = [m if isinstance(m, str) else m.decode("utf-8", "replace") for m in merges]
        added_set = set(added_ids)
        vocab = {}
        for i, t in enumerate(tokens):
            if i in added_set or types[i] == _TT.UNUSED and t == f"[PAD{i}]":
                continue
            vocab.setdefault(t, i)
        pre = md.get("tokenizer.ggml.pre") or "default"
        if add_bos and ids["bos"] is not None:
            bos = tokens[ids["bos"]]
            post = {"type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                             {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                    "special_tokens": {bos: {"id": bos, "ids": [ids["bos"]], "tokens": [bos]}}}
        else:
            post = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
        files["tokenizer.json"] = {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [added_entry(i) for i in added_ids],
            "normalizer": None,
            "pre_tokenizer": hf.pre_tokenizer_for(pre),
            "post_processor": post,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": merges},
        }
        tcfg["tokenizer_class"] = "GPT2Tokenizer"
        if add_space is None:
            tcfg["add_prefix_space"] = False
    elif model == "llama":
        scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        pieces = []
        for i, t in enumerate(tokens):
            typ = int(types[i]) if i < len(types) else 1
            if typ not in (1, 2, 3, 4, 5, 6):
                typ = 1
            pieces.append((t.encode("utf-8"), float(scores[i]), typ))
        has_bytes = any(p[2] == _TT.BYTE for p in pieces)

        def sid(k, default):
            v = ids[k]
            return int(v) if v is not None else default
        unk = sid("unk", 0)
        if not (0 <= unk < len(pieces)) or pieces[unk][2] != _TT.UNKNOWN:
            unk = next((i for i, p in enumerate(pieces) if p[2] == _TT.UNKNOWN), 0)
        files["tokenizer.model"] = hf.build_spm_model(
            pieces, model_type=2, unk_id=unk, bos_id=sid("bos", -1), eos_id=sid("eos", -1),
            pad_id=sid("pad", -1), add_dummy_prefix=True if add_space is None else bool(add_space),
            byte_fallback=has_bytes)
        tcfg["tokenizer_class"] = "LlamaTokenizer"
        tcfg["legacy"] = True
        # every token, CONTROL/USER_DEFINED ones included, is a piece of tokenizer.model itself;
        # listing them again as added tokens would change their scores on a re-convert
        tcfg.pop("added_tokens_decoder")
        tcfg.pop("add_prefix_space", None)
        if add_bos is None:
            tcfg["add_bos_token"] = True
    else:
        raise ConvertError(f"unsupported tokenizer model {model!r}")
    files["tokenizer_config.json"] = tcfg
    stm = {f"{k}_token": tcfg[f"{k}_token"] for k in ("bos", "eos", "unk", "pad") if f"{k}_token" in tcfg}
    files["special_tokens_map.json"] = stm
    return files


def _f32_repr(v: float) -> float:
    """Shortest decimal that reads back as the same float32 (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(v)))


def rope_from_gguf(md: dict, freqs: np.ndarray | None, n_rot: int) -> RopeSpec:
    """The HF RoPE section of a GGUF: metadata as llama.cpp reads it; Llama 3's parameters recovered from
    rope_freqs.weight (only the ratios original_max_position_embeddings / low_freq_factor and / high_freq_factor
    are fixed by the factors: low_freq_factor is taken as 1), accepted only if they regenerate the tensor exactly."""
    theta = _f32_repr(md.get("llama.rope.freq_base", 10000.0))
    scaling = md.get("llama.rope.scaling.type", "linear")
    factor = _f32_repr(md.get("llama.rope.scaling.factor") or 1.0)
    if scaling not in ("none", "linear", "yarn"):
        raise ConvertError(f"cannot export RoPE scaling type {scaling!r} (none, linear, yarn)")
    if freqs is not None:
        if scaling != "none" and factor != 1.0:
            raise ConvertError(f"cannot export rope_freqs.weight together with {scaling} scaling")
        return _fit_llama3(np.asarray(freqs, np.float32), theta, n_rot)
    if scaling == "yarn":
        def opt(k):
            v = md.get(f"llama.rope.scaling.{k}")
            return None if v is None else _f32_repr(v)
        orig = md.get("llama.rope.scaling.original_context_length") or md.get("llama.context_length")
        if not orig:
            raise ConvertError("GGUF lacks llama.rope.scaling.original_context_length for YaRN")
        return RopeSpec("yarn", theta, factor, int(orig), beta_fast=opt("yarn_beta_fast"),
                        beta_slow=opt("yarn_beta_slow"), attn_factor=opt("yarn_attn_factor"))
    if scaling == "linear" and factor != 1.0:
        return RopeSpec("linear", theta, factor)
    return RopeSpec("default", theta)


def _fit_llama3(ff: np.ndarray, theta: float, n_rot: int) -> RopeSpec:
    # rope_freqs = 1 (short wavelengths), factor (long), and 1 / ((1 - s) / factor + s) between, where
    # s = (orig / wavelen - low) / (high - low) is linear in 1 / wavelen: two points of that band fix it
    if ff.shape != (n_rot // 2,):
        raise ConvertError(f"rope_freqs.weight has {ff.size} factors, expected {n_rot // 2}")
    fail = "cannot recover llama3 rope parameters from rope_freqs.weight"
    factor = float(ff[-1])
    band = (ff != 1.0) & (ff != ff[-1])
    if factor <= 1.0 or band.sum() < 2:
        raise ConvertError(f"{fail} (needs factors 1, a smoothing band of >= 2 pairs, then the factor)")
    inv_wl = 1.0 / (2 * math.pi * theta ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot))
    s = (1.0 / ff[band].astype(np.float64) - 1.0 / factor) / (1.0 - 1.0 / factor)
    P, Q = np.polyfit(inv_wl[band], s, 1)      # s = P / wavelen - Q, P = orig / (high - low), Q = low / (high - low)
    P, Q = float(P), -float(Q)
    if not (P > 0 and Q > 0):
        raise ConvertError(f"{fail} (the smoothing band does not fit)")
    orig, high = P / Q, 1.0 + 1.0 / Q
    spec = RopeSpec("llama3", theta, _f32_repr(factor), int(round(orig)), 1.0, float(f"{high:.6g}"))
    if not np.array_equal(llama3_rope_factors(spec, n_rot), ff):
        raise ConvertError(f"{fail} (the best fit, {spec.hf_params()}, does not reproduce it exactly)")
    return spec


def export_hf(in_path, out_dir, dtype: str = "f16", force: bool = False, progress=None) -> Path:
    in_path, out_dir = Path(in_path), Path(out_dir)
    dtype = str(dtype).lower()
    if dtype not in ("f16", "f32", "bf16"):
        raise ConvertError(f"unsupported export dtype {dtype!r} (f16, f32 or bf16)")
    r = _open_gguf(in_path)
    md = gguf_metadata(r)
    arch = md.get("general.architecture")
    if arch != "llama":
        raise ConvertError(f"unsupported architecture {arch!r} (only llama)")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConvertError(f"output exists and is not a folder: {out_dir}")

    def need(k):
        if f"llama.{k}" not in md:
            raise ConvertError(f"GGUF lacks llama.{k}")
        return md[f"llama.{k}"]
    n_layer = int(need("block_count"))
    n_embd = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    n_head_kv = int(md.get("llama.attention.head_count_kv") or n_head)
    head_dim = int(md.get("llama.attention.key_length") or n_embd // n_head)
    names = {t.name: t for t in r.tensors}
    if "token_embd.weight" not in names:
        raise ConvertError("missing tensor token_embd.weight")
    n_vocab = _tensor_shape(names["token_embd.weight"])[0]
    tied = "output.weight" not in names
    unknown = [n for n in names if gguf_to_hf_name(n) is None and n != "rope_freqs.weight"]
    if unknown:
        raise ConvertError(f"unexpected tensor {unknown[0]!r}")
    required = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{_LAYER_MAP[s]}" for i in range(n_layer) for s in _LAYER_REQUIRED]
    missing = [n for n in required if n not in names]
    if missing:
        raise ConvertError(f"missing tensor {missing[0]}")

    tok_files = _tokenizer_files(md, n_vocab)

    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": n_embd,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "max_position_embeddings": int(md.get("llama.context_length") or 2048),
        "rms_norm_eps": _f32_repr(md.get("llama.attention.layer_norm_rms_epsilon") or 1e-5),
        "vocab_size": n_vocab,
        "tie_word_embeddings": tied,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": {"f16": "float16", "f32": "float32", "bf16": "bfloat16"}[dtype],
    }
    if md.get("general.name"):
        cfg["_name_or_path"] = str(md["general.name"])
    if md.get("llama.attention.key_length") is not None or head_dim * n_head != n_embd:
        cfg["head_dim"] = head_dim
    freqs = _tensor_f32(names["rope_freqs.weight"]).reshape(-1) if "rope_freqs.weight" in names else None
    cfg["rope_parameters"] = rope_from_gguf(md, freqs, int(md.get("llama.rope.dimension_count") or head_dim)).hf_params()
    for k, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        v = md.get(f"tokenizer.ggml.{key}_token_id")
        if v is not None:
            cfg[f"{k}_token_id"] = int(v)

    # plan output files
    outputs = ["config.json", "model.safetensors", "generation_config.json"] + list(tok_files)
    for fn in outputs:
        if _same_file(out_dir / fn, in_path):
            raise ConvertError(f"output {out_dir / fn} is the input {in_path}: export to another folder")
        if (out_dir / fn).is_dir():
            raise ConvertError(f"output is a directory: {out_dir / fn}")
        if not force and (out_dir / fn).exists():
            raise ConvertError(f"output exists: {out_dir / fn} (use --force)")
    out_dir.mkdir(parents=True, exist_ok=True)

    np_dtype = {"f16": np.float16, "f32": np.float32, "bf16": np.uint16}[dtype]
    tensors: dict[str, np.ndarray] = {}
    st_dtypes: dict[str, str] = {}
    bar = _Bar(_want_progress(progress), sum(int(t.n_bytes) for t in r.tensors), "export")
    try:
        for rt in r.tensors:
            hname = gguf_to_hf_name(rt.name)
            bar.update(int(rt.n_bytes), rt.name)
            if hname is None:
                continue
            x = _tensor_f32(rt)
            if rt.name.endswith(("attn_q.weight", "attn_q.bias")):
                x = unpermute_qk(x, n_head)
            elif rt.name.endswith(("attn_k.weight", "attn_k.bias")):
                x = unpermute_qk(x, n_head_kv)
            if dtype == "bf16":
                tensors[hname] = hf.f32_to_bf16_bits(x)
                st_dtypes[hname] = "BF16"
            else:
                tensors[hname] = x.astype(np_dtype)
    finally:
        bar.close()

    def put(fn: str, writer: Callable[[Path], None]) -> None:
        tmp = _tmp_path(out_dir / fn)
        try:
            writer(tmp)
            _test_pause()
            os.replace(tmp, out_dir / fn)
        except BaseException:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
            raise

    def put_st(p: Path) -> None:
        hf.write_safetensors(p, tensors, {"format": "pt"}, st_dtypes)
        back = hf.SafetensorsFile(p)
        if sorted(back.keys()) != sorted(tensors) or any(
                back.shape(k) != tensors[k].shape for k in tensors):
            raise ConvertError("written model.safetensors does not read back")

    put("model.safetensors", put_st)
    put("config.json", lambda p: hf.write_json(p, cfg))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    put("generation_config.json", lambda p: hf.write_json(p, gen))
    for fn, content in tok_files.items():
        if isinstance(content, bytes):
            put(fn, lambda p, c=content: p.write_bytes(c))
        else:
            put(fn, lambda p, c=content: hf.write_json(p, c))
    return out_dir
