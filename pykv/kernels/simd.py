"""Explicit short-vector block decoders (Numba intrinsics emitting generic LLVM vector IR).

LLVM's auto-vectorizer leaves some of the block loops scalar (a q8_0 block of 32 became 64 scalar
movsbl / vcvtsi2ss / vmulss), so the hot per-block decodes are written here once as whole-block vector
operations.  The IR is target-independent (<32 x i8> loads, sitofp, fmul by a splat, one <32 x float>
store); LLVM lowers it to the host's widest vectors (AVX-512: two zmm, AVX2: four ymm, NEON: 8 q-regs).

Each decoder reads ONE ggml block at byte offset `so` of the uint8 array `src` and writes its 32 floats
to the float32 array `dst` (any dimension, C-contiguous) at flat element offset `do`.  Like every kernel
here they do no bounds checks: callers pass offsets inside the arrays.

gemm_tile(MR, NR, add) is the register-blocked float32 GEMM micro-tile of attention's prefill (the same
generic vector IR: <8 x float> accumulators and llvm.fmuladd); qk_rows / pv_rows are decode attention's
scores and value sums over f16 or f32 rows (kernels.attn_rows); fwht is the Hadamard rotation of a
head (ops._fwht_vec).
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

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


@intrinsic
def f16_store32(typingctx, x, xo, dst, do):
    """Write x[xo:xo + 32] (float32) as 32 IEEE halves at byte do of uint8 dst, rounded to nearest even
    (LLVM fptrunc: vcvtps2ph, one instruction per 16 values, where the scalar f32_to_f16_bits takes
    ~20 integer operations a value); True when written.  Returns False and writes nothing when a value
    is NaN (the scalar path keeps numpy's NaN bits, the hardware sets the quiet bit), when either
    array is strided, or on a GPU (the caller's scalar path runs then)."""
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 1
            and isinstance(dst, types.Array) and dst.dtype == types.uint8 and dst.ndim == 1
            and isinstance(xo, types.Integer) and isinstance(do, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        B1 = ir.IntType(1)
        if _nvptx(builder):
            return ir.Constant(B1, 0)
        done = cgutils.alloca_once_value(builder, ir.Constant(B1, 0))
        xa = context.make_array(sig.args[0])(context, builder, args[0])
        da = context.make_array(sig.args[2])(context, builder, args[2])
        xs = cgutils.unpack_tuple(builder, xa.strides, 1)[0]
        ds = cgutils.unpack_tuple(builder, da.strides, 1)[0]
        flat = builder.and_(builder.icmp_signed("==", xs, ir.Constant(xs.type, 4)),
                            builder.icmp_signed("==", ds, ir.Constant(ds.type, 1)))
        with builder.if_then(flat):
            v = _load(builder, _ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]), _vec(F32, 32))
            nan = builder.bitcast(builder.fcmp_unordered("uno", v, v), I32)
            with builder.if_then(builder.icmp_unsigned("==", nan, ir.Constant(I32, 0))):
                h = builder.bitcast(builder.fptrunc(v, _vec(F16, 32)), _vec(I16, 32))
                p = _ptr(context, builder, sig.args[2], args[2], args[3], sig.args[3])
                builder.store(h, builder.bitcast(p, _vec(I16, 32).as_pointer()), align=1)
                builder.store(ir.Constant(B1, 1), done)
        return builder.load(done)
    return types.boolean(x, xo, dst, do), codegen


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
        _prefetch(builder, _data(context, builder, sig.args[0], args[0]),
                  context.cast(builder, args[1], sig.args[1], types.int64))
        return context.get_dummy_value()
    return types.void(arr, off), codegen


def _prefetch(builder, base, off, locality=3):
    """IR: prefetch the cache line at base + off (off an i64 value; base a pointer; not inbounds: any
    offset, a hint never faults); locality 3: into all cache levels, 0: non-temporal (x86 prefetchnta:
    a read-once stream that should not evict the caches' other data)."""
    p = builder.gep(base, [off])
    fn = builder.module.declare_intrinsic(
        "llvm.prefetch.p0", fnty=ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32, I32]))
    builder.call(fn, [builder.bitcast(p, I8.as_pointer()), ir.Constant(I32, 0), ir.Constant(I32, locality),
                      ir.Constant(I32, 1)])


