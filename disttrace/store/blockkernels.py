"""store/blockdecode.py's four kernels (`_headers`, `_inflate`, `_check`, `_assemble`) compiled by numba (the
optional `fast` extra): what decodes a block where the C build of the same kernels
(disttrace/native/blockdecode.c, a line-for-line port) was not built or DISTTRACE_NATIVE=0. Imported only
then, so that a process with the C kernels never pays numba's import and LLVM's start (~0.7 s of CPU); an
ImportError without numba, as store/blockdecode.py's import was before. What each kernel takes, checks and
writes is in its docstring and in store/blockdecode.py's.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from disttrace.store.blocklayout import (  # the kernels' compile-time constants
    _BIG,
    _BUFFERS,
    _DICT_BUFFERS,
    _DICT_NODES,
    _LZ4_BLOCK,
    _MAX_OFFSET,
    _NB,
    _NODES,
    _O_DEV,
    _O_DTYPE_O,
    _O_DTYPE_S,
    _O_NUMEL,
    _O_PHASE_O,
    _O_PHASE_S,
    _O_SA_C,
    _O_SA_O,
    _O_SA_V,
    _O_SH_O,
    _O_SH_OFF,
    _O_SH_SHAPE,
    _O_SH_V,
    _O_SHAPE_O,
    _O_SHAPE_V,
    _O_SK64_C,
    _O_SK64_CV,
    _O_SK64_V,
    _O_SK_C,
    _O_SK_CV,
    _O_SK_V,
    _O_TENSOR_O,
    _O_TENSOR_S,
    _SHAPE_DIMS_PER_RECORD,
    _SHAPE_DIMS_SLACK,
)


@njit(cache=True, nogil=True)
def _u32(raw, at):  # pragma: no cover - compiled
    return (
        np.int64(raw[at])
        | (np.int64(raw[at + 1]) << 8)
        | (np.int64(raw[at + 2]) << 16)
        | (np.int64(raw[at + 3]) << 24)
    )


@njit(cache=True, nogil=True)
def _i64(raw, at):  # pragma: no cover - compiled
    hi = _u32(raw, at + 4)
    if hi >= 1 << 31:
        hi -= 1 << 32
    return (hi << 32) | _u32(raw, at)


@njit(cache=True, nogil=True)
def _i32(raw, at):  # pragma: no cover - compiled
    v = _u32(raw, at)
    return v - (1 << 32) if v >= 1 << 31 else v


@intrinsic
def _memcpy(typingctx, dst, at, src, start, n):  # pragma: no cover - compiled
    """dst[at:at + n] = src[start:start + n] as LLVM's memcpy (a loop over bytes runs at a byte a cycle, and
    numba's slice assignment costs seconds to compile); the ranges are checked by the caller and never
    overlap."""

    def codegen(context, builder, signature, args):
        d, da, s_, sa, count = args
        dst_arr = context.make_array(signature.args[0])(context, builder, d)
        src_arr = context.make_array(signature.args[2])(context, builder, s_)
        cgutils.raw_memcpy(
            builder, builder.gep(dst_arr.data, [da]), builder.gep(src_arr.data, [sa]), count, 1
        )
        return context.get_dummy_value()

    return types.void(dst, at, src, start, n), codegen


@njit(cache=True, nogil=True)
def _copy(dst, at, src, start, n):  # pragma: no cover - compiled
    """dst[at:at + n] = src[start:start + n], the ranges checked by the caller and apart."""
    if n > 0:
        _memcpy(dst, at, src, start, n)


@njit(cache=True, nogil=True)
def _length(raw, ip, iend, nibble):  # pragma: no cover - compiled
    """A sequence's literal or match length from its token's nibble: 15 continues in the bytes at raw[ip:],
    each added until one below 255. (length, the position after it); length -1 where the input ends first."""
    n = np.int64(nibble)
    if n == 15:
        while True:
            if ip >= iend:
                return -1, ip
            x = np.int64(raw[ip])
            ip += 1
            n += x
            if x != 255:
                break
    return n, ip


@njit(cache=True, nogil=True)
def _lz4_block(raw, ip, iend, out, ostart, olimit):  # pragma: no cover - compiled
    """One LZ4 block raw[ip:iend] decoded into out[ostart:...], at most olimit; its length, or -1. Held to the
    format's rules, which LZ4's own decoder relies on: every sequence but the last has a match, of an offset
    inside the block's output; the last ends the input exactly; the last match starts 12 bytes or more before
    the block's end and ends 5 or more before it."""
    op = ostart
    last_start = -1
    last_end = -1
    while True:
        if ip >= iend:
            return -1
        token = np.int64(raw[ip])
        ip += 1
        lit, ip = _length(raw, ip, iend, token >> 4)
        if lit < 0:
            return -1
        if lit > iend - ip or lit > olimit - op:
            return -1
        _copy(out, op, raw, ip, lit)
        ip += lit
        op += lit
        if ip == iend:
            break
        if iend - ip < 2:
            return -1
        off = np.int64(raw[ip]) | (np.int64(raw[ip + 1]) << 8)
        ip += 2
        if off == 0 or off > op - ostart:
            return -1
        ml, ip = _length(raw, ip, iend, token & 15)
        if ml < 0:
            return -1
        ml += 4
        if ml > olimit - op:
            return -1
        # the match repeats the `off` bytes before it: copied in pieces that never overlap, each as long as
        # what is already repeated (off, 2 off, 4 off, ...)
        src = op - off
        last_start = op
        end = op + ml
        while op < end:
            piece = min(op - src, end - op)
            _copy(out, op, out, src, piece)
            op += piece
        last_end = op
    if last_start >= 0 and (last_start > op - 12 or last_end > op - 5):
        return -1
    return op - ostart


