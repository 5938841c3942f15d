"""Integer-dot attention over q8_0 cache rows (CPU): the scores q . K and the sums p . V read a
segment's q8_0 rows in place, with no f32 tile in between (attention._item's q8_0 path).

    scores_q8_0_{1,3}(src, o0, rb, n, xq, xd, s, x0)
        s[x0 + x, r] = q_x . K_r for the 1 / 3 query rows x0 + x and the keys r < n (row r at byte
        o0 + r * rb of src: ggml q8_0 blocks [f16 d][32 x int8], HD / 32 of them).  q_x is the query
        row's int16 form (xq int16 (R, HD), xd f32 (R, HD / 32): attention._quant_q16), so per block b
        the int32 dot k_b . xq_x,b is exact and s = sum_b d_b * xd_x,b * (k_b . xq_x,b).  Keys go in
        groups of L (the vector's int32 lanes); a group's lanes past n repeat key n - 1 (never a row
        past the segment) and are stored too, so s needs n rounded up to L columns (attention's
        TILE = 32 columns are).
    accum_q8_0_{1,3}(src, o0, rb, n, s, x0, acc)
        acc[x0 + x] += sum_{r < n} s[x0 + x, r] * V_r for V rows in the same layout: each block's 32
        int8 values become floats once per key and go to the 1 / 3 rows with weight s[x, r] * d_b
        (the block scale folded into the softmax weight); a block's accumulators stay in registers.

The scores work in units of 64 key values (two blocks; HD must be a multiple: ok_hd).  Per key and
query row, each block's 32 int8 keys (sign-extended) and int16 queries go through vpmaddwd (AVX-512BW
zmm on the avx512vnni class, AVX2 ymm otherwise, generic vector IR where neither exists), leaving L
int32 partial sums; they are scaled to float, and the L keys' vectors are summed lane-wise by a
transpose-and-add tree (2 shuffles + 1 add per pair), which leaves the L keys' scores in the L lanes
of one vector: L - 1 combines per L keys instead of a log2(L)-step horizontal sum per key.

Like every kernel here they do no bounds checks: callers pass rows and s / acc rows inside the arrays.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pykv.kernels.simd import F32, I8, I16, I32, I64, _data, _fpext_half, _splat, _vec
from pykv.kernels.tiles import ISA, L, _arr, _call

UNIT = 64                 # key values per scores step (two q8_0 blocks): HD must be a multiple
# int16 pair dots into int32 lanes, per class (vpmaddwd); None: generic vector IR
_PMADD = {"avx512vnni": "llvm.x86.avx512.pmaddw.d.512", "avxvnni": "llvm.x86.avx2.pmadd.wd",
          "avx2": "llvm.x86.avx2.pmadd.wd"}.get(ISA)


def ok_hd(HD: int) -> bool:
    """Whether the scores kernels handle head dimension HD (whole 64-value units)."""
    return HD % UNIT == 0


def _wdot(builder, k, x):
    """<L x i32>: lane i = sum over the 32 / L pairs of int16 products k . x in lane i's share of the
    32 values (k, x: <32 x i16>): vpmaddwd (zmm: one, ymm: two and an add), or generic vector IR."""
    vi = _vec(I32, L)
    if _PMADD is not None:
        if L == 16:
            return _call(builder, _PMADD, vi, [k, x])
        halves = [[builder.shuffle_vector(v, v, ir.Constant(_vec(I32, 16), list(range(16 * h, 16 * h + 16))))
                   for v in (k, x)] for h in range(2)]
        return builder.add(*(_call(builder, _PMADD, vi, hv) for hv in halves))
    p = builder.mul(builder.sext(k, _vec(I32, 32)), builder.sext(x, _vec(I32, 32)))
    per = 32 // L
    acc = None
    for j in range(per):
        t = builder.shuffle_vector(p, p, ir.Constant(vi, list(range(j, 32, per))))
        acc = t if acc is None else builder.add(acc, t)
    return acc


def _c(v):
    return ir.Constant(I64, v)


def _i64(context, builder, sig, args, i):
    return context.cast(builder, args[i], sig.args[i], types.int64)


def _rows(context, builder, sig, args):
    """The segment arguments (src, o0, rb, n) as IR: src's byte pointer, then i64 values."""
    return (_data(context, builder, sig.args[0], args[0]),
            *(_i64(context, builder, sig, args, i) for i in (1, 2, 3)))


