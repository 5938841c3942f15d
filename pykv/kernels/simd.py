"""Explicit short-vector block decoders (Numba intrinsics emitting generic LLVM vector IR).

LLVM's auto-vectorizer leaves some of the block loops scalar (a q8_0 block of 32 became 64 scalar
movsbl / vcvtsi2ss / vmulss), so the hot per-block decodes are written here once as whole-block vector
operations.  The IR is target-independent (<32 x i8> loads, sitofp, fmul by a splat, one <32 x float>
store); LLVM lowers it to the host's widest vectors (AVX-512: two zmm, AVX2: four ymm, NEON: 8 q-regs).

Each decoder reads ONE ggml block at byte offset `so` of the uint8 array `src` and writes its 32 floats
to the float32 array `dst` (any dimension, C-contiguous) at flat element offset `do`.  Like every kernel
here they do no bounds checks: callers pass offsets inside the arrays.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32 = ir.HalfType(), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _data(context, builder, aty, arr):
    """The data pointer of Numba array value arr (type aty)."""
    return context.make_array(aty)(context, builder, arr).data


def _ptr(context, builder, aty, arr, off, oty):
    """Element pointer arr.data + off (off of Numba type oty)."""
    return builder.gep(_data(context, builder, aty, arr), [context.cast(builder, off, oty, types.int64)],
                       inbounds=True)


def _at(builder, p, nbytes):
    return builder.gep(p, [ir.Constant(I64, nbytes)], inbounds=True)


def _load(builder, p, ty):
    return builder.load(builder.bitcast(p, ty.as_pointer()), align=1)


def _fpext_half(builder, h):
    """i16 (or <n x i16>) IEEE half bits -> float (<n x float>): LLVM `fpext half`, exact for every value
    (inf / NaN / subnormals); vcvtph2ps on x86 with F16C.  THE half -> float conversion of pykv."""
    if isinstance(h.type, ir.VectorType):
        n = h.type.count
        return builder.fpext(builder.bitcast(h, _vec(F16, n)), _vec(F32, n))
    return builder.fpext(builder.bitcast(h, F16), F32)


def _half(builder, p):
    """f16 at byte pointer p -> float."""
    return _fpext_half(builder, _load(builder, p, I16))


@intrinsic
def h2f(typingctx, x):
    """IEEE half bits (any integer type, low 16 bits) -> float32, exact (inf / NaN / subnormals
    included); vectorizes in loops (vcvtph2ps)."""
    if isinstance(x, types.Integer):
        def codegen(context, builder, sig, args):
            v = args[0]
            w = v.type.width
            if w > 16:
                v = builder.trunc(v, I16)
            elif w < 16:
                v = builder.zext(v, I16)
            return _fpext_half(builder, v)
        return types.float32(x), codegen
    return None


def _bitcast(name, src, dst, ir_dst):
    """An intrinsic reinterpreting a Numba `src` scalar (any integer of its width) as `dst`."""
    def typer(typingctx, x):
        if x == src or (isinstance(src, types.Integer) and isinstance(x, types.Integer)
                        and x.bitwidth == src.bitwidth):
            def codegen(context, builder, sig, args):
                return builder.bitcast(args[0], ir_dst)
            return dst(x), codegen
        return None
    typer.__name__ = name
    return intrinsic(typer)


f32_bits = _bitcast("f32_bits", types.float32, types.uint32, I32)     # float32 -> its uint32 bits
bits_f32 = _bitcast("bits_f32", types.uint32, types.float32, F32)     # any 32-bit integer -> float32



def _nvptx(builder) -> bool:
    """True while lowering for a CUDA GPU (numba.cuda compiling a kernel that calls this code)."""
    return (builder.module.triple or "").startswith("nvptx")


@intrinsic
def floorf(typingctx, x):
    """floor of a float32 as float32 (llvm.floor: exact for every value; CPU and CUDA alike,
    where np.floor is not available in device code)."""
    if x == types.float32:
        def codegen(context, builder, sig, args):
            fn = builder.module.declare_intrinsic("llvm.floor", [F32])
            return builder.call(fn, [args[0]])
        return types.float32(x), codegen
    return None


@intrinsic
def fmul_rn(typingctx, a, b):
    """a * b (float32), never fused with a following add.  The CPU build does not fuse anyway; on a
    GPU NVVM contracts mul + add into fma by default, which changes the rounding of the quantizers'
    `x * idd + 8.5` and breaks byte-identity with the CPU, so there it is PTX `mul.rn.f32` (an
    explicit rounding mode: never contracted)."""
    if a == types.float32 and b == types.float32:
        def codegen(context, builder, sig, args):
            if _nvptx(builder):
                return builder.asm(ir.FunctionType(F32, [F32, F32]), "mul.rn.f32 $0, $1, $2;", "=f,f,f",
                                   list(args), False)
            return builder.fmul(args[0], args[1])
        return types.float32(a, b), codegen
    return None

def _splat(builder, x, n):
    vt = _vec(x.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(_vec(I32, n), [0] * n))


def _nibbles(builder, p):
    """16 bytes at p -> <32 x i8>: the low nibbles (values 0..15), then the high nibbles (ggml order)."""
    b = _load(builder, p, _vec(I8, 16))
    lo = builder.and_(b, ir.Constant(_vec(I8, 16), [15] * 16))
    hi = builder.lshr(b, ir.Constant(_vec(I8, 16), [4] * 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(_vec(I32, 32), list(range(32))))


def _store32(context, builder, sig, dst, do, v):
    p = _ptr(context, builder, sig.args[2], dst, do, sig.args[3])
    builder.store(v, builder.bitcast(p, _vec(F32, 32).as_pointer()), align=4)


def _decoder(body):
    """An intrinsic (src, so, dst, do) -> None whose vector value is body(builder, byte pointer)."""
    def typer(typingctx, src, so, dst, do):
        if not (isinstance(src, types.Array) and src.dtype == types.uint8
                and isinstance(dst, types.Array) and dst.dtype == types.float32
                and isinstance(so, types.Integer) and isinstance(do, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            p = _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            _store32(context, builder, sig, args[2], args[3], body(builder, p))
            return context.get_dummy_value()
        return types.void(src, so, dst, do), codegen
    typer.__name__ = body.__name__
    return intrinsic(typer)


def _q8_0(builder, p):       # [f16 d][32 x int8]: d * q
    q = builder.sitofp(_load(builder, _at(builder, p, 2), _vec(I8, 32)), _vec(F32, 32))
    return builder.fmul(q, _splat(builder, _half(builder, p), 32))


def _q4_0(builder, p):       # [f16 d][16 bytes of nibbles]: d * (q - 8)
    q = builder.sub(_nibbles(builder, _at(builder, p, 2)), ir.Constant(_vec(I8, 32), [8] * 32))
    return builder.fmul(builder.sitofp(q, _vec(F32, 32)), _splat(builder, _half(builder, p), 32))


def _q4_1(builder, p):       # [f16 d][f16 m][16 bytes of nibbles]: d * q + m  (also KIVI int4 values)
    q = builder.uitofp(_nibbles(builder, _at(builder, p, 4)), _vec(F32, 32))
    return builder.fadd(builder.fmul(q, _splat(builder, _half(builder, p), 32)),
                        _splat(builder, _half(builder, _at(builder, p, 2)), 32))


deq_q8_0 = _decoder(_q8_0)
deq_q4_0 = _decoder(_q4_0)
deq_q4_1 = _decoder(_q4_1)


@intrinsic
def prefetch(typingctx, arr, off):
    """Hint the cache line holding byte `off` of uint8 array `arr` into all cache levels (a hint only:
    never faults, so `off` may point anywhere)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8 and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = builder.gep(_data(context, builder, sig.args[0], args[0]),     # not inbounds: any offset
                        [context.cast(builder, args[1], sig.args[1], types.int64)])
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch.p0", fnty=ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]))
        builder.call(fn, [builder.bitcast(p, I8.as_pointer()), ir.Constant(I32, 0), ir.Constant(I32, 3),
                          ir.Constant(I32, 1)])
        return context.get_dummy_value()
    return types.void(arr, off), codegen