@njit(cache=True, nogil=True)
def _lz4_frame(raw, a, b, out, o, size):  # pragma: no cover - compiled
    """Whether the LZ4 frame raw[a:b] is the writer's kind and decodes to exactly `size` bytes at out[o:]."""
    if b - a < 11:
        return False
    if raw[a] != 0x04 or raw[a + 1] != 0x22 or raw[a + 2] != 0x4D or raw[a + 3] != 0x18:
        return False
    if raw[a + 4] != 0x60 or raw[a + 5] != 0x40 or raw[a + 6] != 0x82:
        return False
    p = a + 7
    op = o
    oend = o + size
    while True:
        if b - p < 4:
            return False
        bs = _u32(raw, p)
        p += 4
        if bs == 0:
            break
        plain = bs >= 1 << 31
        if plain:
            bs -= 1 << 31
        if bs == 0 or bs > _LZ4_BLOCK or bs > b - p:
            return False
        if plain:
            if bs > oend - op:
                return False
            _copy(out, op, raw, p, bs)
            op += bs
        else:
            got = _lz4_block(raw, p, p + bs, out, op, min(oend, op + _LZ4_BLOCK))
            if got < 0:
                return False
            op += got
        p += bs
    return p == b and op == oend


@njit(cache=True, nogil=True)
def _nulls(scratch, at, n):  # pragma: no cover - compiled
    """The zero bits among the first n of the bitmap at scratch[at:]."""
    ones = 0
    full = n >> 3
    for i in range(full):
        x = np.int64(scratch[at + i])
        x = x - ((x >> 1) & 0x55)
        x = (x & 0x33) + ((x >> 2) & 0x33)
        ones += (x + (x >> 4)) & 0x0F
    for i in range(full << 3, n):
        ones += (np.int64(scratch[at + (i >> 3)]) >> (i & 7)) & 1
    return n - ones