def _gemm_typer(MR, NR, add):
    """Typer of a register-blocked float32 GEMM micro-tile (see gemm_tile)."""
    NV = NR // 8
    v8 = _vec(F32, 8)

    def typer(typingctx, A, am, ak, B, C, m0, n0, K):
        if not (all(isinstance(a, types.Array) and a.dtype == types.float32 for a in (A, B, C))
                and B.ndim == C.ndim == 2 and B.layout == C.layout == "C"
                and all(isinstance(i, types.Integer) for i in (am, ak, m0, n0, K))):
            return None

        def codegen(context, builder, sig, args):
            i64 = [context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 5, 6, 7)]
            am_, ak_, m0_, n0_, k_ = i64
            ap, bp, cp = (_data(context, builder, sig.args[i], args[i]) for i in (0, 3, 4))
            ldb = cgutils.unpack_tuple(builder, context.make_array(sig.args[3])(context, builder, args[3]).shape, 2)[1]
            ldc = cgutils.unpack_tuple(builder, context.make_array(sig.args[4])(context, builder, args[4]).shape, 2)[1]
            fma = builder.module.declare_intrinsic("llvm.fmuladd.v8f32", fnty=ir.FunctionType(v8, [v8] * 3))

            def vptr(p, off):
                return builder.bitcast(builder.gep(p, [off], inbounds=True), v8.as_pointer())

            crow = [builder.add(builder.mul(builder.add(m0_, ir.Constant(I64, i)), ldc), n0_) for i in range(MR)]
            cv = [[vptr(cp, builder.add(crow[i], ir.Constant(I64, 8 * v))) for v in range(NV)] for i in range(MR)]
            init = [[builder.load(cv[i][v], align=4) if add else ir.Constant(v8, [0.0] * 8) for v in range(NV)]
                    for i in range(MR)]
            arow = [builder.mul(builder.add(m0_, ir.Constant(I64, i)), am_) for i in range(MR)]
            pre = builder.block
            loop = builder.append_basic_block("gemm.k")
            done = builder.append_basic_block("gemm.done")
            builder.branch(loop)
            builder.position_at_end(loop)            # do k = 0 .. K-1 (K >= 1), accumulators in registers
            k = builder.phi(I64)
            acc = [[builder.phi(v8) for _ in range(NV)] for _ in range(MR)]
            k.add_incoming(ir.Constant(I64, 0), pre)
            boff = builder.add(builder.mul(k, ldb), n0_)
            bv = [builder.load(vptr(bp, builder.add(boff, ir.Constant(I64, 8 * v))), align=4) for v in range(NV)]
            koff = builder.mul(k, ak_)
            new = []
            for i in range(MR):
                a = _splat(builder, builder.load(builder.gep(ap, [builder.add(arow[i], koff)], inbounds=True)), 8)
                new.append([builder.call(fma, [a, bv[v], acc[i][v]]) for v in range(NV)])
            k1 = builder.add(k, ir.Constant(I64, 1))
            end = builder.block
            k.add_incoming(k1, end)
            for i in range(MR):
                for v in range(NV):
                    acc[i][v].add_incoming(init[i][v], pre)
                    acc[i][v].add_incoming(new[i][v], end)
            builder.cbranch(builder.icmp_signed("<", k1, k_), loop, done)
            builder.position_at_end(done)
            for i in range(MR):
                for v in range(NV):
                    builder.store(new[i][v], cv[i][v], align=4)
            return context.get_dummy_value()
        return types.void(A, am, ak, B, C, m0, n0, K), codegen
    typer.__name__ = f"gemm_{MR}x{NR}" + ("_add" if add else "")
    return typer