# ----------------------------------------------------------------------------------------------------
# integer dot products against row-interleaved weight tiles (AVX-512 VNNI: vpdpbusd)
# ----------------------------------------------------------------------------------------------------

def _host_has_vnni() -> bool:
    """True when Numba compiles for this host (no NUMBA_CPU_NAME / NUMBA_CPU_FEATURES override) and the
    host has AVX-512 BW + VNNI (vpdpbusd on zmm).
    PYKV_NO_VNNI=1 forces the float tile kernels (for tests and comparisons)."""
    import os

    import llvmlite.binding as llvm
    from numba.core import config
    if os.environ.get("PYKV_NO_VNNI") or config.CPU_NAME not in (None, "host") or config.CPU_FEATURES:
        return False
    try:
        f = llvm.get_host_cpu_features()
        return bool(f.get("avx512vnni") and f.get("avx512bw") and f.get("avx512f") and f.get("f16c"))
    except Exception:          # pragma: no cover - exotic llvmlite builds
        return False


HAS_VNNI = _host_has_vnni()
TILE_ROWS = 64          # rows per weight tile: four 16-lane groups


def _ld_at(builder, base, off, ty, align=1):
    """Load a value of type ty at element offset off (i64 value) of pointer base."""
    return builder.load(builder.bitcast(builder.gep(base, [off], inbounds=True), ty.as_pointer()), align=align)