@njit(cache=True, nogil=True)
def _put_bits(arena, base, row, scratch, at, n, all_set):  # pragma: no cover - compiled
    """Bits row..row+n of the bitmap at arena[base:] from the first n at scratch[at:] (or all set), a byte
    at a time; the arena starts zeroed, and the source's bits past n are not read."""
    if n <= 0:
        return
    shift = row & 7
    dst = base + (row >> 3)
    full = (n + 7) >> 3
    for i in range(full):
        x = np.int64(255) if all_set else np.int64(scratch[at + i])
        if i == full - 1 and n & 7:
            x &= (1 << (n & 7)) - 1
        arena[dst + i] |= np.uint8((x << shift) & 255)
        if shift and x >> (8 - shift):
            arena[dst + i + 1] |= np.uint8(x >> (8 - shift))


@njit(cache=True, nogil=True)
def _validity(scratch, spos, slen, nn, length):  # pragma: no cover - compiled
    """0 when a step's validity buffer agrees with its node's null count, else a decline code."""
    if nn == 0:
        return 0 if slen < 0 else 9  # the writer leaves the bitmap out when nothing is null
    if slen < (length + 7) >> 3:
        return 6
    if _nulls(scratch, spos, length) != nn:
        return 7
    return 0


@njit(cache=True, nogil=True)
def _headers(
    raw, starts, ends, sizes, tpl_d, mask_d, tpl_b, mask_b, pos, bat, node, buf
):  # pragma: no cover
    """Each step's two messages: their headers the writer's templates but for the values that vary, read into
    bat (per step: the dictionary's length, the batch's), node (length, null count) and buf (where the
    buffer's bytes lie in raw, their length, the size declared, 0 empty / 1 stored / 2 LZ4). raw: the steps'
    bytes joined, step s raw[starts[s]:ends[s]] (after any schema message), sizes[s] its whole length.
    Returns (status, the scratch bytes the buffers take)."""
    n = starts.shape[0]
    scratch_size = 0
    for s in range(n):
        p = starts[s]
        declared = 0
        for m in range(2):
            tpl = tpl_d if m == 0 else tpl_b
            mask = mask_d if m == 0 else mask_b
            size = pos[m, 0]
            if ends[s] - p < size:
                return 1, 0
            for i in range(size):
                if mask[i] == 0 and raw[p + i] != tpl[i]:
                    return 1, 0
            body = _i64(raw, p + pos[m, 1])
            if body < 0 or body > ends[s] - p - size:
                return 1, 0
            # every length below 2^31 (Arrow's 32-bit offsets; a step's records are far fewer): the checks
            # below multiply lengths by widths up to 64, which for a length of 2^58 or more would wrap int64
            # to a small size that passes them
            bat[s, m] = _i64(raw, p + pos[m, 2])
            if bat[s, m] < 0 or bat[s, m] > _MAX_OFFSET:
                return 5, 0
            nodes = _DICT_NODES if m == 0 else _NODES
            first_node = 0 if m == 0 else _DICT_NODES
            for k in range(nodes):
                q = p + pos[m, 3] + 16 * k
                ln = _i64(raw, q)
                nc = _i64(raw, q + 8)
                if ln < 0 or nc < 0 or nc > ln or ln > _MAX_OFFSET:
                    return 5, 0
                node[s, first_node + k, 0] = ln
                node[s, first_node + k, 1] = nc
            buffers = _DICT_BUFFERS if m == 0 else _BUFFERS
            first_buf = 0 if m == 0 else _DICT_BUFFERS
            bstart = p + size
            for k in range(buffers):
                q = p + pos[m, 4] + 16 * k
                off = _i64(raw, q)
                ln = _i64(raw, q + 8)
                j = first_buf + k
                if off < 0 or ln < 0 or off & 7 or off > body or ln > body - off:
                    return 2, 0
                buf[s, j, 0] = 0
                buf[s, j, 1] = 0
                buf[s, j, 2] = 0
                buf[s, j, 3] = 0
                if ln == 0:  # empty
                    continue
                if ln < 8:
                    return 3, 0
                d = _i64(raw, bstart + off)
                buf[s, j, 0] = bstart + off + 8
                buf[s, j, 1] = ln - 8
                if d == -1:  # stored as it is
                    buf[s, j, 2] = ln - 8
                    buf[s, j, 3] = 1
                    declared += ln
                    scratch_size += (ln - 8 + 7) & ~7
                    continue
                # LZ4 expands at most 255-fold: ceil(d / 256) <= ln, as store/trajectory.py bounds it (written
                # so that no d wraps: d + 255 would, for d near 2^63, and two such sizes sum to a small one)
                if d <= 0 or (d - 1) >> 8 >= ln:
                    return 3, 0
                buf[s, j, 2] = d
                buf[s, j, 3] = 2
                declared += d
                scratch_size += (d + 7) & ~7
            p = bstart + body
        if p != ends[s]:
            return 1, 0
        if declared > 32 * sizes[s] + (1 << 20):  # trajectory.STEP_EXPANSION, _step_expansion
            return 12, 0
    return 0, scratch_size