def gemm_tile(MR, NR, add):
    """Intrinsic (A, am, ak, B, C, m0, n0, K): for i < MR, C[m0 + i, n0:n0 + NR] = (C[...] if add else 0)
    + sum_{k < K} A.flat[(m0 + i) * am + k * ak] * B[k, n0:n0 + NR].  A: any float32 array read through
    element strides (am, ak); B, C: 2-D C-contiguous float32; NR a multiple of 8; K >= 1.  The MR x NR
    outputs stay in registers (MR * NR / 8 <8 x float> accumulators) over the k loop: each step is NR / 8
    vector loads of B, MR broadcasts of A and MR * NR / 8 fused multiply-adds (the micro-kernel of a
    BLAS GEMM; generic vector IR, lowered to ymm FMA on x86 with FMA).  No bounds checks."""
    return intrinsic(_gemm_typer(MR, NR, add))


def _stack_codegen(dtype, aty):
    def codegen(context, builder, sig, args):
        lty = context.get_data_type(dtype)
        item = context.get_abi_sizeof(lty)
        n = max(1, int(sig.args[0].literal_value))
        # in the function's entry block: one slot per call of the function, whatever loop the call sits
        # in; 64-byte aligned for whole-vector loads
        with builder.goto_entry_block():
            buf = builder.alloca(ir.ArrayType(lty, n))
            buf.align = 64
        data = builder.bitcast(buf, lty.as_pointer())
        dims = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:])]
        strides, acc = [], ir.Constant(dims[0].type, item)
        for d in reversed(dims):
            strides.insert(0, acc)
            acc = builder.mul(acc, d)
        ary = context.make_array(aty)(context, builder)
        populate_array(ary, data=data, shape=dims, strides=strides,
                       itemsize=context.get_constant(types.intp, item), meminfo=None)
        return ary._getvalue()
    return codegen


def stack_array(dtype, ndim):
    """Intrinsic (cap, n0[, n1]) -> an uninitialized C-contiguous array of shape (n0[, n1]) in the calling
    function's stack frame, room for cap (a literal) elements: the caller checks n0 * n1 <= cap.  Scratch
    of a kernel's work item without malloc / free, in memory the optimizer knows aliases nothing else
    (np.empty's blocks come from a call it cannot see through, so loops over several get alias checks).
    It must not outlive the call: never returned or stored."""
    aty = types.Array(dtype, ndim, "C")

    def ok(cap, shape):
        return isinstance(cap, types.IntegerLiteral) and all(isinstance(n, types.Integer) for n in shape)

    if ndim == 1:
        def typer(typingctx, cap, n0):
            return (aty(cap, n0), _stack_codegen(dtype, aty)) if ok(cap, (n0,)) else None
    else:
        def typer(typingctx, cap, n0, n1):
            return (aty(cap, n0, n1), _stack_codegen(dtype, aty)) if ok(cap, (n0, n1)) else None
    typer.__name__ = f"stack_{dtype}_{ndim}d"
    return intrinsic(typer)


# ---- decode attention over f16 or f32 key / value rows (attention._item) -----------------------------

def _rows_elem(src):
    """The element type of key / value rows in `src`: uint8 bytes hold f16 rows, float32 arrays f32 rows."""
    if isinstance(src, types.Array) and src.layout == "C" and src.dtype in (types.uint8, types.float32):
        return F16 if src.dtype == types.uint8 else F32
    return None


def _row_vec(builder, base, elem, e, W):
    """<W x float>: W elements from element index e (i64) of the row at byte pointer base (i8*)."""
    if elem is F16:
        p = builder.gep(builder.bitcast(base, I16.as_pointer()), [e], inbounds=True)
        return _fpext_half(builder, _load(builder, p, _vec(I16, W)))
    p = builder.gep(builder.bitcast(base, F32.as_pointer()), [e], inbounds=True)
    return _load(builder, p, _vec(F32, W))


