"""Integer-dot weight tiles: one source for every ISA class.

A tile holds R rows of one weight, repacked at load so that each 32-bit lane of a vector holds 4
consecutive weight columns of one row (lanes = rows).  An activation group of 4 int8 columns (llama.cpp's
q8 activations) is broadcast to every lane, and one "dot" adds the 4 products to each row's int32 lane.
The ISA class changes only L (lanes: 16 on zmm, 8 otherwise) and how `_bdot` lowers that dot:

    avx512vnni  vpdpbusd zmm
    avxvnni     vpdpbusd ymm ({vex})
    avx2        vpmaddubsw (u8 x s8 -> i16 pair sums, added in i16 while they cannot saturate) and one
                vpmaddwd by ones, or by the row's sub-block scale (the K-quants' scale multiply is free)
    generic     zext / sext, mul, shuffles: plain LLVM vector IR that any target lowers (SSE, NEON ...)

The class is what Numba compiles for (its target CPU name and features), so NUMBA_CPU_NAME /
NUMBA_CPU_FEATURES overrides select it too (Numba's cache keys on both, so cached code matches).

Two tile families (layouts below, `repack_*` build them from ggml rows):
  * dot_tile_q4 / q5 / q40 / q50 / q8 / iq4: Q4_1, Q5_1, Q4_0, Q5_0, Q8_0, IQ4_NL against q8_0 activation blocks
    of 32 (TILE_ROWS rows).
  * dot_ktile (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): against q8_K activation blocks of 256 with int sums per 16
    (llama.cpp's q8_K), KTILE_ROWS = L rows: each row's dot equals llama.cpp's vec_dot_qX_K_q8_K.
Each has an nt-token form for prefill (_tile_dot(fmt, nt), _ktile_dot(fmt, nt); 2-D activations and
output): the formats in TOKEN_BLOCK unpack each weight vector once for the nt tokens, the others loop
over the tokens in IR.  Both give the one-token dot bit for bit.
"""
import subprocess
import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from pykv.kernels.blocks import KVALUES_IQ4NL
from pykv.kernels.simd import F32, I8, I16, I32, I64, _data, _fpext_half, _prefetch, _splat, _vec

ISA_CLASSES = ("generic", "avx2", "avxvnni", "avx512vnni")

# ----------------------------------------------------------------------------------------------------
# which ISA class Numba compiles for
# ----------------------------------------------------------------------------------------------------

_PROBE = """
import sys, llvmlite.binding as llvm, llvmlite.ir as ir
llvm.initialize_native_target(); llvm.initialize_native_asmprinter()
cpu, feats, name, n, nargs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
m = ir.Module(); m.triple = llvm.get_process_triple()
v = ir.VectorType(ir.IntType(32), n)
a = v if nargs == 3 else ir.VectorType(ir.IntType(16), 2 * n)
f = ir.Function(m, ir.FunctionType(v, [a] * nargs), "f")
b = ir.IRBuilder(f.append_basic_block())
b.ret(b.call(m.declare_intrinsic(name, fnty=ir.FunctionType(v, [a] * nargs)), f.args))
tm = llvm.Target.from_default_triple().create_target_machine(cpu=cpu, features=feats)
print(tm.emit_assembly(llvm.parse_assembly(str(m))))
"""

# class -> (the intrinsic its dot needs, int32 lanes, operands, the mnemonic the assembly must show)
_PROBES = (("avx512vnni", "llvm.x86.avx512.vpdpbusd.512", 16, 3, "vpdpbusd"),
           ("avxvnni", "llvm.x86.avx512.vpdpbusd.256", 8, 3, "vpdpbusd"),
           ("avx2", "llvm.x86.avx2.pmadd.wd", 8, 2, "vpmaddwd"))


def _probe(cpu: str, feats: str) -> str:
    """The best class LLVM compiles for (cpu, feats): each candidate's intrinsic in a subprocess (a
    target that lacks it aborts LLVM: 'Cannot select')."""
    for cls, name, n, nargs, mnem in _PROBES:
        try:
            r = subprocess.run([sys.executable, "-c", _PROBE, cpu, feats, name, str(n), str(nargs)],
                               capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            continue
        if r.returncode == 0 and mnem in r.stdout:
            return cls
    return "generic"


def _classify(has) -> str:
    if has("avx512vnni") and has("avx512bw") and has("avx512f"):
        return "avx512vnni"
    if has("avxvnni") and has("avx2"):
        return "avxvnni"
    if has("avx2"):
        return "avx2"
    return "generic"


def target_isa() -> str:
    """The ISA class of the code Numba generates in this process (see the module doc)."""
    import llvmlite.binding as llvm
    from numba.core import config
    from pykv.kernels import TUNING_PINNED
    name, feats = config.CPU_NAME, config.CPU_FEATURES
    try:
        if name in (None, "host") and (feats is None or TUNING_PINNED):   # the host's own features
            f = llvm.get_host_cpu_features()
            return _classify(lambda k: bool(f.get(k)))
        if name in (None, "host"):
            name = llvm.get_host_cpu_name()
        if feats is None:
            feats = llvm.get_host_cpu_features().flatten()
    except Exception:              # pragma: no cover - exotic llvmlite builds
        return "generic"
    return _probe(name, feats)


ISA = target_isa()
L = 16 if ISA == "avx512vnni" else 8        # int32 lanes (rows) per vector
G = 4                                       # row groups per Q4/Q8 tile
TILE_ROWS = G * L                           # rows per Q4_0 / Q4_1 / Q8_0 tile
KTILE_ROWS = L                              # rows per K-quant tile


# ----------------------------------------------------------------------------------------------------
# the one ISA-specific piece: sum of 4-byte dots into int32 lanes
# ----------------------------------------------------------------------------------------------------

def _c(v):
    return ir.Constant(I64, v)


def _call(builder, name, ret, args):
    fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ret, [a.type for a in args]))
    return builder.call(fn, args)


def _bytes(builder, v):
    return builder.bitcast(v, _vec(I8, 4 * L))


