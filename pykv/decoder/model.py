"""The LLaMA decoder: weights (kept quantized, memory-mapped), run state, forward through the KV cache."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GT

from pykv.files.config import Config, ContextWarning, PykvError
from pykv.files.gguf_io import WEIGHT_TYPES, GGUFFile, open_model
from pykv.kernels import matmul as mm
from pykv.kernels.backend import Backend, get_backend
from pykv.kernels.ops import rope_tables
from pykv.kv.cache import N_SINK, KVCache, Sequence, _fmt_list
from pykv.decoder.threads import Threads, free_cores
from pykv.files.tokenizer import Tokenizer

NORM_TYPES = {GT.F32}
ROTATE_SEED = 0x5EED
# Rotation is on by default for every quantized KV type: with it the KL divergence to the f16-cache
# run measured lower for each of them (tools/kv_table.py --rotate flip; docs/kv-formats.md's KV table).


@dataclass
class LayerWeights:
    attn_norm: np.ndarray   # (D,) f32
    wq: mm.Weight           # (H*HD, D)
    wk: mm.Weight           # (KVH*HD, D)
    wv: mm.Weight           # (KVH*HD, D)
    wo: mm.Weight           # (D, H*HD)
    ffn_norm: np.ndarray    # (D,) f32
    w_gate: mm.Weight       # (FF, D)
    w_up: mm.Weight         # (FF, D)
    w_down: mm.Weight       # (D, FF)
    qkv: object = None      # (wq, wk, wv) and (w_gate, w_up) as the backend's matmul.fuse prepares them
    gate_up: object = None


@dataclass
class Weights:
    token_embd: mm.Weight   # (V, D)
    output_norm: np.ndarray  # (D,) f32
    output: mm.Weight       # (V, D): output.weight, or token_embd when tied
    layers: list
    rope_freqs: np.ndarray | None = None   # (n_rot/2,) f32 rope_freqs.weight: Llama 3's per-pair frequency divisors

    @classmethod
    def load(cls, gf: GGUFFile, cfg: Config, q8_act: bool = True, be: Backend | None = None) -> "Weights":
        """Every weight prepared (and uploaded) for backend be (default: the CPU).  A file of more than
        PROGRESS_BYTES shows a progress bar on a terminal, one line on stderr otherwise."""
        be = be or get_backend("cpu")
        D, FF, V, KV = cfg.dim, cfg.ff_dim, cfg.n_vocab, cfg.kv_dim
        bar = _load_progress(gf)

        def mat(name, rows, cols, repack=True):
            ti = gf.tensor(name, (cols, rows))
            if bar is not None:
                bar.update(ti.data.nbytes)
            if ti.ggml_type not in WEIGHT_TYPES:
                raise PykvError(f"tensor {name} has unsupported type {GT(ti.ggml_type).name}")
            try:
                w = be.matmul.prepare_weight(ti.ggml_type, ti.data, rows, cols, q8_act, repack)
            except ValueError as e:
                raise PykvError(f"tensor {name}: {e}") from None
            if getattr(w, "qt", None) is not None:     # repacked (the kernels read the copy): drop the file's pages
                gf.release(name)
            return w

        def vec(name):
            return be.to_device(np.ascontiguousarray(gf.tensor(name, (D,), NORM_TYPES).data, dtype=np.float32))

        layers = []
        for l in range(cfg.n_layers):
            p = f"blk.{l}."
            layers.append(LayerWeights(
                vec(p + "attn_norm.weight"), mat(p + "attn_q.weight", D, D), mat(p + "attn_k.weight", KV, D),
                mat(p + "attn_v.weight", KV, D), mat(p + "attn_output.weight", D, D), vec(p + "ffn_norm.weight"),
                mat(p + "ffn_gate.weight", FF, D), mat(p + "ffn_up.weight", FF, D), mat(p + "ffn_down.weight", D, FF)))
            lw = layers[-1]
            lw.qkv, lw.gate_up = be.matmul.fuse((lw.wq, lw.wk, lw.wv)), be.matmul.fuse((lw.w_gate, lw.w_up))
        tied = "output.weight" not in gf.tensors
        # token_embd is read by get_rows from the file's blocks; its tile copy is made only when it is also
        # the output matrix (tied), so no weight is held twice
        embd = mat("token_embd.weight", V, D, repack=tied)
        out = embd if tied else mat("output.weight", V, D)
        if bar is not None:
            bar.close()
        freqs = None
        if "rope_freqs.weight" in gf.tensors:
            freqs = np.array(gf.tensor("rope_freqs.weight", (cfg.rope_dims // 2,), NORM_TYPES).data, np.float32)
            if not (np.isfinite(freqs).all() and (freqs > 0).all()):
                raise PykvError("tensor rope_freqs.weight has non-positive or non-finite factors")
        return cls(embd, vec("output_norm.weight"), out, layers, freqs)

    def nbytes(self) -> int:
        seen, total = set(), self.output_norm.nbytes
        for w in [self.token_embd, self.output] + [getattr(l, f) for l in self.layers
                                                   for f in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]:
            if id(w) not in seen:
                seen.add(id(w))
                total += w.nbytes
        return total


PROGRESS_BYTES = 1 << 30
BIND_KEEP = 64      # bound products kept per batch size up to this (decode steps of up to this many sequences)


def _load_progress(gf: GGUFFile):
    """A tqdm bar over the file's bytes (a terminal) for a file over PROGRESS_BYTES, after one line on
    stderr when stderr is not a terminal; else None."""
    if gf.file_size <= PROGRESS_BYTES:
        return None
    import sys
    msg = f"pykv: loading {os.path.basename(gf.path)} ({gf.file_size / 1e9:.1f} GB)"
    if not sys.stderr.isatty():
        print(msg, file=sys.stderr, flush=True)
        return None
    from tqdm import tqdm
    return tqdm(total=gf.file_size, desc="pykv: loading", unit="B", unit_scale=True, file=sys.stderr, leave=False)


class RunState:
    """Every activation buffer, allocated once per model (never per token) where backend be's kernels
    run. B = max tokens per batch."""

    def __init__(self, cfg: Config, n_batch: int, n_chunks: int, be: Backend):
        B, D, FF, H, KVH, HD = n_batch, cfg.dim, cfg.ff_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        z = be.zeros
        self.x = z((B, D))            # residual stream
        self.h = z((B, D))            # normed input of a sub-block
        self.q = z((B, H * HD))
        self.k = z((B, KVH * HD))
        self.v = z((B, KVH * HD))
        self.att = z((B, H * HD))     # attention output (per head, concatenated)
        self.o = z((B, D))            # projection output added to x
        self.g = z((B, FF))
        self.u = z((B, FF))
        self.logits = z((B, cfg.n_vocab))
        self.act_d = be.matmul.Act(D, B)     # matmul activations, reused by Q/K/V, gate/up, head
        self.act_ff = be.matmul.Act(FF, B)
        G = H // KVH
        # attention partials: (T, KVH, C, G, HD + 2), sized for the larger of prefill (C=1) and decode
        self.part = z(max(B, n_chunks) * KVH * G * (HD + 2))
        self._shape = (H, KVH, HD)
        self._views = {}
        self._parts = {}

    def part_view(self, T: int, C: int) -> np.ndarray:
        """part's first T * KVH * C * G * (HD + 2) floats as (T, KVH, C, G, HD + 2) (kept: every layer of
        a batch asks for the same shape)."""
        key = (T, C)
        p = self._parts.get(key)
        if p is None:
            H, KVH, HD = self._shape
            G = H // KVH
            p = self._parts[key] = self.part[:T * KVH * C * G * (HD + 2)].reshape(T, KVH, C, G, HD + 2)
        return p

    def views(self, T: int) -> "Views":
        """The buffers' first T rows (made once per T: a decode step reuses them every layer)."""
        v = self._views.get(T)
        if v is None:
            v = self._views[T] = Views(self, T)
        return v