def _sum_lanes(builder, vecs, W):
    """The KG = len(vecs) lane sums of <W x float> vectors as one <KG x float> (KG a power of two <= W):
    pairs of vectors are folded into one holding both halves' sums (two shuffles and an add), so a key's
    sum costs about 3 operations where a horizontal sum of its own vector costs 8."""
    m, w = 1, W                     # each vector: m segments of w lanes, one key's partial sums each
    while len(vecs) > 1:
        lo, hi = [], []
        for t in range(2 * m):      # new segment t: segment t % m of u (t < m) or of v
            src = (t % m) * w + (0 if t < m else W)
            lo += list(range(src, src + w // 2))
            hi += list(range(src + w // 2, src + w))
        mlo, mhi = ir.Constant(_vec(I32, W), lo), ir.Constant(_vec(I32, W), hi)
        vecs = [builder.fadd(builder.shuffle_vector(u, v, mlo), builder.shuffle_vector(u, v, mhi))
                for u, v in zip(vecs[::2], vecs[1::2])]
        m, w = 2 * m, w // 2
    v = vecs[0]
    n = W
    while w > 1:                    # one vector of m keys x w lanes: fold each segment's halves
        lo = [s * w + i for s in range(m) for i in range(w // 2)]
        hi = [s * w + w // 2 + i for s in range(m) for i in range(w // 2)]
        u = ir.Constant(_vec(F32, n), ir.Undefined)
        v = builder.fadd(builder.shuffle_vector(v, u, ir.Constant(_vec(I32, len(lo)), lo)),
                         builder.shuffle_vector(v, u, ir.Constant(_vec(I32, len(hi)), hi)))
        n, w = len(lo), w // 2
    return v


def qk_rows(RB, KG, W):
    """Intrinsic (q, x0, src, so, rb, s, r0): s[x0 + i, r0:r0 + KG] = q[x0 + i, :] . key r for i < RB and
    the KG keys r whose rows start at byte so + r * rb of src (uint8: f16 rows, float32: f32 rows);
    q, s: float32 2-D C-contiguous, HD = q.shape[1] a multiple of W (>= W).  The RB x KG products stay
    in registers over the HD loop (<W x float> each), then _sum_lanes folds them: no horizontal sum
    per key.  No bounds checks."""
    def typer(typingctx, q, x0, src, so, rb, s, r0):
        elem = _rows_elem(src)
        if elem is None or not (all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2
                                    and a.layout == "C" for a in (q, s))
                                and all(isinstance(i, types.Integer) for i in (x0, so, rb, r0))):
            return None

        def codegen(context, builder, sig, args):
            x0_, so_, rb_, r0_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 3, 4, 6))
            qa = context.make_array(sig.args[0])(context, builder, args[0])
            sa = context.make_array(sig.args[5])(context, builder, args[5])
            HD = cgutils.unpack_tuple(builder, qa.shape, 2)[1]
            lds = cgutils.unpack_tuple(builder, sa.shape, 2)[1]
            base = builder.gep(builder.bitcast(_data(context, builder, sig.args[2], args[2]), I8.as_pointer()),
                               [so_], inbounds=True)
            krow = [builder.gep(base, [builder.mul(rb_, ir.Constant(I64, r))], inbounds=True) for r in range(KG)]
            qrow = [builder.gep(qa.data, [builder.mul(builder.add(x0_, ir.Constant(I64, i)), HD)], inbounds=True)
                    for i in range(RB)]
            vw = _vec(F32, W)
            fma = builder.module.declare_intrinsic(f"llvm.fmuladd.v{W}f32", fnty=ir.FunctionType(vw, [vw] * 3))
            pre = builder.block
            loop = builder.append_basic_block("qk.e")
            done = builder.append_basic_block("qk.done")
            builder.branch(loop)
            builder.position_at_end(loop)
            e = builder.phi(I64)
            acc = [[builder.phi(vw) for _ in range(KG)] for _ in range(RB)]
            e.add_incoming(ir.Constant(I64, 0), pre)
            qv = [_load(builder, builder.gep(qrow[i], [e], inbounds=True), vw) for i in range(RB)]
            new = [[None] * KG for _ in range(RB)]
            for r in range(KG):
                kv = _row_vec(builder, krow[r], elem, e, W)
                for i in range(RB):
                    new[i][r] = builder.call(fma, [qv[i], kv, acc[i][r]])
            e1 = builder.add(e, ir.Constant(I64, W))
            end = builder.block
            e.add_incoming(e1, end)
            for i in range(RB):
                for r in range(KG):
                    acc[i][r].add_incoming(ir.Constant(vw, [0.0] * W), pre)
                    acc[i][r].add_incoming(new[i][r], end)
            builder.cbranch(builder.icmp_signed("<", e1, HD), loop, done)
            builder.position_at_end(done)
            for i in range(RB):
                tot = _sum_lanes(builder, new[i], W)
                off = builder.add(builder.mul(builder.add(x0_, ir.Constant(I64, i)), lds), r0_)
                p = builder.gep(sa.data, [off], inbounds=True)
                if KG == 1:
                    builder.store(tot if tot.type == F32 else builder.extract_element(tot, ir.Constant(I32, 0)), p)
                else:
                    builder.store(tot, builder.bitcast(p, tot.type.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(q, x0, src, so, rb, s, r0), codegen
    typer.__name__ = f"qk_rows_{RB}x{KG}_{W}"
    return intrinsic(typer)


def pv_rows(RB, NV, W):
    """Intrinsic (p, x0, src, so, rb, n, acc, c0): acc[x0 + i, c0:c0 + NV * W] += sum_{r < n} p[x0 + i, r] *
    value r[c0:c0 + NV * W] for i < RB, value r's row at byte so + r * rb of src (uint8: f16 rows, float32:
    f32 rows); p, acc: float32 2-D C-contiguous; n >= 1.  The RB x NV accumulators stay in registers over
    the keys (the value row is read and converted once for the RB rows).  No bounds checks."""
    def typer(typingctx, p, x0, src, so, rb, n, acc, c0):
        elem = _rows_elem(src)
        if elem is None or not (all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2
                                    and a.layout == "C" for a in (p, acc))
                                and all(isinstance(i, types.Integer) for i in (x0, so, rb, n, c0))):
            return None

        def codegen(context, builder, sig, args):
            x0_, so_, rb_, n_, c0_ = (context.cast(builder, args[i], sig.args[i], types.int64)
                                      for i in (1, 3, 4, 5, 7))
            pa = context.make_array(sig.args[0])(context, builder, args[0])
            aa = context.make_array(sig.args[6])(context, builder, args[6])
            ldp = cgutils.unpack_tuple(builder, pa.shape, 2)[1]
            lda = cgutils.unpack_tuple(builder, aa.shape, 2)[1]
            base = builder.gep(builder.bitcast(_data(context, builder, sig.args[2], args[2]), I8.as_pointer()),
                               [so_], inbounds=True)
            vw = _vec(F32, W)
            fma = builder.module.declare_intrinsic(f"llvm.fmuladd.v{W}f32", fnty=ir.FunctionType(vw, [vw] * 3))
            prow = [builder.gep(pa.data, [builder.mul(builder.add(x0_, ir.Constant(I64, i)), ldp)], inbounds=True)
                    for i in range(RB)]
            aptr = [[builder.bitcast(builder.gep(aa.data, [builder.add(builder.mul(
                builder.add(x0_, ir.Constant(I64, i)), lda), builder.add(c0_, ir.Constant(I64, v * W)))],
                inbounds=True), vw.as_pointer()) for v in range(NV)] for i in range(RB)]
            init = [[builder.load(aptr[i][v], align=4) for v in range(NV)] for i in range(RB)]
            pre = builder.block
            loop = builder.append_basic_block("pv.r")
            done = builder.append_basic_block("pv.done")
            builder.branch(loop)
            builder.position_at_end(loop)
            r = builder.phi(I64)
            a = [[builder.phi(vw) for _ in range(NV)] for _ in range(RB)]
            r.add_incoming(ir.Constant(I64, 0), pre)
            row = builder.gep(base, [builder.mul(r, rb_)], inbounds=True)
            vv = [_row_vec(builder, row, elem, builder.add(c0_, ir.Constant(I64, v * W)), W) for v in range(NV)]
            new = []
            for i in range(RB):
                w = _splat(builder, builder.load(builder.gep(prow[i], [r], inbounds=True)), W)
                new.append([builder.call(fma, [w, vv[v], a[i][v]]) for v in range(NV)])
            r1 = builder.add(r, ir.Constant(I64, 1))
            end = builder.block
            r.add_incoming(r1, end)
            for i in range(RB):
                for v in range(NV):
                    a[i][v].add_incoming(init[i][v], pre)
                    a[i][v].add_incoming(new[i][v], end)
            builder.cbranch(builder.icmp_signed("<", r1, n_), loop, done)
            builder.position_at_end(done)
            for i in range(RB):
                for v in range(NV):
                    builder.store(new[i][v], aptr[i][v], align=4)
            return context.get_dummy_value()
        return types.void(p, x0, src, so, rb, n, acc, c0), codegen
    typer.__name__ = f"pv_rows_{RB}x{NV}_{W}"
    return intrinsic(typer)


FWHT_SIZES = (16, 32, 64, 128)     # head dims the vector Hadamard transform covers


@intrinsic
def fwht(typingctx, v, sign, inverse):
    """ops._fwht_vec as whole-vector IR: v (float32, C, length HD) <- H diag(sign) v / sqrt(HD) (inverse:
    diag(sign) H v / sqrt(HD)) in place, the butterfly's stages as a shuffle, add, subtract and select
    each, the scaling in float64 as the scalar code does it: the same bits.  Returns False (and leaves
    v alone) when HD is not in FWHT_SIZES."""
    if not (isinstance(v, types.Array) and v.ndim == 1 and v.layout == "C" and v.dtype == types.float32
            and isinstance(sign, types.Array) and sign.ndim == 1 and sign.dtype == types.float32
            and isinstance(inverse, types.Boolean)):
        return None

    def codegen(context, builder, sig, args):
        va = context.make_array(sig.args[0])(context, builder, args[0])
        sa = context.make_array(sig.args[1])(context, builder, args[1])
        HD = cgutils.unpack_tuple(builder, va.shape, 1)[0]
        inv = context.cast(builder, args[2], sig.args[2], types.boolean)
        done = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(1), 0))
        end = builder.append_basic_block("fwht.end")
        sw = builder.switch(HD, end)
        for n in FWHT_SIZES:
            bb = builder.append_basic_block(f"fwht.{n}")
            sw.add_case(ir.Constant(HD.type, n), bb)
            builder.position_at_end(bb)
            vf, vd = _vec(F32, n), _vec(ir.DoubleType(), n)
            vp = builder.bitcast(va.data, vf.as_pointer())
            x = builder.load(vp, align=4)
            sg = builder.load(builder.bitcast(sa.data, vf.as_pointer()), align=4)
            x = builder.select(inv, x, builder.fmul(x, sg))
            s = 1
            while s < n:
                p = builder.shuffle_vector(x, ir.Constant(vf, ir.Undefined), ir.Constant(_vec(I32, n), [i ^ s for i in range(n)]))
                low = ir.Constant(_vec(ir.IntType(1), n), [int(i & s == 0) for i in range(n)])
                x = builder.select(low, builder.fadd(x, p), builder.fsub(p, x))
                s *= 2
            norm = ir.Constant(vd, [1.0 / float(n) ** 0.5] * n)
            scale = builder.select(inv, builder.fmul(norm, builder.fpext(sg, vd)), norm)
            builder.store(builder.fptrunc(builder.fmul(builder.fpext(x, vd), scale), vf), vp, align=4)
            builder.store(ir.Constant(ir.IntType(1), 1), done)
            builder.branch(end)
        builder.position_at_end(end)
        return builder.load(done)
    return types.boolean(v, sign, inverse), codegen