@njit(cache=True, nogil=True)
def _inflate(raw, buf, scratch, spos, slen):  # pragma: no cover - compiled
    """Every buffer decompressed (or copied) into scratch, each at a multiple of 8: spos, slen (-1: an empty
    buffer). Returns a status."""
    at = 0
    for s in range(buf.shape[0]):
        for j in range(_NB):
            slen[s, j] = -1
            spos[s, j] = 0
            kind = buf[s, j, 3]
            if kind == 0:
                continue
            d = buf[s, j, 2]
            src = buf[s, j, 0]
            if kind == 1:
                _copy(scratch, at, raw, src, d)
            elif not _lz4_frame(raw, src, src + buf[s, j, 1], scratch, at, d):
                return 4
            spos[s, j] = at
            slen[s, j] = d
            at += (d + 7) & ~7
    return 0


@njit(cache=True, nogil=True)
def _offsets(s32, o0, length, limit):  # pragma: no cover - compiled
    """The last of length + 1 int32 offsets at s32[o0:], or -1 where one is negative, out of order or past
    limit."""
    prev = np.int64(s32[o0])
    if prev < 0:
        return -1
    for r in range(1, length + 1):
        x = np.int64(s32[o0 + r])
        if x < prev:
            return -1
        prev = x
    return prev if prev <= limit else -1


