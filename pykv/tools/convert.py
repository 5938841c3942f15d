"""`pykv convert`: a Hugging Face LLaMA directory (safetensors, tokenizer, config) to GGUF."""
from __future__ import annotations
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from pykv.files import hf
from pykv.tools.common import ConvertError, FILE_TYPES, SUPPORTED_ARCHS, WEIGHT_TYPES, _IGNORED, _LAYER_REQUIRED, _PlannedTensor, _can_use, _check_out, _keeps_f32, _write_gguf, encode, hf_to_gguf_name, parse_type, permute_qk


# ----------------------------------------------------------------------------
# tokenizer -> GGUF metadata (llama.cpp converter conventions)
# ----------------------------------------------------------------------------

_TT = gguf.TokenType


def _looks_special(tok: str) -> bool:
    if tok.startswith("<|") and tok.endswith("|>"):
        return True
    return tok in ("<s>", "</s>", "<pad>", "<unk>", "<mask>", "<cls>", "<sep>", "<eos>", "<bos>")


def _vocab_spm(hf_dir: Path, vocab_size: int | None):
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(hf_dir / "tokenizer.model"))
    n = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]".encode() for i in range(n)]
    scores = [-10000.0] * n
    types = [int(_TT.UNUSED)] * n
    for i in range(min(sp.vocab_size(), n)):
        t = _TT.NORMAL
        if sp.IsUnknown(i):
            t = _TT.UNKNOWN
        elif sp.IsControl(i):
            t = _TT.CONTROL
        elif sp.IsUnused(i):
            t = _TT.UNUSED
        elif sp.IsByte(i):
            t = _TT.BYTE
        tokens[i] = sp.IdToPiece(i).encode("utf-8")
        scores[i] = float(sp.GetScore(i))
        types[i] = int(t)
    added = hf_dir / "added_tokens.json"
    if added.is_file():
        for text, tid in hf.read_json(added).items():
            if 0 <= tid < n:
                tokens[tid], scores[tid], types[tid] = text.encode("utf-8"), -1000.0, int(_TT.USER_DEFINED)
    tc = hf_dir / "tokenizer_config.json"
    if tc.is_file():
        for sid, data in (hf.read_json(tc).get("added_tokens_decoder") or {}).items():
            tid = int(sid)
            if not 0 <= tid < n:
                continue
            text = data["content"]
            if data.get("special") or _looks_special(text):
                types[tid] = int(_TT.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types[tid] = int(_TT.USER_DEFINED)
            scores[tid] = -1000.0
            tokens[tid] = text.encode("utf-8")
    return tokens, scores, types


def _vocab_bpe(tok_json: dict, vocab_size: int | None):
    model = tok_json.get("model") or {}
    vocab: dict[str, int] = model.get("vocab") or {}
    added = tok_json.get("added_tokens") or []
    rev: dict[int, str] = {i: t for t, i in vocab.items()}
    added_special: dict[int, bool] = {}
    for a in added:
        rev[int(a["id"])] = a["content"]
        added_special[int(a["id"])] = bool(a.get("special"))
    n = vocab_size or (max(rev) + 1 if rev else 0)
    if rev and max(rev) >= n:
        raise ConvertError(f"tokenizer has token id {max(rev)} but vocab_size is {n}")
    tokens, types = [], []
    for i in range(n):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(int(_TT.UNUSED))
        elif i in added_special:
            tokens.append(rev[i])
            special = added_special[i] or _looks_special(rev[i])
            types.append(int(_TT.CONTROL if special else _TT.USER_DEFINED))
        else:
            tokens.append(rev[i])
            types.append(int(_TT.NORMAL))
    return tokens, types


def _add_vocab(w: gguf.GGUFWriter, hf_dir: Path, cfg: dict) -> None:
    vocab_size = cfg.get("vocab_size")
    tj_path = hf_dir / "tokenizer.json"
    if (hf_dir / "tokenizer.model").is_file():
        tokens, scores, types = _vocab_spm(hf_dir, vocab_size)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        gguf.SpecialVocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)
    elif tj_path.is_file():
        tj = hf.read_json(tj_path)
        mtype = (tj.get("model") or {}).get("type")
        if mtype != "BPE":
            raise ConvertError(f"unsupported tokenizer.json model type {mtype!r} (only BPE)")
        steps = [s.get("type") for s in hf._flatten_pre(tj.get("pre_tokenizer"))]
        if "ByteLevel" not in steps:
            raise ConvertError("unsupported tokenizer.json: BPE without ByteLevel pre-tokenizer "
                               "(SentencePiece-style tokenizers need tokenizer.model)")
        pre = hf.detect_bpe_pre(tj)
        if pre is None:
            print(f"warning: unrecognized BPE pre-tokenizer {steps}; writing tokenizer.ggml.pre=default",
                  file=sys.stderr)
            pre = "default"
        tokens, types = _vocab_bpe(tj, vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        sv = gguf.SpecialVocab(hf_dir, load_merges=True)
        if not sv.merges:
            raise ConvertError("tokenizer.json has no BPE merges")
        pp = tj.get("post_processor") or {}
        if any(p.get("type") == "ByteLevel" for p in pp.get("processors", [pp])):
            # a ByteLevel post-processor adds no BOS/EOS: newer gguf-py (llama.cpp's converter) says so
            sv.add_special_token.setdefault("bos", False)
            sv.add_special_token.setdefault("eos", False)
        sv.add_to_gguf(w, quiet=True)
    else:
        raise ConvertError(f"no tokenizer.json or tokenizer.model in {hf_dir}")
    tc = hf_dir / "tokenizer_config.json"
    if tc.is_file():
        tcj = hf.read_json(tc)
        if "add_prefix_space" in tcj and isinstance(tcj["add_prefix_space"], bool):
            w.add_add_space_prefix(tcj["add_prefix_space"])
    if vocab_size == 49152 and not any(gguf.Keys.Tokenizer.ADD_BOS in kv for kv in w.kv_data):
        w.add_add_bos_token(False)  # llama.cpp: granite/SmolLM small models never add BOS


# ----------------------------------------------------------------------------
# convert HF -> GGUF
# ----------------------------------------------------------------------------

ROPE_TYPES = ("default", "linear", "llama3", "yarn")   # what llama.cpp's converter maps for LLaMA


@dataclass(frozen=True)
class RopeSpec:
    """The RoPE section of a HF LLaMA config, read from either schema and checked."""
    type: str                    # default | linear | llama3 | yarn
    theta: float                 # rope_theta -> llama.rope.freq_base
    factor: float = 1.0          # linear, llama3, yarn: context extension factor
    orig_ctx: int = 0            # llama3, yarn: original_max_position_embeddings
    low_freq_factor: float = 0.0   # llama3
    high_freq_factor: float = 0.0  # llama3
    beta_fast: float | None = None   # yarn, when given
    beta_slow: float | None = None   # yarn, when given
    attn_factor: float | None = None  # yarn: attention_factor given, or from mscale / mscale_all_dim

    def hf_params(self) -> dict:
        """transformers 5's rope_parameters for this spec."""
        d: dict[str, Any] = {"rope_type": self.type, "rope_theta": self.theta}
        if self.type != "default":
            d["factor"] = self.factor
        if self.type in ("llama3", "yarn"):
            d["original_max_position_embeddings"] = self.orig_ctx
        if self.type == "llama3":
            d.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        for k, v in (("attention_factor", self.attn_factor), ("beta_fast", self.beta_fast),
                     ("beta_slow", self.beta_slow)):
            if v is not None:
                d[k] = v
        return d


def _num(where: str, v, integer: bool = False, positive: bool = True):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ConvertError(f"config.json: {where} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v) or (positive and v <= 0):
        raise ConvertError(f"config.json: {where} must be {'positive' if positive else 'finite'}, got {v!r}")
    return v


def read_rope(cfg: dict) -> RopeSpec:
    """RoPE of a config.json: transformers 4 (top-level rope_theta, rope_scaling with type/rope_type) or
    transformers 5 (rope_parameters with rope_theta and rope_type, possibly per layer type). Missing values
    default only where transformers' LlamaConfig does (rope_theta 10000 without any RoPE section;
    original_max_position_embeddings = max_position_embeddings for llama3 / yarn)."""
    rp, rs = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    if rp is not None and rs is not None and rp != rs:
        raise ConvertError("config.json: both rope_parameters and rope_scaling are set and differ")
    sec, src = (rp, "rope_parameters") if rp is not None else (rs, "rope_scaling")
    if sec is not None and not isinstance(sec, dict):
        raise ConvertError(f"config.json: {src} must be an object, got {sec!r}")
    sec = dict(sec or {})
    nested = [k for k in sec if k.endswith("_attention")]
    if nested:   # per layer type; every LLaMA layer is full attention
        if nested != ["full_attention"] or len(sec) != 1:
            raise ConvertError(f"config.json: {src} per layer type {sorted(sec)} is ambiguous for LLaMA "
                               "(only full_attention layers)")
        lt = cfg.get("layer_types")
        if lt is not None and (not isinstance(lt, list) or any(t != "full_attention" for t in lt)):
            raise ConvertError(f"config.json: layer_types {lt!r} is not all full_attention (LLaMA)")
        src += ".full_attention"
        sec = sec["full_attention"]
        if not isinstance(sec, dict):
            raise ConvertError(f"config.json: {src} must be an object, got {sec!r}")
    top_theta = cfg.get("rope_theta")
    if "rope_theta" in sec:
        theta = _num(f"{src}.rope_theta", sec["rope_theta"])
        if top_theta is not None and top_theta != theta:
            raise ConvertError(f"config.json: rope_theta {top_theta!r} differs from {src}.rope_theta {theta!r}")
    elif top_theta is not None:
        theta = _num("rope_theta", top_theta)
    elif src.startswith("rope_parameters"):
        raise ConvertError(f"config.json: {src} lacks rope_theta")
    else:
        theta = 10000.0   # transformers' LlamaConfig default_theta, for a config without any RoPE base
    t1, t2 = sec.get("rope_type"), sec.get("type")
    if t1 is not None and t2 is not None and t1 != t2:
        raise ConvertError(f"config.json: {src}.rope_type {t1!r} differs from {src}.type {t2!r}")
    typ = t1 if t1 is not None else t2 if t2 is not None else "default"
    if typ not in ROPE_TYPES:
        raise ConvertError(f"config.json: unsupported {src}.rope_type {typ!r} (supported: {', '.join(ROPE_TYPES)})")
    prf = sec.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if prf is not None and _num(f"{src}.partial_rotary_factor", prf) != 1:
        raise ConvertError(f"config.json: {src}.partial_rotary_factor {prf!r} is not supported (LLaMA rotates "
                           "the whole head)")
    if typ == "default":
        return RopeSpec("default", float(theta))

    def need(k, integer=False):
        if sec.get(k) is None:
            raise ConvertError(f"config.json: {src} of type {typ!r} lacks {k}")
        return _num(f"{src}.{k}", sec[k], integer)

    def opt(k):
        return None if sec.get(k) is None else float(_num(f"{src}.{k}", sec[k]))

    factor = float(need("factor"))
    if typ == "linear":
        return RopeSpec("linear", float(theta), factor)
    if sec.get("original_max_position_embeddings") is None:
        sec["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
    orig = int(need("original_max_position_embeddings", integer=True))
    if typ == "llama3":
        lo, hi = float(need("low_freq_factor")), float(need("high_freq_factor"))
        if hi <= lo:
            raise ConvertError(f"config.json: {src}.high_freq_factor {hi} must exceed low_freq_factor {lo}")
        return RopeSpec("llama3", float(theta), factor, orig, lo, hi)
    if sec.get("truncate", True) is not True:
        raise ConvertError(f"config.json: {src}.truncate must be true (GGUF YaRN always truncates the "
                           f"correction range), got {sec['truncate']!r}")
    attn = opt("attention_factor")
    ms, ms_all = opt("mscale"), opt("mscale_all_dim")
    if attn is None and ms and ms_all:   # transformers' _compute_yarn_parameters
        attn = _yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all)
    return RopeSpec("yarn", float(theta), factor, orig, beta_fast=opt("beta_fast"), beta_slow=opt("beta_slow"),
                    attn_factor=attn)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def llama3_rope_factors(rope: RopeSpec, n_rot: int) -> np.ndarray:
    """rope_freqs.weight (n_rot/2,) f32: the divisor of each pair's frequency, computed in float32 as
    llama.cpp's converter does (LlamaModel.generate_extra_tensors)."""
    f32 = np.float32
    # theta ** (2i / n_rot) correctly rounded to float32 (libm's double pow, scalar): numpy's float32 power
    # dispatches to SVML on AVX-512 hosts and differs there by an ulp from torch and from AVX2 hosts
    expo = np.arange(0, n_rot, 2, dtype=np.float32) / f32(n_rot)
    freqs = f32(1.0) / np.array([math.pow(float(f32(rope.theta)), float(x)) for x in expo]).astype(np.float32)
    wavelen = f32(2 * math.pi) / freqs
    lo_wl = f32(rope.orig_ctx / rope.low_freq_factor)
    hi_wl = f32(rope.orig_ctx / rope.high_freq_factor)
    smooth = (f32(rope.orig_ctx) / wavelen - f32(rope.low_freq_factor)) / f32(
        rope.high_freq_factor - rope.low_freq_factor)
    mid = f32(1) / ((f32(1) - smooth) / f32(rope.factor) + smooth)
    out = np.where(wavelen < hi_wl, f32(1), np.where(wavelen > lo_wl, f32(rope.factor), mid))
    return out.astype(np.float32)


def convert_hf(hf_dir, out_path, outtype: str = "f16", force: bool = False, progress=None) -> Path:
    hf_dir = Path(hf_dir)
    out_path = Path(out_path)
    outtype = parse_type(outtype, "--outtype")
    if not hf_dir.exists():
        raise ConvertError(f"HF model folder not found: {hf_dir}")
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir} is a file, expected a HF model folder")
    _check_out(out_path, force, [p for p in hf_dir.iterdir() if p.is_file()])
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"no config.json in {hf_dir}")
    cfg = hf.read_json(cfg_path)
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED_ARCHS:
        raise ConvertError(f"unsupported architecture {archs[0] if archs else cfg.get('model_type')!r} "
                           f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    try:
        n_layer = int(cfg["num_hidden_layers"])
        n_embd = int(cfg["hidden_size"])
        n_ff = int(cfg["intermediate_size"])
        n_head = int(cfg["num_attention_heads"])
    except KeyError as e:
        raise ConvertError(f"config.json lacks {e.args[0]}") from None
    n_head_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or n_embd // n_head)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
    rope = read_rope(cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))

    try:
        ckpt = hf.HFCheckpoint(hf_dir)
    except hf.SafetensorsError as e:
        raise ConvertError(str(e)) from None

    # map & validate tensor names
    gnames: dict[str, str] = {}
    for name in ckpt.names():
        if _IGNORED.match(name):
            continue
        g = hf_to_gguf_name(name)
        if g is None:
            raise ConvertError(f"unexpected tensor {name!r} (not a LLaMA tensor)")
        m = re.match(r"blk\.(\d+)\.", g)
        if m and int(m.group(1)) >= n_layer:
            raise ConvertError(f"tensor {name!r} beyond num_hidden_layers={n_layer}")
        gnames[name] = g
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    required += [f"model.layers.{i}.{s}" for i in range(n_layer) for s in _LAYER_REQUIRED]
    if not tied:
        required.append("lm_head.weight")
    missing = [n for n in required if n not in ckpt]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"missing tensor {missing[0]}{more}")
    if tied and "lm_head.weight" in gnames:
        del gnames["lm_head.weight"]
    for name in ckpt.names():
        if name in gnames and ckpt.dtype(name) not in ("F32", "F16", "BF16"):
            raise ConvertError(f"tensor {name}: unsupported dtype {ckpt.dtype(name)}")

    vocab_size = int(cfg.get("vocab_size") or ckpt.shape("model.embed_tokens.weight")[0])
    if ckpt.shape("model.embed_tokens.weight") != (vocab_size, n_embd):
        raise ConvertError(f"embed_tokens shape {ckpt.shape('model.embed_tokens.weight')} "
                           f"does not match vocab_size={vocab_size}, hidden_size={n_embd}")
    target = WEIGHT_TYPES[outtype]

    def order_key(item):
        g = item[1]
        m = re.match(r"blk\.(\d+)\.", g)
        if g == "token_embd.weight":
            return (0, 0, g)
        if m:
            return (1, int(m.group(1)), g)
        return (2, 0 if g == "output_norm.weight" else 1, g)

    planned: list[_PlannedTensor] = []
    if rope.type == "llama3":
        rope_factors = llama3_rope_factors(rope, head_dim)
        planned.append(_PlannedTensor("rope_freqs.weight", rope_factors.shape, QT.F32,
                                      (lambda a=rope_factors: a)))
    for hname, g in sorted(gnames.items(), key=order_key):
        shape = ckpt.shape(hname)
        if _keeps_f32(g, len(shape)):
            qt = QT.F32
        elif not _can_use(target, shape[-1]):
            qt = QT.F16
            print(f"warning: {g}: row length {shape[-1]} not a multiple of the {outtype} block, using f16",
                  file=sys.stderr)
        else:
            qt = target
        perm = None
        if hname.endswith(("q_proj.weight", "q_proj.bias")):
            perm = n_head
        elif hname.endswith(("k_proj.weight", "k_proj.bias")):
            perm = n_head_kv

        def produce(hname=hname, qt=qt, perm=perm):
            x = np.asarray(ckpt.get(hname), dtype=np.float32)
            if perm is not None:
                x = permute_qk(x, perm)
            return encode(x, qt)
        planned.append(_PlannedTensor(g, tuple(shape), qt, produce))

    def setup(w: gguf.GGUFWriter) -> None:
        w.add_type("model")
        name = str(cfg.get("_name_or_path") or "").rstrip("/").split("/")[-1] or hf_dir.resolve().name
        w.add_name(name)
        arch = "llama"
        w.add_block_count(n_layer)
        w.add_context_length(int(cfg.get("max_position_embeddings") or cfg.get("max_sequence_length") or 2048))
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_freq_base(rope.theta)
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
        if cfg.get("head_dim") is not None:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_file_type(int(FILE_TYPES[outtype]))
        w.add_vocab_size(vocab_size)
        w.add_rope_dimension_count(head_dim)
        if rope.type in ("linear", "yarn"):   # llama.cpp's TextModel.set_gguf_parameters
            w.add_rope_scaling_type(gguf.RopeScalingType(rope.type))
            w.add_rope_scaling_factor(rope.factor)
        if rope.type == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope.orig_ctx)
            if rope.attn_factor is not None:
                w.add_rope_scaling_yarn_attn_factor(rope.attn_factor)
            if rope.beta_fast is not None:
                w.add_rope_scaling_yarn_beta_fast(rope.beta_fast)
            if rope.beta_slow is not None:
                w.add_rope_scaling_yarn_beta_slow(rope.beta_slow)
        assert arch == w.arch
        _add_vocab(w, hf_dir, cfg)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    return _write_gguf(out_path, setup, "llama", planned, force, progress, "convert")