def _bdot(builder, pairs, umax, scale=None, signed=False, xsum=None):
    """<L x i32>: for each lane, sum over (w, x) in pairs of the 4-byte dot of w's and x's bytes
    (<4L x i8> each), times scale (<L x i32>, |scale| < 2**15) when given.
    x: int8 in -127..127.  w: unsigned bytes 0..umax, or signed int8 (signed=True).  xsum (signed, VNNI):
    <L x i32> splat of the sum of every x byte in pairs (the activation block's xs), which spares the
    dots of the correction term below."""
    n4 = 4 * L
    vi = _vec(I32, L)
    zero = ir.Constant(vi, [0] * L)
    if ISA in ("avx512vnni", "avxvnni"):
        name = "llvm.x86.avx512.vpdpbusd.512" if L == 16 else "llvm.x86.avx512.vpdpbusd.256"
        acc = zero
        corr = zero
        for w, x in pairs:
            xi = builder.bitcast(x, vi)
            if signed:     # (w + 128) . x - 128 * sum(x): the second term is the same for every row tile
                w = builder.xor(w, ir.Constant(_vec(I8, n4), [-128] * n4))
                if xsum is None:
                    corr = _call(builder, name, vi, [corr, ir.Constant(vi, [0x80808080 - (1 << 32)] * L), xi])
            acc = _call(builder, name, vi, [acc, builder.bitcast(w, vi), xi])
        if signed:
            acc = builder.sub(acc, corr if xsum is None else builder.shl(xsum, ir.Constant(vi, [7] * L)))
        return acc if scale is None else builder.mul(acc, scale)
    if ISA == "avx2":
        v16 = _vec(I16, 2 * L)
        if scale is None:
            s16 = ir.Constant(v16, [1] * (2 * L))
        else:               # the scale in both i16 halves of each lane
            s16 = builder.bitcast(builder.or_(builder.and_(scale, ir.Constant(vi, [0xFFFF] * L)),
                                              builder.shl(scale, ir.Constant(vi, [16] * L))), v16)
        per = 1 if signed else max(1, 32767 // (2 * umax * 127))      # pmaddubsw sums that fit in i16
        acc = None
        for i in range(0, len(pairs), per):
            h = None
            for w, x in pairs[i:i + per]:
                if signed:     # |w| . sign(x, w): |w| <= 128, so a pair sum stays under 2**15
                    x = _call(builder, "llvm.x86.avx2.psign.b", x.type, [x, w])
                    w = _call(builder, "llvm.abs.v32i8", w.type, [w, ir.Constant(ir.IntType(1), 0)])
                p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [w, x])
                h = p if h is None else builder.add(h, p)
            p = _call(builder, "llvm.x86.avx2.pmadd.wd", vi, [h, s16])
            acc = p if acc is None else builder.add(acc, p)
        return acc
    # generic vector IR
    v4 = _vec(I32, n4)
    acc = zero
    for w, x in pairs:
        p = builder.mul(builder.sext(w, v4) if signed else builder.zext(w, v4), builder.sext(x, v4))
        for j in range(4):
            acc = builder.add(acc, builder.shuffle_vector(p, p, ir.Constant(vi, list(range(j, n4, 4)))))
    return acc if scale is None else builder.mul(acc, scale)