def _c(v):
    return ir.Constant(I64, v)


def _halves16(builder, base, off):
    """16 consecutive f16 (uint16 element offset off of base) -> <16 x float>."""
    return _fpext_half(builder, _ld_at(builder, base, off, _vec(I16, 16), 2))


def _tile_dot(q4):
    """Intrinsic (qt, sc, xq, xd, xs, nb, out): out[0:64] = the tile's 64 rows . x.

    Tile layout (one tile of TILE_ROWS rows, nb blocks of 32 columns), groups of 4 columns per 32-bit lane:
      Q4 (Q4_0 / Q4_1): qt uint8 [nb][4 groups jj][64 rows][4 bytes]: byte c of group jj holds columns
          4jj+c (low nibble) and 16+4jj+c (high nibble) of the row's block, as ggml's qs[4jj+c];
          sc uint16 [nb][2][64] = f16 d and m per row (Q4_0 stored as m = -8 d).
          row . x = sum_b d*xd_b * sum_j q_j xq_j  +  m * xd_b * xs_b   (xs_b: int sum of xq's block)
      Q8 (Q8_0): qt uint8 [nb][8 groups][64 rows][4 bytes] = ggml's int8 qs XOR 0x80 (= q + 128, unsigned);
          sc uint16 [nb][64] = f16 d.  Both are llama.cpp's q4_0/q4_1/q8_0 x q8 dots, exactly.
          row . x = sum_b d*xd_b * (sum_j (q_j + 128) xq_j - 128 * xs_b)
    x is llama.cpp's q8 activation: xq int8 [nb*32], xd f32 [nb].  vpdpbusd multiplies 4 unsigned
    weight bytes by 4 signed activation bytes and adds the 4 products to each int32 lane (one row),
    so a block costs 8 vpdpbusd per 16 rows; the per-block int32 sums are scaled in float."""
    groups = 4 if q4 else 8

    def typer(typingctx, qt, sc, xq, xd, xa, nb, out):
        ok = (isinstance(qt, types.Array) and qt.dtype == types.uint8 and isinstance(sc, types.Array)
              and sc.dtype == types.uint16 and isinstance(xq, types.Array) and xq.dtype == types.int8
              and isinstance(xd, types.Array) and xd.dtype == types.float32 and isinstance(xa, types.Array)
              and xa.dtype == types.int32 and isinstance(nb, types.Integer)
              and isinstance(out, types.Array) and out.dtype == types.float32)
        if not ok:
            return None

        def codegen(context, builder, sig, args):
            qtp, scp, xqp, xdp, xap = (_data(context, builder, sig.args[i], args[i]) for i in range(5))
            nbv = context.cast(builder, args[5], sig.args[5], types.int64)
            outp = _data(context, builder, sig.args[6], args[6])
            dp = builder.module.declare_intrinsic(
                "llvm.x86.avx512.vpdpbusd.512", fnty=ir.FunctionType(_vec(I32, 16), [_vec(I32, 16)] * 3))
            zero_f = ir.Constant(_vec(F32, 16), [0.0] * 16)
            zero_i = ir.Constant(_vec(I32, 16), [0] * 16)
            m15 = ir.Constant(_vec(I8, 64), [15] * 64)
            sh4 = ir.Constant(_vec(I8, 64), [4] * 64)
            sums = [cgutils.alloca_once_value(builder, zero_f) for _ in range(4)]
            with cgutils.for_range(builder, nbv) as loop:
                b = loop.index
                acc = [zero_i] * 4
                xb = builder.mul(b, _c(32))
                qb = builder.mul(b, _c(groups * 256))
                for jj in range(groups):
                    if q4:
                        xs = [_ld_at(builder, xqp, builder.add(xb, _c(4 * jj)), I32),
                              _ld_at(builder, xqp, builder.add(xb, _c(16 + 4 * jj)), I32)]
                    else:
                        xs = [_ld_at(builder, xqp, builder.add(xb, _c(4 * jj)), I32)]
                    xs = [_splat(builder, v, 16) for v in xs]
                    for k in range(4):
                        w = _ld_at(builder, qtp, builder.add(qb, _c(256 * jj + 64 * k)), _vec(I8, 64))
                        if q4:
                            lo = builder.bitcast(builder.and_(w, m15), _vec(I32, 16))
                            hi = builder.bitcast(builder.and_(builder.lshr(w, sh4), m15), _vec(I32, 16))
                            acc[k] = builder.call(dp, [builder.call(dp, [acc[k], lo, xs[0]]), hi, xs[1]])
                        else:
                            acc[k] = builder.call(dp, [acc[k], builder.bitcast(w, _vec(I32, 16)), xs[0]])
                xdb = _splat(builder, _ld_at(builder, xdp, b, F32, 4), 16)
                xsv = _ld_at(builder, xap, b, I32, 4)
                if q4:
                    xfb = _splat(builder, builder.fmul(_ld_at(builder, xdp, b, F32, 4),
                                                       builder.sitofp(xsv, F32)), 16)
                else:
                    xsb = _splat(builder, builder.mul(xsv, ir.Constant(I32, 128)), 16)
                sb = builder.mul(b, _c(128 if q4 else 64))
                for k in range(4):
                    d = _halves16(builder, scp, builder.add(sb, _c(16 * k)))
                    a = acc[k] if q4 else builder.sub(acc[k], xsb)
                    s = builder.fadd(builder.load(sums[k]),
                                     builder.fmul(builder.fmul(d, xdb), builder.sitofp(a, _vec(F32, 16))))
                    if q4:
                        s = builder.fadd(s, builder.fmul(_halves16(builder, scp, builder.add(sb, _c(64 + 16 * k))), xfb))
                    builder.store(s, sums[k])
            for k in range(4):
                p = builder.gep(outp, [_c(16 * k)], inbounds=True)
                builder.store(builder.load(sums[k]), builder.bitcast(p, _vec(F32, 16).as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(qt, sc, xq, xd, xa, nb, out), codegen
    typer.__name__ = "dot_tile_q4" if q4 else "dot_tile_q8"
    return intrinsic(typer)


dot_tile_q4 = _tile_dot(True)
dot_tile_q8 = _tile_dot(False)