def _shape(context, builder, aty, arr):
    return cgutils.unpack_tuple(builder, context.make_array(aty)(context, builder, arr).shape)


def _ld(builder, p, off, ty, align=1):
    return builder.load(builder.bitcast(builder.gep(p, [off], inbounds=True), ty.as_pointer()), align=align)


def _half_at(builder, p, off):
    return _fpext_half(builder, _ld(builder, p, off, I16))


def _combine(builder, a, b, lev):
    """Tree level lev: a and b each hold 2**lev keys' partial sums, w = L >> lev lanes per key (key k in
    lanes [k w, k w + w)); returns 2**(lev+1) keys (a's then b's), w / 2 lanes each, each lane the sum
    of two of a key's lanes."""
    w = L >> lev
    h = w // 2
    lo = []
    for o in range(L):
        src, oo = (0, o) if o < L // 2 else (L, o - L // 2)
        lo.append(src + (oo // h) * w + oo % h)
    hi = [i + h for i in lo]
    m = _vec(I32, L)
    return builder.fadd(builder.shuffle_vector(a, b, ir.Constant(m, lo)),
                        builder.shuffle_vector(a, b, ir.Constant(m, hi)))


def _push(builder, stack, v):
    """Add key vector v to a binary-counter stack of tree nodes [(level, vector)]."""
    lev = 0
    while stack and stack[-1][0] == lev:
        v = _combine(builder, stack.pop()[1], v, lev)
        lev += 1
    stack.append((lev, v))


def _scores(m):
    def typer(typingctx, src, o0, rb, n, xq, xd, s, x0):
        if not (_arr(src, types.uint8) and _arr(xq, types.int16) and _arr(xd, types.float32)
                and _arr(s, types.float32) and xq.ndim == 2 and xd.ndim == 2 and s.ndim == 2
                and all(isinstance(t, types.Integer) for t in (o0, rb, n, x0))):
            return None

        def codegen(context, builder, sig, args):
            srcp, o0v, rbv, nv = _rows(context, builder, sig, args)
            xqp = _data(context, builder, sig.args[4], args[4])
            xdp = _data(context, builder, sig.args[5], args[5])
            sp = _data(context, builder, sig.args[6], args[6])
            x0v = _i64(context, builder, sig, args, 7)
            HD = _shape(context, builder, sig.args[4], args[4])[1]
            NB = _shape(context, builder, sig.args[5], args[5])[1]
            TS = _shape(context, builder, sig.args[6], args[6])[1]
            vw, vf = _vec(I16, 32), _vec(F32, L)
            last = builder.sub(nv, _c(1))
            groups = builder.sdiv(builder.add(nv, _c(L - 1)), _c(L))
            rows = [builder.add(x0v, _c(x)) for x in range(m)]
            with cgutils.for_range(builder, groups) as gl:
                r0 = builder.mul(gl.index, _c(L))
                accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * L)) for _ in range(m)]
                with cgutils.for_range(builder, builder.sdiv(HD, _c(UNIT))) as ul:
                    b0 = builder.mul(ul.index, _c(2))            # the unit's first block
                    qs = []
                    for row in rows:                # the query rows' two blocks and their scales
                        xo = builder.add(builder.mul(row, HD), builder.mul(b0, _c(32)))
                        xb = builder.add(builder.mul(row, NB), b0)
                        qs.append([(_ld(builder, xqp, builder.add(xo, _c(32 * h)), vw),
                                    _splat(builder, _ld(builder, xdp, builder.add(xb, _c(h)), F32, 4), L))
                                   for h in range(2)])
                    stacks = [[] for _ in range(m)]
                    for k in range(L):
                        r = builder.add(r0, _c(k))
                        r = builder.select(builder.icmp_signed("<", r, nv), r, last)
                        base = builder.add(builder.add(o0v, builder.mul(r, rbv)), builder.mul(b0, _c(34)))
                        kb = [(builder.sext(_ld(builder, srcp, builder.add(base, _c(34 * h + 2)), _vec(I8, 32)), vw),
                               _splat(builder, _half_at(builder, srcp, builder.add(base, _c(34 * h))), L))
                              for h in range(2)]
                        for q2, st in zip(qs, stacks):
                            v = None
                            for (kw, dk), (xw, xdv) in zip(kb, q2):
                                t = builder.fmul(builder.sitofp(_wdot(builder, kw, xw), vf), builder.fmul(dk, xdv))
                                v = t if v is None else builder.fadd(v, t)
                            _push(builder, st, v)
                    for acc, st in zip(accs, stacks):
                        builder.store(builder.fadd(builder.load(acc), st[0][1]), acc)
                for acc, row in zip(accs, rows):
                    p = builder.gep(sp, [builder.add(builder.mul(row, TS), r0)], inbounds=True)
                    builder.store(builder.load(acc), builder.bitcast(p, vf.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(src, o0, rb, n, xq, xd, s, x0), codegen
    typer.__name__ = f"scores_q8_0_{m}"
    return intrinsic(typer)


def _accum(m):
    def typer(typingctx, src, o0, rb, n, s, x0, acc):
        if not (_arr(src, types.uint8) and _arr(s, types.float32) and _arr(acc, types.float32)
                and s.ndim == 2 and acc.ndim == 2
                and all(isinstance(t, types.Integer) for t in (o0, rb, n, x0))):
            return None

        def codegen(context, builder, sig, args):
            srcp, o0v, rbv, nv = _rows(context, builder, sig, args)
            sp = _data(context, builder, sig.args[4], args[4])
            x0v = _i64(context, builder, sig, args, 5)
            ap = _data(context, builder, sig.args[6], args[6])
            TS = _shape(context, builder, sig.args[4], args[4])[1]
            HD = _shape(context, builder, sig.args[6], args[6])[1]
            v32 = _vec(F32, 32)
            rows = [builder.add(x0v, _c(x)) for x in range(m)]
            fma = builder.module.declare_intrinsic("llvm.fmuladd.v32f32", fnty=ir.FunctionType(v32, [v32] * 3))
            with cgutils.for_range(builder, builder.sdiv(HD, _c(32))) as bl:
                b = bl.index
                aps = [builder.bitcast(builder.gep(ap, [builder.add(builder.mul(row, HD), builder.mul(b, _c(32)))],
                                                   inbounds=True), v32.as_pointer()) for row in rows]
                accs = [cgutils.alloca_once_value(builder, builder.load(p, align=4)) for p in aps]
                with cgutils.for_range(builder, nv) as rl:
                    r = rl.index
                    base = builder.add(builder.add(o0v, builder.mul(r, rbv)), builder.mul(b, _c(34)))
                    d = _half_at(builder, srcp, base)
                    v = builder.sitofp(_ld(builder, srcp, builder.add(base, _c(2)), _vec(I8, 32)), v32)
                    for row, acc in zip(rows, accs):
                        c = builder.fmul(_ld(builder, sp, builder.add(builder.mul(row, TS), r), F32, 4), d)
                        builder.store(builder.call(fma, [_splat(builder, c, 32), v, builder.load(acc)]), acc)
                for p, acc in zip(aps, accs):
                    builder.store(builder.load(acc), p, align=4)
            return context.get_dummy_value()
        return types.void(src, o0, rb, n, s, x0, acc), codegen
    typer.__name__ = f"accum_q8_0_{m}"
    return intrinsic(typer)


scores_q8_0_1 = _scores(1)
scores_q8_0_3 = _scores(3)
accum_q8_0_1 = _accum(1)
accum_q8_0_3 = _accum(3)