@njit(cache=True, nogil=True)
def _check(
    scratch, s16, s32, s64, bat, node, spos, slen, fixed, rows, totals
):  # pragma: no cover - compiled
    """Each step's columns held to what the writer writes and Arrow requires; rows (per step) and totals (rows,
    tensor name bytes, phase and dtype bytes, shape values, sample ids, shard values of each half) counted.
    s16, s32, s64: scratch seen as int16, int32, int64 (made in Python: numba's view costs seconds to
    compile). Returns a status."""
    D = _DICT_BUFFERS
    N = _DICT_NODES
    for i in range(totals.shape[0]):
        totals[i] = 0
    for s in range(bat.shape[0]):
        length = bat[s, 1]
        if length <= 0:
            return 5
        for k in range(_NODES):
            child = k == 13 or k == 15 or k == 18 or k == 21
            if not child and node[s, N + k, 0] != length:
                return 5
        for c in range(fixed.shape[0]):
            k, v, dbuf, width = fixed[c, 0], fixed[c, 1], fixed[c, 2], fixed[c, 3]
            e = _validity(scratch, spos[s, D + v], slen[s, D + v], node[s, N + k, 1], length)
            if e:
                return e
            if slen[s, D + dbuf] < length * width:
                return 6
        if node[s, N + 0, 1] or node[s, N + 8, 1]:  # a record without its step or digest
            return 9
        # phase and dtype: string views, every one inline (no data buffer), zero-padded
        for c in range(2):
            k = 2 if c == 0 else 6
            vb = D + (5 if c == 0 else 14)
            if node[s, N + k, 1] or slen[s, D + (4 if c == 0 else 13)] >= 0:
                return 9
            if slen[s, vb] < 16 * length:
                return 6
            w0 = spos[s, vb] >> 3
            for r in range(length):
                lo = s64[w0 + 2 * r]
                hi = s64[w0 + 2 * r + 1]
                size = lo & 0xFFFFFFFF
                if size > 12:
                    return 9
                # the bytes after the name, 4 + size .. 15, are zero: the low word's above byte 4 + size,
                # the high word's above byte size - 4 (shifts of 64 or more would wrap: split by hand)
                if size < 4:
                    if (lo >> (32 + 8 * size)) != 0 or hi != 0:
                        return 9
                elif size < 12 and (hi >> (8 * (size - 4))) != 0:
                    return 9
                totals[2 + c] += size
        # tensor: a string per record
        if node[s, N + 5, 1] or slen[s, D + 10] >= 0:
            return 9
        if slen[s, D + 11] < 4 * (length + 1):
            return 6
        o0 = spos[s, D + 11] >> 2
        last = _offsets(s32, o0, length, max(slen[s, D + 12], 0))
        if last < 0:
            return 8
        totals[1] += last - np.int64(s32[o0])
        # device_digest: a bit per record, never null
        if node[s, N + 9, 1] or slen[s, D + 19] >= 0:
            return 9
        if slen[s, D + 20] < (length + 7) >> 3:
            return 6
        # the shape dictionary: list<int64> without nulls; every entry's product below 2^62
        dn = node[s, 0, 0]
        if bat[s, 0] != dn or dn <= 0 or node[s, 0, 1] or node[s, 1, 1] or slen[s, 0] >= 0:
            return 9
        if slen[s, 2] >= 0:
            return 9
        dv = node[s, 1, 0]
        if slen[s, 1] < 4 * (dn + 1) or max(slen[s, 3], 0) < 8 * dv:
            return 6
        o0 = spos[s, 1] >> 2
        if _offsets(s32, o0, dn, dv) < 0:
            return 8
        v0 = spos[s, 3] >> 3
        for r in range(dn):
            prod = 1.0
            for i in range(np.int64(s32[o0 + r]), np.int64(s32[o0 + r + 1])):
                prod *= abs(np.float64(s64[v0 + i]))
                if prod >= _BIG:
                    return 11
        # the shape's indices: int16, never null, each inside the step's dictionary
        if node[s, N + 7, 1] or slen[s, D + 15] >= 0:
            return 9
        if slen[s, D + 16] < 2 * length:
            return 6
        i0 = spos[s, D + 16] >> 1
        dims = 0
        for r in range(length):
            x = np.int64(s16[i0 + r])
            if x < 0 or x >= dn:
                return 10
            dims += np.int64(s32[o0 + x + 1]) - np.int64(s32[o0 + x])
        if dims > _SHAPE_DIMS_PER_RECORD * length + _SHAPE_DIMS_SLACK:
            return 14
        totals[4] += dims
        # sketch, sketch64: fixed-size lists of 4 floats, nulls in the list and its child
        for c in range(2):
            k = 12 if c == 0 else 14
            pb = 25 if c == 0 else 28
            width = 4 if c == 0 else 8
            e = _validity(scratch, spos[s, D + pb], slen[s, D + pb], node[s, N + k, 1], length)
            if e:
                return e
            if node[s, N + k + 1, 0] != 4 * length:
                return 5
            e = _validity(
                scratch, spos[s, D + pb + 1], slen[s, D + pb + 1], node[s, N + k + 1, 1], 4 * length
            )
            if e:
                return e
            if slen[s, D + pb + 2] < 4 * length * width:
                return 6
        # samples, shard: list<int64>, nulls in the list only
        for c in range(2):
            k = 17 if c == 0 else 20
            vb = 33 if c == 0 else 39
            e = _validity(scratch, spos[s, D + vb], slen[s, D + vb], node[s, N + k, 1], length)
            if e:
                return e
            cl = node[s, N + k + 1, 0]
            if node[s, N + k + 1, 1] or slen[s, D + vb + 2] >= 0:
                return 9
            if slen[s, D + vb + 1] < 4 * (length + 1) or max(slen[s, D + vb + 3], 0) < 8 * cl:
                return 6
            o0 = spos[s, D + vb + 1] >> 2
            last = _offsets(s32, o0, length, cl)
            if last < 0:
                return 8
            if c == 0:
                totals[5] += last - np.int64(s32[o0])
                continue
            vpos = spos[s, D + vb]
            has_bitmap = slen[s, D + vb] >= 0
            for r in range(length):
                if has_bitmap and not (scratch[vpos + (r >> 3)] >> (r & 7)) & 1:
                    continue
                w = np.int64(s32[o0 + r + 1]) - np.int64(s32[o0 + r])
                if w & 1:
                    return 9
                totals[6] += w >> 1
        rows[s] = length
        totals[0] += length
    for i in range(totals.shape[0]):
        if totals[i] >= _MAX_OFFSET:
            return 13
    return 0