def _lut16(builder, idx, table):
    """<4L x i8>: table[idx] per byte (idx 0..15; table: 16 int8).  One vpshufb on x86 (the table in
    every 128-bit lane); a chain of selects in generic vector IR."""
    n4 = 4 * L
    vb = _vec(I8, n4)
    if ISA in ("avx512vnni", "avxvnni", "avx2"):
        name = "llvm.x86.avx512.pshuf.b.512" if L == 16 else "llvm.x86.avx2.pshuf.b"
        return _call(builder, name, vb, [ir.Constant(vb, [int(v) for v in table] * (n4 // 16)), idx])
    out = ir.Constant(vb, [int(table[0])] * n4)
    for k in range(1, 16):
        hit = builder.icmp_unsigned("==", idx, ir.Constant(vb, [k] * n4))
        out = builder.select(hit, ir.Constant(vb, [int(table[k])] * n4), out)
    return out


def _target_cpu() -> str:
    """LLVM's name of the CPU Numba compiles for (NUMBA_CPU_NAME, else the host's)."""
    import llvmlite.binding as llvm
    from numba.core import config
    name = config.CPU_NAME
    return llvm.get_host_cpu_name() if name in (None, "host") else name


# Several tokens (prefill, batched decode): a tile call for nt tokens unpacks each weight vector once for a
# group of tokens where that was measured to pay (avx2; Q4_1 on AMD's AVX-512 cores; the K
# formats on Intel's, where the unpacking costs more than the dot; docs/code-notes.md); other formats and
# classes run the tokens one after another in the call.
TOKEN_BLOCK = {"avx2": ("q4", "q40", "q50", "q5", "q2k", "q3k", "q5k", "q6k"),
               "avx512vnni": ("q4",) if _target_cpu().startswith("znver") else ("q4k", "q5k", "q6k")}.get(ISA, ())
# A grouped Q4 / Q5 / Q8 tile call runs one row group (L rows) at a time over the blocks, so only that
# group's sums for the tokens stay in registers (all G groups' sums for 4 tokens and each token's broadcast
# activations spilled: measured slower than one token at a time on AVX-512, and on avx2 slower than 8
# tokens a row group at a time); the generic class keeps the block-by-block order.
KOUTER = ISA in ("avx512vnni", "avx2")
TOKEN_NT = 8 if KOUTER else 4     # tokens a grouped Q4 / Q5 / Q8 tile call takes (mm_tiles._TOK_NT_Q)


# ----------------------------------------------------------------------------------------------------
# tile kernels (intrinsics).  No bounds checks: callers pass whole tiles.
# ----------------------------------------------------------------------------------------------------

def _ld(builder, base, off, ty, align=1):
    """Load a value of type ty at element offset off (i64 value) of pointer base."""
    return builder.load(builder.bitcast(builder.gep(base, [off], inbounds=True), ty.as_pointer()), align=align)


def _bcast4(builder, xqp, off):
    """The 4 int8 activations at xq[off:off+4] in every lane: <4L x i8>."""
    return _bytes(builder, _splat(builder, _ld(builder, xqp, off, I32), L))


def _halves(builder, base, off):
    """L consecutive f16 at element offset off of the i16/u16 pointer base -> <L x float>."""
    return _fpext_half(builder, _ld(builder, base, off, _vec(I16, L), 2))


def _store_out(builder, outp, sums):
    for k, s in enumerate(sums):
        p = builder.gep(outp, [_c(L * k)], inbounds=True)
        builder.store(builder.load(s), builder.bitcast(p, _vec(F32, L).as_pointer()), align=4)


def _arr(t, dt):
    return isinstance(t, types.Array) and t.dtype == dt


def _tile_dot(fmt, nt=1):
    """Typer of the intrinsic (qt, sc, xq, xd, xs, nb, out): out[0:TILE_ROWS] = the tile's rows . x.
    nt > 1: nt tokens at once (xq, xd, xs, out 2-D, their first nt rows), each weight vector unpacked once.

    Tile layout (TILE_ROWS = G*L rows, nb blocks of 32 columns), 4 columns of one row per 32-bit lane:
      Q4 (Q4_0 / Q4_1): qt uint8 [nb][4 groups jj][R rows][4 bytes]: byte c of group jj holds columns
          4jj+c (low nibble) and 16+4jj+c (high nibble) of the row's block, as ggml's qs[4jj+c];
          sc uint16 [nb][2][R] = f16 d and m per row (Q4_0 stored as m = -8 d).
          row . x = sum_b d*xd_b * sum_j q_j xq_j  +  m * xd_b * xs_b   (xs_b: int sum of xq's block)
      Q5 (Q5_0 / Q5_1): as Q4 with a fifth group [R][4]: byte c of a row's word holds bit 4 of column
          4jj+c in bit jj and of column 16+4jj+c in bit 4+jj (Q5_0: m = -16 d).
      Q40 / Q50 (Q4_0 / Q5_0): as Q4 / Q5 with sc uint16 [nb][1][R] = f16 d only (2 bytes less per block):
          row . x = sum_b d*xd_b * (sum_j q_j xq_j - z xs_b)   (z = 8 / 16: llama.cpp's q4_0 / q5_0 dot)
      Q8 (Q8_0): qt uint8 [nb][8 groups][R rows][4 bytes] = ggml's int8 qs;  sc uint16 [nb][1][R] = f16 d.
          row . x = sum_b d*xd_b * sum_j q_j xq_j
      IQ4 (IQ4_NL): as Q40 (nibbles, d only); each nibble indexes llama.cpp's 16 int8 levels
          (kvalues_iq4nl) before the signed dot: row . x = sum_b d*xd_b * sum_j kv[q_j] xq_j
    x is llama.cpp's q8_0 activation: xq int8 [nb*32], xd f32 [nb], xs int32 [nb].  These are llama.cpp's
    q4_0/q4_1/q5_0/q5_1/q8_0 x q8 dot products: the per-block int32 sums are exact, then scaled in float."""
    q4 = fmt != "q8"                           # nibble formats
    nl = fmt == "iq4"                          # nibbles index a table of int8 levels (signed dot)
    q5 = fmt in ("q5", "q50")                  # with the fifth (high bit) group
    z = {"q40": 8, "q50": 16}.get(fmt, 0)      # offset form: no m
    hasm = q4 and not z and not nl
    sgn = nl or not q4                         # signed weight bytes (the dot's offset form takes xs)
    nsc = 2 if hasm else 1                     # f16 scales per row per block
    groups = 4 if q4 else 8
    stride = (groups + q5) * 4                 # bytes per row per block

    nd = 1 if nt == 1 else 2
    tb = nt if fmt in TOKEN_BLOCK else 1

    def typer(typingctx, qt, sc, xq, xd, xa, nb, out):
        if not (_arr(qt, types.uint8) and _arr(sc, types.uint16) and _arr(xq, types.int8)
                and _arr(xd, types.float32) and _arr(xa, types.int32) and isinstance(nb, types.Integer)
                and _arr(out, types.float32) and xq.ndim == xd.ndim == xa.ndim == out.ndim == nd):
            return None

        def codegen(context, builder, sig, args):
            qtp, scp = (_data(context, builder, sig.args[i], args[i]) for i in range(2))
            rows = [_row_ptr(context, builder, sig.args[i], args[i]) for i in (2, 3, 4, 6)]
            nbv = context.cast(builder, args[5], sig.args[5], types.int64)
            R = TILE_ROWS
            n4 = 4 * L
            vi = _vec(I32, L)
            m15 = ir.Constant(_vec(I8, n4), [15] * n4)
            sh4 = ir.Constant(_vec(I8, n4), [4] * n4)
            # the 4-byte activation groups in pair order (Q4: low then high nibble columns)
            offs = [o for jj in range(groups) for o in ((4 * jj, 16 + 4 * jj) if q4 else (4 * jj,))]

            def block(b, ks, ns, xqp, xdp, xap, sums, pf, npass):
                """Block b's contribution to row groups ks for tokens ns (in pass pf of npass)."""
                xb = builder.mul(b, _c(32))
                qb = builder.mul(b, _c(stride * R))
                _next_tile(builder, pf, b, npass, qtp, builder.mul(nbv, _c(stride * R)), qb, stride * R)
                _next_tile(builder, pf, b, npass, builder.bitcast(scp, I8.as_pointer()),
                           builder.mul(nbv, _c(nsc * R * 2)), builder.mul(b, _c(nsc * R * 2)), nsc * R * 2)
                xdb, xfb, zxs, xsb = {}, {}, {}, {}      # per token n
                for n in ns:
                    xdv = _ld(builder, xdp[n], b, F32, 4)
                    xdb[n] = _splat(builder, xdv, L)
                    xa_n = _ld(builder, xap[n], b, I32, 4)
                    if sgn:
                        xsb[n] = _splat(builder, xa_n, L)
                    if hasm:
                        xfb[n] = _splat(builder, builder.fmul(xdv, builder.sitofp(xa_n, F32)), L)
                    if z:
                        zxs[n] = _splat(builder, builder.mul(xa_n, ir.Constant(I32, z)), L)
                # the activation words once a block, for every row group; KOUTER's several tokens: each
                # token's at its dot (a broadcast operand of the dot: nt x 8 words would not stay in registers)
                xs = {n: [_bcast4(builder, xqp[n], builder.add(xb, _c(o))) for o in offs] for n in ns} \
                    if len(ns) == 1 or not KOUTER else None
                sb = builder.mul(b, _c(nsc * R))
                if PF_BYTES:
                    ahead = -(-PF_BYTES // (stride * R))   # blocks ahead to prefetch (past the tile: the next one's)
                    for o in range(0, stride * R, 64):
                        _prefetch(builder, qtp, builder.add(qb, _c(ahead * stride * R + o)), PF_LOCALITY)
                    _prefetch(builder, builder.bitcast(scp, I8.as_pointer()),
                              builder.mul(builder.add(b, _c(ahead)), _c(nsc * R * 2)), PF_LOCALITY)
                for k in ks:
                    ws = []                # the group's weight values, unpacked once for the tokens ns
                    if q5:
                        hw = _ld(builder, qtp, builder.add(qb, _c(4 * R * groups + n4 * k)), vi)

                        def hbit(s):       # bit s of each byte of hw, moved to bit 4
                            v = builder.and_(builder.lshr(hw, ir.Constant(vi, [s] * L)),
                                             ir.Constant(vi, [0x01010101] * L))
                            return _bytes(builder, builder.shl(v, ir.Constant(vi, [4] * L)))
                    for jj in range(groups):
                        w = _ld(builder, qtp, builder.add(qb, _c(4 * R * jj + n4 * k)), _vec(I8, n4))
                        if q4:
                            lo = builder.and_(w, m15)
                            hi = builder.and_(builder.lshr(w, sh4), m15)
                            if q5:
                                lo = builder.or_(lo, hbit(jj))
                                hi = builder.or_(hi, hbit(4 + jj))
                            if nl:
                                lo, hi = _lut16(builder, lo, KVALUES_IQ4NL), _lut16(builder, hi, KVALUES_IQ4NL)
                            ws += [lo, hi]
                        else:
                            ws.append(w)
                    d = _halves(builder, scp, builder.add(sb, _c(L * k)))
                    if hasm:
                        m = _halves(builder, scp, builder.add(sb, _c(R + L * k)))
                    for n in ns:
                        xn = xs[n] if xs is not None else \
                            [_bcast4(builder, xqp[n], builder.add(xb, _c(o))) for o in offs]
                        a = _bdot(builder, list(zip(ws, xn)), 31 if q5 else 15, signed=sgn, xsum=xsb.get(n))
                        if z:
                            a = builder.sub(a, zxs[n])
                        s = builder.fadd(builder.load(sums[n][k]),
                                         builder.fmul(builder.fmul(d, xdb[n]), builder.sitofp(a, _vec(F32, L))))
                        if hasm:
                            s = builder.fadd(s, builder.fmul(m, xfb[n]))
                        builder.store(s, sums[n][k])

            for ns, (xqp, xdp, xap, outp), pf in _groups(builder, rows, nt, tb):   # weights unpacked once a pass
                sums = {n: [cgutils.alloca_once_value(builder, ir.Constant(_vec(F32, L), [0.0] * L))
                            for _ in range(G)] for n in ns}
                if len(ns) == 1 or not KOUTER:      # block by block, every row group
                    with cgutils.for_range(builder, nbv) as loop:
                        block(loop.index, range(G), ns, xqp, xdp, xap, sums, pf, nt)
                else:       # several tokens: a row group at a time (only its tokens' sums live in registers),
                    for k in range(G):      # the later groups prefetching the next tile (_next_tile's passes)
                        with cgutils.for_range(builder, nbv) as loop:
                            block(loop.index, (k,), ns, xqp, xdp, xap, sums, _c(k), G)
                for n in ns:
                    _store_out(builder, outp[n], sums[n])
            return context.get_dummy_value()
        return types.void(qt, sc, xq, xd, xa, nb, out), codegen
    typer.__name__ = "dot_tile_" + fmt + (f"_x{nt}" if nt > 1 else "")
    return typer


dot_tile_q4 = intrinsic(_tile_dot("q4"))
dot_tile_q5 = intrinsic(_tile_dot("q5"))
dot_tile_q40 = intrinsic(_tile_dot("q40"))
dot_tile_q50 = intrinsic(_tile_dot("q50"))
dot_tile_q8 = intrinsic(_tile_dot("q8"))
dot_tile_iq4 = intrinsic(_tile_dot("iq4"))


def _pick(typingctx, typers, kind, args):
    """(signature, codegen) of typers[kind](*args) behind a leading literal `kind` argument, or None.
    kind is an integer literal (numba.literally) chosen at typing time, so a kernel compiles only the
    formats it is called with (a branch on a literal inside an inlined helper is not pruned; this is)."""
    if not isinstance(kind, types.IntegerLiteral) or kind.literal_value not in typers:
        return None
    r = typers[kind.literal_value](typingctx, *args)
    if r is None:
        return None
    inner, cg = r

    def codegen(context, builder, sig, cargs):
        return cg(context, builder, inner, cargs[1:])
    return types.void(kind, *args), codegen


def dot_tile_by(fmts, nt=1):
    """Intrinsic (kind, qt, sc, xq, xd, xs, nb, out): dot_tile_<fmts[kind]>(qt, ...) for nt tokens."""
    typers = {k: _tile_dot(f, nt) for k, f in fmts.items()}

    def typer(typingctx, kind, qt, sc, xq, xd, xa, nb, out):
        return _pick(typingctx, typers, kind, (qt, sc, xq, xd, xa, nb, out))
    return intrinsic(typer)


# ---- K-quant tiles.  Per super-block of 256 columns, a tile of R = KTILE_ROWS rows is KBYTES[type] * R
# contiguous bytes (offsets in units of R):
#   Q2_K: qs [2 h][8 groups jj][R][4] (byte = ggml qs[32h + 4jj + i]: bits 2k..2k+1 = sub-block 4h+k)
#         @0 | sc u8 [16][R] (ggml's bytes: low nibble scale, high nibble min of sub-block of 16) @64 |
#         d f16 [R] @80 | dmin f16 [R] @82
#   Q3_K: qs @0 (as Q2_K) | hmask [8 jj][R][4] (ggml hmask[4jj + i]: bit t = bit 2 of sub-block t) @64 |
#         sc i8 [16][R] (the 6-bit scales minus 32) @96 | d f16 [R] @112
#   Q4_K: qs [4 chunks c][8 jj][R][4] (byte = ggml qs[32c + 4jj + i]: low nibble sub-block 2c,
#         high nibble 2c+1) @0 | sc u8 [8][R] @128 | m u8 [8][R] @136 | d f16 [R] @144 | dmin f16 [R] @146
#   Q5_K: qs @0 | qh [8 jj][R][4] (ggml qh[4jj + i]: bit t = bit 4 of sub-block t) @128 | sc @160 |
#         m @168 | d @176 | dmin @178
#   Q6_K: ql [4 c][8 jj][R][4] (low 4 bits: sub-block 2c low nibble, 2c+1 high) @0 |
#         qh [2 g][8 jj][R][4] (bits 2i..2i+1: high 2 bits of sub-block 4g+i) @128 |
#         sc i8 [16][R] @192 | d f16 [R] @208
# q value of column 32t + 4jj + i (sub-block t of 32; q unsigned: Q3_K's 0..7 is ggml's q + 4, Q6_K's
# 0..63 its q + 32).  Per super-block and row, with llama.cpp's q8_K x (xq int8 [256], xd f32,
# xb int32 [16] sums of 16; h: sub-blocks of 16):
#   Q2_K:      xd * (d * sum_h sc_h (q_h . x_h) - dmin * sum_h m_h xb_h)
#   Q3_K:      xd * d * (sum_h sc_h (q_h . x_h) - 4 sum_h sc_h xb_h)
#   Q4_K/Q5_K: xd * (d * sum_t sc_t (q_t . x_t) - dmin * sum_t m_t (xb_2t + xb_2t+1))
#   Q6_K:      xd * d * (sum_h sc_h (q_h . x_h) - 32 sum_h sc_h xb_h)

KBYTES = {"q2k": 84, "q3k": 114, "q4k": 148, "q5k": 180, "q6k": 210}
_INTEL512 = ISA == "avx512vnni" and not _target_cpu().startswith("znver")
# Weights are read once per token.  AMD cores take non-temporal prefetches (prefetchnta), which keep the
# stream out of the caches' other data; on Intel's AVX-512 cores prefetchnta halves the tiles' DRAM rate
# with 2 threads and prefetcht1 (into L2) streams at the read ceiling, so there the weights go to L2.
PF_LOCALITY = 2 if _INTEL512 else 0
# Software prefetch of the weight stream helps where the hardware prefetcher lags (the avx2 class, and
# Intel's AVX-512 cores).  On AMD's AVX-512 cores the Q4 / Q5 / Q8 tiles leave it to the hardware
# (prefetching measured slower), and the K tiles prefetch 2 super-blocks ahead (8 ahead measured slower;
# the measurements are in docs/code-notes.md and docs/benchmarks.md).
_PF = ISA != "avx512vnni" or _INTEL512
PF_BYTES = 4096 if _PF else 0    # bytes ahead a Q4 / Q5 / Q8 tile prefetches its weights (0: none)
KPF_AHEAD = 2 if ISA == "avx512vnni" else 8      # super-blocks ahead a K tile prefetches (0: none)

# fmt -> (low bits per q in the qs plane @0, (high bits, their plane's offset) or None,
#         offset of the per-16 scales (None: 6-bit sc / m per 32 at SB-20 / SB-12), offset z (q - z signed, no dmin))
_KFMT = {"q2k": (2, None, 64, 0), "q3k": (2, (1, 64), 96, 4), "q4k": (4, None, None, 0),
         "q5k": (4, (1, 128), None, 0), "q6k": (4, (2, 128), 192, 32)}


def _row_ptr(context, builder, aty, arr):
    """f(n) -> the data pointer of row n (an i64 value) of a 2-D array value (1-D: its data pointer)."""
    a = context.make_array(aty)(context, builder, arr)
    if aty.ndim == 1:
        return lambda n: a.data
    stride = cgutils.unpack_tuple(builder, a.strides, 2)[0]           # bytes
    base = builder.bitcast(a.data, I8.as_pointer())
    return lambda n: builder.bitcast(builder.gep(base, [builder.mul(stride, n)]), a.data.type)


def _groups(builder, rows, nt, tb):
    """The passes of an nt-token tile call over its weights: (token indices, each array's row pointers
    for them, the pass's index (an i64 value) or None).  tb == nt: one pass for all nt tokens (the weights
    unpacked once; None); tb == 1: an IR loop over the tokens, one per pass (the one-token code once, not
    nt copies of it), whose later passes prefetch the next tile (_next_tile)."""
    assert tb in (1, nt), (tb, nt)
    if tb == nt:
        yield list(range(nt)), [[f(_c(n)) for n in range(nt)] for f in rows], None
    else:
        with cgutils.for_range(builder, _c(nt)) as loop:
            yield [0], [[f(loop.index)] for f in rows], loop.index


# A tile call for several tokens one pass each reads its weights from memory in the first pass and
# from L1 in the others: without help the core computes those passes with the memory idle, and stalls in
# the next tile's first pass.  So the later passes prefetch the next tile (the bytes after this one's, in
# the same weight's array) into L2, a share of its blocks each (measurements: docs/code-notes.md).
NEXT_LOCALITY = 2


def _next_tile(builder, pf, b, nt, base, tile_bytes, off, nbytes):
    """IR, at block b of pass pf (an i64 value, or None: nothing) of an nt-token call: the passes after the
    first take every (nt-1)-th block each, and for theirs prefetch nbytes at base + tile_bytes + off
    (tile_bytes, off: i64 values; base an i8 pointer): the next tile's block b."""
    if pf is None or nt == 1:
        return
    cond = builder.and_(builder.icmp_signed(">=", pf, _c(1)),
                        builder.icmp_signed("==", builder.srem(b, _c(nt - 1)), builder.sub(pf, _c(1))))
    with builder.if_then(cond):
        start = builder.add(tile_bytes, off)
        for o in range(0, nbytes, 64):
            _prefetch(builder, base, builder.add(start, _c(o)), NEXT_LOCALITY)


def _ktile_typer(fmt, nt):
    """Typer of the intrinsic (qt, xq, xd, xb, nsb, out): out[0:L] = the K tile's rows . x (qt: one tile's bytes).
    nt > 1: nt tokens at once (xq, xd, xb, out 2-D, their first nt rows): each sub-block's weight
    values are unpacked once for all nt tokens (prefill)."""
    SB = KBYTES[fmt]
    lb, hi, sco, z = _KFMT[fmt]
    umax = (1 << (lb + (hi[0] if hi else 0))) - 1
    nd = 1 if nt == 1 else 2
    tb = nt if fmt in TOKEN_BLOCK else 1

    def typer(typingctx, qt, xq, xd, xb, nsb, out):
        if not (_arr(qt, types.uint8) and _arr(xq, types.int8) and _arr(xd, types.float32)
                and _arr(xb, types.int32) and isinstance(nsb, types.Integer) and _arr(out, types.float32)
                and xq.ndim == xd.ndim == xb.ndim == out.ndim == nd):
            return None

        def codegen(context, builder, sig, args):
            qtp = _data(context, builder, sig.args[0], args[0])
            rows = [_row_ptr(context, builder, sig.args[i], args[i]) for i in (1, 2, 3, 5)]
            nv = context.cast(builder, args[4], sig.args[4], types.int64)
            R = L
            n4 = 4 * L
            vi, vb = _vec(I32, L), _vec(I8, n4)

            def cb(v):
                return ir.Constant(vb, [v] * n4)

            def ci(v):
                return ir.Constant(vi, [v] * L)

            def bits(base, off, nbits, t):     # field t of nbits-bit fields of the <4L x i8> at base + off
                w = _ld(builder, qtp, builder.add(base, _c(off * R)), vb)
                per = 8 // nbits
                return builder.and_(builder.lshr(w, cb(nbits * (t % per))), cb((1 << nbits) - 1))

            def row_bytes(base, off):          # <L x i8> at base + off * R
                return _ld(builder, qtp, builder.add(base, _c(off * R)), _vec(I8, L))

            def xsum(n, b, h):                 # splat of token n's xb[16b + h]
                return _splat(builder, _ld(builder, xbp[n], builder.add(builder.mul(b, _c(16)), _c(h)), I32, 4), L)

            for ns, (xqp, xdp, xbp, outp), pf in _groups(builder, rows, nt, tb):   # weights unpacked once a pass
                sums = {n: cgutils.alloca_once_value(builder, ir.Constant(_vec(F32, L), [0.0] * L)) for n in ns}
                with cgutils.for_range(builder, nv) as loop:
                    b = loop.index
                    base = builder.mul(b, _c(SB * R))
                    _next_tile(builder, pf, b, nt, qtp, builder.mul(nv, _c(SB * R)), base, SB * R)
                    xb0 = builder.mul(b, _c(256))
                    if KPF_AHEAD:                    # the super-block KPF_AHEAD ahead (past the tile: the next one's)
                        for o in range(0, SB * R, 64):
                            _prefetch(builder, qtp, builder.add(base, _c(KPF_AHEAD * SB * R + o)), PF_LOCALITY)
                    isum = [ci(0)] * nt
                    msum = [ci(0)] * nt
                    for t in range(8):
                        us = []
                        for jj in range(8):
                            u = bits(base, 32 * (t * lb // 8) + 4 * jj, lb, t)
                            if hi:
                                hb, ho = hi
                                h = bits(base, ho + 32 * (t * hb // 8) + 4 * jj, hb, t)
                                u = builder.or_(u, builder.shl(h, cb(lb)))
                            us.append(u)
                        if sco is None:                # 6-bit sc, m per sub-block of 32
                            sc = builder.zext(row_bytes(base, SB - 20 + t), vi)
                            mn = builder.zext(row_bytes(base, SB - 12 + t), vi)
                            for n in ns:
                                xs = [_bcast4(builder, xqp[n], builder.add(xb0, _c(32 * t + 4 * jj))) for jj in range(8)]
                                isum[n] = builder.add(isum[n], _bdot(builder, list(zip(us, xs)), umax, sc))
                                msum[n] = builder.add(msum[n], builder.mul(mn, builder.add(xsum(n, b, 2 * t),
                                                                                           xsum(n, b, 2 * t + 1))))
                            continue
                        for half in range(2):          # a scale per sub-block of 16
                            h = 2 * t + half
                            if z:                      # signed scale; the offset z is taken off once per super-block
                                sc = builder.sext(row_bytes(base, sco + h), vi)
                                mn = sc
                            else:                      # Q2_K: scale | min << 4
                                s8 = builder.zext(row_bytes(base, sco + h), vi)
                                sc = builder.and_(s8, ci(15))
                                mn = builder.lshr(s8, ci(4))
                            for n in ns:
                                xs = [_bcast4(builder, xqp[n], builder.add(xb0, _c(32 * t + 4 * jj)))
                                      for jj in range(4 * half, 4 * half + 4)]
                                isum[n] = builder.add(isum[n], _bdot(builder, list(zip(us[4 * half:4 * half + 4], xs)),
                                                                     umax, sc))
                                msum[n] = builder.add(msum[n], builder.mul(mn, xsum(n, b, h)))
                    hp = builder.bitcast(qtp, I16.as_pointer())
                    hb_ = builder.mul(b, _c(SB * R // 2))
                    d = _halves(builder, hp, builder.add(hb_, _c((SB - 2 if z else SB - 4) * R // 2)))
                    if not z:
                        dmin = _halves(builder, hp, builder.add(hb_, _c((SB - 2) * R // 2)))
                    for n in ns:
                        xdb = _splat(builder, _ld(builder, xdp[n], b, F32, 4), L)
                        if z:
                            v = builder.fmul(d, builder.sitofp(builder.sub(isum[n], builder.mul(msum[n], ci(z))),
                                                               _vec(F32, L)))
                        else:
                            v = builder.fsub(builder.fmul(d, builder.sitofp(isum[n], _vec(F32, L))),
                                             builder.fmul(dmin, builder.sitofp(msum[n], _vec(F32, L))))
                        builder.store(builder.fadd(builder.load(sums[n]), builder.fmul(xdb, v)), sums[n])
                for n in ns:
                    _store_out(builder, outp[n], [sums[n]])
            return context.get_dummy_value()
        return types.void(qt, xq, xd, xb, nsb, out), codegen
    typer.__name__ = f"dot_ktile_{fmt}" + (f"_x{nt}" if nt > 1 else "")
    return typer


def _ktile_dot(fmt, nt=1):
    return intrinsic(_ktile_typer(fmt, nt))


def dot_ktile_by(fmts, nt=1):
    """Intrinsic (kind, qt, xq, xd, xb, nsb, out): the nt-token K tile dot of format fmts[kind]."""
    typers = {k: _ktile_typer(f, nt) for k, f in fmts.items()}

    def typer(typingctx, kind, qt, xq, xd, xb, nsb, out):
        return _pick(typingctx, typers, kind, (qt, xq, xd, xb, nsb, out))
    return intrinsic(typer)


def dot_any_by(ifmts, kfmts, koff=100, nt=1, ntk=1):
    """Intrinsic (code, qt, sc, xq, xd, xs, xqk, xdk, xbk, nb, out): the dot of one tile of any integer
    tile weight, code a literal: below koff dot_tile_<ifmts[code]>(qt, sc, xq, xd, xs, nb, out) for nt
    tokens (q8_0 activations), from koff dot_ktile_<kfmts[code - koff]>(qt, xqk, xdk, xbk, nb, out) for
    ntk tokens (q8_K activations; sc is not read); several tokens: 2-D activations and out."""
    typers = {k: (_tile_dot(f, nt), (0, 1, 2, 3, 4, 8, 9)) for k, f in ifmts.items()}
    typers.update({k + koff: (_ktile_typer(f, ntk), (0, 5, 6, 7, 8, 9)) for k, f in kfmts.items()})

    def typer(typingctx, code, qt, sc, xq, xd, xs, xqk, xdk, xbk, nb, out):
        if not isinstance(code, types.IntegerLiteral) or code.literal_value not in typers:
            return None
        inner_typer, pick = typers[code.literal_value]
        args = (qt, sc, xq, xd, xs, xqk, xdk, xbk, nb, out)
        r = inner_typer(typingctx, *(args[i] for i in pick))
        if r is None:
            return None
        inner, cg = r

        def codegen(context, builder, sig, cargs):
            return cg(context, builder, inner, [cargs[1 + i] for i in pick])
        return types.void(code, *args), codegen
    return intrinsic(typer)


dot_ktile_q2k = _ktile_dot("q2k")
dot_ktile_q3k = _ktile_dot("q3k")
dot_ktile_q4k = _ktile_dot("q4k")
dot_ktile_q5k = _ktile_dot("q5k")
dot_ktile_q6k = _ktile_dot("q6k")


# ----------------------------------------------------------------------------------------------------
# load-time repacking (numpy)
# ----------------------------------------------------------------------------------------------------

def f16_bits(b2):
    """(..., 2) uint8 little-endian halves (the last axis contiguous) -> uint16 (...): a view."""
    return b2.view(np.dtype("<u2"))[..., 0]


def lanes(q):
    """(..., w) uint8 with a contiguous last axis (w % 4 == 0) -> (..., w // 4) little-endian uint32: a
    view, so the repacks' transposing copies move 4-byte lanes, not single bytes (ten times faster)."""
    return q.view(np.dtype("<u4"))


def _lanes4(q, R):
    """(nt*R, nsb, n) bytes -> (nt, nsb, n // 4, R) uint32: 4 consecutive bytes of a row per lane."""
    rows, nsb, n = q.shape
    return lanes(q).reshape(rows // R, R, nsb, n // 4).transpose(0, 2, 3, 1)


def _rowmajor(v, R):
    """(nt*R, nsb, n) -> (nt, nsb, n, R) (one value per row, rows contiguous)."""
    rows, nsb, n = v.shape
    return v.reshape(rows // R, R, nsb, n).transpose(0, 2, 3, 1)


def repack_ktile(fmt, blk, out=None):
    """ggml K-quant super-blocks blk uint8 (rows, nsb, bytes), rows a multiple of KTILE_ROWS ->
    uint8 (nt, nsb * KBYTES[fmt] * R) tiles (layout above), written into out when given."""
    R = KTILE_ROWS
    rows, nsb, _ = blk.shape
    nt = rows // R
    parts = []
    if fmt == "q2k":
        parts += [_lanes4(blk[:, :, 16:80], R), _rowmajor(blk[:, :, 0:16], R),
                  _rowmajor(f16_bits(blk[:, :, 80:84].reshape(rows, nsb, 2, 2)), R)]
    elif fmt == "q3k":
        s = blk[:, :, 96:108].astype(np.int32)
        j = np.arange(16)
        lo = np.where(j < 8, s[..., j % 8] & 15, s[..., j % 8] >> 4)
        sc = lo | (((s[..., 8 + (j & 3)] >> (2 * (j >> 2))) & 3) << 4)
        parts += [_lanes4(blk[:, :, 32:96], R), _lanes4(blk[:, :, 0:32], R), _rowmajor((sc - 32).astype(np.int8), R),
                  _rowmajor(f16_bits(blk[:, :, 108:110].reshape(rows, nsb, 1, 2)), R)]
    elif fmt in ("q4k", "q5k"):
        qo = 16 if fmt == "q4k" else 48
        sc6 = blk[:, :, 4:16].astype(np.int32)
        sc = np.empty((rows, nsb, 8), np.uint8)
        mn = np.empty((rows, nsb, 8), np.uint8)
        sc[..., :4] = sc6[..., 0:4] & 63
        mn[..., :4] = sc6[..., 4:8] & 63
        sc[..., 4:] = (sc6[..., 8:12] & 15) | ((sc6[..., 0:4] >> 6) << 4)
        mn[..., 4:] = (sc6[..., 8:12] >> 4) | ((sc6[..., 4:8] >> 6) << 4)
        parts.append(_lanes4(blk[:, :, qo:qo + 128], R))
        if fmt == "q5k":
            parts.append(_lanes4(blk[:, :, 16:48], R))
        parts += [_rowmajor(sc, R), _rowmajor(mn, R), _rowmajor(f16_bits(blk[:, :, 0:4].reshape(rows, nsb, 2, 2)), R)]
    else:
        ql = blk[:, :, 0:128]
        qh = blk[:, :, 128:192]
        q = np.empty((rows, nsb, 256), np.uint8)           # 0..63, element order (uint8 all through)
        for h in range(2):
            for k in range(4):
                lo = (ql[:, :, 64 * h + 32 * (k & 1):64 * h + 32 * (k & 1) + 32] >> (4 * (k >> 1))) & 15
                hi = (qh[:, :, 32 * h:32 * h + 32] >> (2 * k)) & 3
                q[:, :, 128 * h + 32 * k:128 * h + 32 * k + 32] = lo | (hi << 4)
        t = q.reshape(rows, nsb, 8, 32)
        lo4 = ((t[:, :, 0::2] & 15) | ((t[:, :, 1::2] & 15) << 4)).reshape(rows, nsb, 128)
        hi2 = t.reshape(rows, nsb, 2, 4, 32) >> 4
        hi2 = (hi2[:, :, :, 0] | (hi2[:, :, :, 1] << 2) | (hi2[:, :, :, 2] << 4) | (hi2[:, :, :, 3] << 6))
        parts += [_lanes4(lo4, R), _lanes4(hi2.reshape(rows, nsb, 64), R),
                  _rowmajor(blk[:, :, 192:208], R),
                  _rowmajor(f16_bits(blk[:, :, 208:210].reshape(rows, nsb, 1, 2)), R)]
    flat = [np.ascontiguousarray(p).view(np.uint8).reshape(nt, nsb, -1) for p in parts]
    assert sum(f.shape[2] for f in flat) == KBYTES[fmt] * R
    if out is None:
        out = np.empty((nt, nsb * KBYTES[fmt] * R), np.uint8)
    np.concatenate(flat, axis=2, out=out.reshape(nt, nsb, -1))
    return out


_KFMT_CODE = {"q4k": 0, "q5k": 1, "q6k": 2}     # the formats repack_ktile_nb writes (q2k / q3k: numpy only)


@njit(cache=True, nogil=True, parallel=True)
def _repack_k_nb(code, blk, out, R, KB):
    """repack_ktile's layout for q4k (code 0), q5k (1), q6k (2) in one parallel pass: blk (rows, nsb,
    bytes) -> out (nt, nsb * KB * R) (nt * R >= rows; rows past blk are zero, as the padded tiles)."""
    rows, nsb = blk.shape[0], blk.shape[1]
    for it in prange(out.shape[0] * nsb):
        t = it // nsb
        sb = it % nsb
        o = out[t]
        base = sb * KB * R
        if (t + 1) * R > rows:          # the last tile's rows past blk: zeros, as the zero-padded blocks give
            for k in range(KB * R):
                o[base + k] = 0
        for r in range(min(R, rows - t * R)):
            row = t * R + r
            b = blk[row, sb]
            if code == 2:
                # q: 256 values of 6 bits in element order, then lo4 (128 bytes) and hi2 (64 bytes) as lanes
                for g2 in range(4):
                    for l in range(32):
                        e0 = 64 * g2 + l
                        e1 = e0 + 32
                        v0 = _q6(b, e0)
                        v1 = _q6(b, e1)
                        j = 32 * g2 + l
                        o[base + ((j >> 2) * R + r) * 4 + (j & 3)] = (v0 & 15) | ((v1 & 15) << 4)
                for h in range(2):
                    for l in range(32):
                        v = 0
                        for k in range(4):
                            v |= (_q6(b, 128 * h + 32 * k + l) >> 4) << (2 * k)
                        j = 32 * h + l
                        o[base + 128 * R + ((j >> 2) * R + r) * 4 + (j & 3)] = v
                for j in range(16):
                    o[base + 192 * R + j * R + r] = b[192 + j]
                o[base + 208 * R + 2 * r] = b[208]
                o[base + 208 * R + 2 * r + 1] = b[209]
            else:
                qo = 16 if code == 0 else 48
                for j in range(128):
                    o[base + ((j >> 2) * R + r) * 4 + (j & 3)] = b[qo + j]
                p = 128 * R
                if code == 1:
                    for j in range(32):
                        o[base + p + ((j >> 2) * R + r) * 4 + (j & 3)] = b[16 + j]
                    p += 32 * R
                for j in range(4):
                    o[base + p + j * R + r] = b[4 + j] & 63
                    o[base + p + (4 + j) * R + r] = (b[12 + j] & 15) | ((b[4 + j] >> 6) << 4)
                    o[base + p + 8 * R + j * R + r] = b[8 + j] & 63
                    o[base + p + 8 * R + (4 + j) * R + r] = (b[12 + j] >> 4) | ((b[8 + j] >> 6) << 4)
                p += 16 * R
                for k in range(2):
                    o[base + p + 2 * (k * R + r)] = b[2 * k]
                    o[base + p + 2 * (k * R + r) + 1] = b[2 * k + 1]


@njit(cache=True, nogil=True, inline="always")
def _q6(b, e):
    """6-bit quant of element e (0..255) of a Q6_K block b (ql[128], qh[64], ...)."""
    h = e >> 7
    k = (e >> 5) & 3
    l = e & 31
    lo = (b[64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 15
    hi = (b[128 + 32 * h + l] >> (2 * k)) & 3
    return lo | (hi << 4)


def repack_ktile_nb(fmt, blk, n_tiles):
    """repack_ktile (its layout, bit for bit) of blk (rows, nsb, bytes) into n_tiles tiles, the rows past
    blk zero: one parallel Numba pass for q4k / q5k / q6k (the numpy repack took ~10 s of an 8B Q4_K_M
    file's load), None for the formats it does not cover."""
    code = _KFMT_CODE.get(fmt)
    if code is None:
        return None
    R = KTILE_ROWS
    out = np.empty((n_tiles, blk.shape[1] * KBYTES[fmt] * R), np.uint8)
    _repack_k_nb(code, blk, out, R, KBYTES[fmt])
    return out