class Views:
    """RunState's rows for T tokens; q3, k3, v3, att3: q, k, v, att as (T, heads, HD)."""

    __slots__ = ("x", "q", "k", "v", "q3", "k3", "v3", "att3", "o", "g", "u")

    def __init__(self, st: RunState, T: int):
        H, KVH, HD = st._shape
        self.x, self.q, self.k, self.v, self.o, self.g, self.u = (a[:T] for a in (st.x, st.q, st.k, st.v, st.o,
                                                                                 st.g, st.u))
        self.q3, self.k3, self.v3 = self.q.reshape(T, H, HD), self.k.reshape(T, KVH, HD), self.v.reshape(T, KVH, HD)
        self.att3 = st.att[:T].reshape(T, H, HD)


class Decoder:
    """The LLaMA decoder: weights, run state, KV cache and the forward pass (prefill, decode, logits).
    The library's Model (pykv.api.model) adds text generation, sessions and chat on top."""

    def __init__(self, path=None, *, n_ctx: int = 2048, kv_type_k="f16", kv_type_v="f16", threads=None,
                 kv_rotate=None, page_tokens: int = 32, n_batch: int = 256, kv_budget=None, kv_smooth=True,
                 kv_prerope=None, q8_act: bool = True, max_seqs: int = 1, device: str = "cpu", kv_window: int = 0,
                 kv_sinks: int = N_SINK, kv_window_type: str = "f16"):
        """q8_act: activations quantized to 8-bit blocks for integer-dot weight kernels (llama.cpp's
        scheme; the fast path where the CPU has AVX-512 VNNI). False: float activations, slower but
        free of q8 rounding flips, which make two runs whose inputs differ by float rounding drift
        apart (f32 vs f16 KV cache: KL 0.0044 with q8 activations, 0.00000 without); `pykv perplexity`
        uses False to measure KV formats. max_seqs: the KV pool holds that many full contexts (shared by
        model.generate and every Session) unless kv_budget sets its size in bytes.
        device: "cpu" or "cuda" (numba.cuda: weights, run state and KV cache on the GPU; float activations);
        the backend (kernels.backend) is picked here, once.  kv_window: the newest tokens each query
        reads as f16 copies (quantized types; KVCache), kv_window_type "q8_0": as q8_0 copies (half the bytes);
        kv_sinks: the first tokens kept as f16 rows.  threads: CPU threads for each call (self.threads, set
        around the call on the calling thread); None: the cores other work leaves free, read per call
        (pykv.decoder.threads).  Results do not depend on it (docs/repeatability.md)."""
        self.be = get_backend(device)   # first: a missing GPU / extra fails before any model fetch
        self.device = self.be.name
        if path is None or not os.path.exists(path):   # the default model or a registry name
            from pykv.models import ModelFetchError, resolve_model
            try:
                path = resolve_model(None if path is None else os.fspath(path))
            except ModelFetchError as e:
                raise PykvError(str(e)) from None
        if threads is not None and threads < 1:
            raise PykvError(f"threads must be >= 1, got {threads}")
        # set around each call (pykv.decoder.threads.Threads): Numba keeps the count per calling thread
        self.threads = None if threads is None else int(threads)
        free_cores()        # starts the reading of other work's load (threads=None)
        self.path = os.fspath(path)
        self.gguf, self.config = open_model(self.path)
        cfg = self.config
        if n_ctx is None or n_ctx <= 0:
            n_ctx = cfg.n_ctx_train
        self.n_ctx = int(n_ctx)
        if self.n_ctx > cfg.n_ctx_train:
            warnings.warn(f"context size {self.n_ctx} is above the model's training context {cfg.n_ctx_train}: "
                          "quality may drop past it", ContextWarning, stacklevel=3)
        self.q8_act = bool(q8_act)
        self.weights = Weights.load(self.gguf, cfg, self.q8_act, self.be)
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        self._kv_opts = {"page_tokens": page_tokens, "kv_budget": kv_budget, "k_smooth": kv_smooth,
                         "k_prerope": kv_prerope, "max_seqs": max_seqs, "kv_window": kv_window, "kv_sinks": kv_sinks,
                         "kv_window_type": kv_window_type}
        self.n_batch = int(n_batch)
        self._bound = {}     # (layer, T) -> its products bound to the run state (_bound_calls)
        self.compile_helper = None   # pykv.tools.warm.Helper compiling the decode kernels elsewhere (a cold cache)
        self.max_chunks = 8 * self.be.max_workers + 2
        # a step of many sequences (step) runs up to n_batch prompt tokens beside max_seqs decode tokens
        self.step_rows = self.n_batch + (int(max_seqs) if max_seqs > 1 else 0)
        self.state = RunState(cfg, self.step_rows, self.max_chunks, self.be)
        cos, sin = rope_tables(self.n_ctx, cfg.rope_dims, cfg.rope_base, cfg.rope_freq_scale,
                                         self.weights.rope_freqs, cfg.yarn_ext_factor, cfg.yarn_attn_mul,
                                         cfg.yarn_beta_fast, cfg.yarn_beta_slow, cfg.rope_orig_ctx)
        self.cos, self.sin = self.be.to_device(cos), self.be.to_device(sin)
        self.q_mul = np.float32(1.0 / np.sqrt(cfg.head_dim))
        self.rot_sign = self.be.to_device(np.random.default_rng(ROTATE_SEED).choice(
            np.array([-1.0, 1.0], np.float32), cfg.head_dim).astype(np.float32))
        self.set_kv_types(kv_type_k, kv_type_v, kv_rotate)
        self.last_stats: dict = {}

    def set_kv_types(self, kv_type_k="f16", kv_type_v="f16", kv_rotate=None, kv_window=None, kv_sinks=None,
                     kv_window_type=None) -> None:
        """A fresh KV cache of these types (same context, pages, budget and key smoothing) and its
        rotation default; the weights stay loaded. The old cache's sequence is dropped. kv_window /
        kv_sinks: given, they replace the model's setting (kept for later calls)."""
        if kv_window is not None:
            self._kv_opts["kv_window"] = int(kv_window)
        if kv_sinks is not None:
            self._kv_opts["kv_sinks"] = int(kv_sinks)
        if kv_window_type is not None:
            self._kv_opts["kv_window_type"] = kv_window_type
        stats = None
        if any(f.kind == "klt" for f in _fmt_list(kv_type_k, self.config.n_layers, "cache-type-k")):
            # the klt key transform is calibrated on an f16 cache first
            from pykv.kv import transform as kv_transform
            stats = kv_transform.calib_stats(self)
        self.cache = KVCache(self.config, self.n_ctx, kv_type_k, kv_type_v, backend=self.be, **self._kv_opts)
        self.rotate = self._rotate_default(kv_rotate)
        self._chains = None    # the decode chains undo this cache's rotation (_decode_chains)
        self.cache.set_k_transform(self.cos, self.sin, self.rot_sign if self.rotate else None)
        if stats is not None:
            from pykv.kv import transform as kv_transform
            self.cache.set_key_xf(kv_transform.layer_maps(
                stats, [l.k_fmt for l in self.cache.layers],
                self.be.to_host(self.rot_sign) if self.rotate else None))
        self.seq: Sequence | None = None

    def _rotate_default(self, flag) -> bool:
        hd = self.config.head_dim
        if flag and hd & (hd - 1):
            raise PykvError(f"--kv-rotate needs a power-of-two head_dim (got {hd})")
        if flag is not None:
            return bool(flag)
        fmts = [l.k_fmt for l in self.cache.layers] + [l.v_fmt for l in self.cache.layers]
        return hd & (hd - 1) == 0 and any(f.kind != "float" for f in fmts)

    # ---- tokens ------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.config.n_vocab

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=True, parse_special=special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def kv_bytes_per_token(self) -> float:
        return self.cache.bytes_per_token()

    # ---- forward -----------------------------------------------------------------------------
    def _layer(self, li: int, segs, T: int, chains=None, fold=None, grp=None) -> None:
        """Layer li for the batch's T rows: segs lists (seq, r0, t, chunk), rows r0 .. r0 + t of the
        run state are seq's tokens at seq.n_tokens .. (one segment: a sequence's batch; many: a step of
        many sequences, _run), chunk: attention's keys per work item (_run picks it once for all layers).
        The products see all T rows at once (their rows do not depend on each other, so a sequence's
        bits do not depend on the batch); RoPE, the cache append and attention run per segment.
        grp (a KVCache.DecodeGroup): segs' first len(grp.pos) segments are one-token sequences whose RoPE,
        append and attention run batched, one call each for all of them (rows 0 .. S - 1).
        chains (a decode step's one-token rows, _decode_chains): chains[li] ran this layer's norm and
        Q/K/V products, and its attention where fold[li] (KVCache.fold_args, one token) is not None;
        chains[li + 1] runs everything after its attention (and the next layer's)."""
        cfg, st, lw, cache = self.config, self.state, self.weights.layers[li], self.cache
        ops = self.be.ops
        vw, ad, af = st.views(T), st.act_d, st.act_ff
        x, o = vw.x, vw.o
        if chains is not None and fold[li] is not None:     # attention ran in chains[li]
            chains[li + 1](fold[li + 1], T)
            return
        if chains is None:
            mq, mo, mgu, mdown = self._bound_calls(li, T, vw)
            if li == 0:
                ops.rmsnorm_act(x, lw.attn_norm, cfg.norm_eps, ad.x, ad.xf)
            else:   # the previous layer's FFN output is still in st.o: x += o and the norm in one call
                ops.add_rmsnorm_act(x, o, lw.attn_norm, cfg.norm_eps, ad.x, ad.xf)
            ad.mark(T)
            mq()                            # q, k, v = x @ (wq, wk, wv)
        S = 0
        if grp is not None:
            S = len(grp.pos)
            q3, k3, v3 = vw.q3[:S], vw.k3[:S], vw.v3[:S]
            cache.append_seqs(li, grp, k3, v3, (q3, self.cos, self.sin, cfg.rope_dims, self.rot_sign, self.rotate,
                                                self.q_mul))    # RoPE, smoothing, rotation first
            cache.attend_seqs(li, grp, q3, vw.att3[:S])
        for seq, r0, t, chunk in segs[S:]:
            self._attention(li, seq, vw, r0, t, chunk)
        if chains is not None:              # this layer's tail and the next layer's head, one region
            chains[li + 1](fold[li + 1], T)
            return
        att3 = vw.att3
        ops.attn_out_act(att3, self.rot_sign, self.rotate, ad.x, ad.xf)
        ad.mark(T)
        mo()                                # o = att @ wo
        ops.add_rmsnorm_act(x, o, lw.ffn_norm, cfg.norm_eps, ad.x, ad.xf)
        ad.mark(T)
        mgu()                               # g, u = x @ (w_gate, w_up)
        ops.swiglu_act(vw.g, vw.u, af.x, af.xf)
        af.mark(T)
        mdown()                             # o = swiglu @ w_down
        if li == cfg.n_layers - 1:
            ops.add_inplace(x, o)
        # else: the next layer's add_rmsnorm_act adds o to x

    def _attention(self, li: int, seq: Sequence, vw: Views, r0: int, t: int, chunk: int) -> None:
        """Layer li's RoPE, key smoothing, cache append and attention for seq's rows r0 .. r0 + t
        (its tokens at seq.n_tokens ..): att3's rows from q3, k3, v3's."""
        cfg, st, cache, ops = self.config, self.state, self.cache, self.be.ops
        q3, k3, v3 = vw.q3[r0:r0 + t], vw.k3[r0:r0 + t], vw.v3[r0:r0 + t]
        n_past = seq.n_tokens
        smooth = cache.k_smooth[li]
        if cache.k_pre[li]:      # keys stored before RoPE (attention ropes them): plain roped queries
            if n_past == 0:
                cache.smooth_stats(li, seq, k3, q3)
            qr = q3.copy()
            ops.qkv_prep(q3, k3, v3, n_past, self.cos, self.sin, cfg.rope_dims, False, seq.k_shift[li],
                         seq.k_scale[li], True, self.rot_sign, self.rotate, self.q_mul)
            ops.rope(qr, n_past, self.cos, self.sin, cfg.rope_dims)
            np.multiply(qr, self.q_mul, out=q3)
        else:
            do_rope = not (smooth and n_past == 0)
            if not do_rope:          # a sequence's first batch fixes the key smoothing from its roped keys
                ops.rope(q3, n_past, self.cos, self.sin, cfg.rope_dims)
                ops.rope(k3, n_past, self.cos, self.sin, cfg.rope_dims)
                cache.smooth_stats(li, seq, k3, q3)
            ops.qkv_prep(q3, k3, v3, n_past, self.cos, self.sin, cfg.rope_dims, do_rope, seq.k_shift[li],
                         seq.k_scale[li], smooth, self.rot_sign, self.rotate, self.q_mul)
            if cache.k_xf[li] is not None:     # klt keys: the calibrated transform (kv_transform)
                ops.key_xform(q3, k3, *cache.k_xf[li])
        cache.append(li, seq, k3, v3)
        part = st.part_view(t, -(-(n_past + t) // chunk))
        cache.attend(li, seq, q3, n_past, chunk, part, vw.att3[r0:r0 + t])

    def _bound_calls(self, li: int, T: int, vw: Views):
        """Layer li's four products (Q/K/V, output, gate/up, down) for T tokens as the backend's bound
        calls (matmul.bind): kept for T <= BIND_KEEP (decode steps), where their Python is a share of each token."""
        c = self._bound.get((li, T)) if T <= BIND_KEEP else None
        if c is None:
            lw, st, bind = self.weights.layers[li], self.state, self.be.matmul.bind
            c = (bind(lw.qkv, st.act_d, (vw.q, vw.k, vw.v), T), bind(lw.wo, st.act_d, vw.o, T),
                 bind(lw.gate_up, st.act_d, (vw.g, vw.u), T), bind(lw.w_down, st.act_ff, vw.o, T))
            if T <= BIND_KEEP:
                self._bound[(li, T)] = c
        return c

    def _decode_chains(self):
        """The backend's chains (kernels.chain) of a step of one-token rows (up to the backend's
        chain.MAX_ROWS, None: any), one per layer boundary: [0] the first layer's norm and Q/K/V, [l + 1]
        layer l after its attention and layer l + 1's head; None where the backend or a weight has none
        (each layer's calls then run one by one)."""
        ch = self._chains
        if ch is None:
            cfg, lws, st, bind = self.config, self.weights.layers, self.state, self.be.chain.bind
            rows = self.be.chain.MAX_ROWS or st.x.shape[0]
            L = cfg.n_layers
            ch = []
            for b in range(L + 1):
                t, h = (lws[b - 1] if b else None), (lws[b] if b < L else None)
                kv = self.cache.fold_static(b if b < L else 0, self.cos, self.sin, st.part, cfg.rope_dims,
                                            self.q_mul)           # layer b's attention (mode ATTN)
                c = bind(None if t is None else (t.wo, t.w_gate, t.w_up, t.w_down, t.ffn_norm),
                         None if h is None else (h.wq, h.wk, h.wv, h.attn_norm), st.views(rows), st.act_d,
                         st.act_ff, self.rot_sign, self.rotate, cfg.norm_eps, kv)
                if c is None:
                    ch = False
                    break
                ch.append(c)
            self._chains = ch
        return ch if ch and self.be.chain.enabled() else None

    def _batch(self, seq: Sequence, ids: np.ndarray, all_logits: bool, need_logits: bool = True):
        """Run T <= n_batch tokens at positions seq.n_tokens.. ; returns logits (T or 1, V) (a view),
        or None when need_logits is False."""
        return self._run([(seq, ids)], "all" if all_logits else ("last" if need_logits else None))

    def _run(self, work, rows):
        """One forward step over [(seq, ids), ...]: each sequence's ids at its positions seq.n_tokens..
        (T = all ids <= step_rows; a sequence appears once).  rows: "all" (logits of every row, one sequence), "last"
        (each sequence's last row, in work's order), None (no logits).  Returns logits (n, V), a view."""
        st, w = self.state, self.weights
        ops, mm = self.be.ops, self.be.matmul
        for seq, ids in work:
            self.cache.reserve(seq, len(ids))
        order = None
        grp = None
        n1 = sum(1 for _, i in work if len(i) == 1)
        if n1 > 1 or (n1 and self.be.name != "cpu"):
            # the one-token sequences first, batched (KVCache.decode_group) where they can be; on a GPU
            # also one alone: its RoPE, K / V appends and attention are then three launches a layer
            order = sorted(range(len(work)), key=lambda j: len(work[j][1]) != 1)
            work = [work[j] for j in order]
            grp = self.cache.decode_group([seq for seq, _ in work[:n1]], self.be.workers())
        ids = work[0][1] if len(work) == 1 else np.concatenate([np.asarray(i, np.int64) for _, i in work])
        T = len(ids)
        if T == len(work) and self.compile_helper is not None:    # it compiles this step's kernels: load them
            self.compile_helper.wait()
            self.compile_helper = None
        mm.get_rows(w.token_embd, ids, st.x[:T])
        workers, segs, r0 = self.be.workers(), [], 0
        for seq, i in work:
            segs.append((seq, r0, len(i), self.cache.chunk_for(seq.n_tokens + len(i), len(i), workers)))
            r0 += len(i)
        one_token_rows = (T == 1 or T == n1) and T <= (self.be.chain.MAX_ROWS or T)
        chains = self._decode_chains() if one_token_rows else None
        fold = None
        if chains is not None:
            if T == 1:
                fold = self.cache.fold_args(segs[0][0], segs[0][3]) + [None]    # [L]: the last chain has no next layer
            else:           # the decode group's attention runs between the chains (KVCache.append_seqs / attend_seqs)
                fold = [None] * (self.config.n_layers + 1)
            chains[0](fold[0], T)
        for li in range(self.config.n_layers):
            self._layer(li, segs, T, chains, fold, grp)
        for seq, _, t, _ in segs:
            seq.n_tokens += t
        if rows is None:
            return None
        if order is not None:     # back to the caller's order
            inv = np.argsort(order)
            segs = [segs[j] for j in inv]
            if T == len(work):
                rows = "last"
        if rows == "all" or (T == len(work) and order is None):
            return self._head(st.x[:T])
        last = [r + t - 1 for _, r, t, _ in segs]
        if len(last) == 1:
            return self._head(st.x[last[0]:last[0] + 1])
        x = np.ascontiguousarray(self.be.to_host(st.x[:T])[last])   # a mixed step's last rows, to the front
        rows = st.o[:len(last)]         # free after the last layer (its FFN output is in x)
        if self.be.name == "cpu":
            rows[...] = x
        else:
            rows.copy_to_device(x)
        return self._head(rows)

    def step(self, work) -> np.ndarray:
        """One forward step of many sequences (continuous batching): work is [(seq, ids), ...], a
        decode token or a prompt chunk per sequence, at most step_rows ids in all.  The weights are read
        once for the step.  Returns each sequence's last-token logits (len(work), V) on the host, equal
        bit for bit (q8 activations) to what the sequence's own _feed would give when each prompt
        chunk is the one _feed would run (chunk_limit tokens, or the rest)."""
        if not work:
            raise PykvError("step: no sequences")
        seen, total = set(), 0
        for seq, ids in work:
            if id(seq) in seen:
                raise PykvError("step: a sequence appears twice")
            seen.add(id(seq))
            ids = self._check_ids(seq, ids)
            lim = self.cache.kivi_batch_limit(seq.n_tokens)
            if lim is not None and len(ids) > lim:
                raise PykvError(f"step: a KIVI cache takes at most {lim} tokens here (chunk_limit)")
            total += len(ids)
        if total > self.step_rows:
            raise PykvError(f"step: {total} tokens exceed the step's rows {self.step_rows} (n_batch + max_seqs)")
        work = [(seq, np.asarray(ids, np.int64)) for seq, ids in work]
        # the logits are a view of the shared run state: copied before the next step can write it
        return self._guarded(lambda: self.be.to_host(self._run(work, "last")).copy())

    def _check_ids(self, seq: Sequence, ids) -> np.ndarray:
        """ids as int64 after the checks a kernel cannot make: non-empty, in the vocabulary, in the context."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise PykvError("expected a non-empty list of token ids")
        if ids.min() < 0 or ids.max() >= self.n_vocab:
            raise PykvError(f"token id out of range [0, {self.n_vocab})")
        if seq.n_tokens + len(ids) > self.n_ctx:
            raise PykvError(f"{seq.n_tokens + len(ids)} tokens exceed the context size {self.n_ctx} (use -c)")
        return ids

    def _guarded(self, run):
        """run() with the model's thread count; a Numba division by a sum of NaN/inf activations becomes
        a one-line PykvError."""
        try:
            with Threads(self.threads):
                return run()
        except ZeroDivisionError:
            raise PykvError(f"{self.path}: the forward pass overflowed to inf/NaN (weights too large "
                            "for float32 activations)") from None

    def chunk_limit(self, seq: Sequence) -> int:
        """The most prompt tokens seq may take in one step: n_batch, and with a KIVI cache the rest of
        its page (kivi_batch_limit), as _feed cuts a prompt, so a chunked prompt gets the same bits."""
        lim = self.cache.kivi_batch_limit(seq.n_tokens)
        return self.n_batch if lim is None else min(self.n_batch, lim)

    def _head(self, rows):
        """Logits (n, V) of residual rows (n, D) of the run state: the final norm, then the output product."""
        st, n = self.state, rows.shape[0]
        self.be.ops.rmsnorm(rows, self.weights.output_norm, self.config.norm_eps, st.h[:n])
        st.act_d.set(st.h[:n])
        self.be.matmul.matmul(self.weights.output, st.act_d, st.logits[:n])
        return st.logits[:n]

    def eval(self, seq: Sequence, ids, all_logits: bool = False, progress=None) -> np.ndarray:
        """Feed ids through the cache of `seq`. Returns host logits (len(ids), V) or (1, V) for the last token."""
        if all_logits:
            out = np.zeros((len(ids), self.n_vocab), np.float32)
            self._feed(seq, ids, out, progress)
            return out
        return self.be.to_host(self._feed(seq, ids, None, progress)).reshape(1, self.n_vocab).copy()

    def next_token(self, seq: Sequence, ids, sampler, history) -> int:
        """Feed ids, then one token sampled from the last logits where they are (on a GPU only the id
        comes down): the backend's sampler.pick with the uniform draw of `sampler` (pykv.decoder.sampler.Sampler)."""
        with Threads(self.threads):
            row = self._feed(seq, ids, None, None)
            return int(self.be.sampler.pick(row, sampler, history, sampler.draw()))

    def _feed(self, seq: Sequence, ids, out, progress):
        """Run ids in batches; out (len(ids), V) host array: every token's logits copied there; None:
        returns the last token's logits (1, V), a view of the backend's run state."""
        ids = self._check_ids(seq, ids)
        return self._guarded(lambda: self._eval_batches(seq, ids, out, progress))

    def _eval_batches(self, seq: Sequence, ids: np.ndarray, out, progress):
        all_logits, last_row, s = out is not None, None, 0
        while s < len(ids):
            n = min(self.n_batch, len(ids) - s)
            lim = self.cache.kivi_batch_limit(seq.n_tokens)
            if lim is not None:
                n = min(n, lim)
            last = s + n == len(ids)
            part = self._batch(seq, ids[s:s + n], all_logits, need_logits=all_logits or last)
            if all_logits:
                out[s:s + n] = self.be.to_host(part)
            elif last:
                last_row = part[-1:]
            s += n
            if progress is not None:
                progress(s)
        return last_row

    def new_sequence(self) -> Sequence:
        if self.seq is not None:
            self.cache.free_sequence(self.seq)
        self.seq = self.cache.new_sequence()
        return self.seq

    def forward(self, ids) -> np.ndarray:
        """float32 logits (len(ids), n_vocab) of a fresh sequence, computed through its KV cache."""
        return self.eval(self.new_sequence(), ids, all_logits=True)