@njit(cache=True, nogil=True)
def _assemble(
    scratch,
    s16,
    s32,
    s64,
    node,
    spos,
    slen,
    rows,
    fixed,
    ofixed,
    where,
    bitmap,
    offsets,
    arena,
    a32,
    a64,
):  # pragma: no cover - compiled
    """The checked steps' columns written into the arena, at where[output buffer] (offset, length; -1:
    absent); bitmap and offsets say which output buffers are bitmaps and offsets."""
    D = _DICT_BUFFERS
    N = _DICT_NODES
    for o in range(where.shape[0]):  # the bitmaps are or-ed into, the offsets start at 0
        if where[o, 0] >= 0 and (bitmap[o] or offsets[o]):
            for i in range(where[o, 0], where[o, 0] + (where[o, 1] if bitmap[o] else 4)):
                arena[i] = 0
    row = 0
    tensor_at = 0
    phase_at = 0
    dtype_at = 0
    shape_at = 0
    samples_at = 0
    shard_at = 0
    for s in range(rows.shape[0]):
        length = rows[s]
        for c in range(fixed.shape[0]):
            k, v, dbuf, width = fixed[c, 0], fixed[c, 1], fixed[c, 2], fixed[c, 3]
            _copy(
                arena,
                where[ofixed[c, 0], 0] + row * width,
                scratch,
                spos[s, D + dbuf],
                length * width,
            )
            if where[ofixed[c, 1], 0] >= 0:
                _put_bits(
                    arena,
                    where[ofixed[c, 1], 0],
                    row,
                    scratch,
                    spos[s, D + v],
                    length,
                    node[s, N + k, 1] == 0,
                )
        # phase, dtype
        for c in range(2):
            vb = D + (5 if c == 0 else 14)
            oo = (where[_O_PHASE_O, 0] if c == 0 else where[_O_DTYPE_O, 0]) >> 2
            so = where[_O_PHASE_S, 0] if c == 0 else where[_O_DTYPE_S, 0]
            b0 = spos[s, vb]
            at = phase_at if c == 0 else dtype_at
            for r in range(length):
                q = b0 + 16 * r
                size = np.int64(scratch[q])  # 0..12, checked: the other three bytes are zero
                for i in range(size):
                    arena[so + at + i] = scratch[q + 4 + i]
                at += size
                a32[oo + row + r + 1] = at
            if c == 0:
                phase_at = at
            else:
                dtype_at = at
        # tensor
        o0 = spos[s, D + 11] >> 2
        first = np.int64(s32[o0])
        last = np.int64(s32[o0 + length])
        _copy(
            arena, where[_O_TENSOR_S, 0] + tensor_at, scratch, spos[s, D + 12] + first, last - first
        )
        oo = where[_O_TENSOR_O, 0] >> 2
        for r in range(1, length + 1):
            a32[oo + row + r] = tensor_at + np.int64(s32[o0 + r]) - first
        tensor_at += last - first
        # device_digest
        _put_bits(arena, where[_O_DEV, 0], row, scratch, spos[s, D + 20], length, False)
        # shape and numel, from the step's dictionary
        do = spos[s, 1] >> 2
        v0 = spos[s, 3] >> 3
        i0 = spos[s, D + 16] >> 1
        oo = where[_O_SHAPE_O, 0] >> 2
        vo = where[_O_SHAPE_V, 0] >> 3
        no = where[_O_NUMEL, 0] >> 3
        for r in range(length):
            x = np.int64(s16[i0 + r])
            prod = np.int64(1)
            for i in range(np.int64(s32[do + x]), np.int64(s32[do + x + 1])):
                dim = s64[v0 + i]
                a64[vo + shape_at] = dim
                shape_at += 1
                prod *= dim
            a32[oo + row + r + 1] = shape_at
            a64[no + row + r] = prod
        # sketch, sketch64
        for c in range(2):
            k = 12 if c == 0 else 14
            pb = 25 if c == 0 else 28
            width = 4 if c == 0 else 8
            ov = _O_SK_V if c == 0 else _O_SK64_V
            ocv = _O_SK_CV if c == 0 else _O_SK64_CV
            oc = _O_SK_C if c == 0 else _O_SK64_C
            _copy(
                arena,
                where[oc, 0] + 4 * row * width,
                scratch,
                spos[s, D + pb + 2],
                4 * length * width,
            )
            if where[ov, 0] >= 0:
                _put_bits(
                    arena,
                    where[ov, 0],
                    row,
                    scratch,
                    spos[s, D + pb],
                    length,
                    node[s, N + k, 1] == 0,
                )
            if where[ocv, 0] >= 0:
                _put_bits(
                    arena,
                    where[ocv, 0],
                    4 * row,
                    scratch,
                    spos[s, D + pb + 1],
                    4 * length,
                    node[s, N + k + 1, 1] == 0,
                )
        # samples
        o0 = spos[s, D + 34] >> 2
        first = np.int64(s32[o0])
        last = np.int64(s32[o0 + length])
        _copy(
            arena,
            where[_O_SA_C, 0] + 8 * samples_at,
            scratch,
            spos[s, D + 36] + 8 * first,
            8 * (last - first),
        )
        oo = where[_O_SA_O, 0] >> 2
        for r in range(1, length + 1):
            a32[oo + row + r] = samples_at + np.int64(s32[o0 + r]) - first
        samples_at += last - first
        if where[_O_SA_V, 0] >= 0:
            _put_bits(
                arena,
                where[_O_SA_V, 0],
                row,
                scratch,
                spos[s, D + 33],
                length,
                node[s, N + 17, 1] == 0,
            )
        # shard: each valid row's list cut in half, offset then logical shape
        o0 = spos[s, D + 40] >> 2
        c0 = spos[s, D + 42] >> 3
        vpos = spos[s, D + 39]
        has_bitmap = slen[s, D + 39] >= 0
        oo = where[_O_SH_O, 0] >> 2
        ho = where[_O_SH_OFF, 0] >> 3
        hs = where[_O_SH_SHAPE, 0] >> 3
        for r in range(length):
            if not has_bitmap or (scratch[vpos + (r >> 3)] >> (r & 7)) & 1:
                a = np.int64(s32[o0 + r])
                half = (np.int64(s32[o0 + r + 1]) - a) >> 1
                for i in range(half):
                    a64[ho + shard_at + i] = s64[c0 + a + i]
                    a64[hs + shard_at + i] = s64[c0 + a + half + i]
                shard_at += half
            a32[oo + row + r + 1] = shard_at
        if where[_O_SH_V, 0] >= 0:
            _put_bits(arena, where[_O_SH_V, 0], row, scratch, vpos, length, node[s, N + 20, 1] == 0)
        row += length
    return 0
