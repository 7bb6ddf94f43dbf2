/* The four kernels of store/blockdecode.py in C (module disttrace.native._blockdecode): a block of v2
 * trajectory steps decoded in four calls, each releasing the GIL. The comment above each kernel says what it
 * does and why each check is there. The input is hostile (a run store may come from an attacker): every index
 * into the input, the scratch and the arena is checked before it is used, and values read from the input are
 * int64 with overflow-safe bounds (every length below 2^31 before it is multiplied by a width).
 *
 * Also: each argument is taken through the buffer protocol and held to the dtype and shape the
 * kernel indexes (ValueError otherwise), and the arrays one kernel hands the next (buf, spos and slen, where)
 * are held to the buffers they index, so that no call, however its arguments were made, reads or writes
 * outside them. Loads from the scratch and stores into the arena at positions not known to be aligned go
 * through memcpy (the s16/s32/s64 and a32/a64 arguments must be views of the scratch and the arena: their
 * memory is read and written through the byte arrays). Integers read from the input are assembled from
 * bytes, little-endian, as u32 below does; products that may wrap (numel) are taken in uint64. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* store/blockdecode.py's layout (LAYOUT below lets it check them against its own at import) */
#define NODES 22
#define BUFFERS 43
#define DICT_NODES 2
#define DICT_BUFFERS 4
#define NB (DICT_BUFFERS + BUFFERS)
#define NN (DICT_NODES + NODES)
#define N_OUT 41
#define N_FIXED 9
#define N_TOTALS 7
#define LZ4_BLOCK ((int64_t)1 << 16)
#define MAX_OFFSET (((int64_t)1 << 31) - 1)
#define BIG 4611686018427387904.0 /* 2^62 */
#define SHAPE_DIMS_PER_RECORD 16
#define SHAPE_DIMS_SLACK 4096
/* the output buffers (blockdecode.OUT) */
#define O_PHASE_O 18
#define O_PHASE_S 19
#define O_TENSOR_O 20
#define O_TENSOR_S 21
#define O_DTYPE_O 22
#define O_DTYPE_S 23
#define O_SHAPE_O 24
#define O_SHAPE_V 25
#define O_NUMEL 26
#define O_DEV 27
#define O_SK_V 28
#define O_SK_CV 29
#define O_SK_C 30
#define O_SK64_V 31
#define O_SK64_CV 32
#define O_SK64_C 33
#define O_SA_V 34
#define O_SA_O 35
#define O_SA_C 36
#define O_SH_V 37
#define O_SH_O 38
#define O_SH_OFF 39
#define O_SH_SHAPE 40

#define BAD_ARGS (-1) /* a kernel's arguments disagree with each other: ValueError */

/* ---------------------------------------------------------------- reading the input */

static inline int64_t u32(const uint8_t *raw, int64_t at) {
    return (int64_t)raw[at] | ((int64_t)raw[at + 1] << 8) | ((int64_t)raw[at + 2] << 16) |
           ((int64_t)raw[at + 3] << 24);
}

static inline int64_t i64(const uint8_t *raw, int64_t at) {
    /* (hi << 32) | lo in two's complement: assembled unsigned, converted (GCC and Clang define it modulo) */
    return (int64_t)((uint64_t)u32(raw, at) | ((uint64_t)u32(raw, at + 4) << 32));
}

static inline int64_t ld16(const uint8_t *p, int64_t i) {
    int16_t v;
    memcpy(&v, p + 2 * i, 2);
    return v;
}

static inline int64_t ld32(const uint8_t *p, int64_t i) {
    int32_t v;
    memcpy(&v, p + 4 * i, 4);
    return v;
}

static inline int64_t ld64(const uint8_t *p, int64_t i) {
    int64_t v;
    memcpy(&v, p + 8 * i, 8);
    return v;
}

static inline void st32(uint8_t *p, int64_t i, int64_t x) {
    int32_t v = (int32_t)(uint32_t)(uint64_t)x; /* an int32 store keeps the low 32 bits */
    memcpy(p + 4 * i, &v, 4);
}

static inline void st64(uint8_t *p, int64_t i, int64_t x) { memcpy(p + 8 * i, &x, 8); }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* dst[at:at + n] = src[start:start + n], the ranges checked by the caller and apart */
static inline void copy(uint8_t *dst, int64_t at, const uint8_t *src, int64_t start, int64_t n) {
    if (n > 0) memcpy(dst + at, src + start, (size_t)n);
}

/* ---------------------------------------------------------------- LZ4 */

/* a sequence's literal or match length from its token's nibble; -1 where the input ends first */
static inline int64_t length_of(const uint8_t *raw, int64_t *ip, int64_t iend, int64_t nibble) {
    int64_t n = nibble;
    if (n == 15) {
        for (;;) {
            if (*ip >= iend) return -1;
            int64_t x = raw[*ip];
            *ip += 1;
            n += x;
            if (x != 255) break;
        }
    }
    return n;
}

/* One LZ4 block raw[ip:iend] decoded into out[ostart:...], at most olimit; its length, or -1. Held to the
 * format's rules, which LZ4's own decoder relies on: every sequence but the last has a match, of an offset
 * inside the output from `base` on (the block's own output, or in a frame of linked blocks the frame's so
 * far: base <= ostart); the last ends the input exactly; the last match starts 12 bytes or more before the
 * block's end and ends 5 or more before it. */
static int64_t lz4_block(const uint8_t *raw, int64_t ip, int64_t iend, uint8_t *out, int64_t base,
                         int64_t ostart, int64_t olimit) {
    int64_t op = ostart;
    int64_t last_start = -1;
    int64_t last_end = -1;
    for (;;) {
        if (ip >= iend) return -1;
        int64_t token = raw[ip];
        ip += 1;
        int64_t lit = length_of(raw, &ip, iend, token >> 4);
        if (lit < 0) return -1;
        if (lit > iend - ip || lit > olimit - op) return -1;
        copy(out, op, raw, ip, lit);
        ip += lit;
        op += lit;
        if (ip == iend) break;
        if (iend - ip < 2) return -1;
        int64_t off = (int64_t)raw[ip] | ((int64_t)raw[ip + 1] << 8);
        ip += 2;
        if (off == 0 || off > op - base) return -1;
        int64_t ml = length_of(raw, &ip, iend, token & 15);
        if (ml < 0) return -1;
        ml += 4;
        if (ml > olimit - op) return -1;
        /* the match repeats the `off` bytes before it, in pieces that never overlap */
        int64_t src = op - off;
        last_start = op;
        int64_t end = op + ml;
        while (op < end) {
            int64_t piece = min64(op - src, end - op);
            copy(out, op, out, src, piece);
            op += piece;
        }
        last_end = op;
    }
    if (last_start >= 0 && (last_start > op - 12 || last_end > op - 5)) return -1;
    return op - ostart;
}

/* Whether the LZ4 frame raw[a:b] is the writer's kind and decodes to exactly `size` bytes at out[o:]. The
 * writer's two frame descriptors: 64 KiB blocks, no checksums, no content size, the blocks independent
 * (60 40 82) or, for a buffer of more than one block, linked (40 40 C0: a match may reach back into the
 * blocks before it, which lie just before it in out). */
static int lz4_frame(const uint8_t *raw, int64_t a, int64_t b, uint8_t *out, int64_t o, int64_t size) {
    if (b - a < 11) return 0;
    if (raw[a] != 0x04 || raw[a + 1] != 0x22 || raw[a + 2] != 0x4D || raw[a + 3] != 0x18) return 0;
    int linked = raw[a + 4] == 0x40 && raw[a + 5] == 0x40 && raw[a + 6] == 0xC0;
    if (!linked && (raw[a + 4] != 0x60 || raw[a + 5] != 0x40 || raw[a + 6] != 0x82)) return 0;
    int64_t p = a + 7;
    int64_t op = o;
    int64_t oend = o + size;
    for (;;) {
        if (b - p < 4) return 0;
        int64_t bs = u32(raw, p);
        p += 4;
        if (bs == 0) break;
        int plain = bs >= ((int64_t)1 << 31);
        if (plain) bs -= (int64_t)1 << 31;
        if (bs == 0 || bs > LZ4_BLOCK || bs > b - p) return 0;
        if (plain) {
            if (bs > oend - op) return 0;
            copy(out, op, raw, p, bs);
            op += bs;
        } else {
            int64_t got = lz4_block(raw, p, p + bs, out, linked ? o : op, op, min64(oend, op + LZ4_BLOCK));
            if (got < 0) return 0;
            op += got;
        }
        p += bs;
    }
    return p == b && op == oend;
}

/* ---------------------------------------------------------------- bitmaps */

/* The zero bits among the first n of the bitmap at scratch[at:]. */
static int64_t nulls(const uint8_t *scratch, int64_t at, int64_t n) {
    int64_t ones = 0;
    int64_t full = n >> 3;
    for (int64_t i = 0; i < full; i++) {
        int64_t x = scratch[at + i];
        x = x - ((x >> 1) & 0x55);
        x = (x & 0x33) + ((x >> 2) & 0x33);
        ones += (x + (x >> 4)) & 0x0F;
    }
    for (int64_t i = full << 3; i < n; i++) ones += ((int64_t)scratch[at + (i >> 3)] >> (i & 7)) & 1;
    return n - ones;
}

/* Bits row..row+n of the bitmap at arena[base:] from the first n at scratch[at:] (or all set), a byte at a
 * time; the arena starts zeroed, and the source's bits past n are not read. */
static void put_bits(uint8_t *arena, int64_t base, int64_t row, const uint8_t *scratch, int64_t at,
                     int64_t n, int all_set) {
    if (n <= 0) return;
    int64_t shift = row & 7;
    int64_t dst = base + (row >> 3);
    int64_t full = (n + 7) >> 3;
    for (int64_t i = 0; i < full; i++) {
        int64_t x = all_set ? 255 : (int64_t)scratch[at + i];
        if (i == full - 1 && (n & 7)) x &= ((int64_t)1 << (n & 7)) - 1;
        arena[dst + i] |= (uint8_t)((x << shift) & 255);
        if (shift && (x >> (8 - shift))) arena[dst + i + 1] |= (uint8_t)(x >> (8 - shift));
    }
}

/* 0 when a step's validity buffer agrees with its node's null count, else a decline code. */
static int validity(const uint8_t *scratch, int64_t spos, int64_t slen, int64_t nn, int64_t length) {
    if (nn == 0) return slen < 0 ? 0 : 9; /* the writer leaves the bitmap out when nothing is null */
    if (slen < ((length + 7) >> 3)) return 6;
    if (nulls(scratch, spos, length) != nn) return 7;
    return 0;
}

/* ---------------------------------------------------------------- the kernels */

#define BAT(s, m) bat[(s) * 2 + (m)]
#define NODE(s, k, f) node[((s) * NN + (k)) * 2 + (f)]
#define BUF(s, j, f) buf[((s) * NB + (j)) * 4 + (f)]
#define SPOS(s, j) spos[(s) * NB + (j)]
#define SLEN(s, j) slen[(s) * NB + (j)]
#define POS(m, k) pos[(m) * 5 + (k)]
#define FIX(c, f) fixed[(c) * fcols + (f)] /* fixed: (node, validity, data, width, ...) a row */
#define WHERE(o, f) where[(o) * 2 + (f)]

/* Each step's two messages: their headers the writer's templates but for the values that vary, read into bat
 * (per step: the dictionary's length, the batch's), node (length, null count) and buf (where the buffer's
 * bytes lie in raw, their length, the size declared, 0 empty / 1 stored / 2 LZ4). raw: the steps' bytes
 * joined, step s raw[starts[s]:ends[s]] (after any schema message), sizes[s] its whole length. Returns
 * (status, the scratch bytes the buffers take). */
static int headers_k(const uint8_t *raw, int64_t n, const int64_t *starts, const int64_t *ends,
                     const int64_t *sizes, const uint8_t *tpl_d, const uint8_t *mask_d, const uint8_t *tpl_b,
                     const uint8_t *mask_b, const int64_t *pos, int64_t *bat, int64_t *node, int64_t *buf,
                     int64_t *scratch_out) {
    int64_t scratch_size = 0;
    *scratch_out = 0;
    for (int64_t s = 0; s < n; s++) {
        int64_t p = starts[s];
        int64_t declared = 0;
        for (int m = 0; m < 2; m++) {
            const uint8_t *tpl = m == 0 ? tpl_d : tpl_b;
            const uint8_t *mask = m == 0 ? mask_d : mask_b;
            int64_t size = POS(m, 0);
            if (ends[s] - p < size) return 1;
            for (int64_t i = 0; i < size; i++)
                if (mask[i] == 0 && raw[p + i] != tpl[i]) return 1;
            int64_t body = i64(raw, p + POS(m, 1));
            if (body < 0 || body > ends[s] - p - size) return 1;
            /* every length below 2^31: the checks below multiply lengths by widths up to 64 */
            BAT(s, m) = i64(raw, p + POS(m, 2));
            if (BAT(s, m) < 0 || BAT(s, m) > MAX_OFFSET) return 5;
            int nodes = m == 0 ? DICT_NODES : NODES;
            int first_node = m == 0 ? 0 : DICT_NODES;
            for (int k = 0; k < nodes; k++) {
                int64_t q = p + POS(m, 3) + 16 * k;
                int64_t ln = i64(raw, q);
                int64_t nc = i64(raw, q + 8);
                if (ln < 0 || nc < 0 || nc > ln || ln > MAX_OFFSET) return 5;
                NODE(s, first_node + k, 0) = ln;
                NODE(s, first_node + k, 1) = nc;
            }
            int buffers = m == 0 ? DICT_BUFFERS : BUFFERS;
            int first_buf = m == 0 ? 0 : DICT_BUFFERS;
            int64_t bstart = p + size;
            for (int k = 0; k < buffers; k++) {
                int64_t q = p + POS(m, 4) + 16 * k;
                int64_t off = i64(raw, q);
                int64_t ln = i64(raw, q + 8);
                int j = first_buf + k;
                if (off < 0 || ln < 0 || (off & 7) || off > body || ln > body - off) return 2;
                BUF(s, j, 0) = 0;
                BUF(s, j, 1) = 0;
                BUF(s, j, 2) = 0;
                BUF(s, j, 3) = 0;
                if (ln == 0) continue; /* empty */
                if (ln < 8) return 3;
                int64_t d = i64(raw, bstart + off);
                BUF(s, j, 0) = bstart + off + 8;
                BUF(s, j, 1) = ln - 8;
                if (d == -1) { /* stored as it is */
                    BUF(s, j, 2) = ln - 8;
                    BUF(s, j, 3) = 1;
                    declared += ln;
                    scratch_size += (ln - 8 + 7) & ~(int64_t)7;
                    continue;
                }
                /* LZ4 expands at most 255-fold: ceil(d / 256) <= ln, written so that no d wraps */
                if (d <= 0 || ((d - 1) >> 8) >= ln) return 3;
                BUF(s, j, 2) = d;
                BUF(s, j, 3) = 2;
                declared += d;
                scratch_size += (d + 7) & ~(int64_t)7;
            }
            p = bstart + body;
        }
        if (p != ends[s]) return 1;
        if (declared > 32 * sizes[s] + ((int64_t)1 << 20)) return 12; /* trajectory.STEP_EXPANSION */
    }
    *scratch_out = scratch_size;
    return 0;
}

/* Every buffer decompressed (or copied) into scratch, each at a multiple of 8: spos, slen (-1: an empty
 * buffer). Returns a status. raw_len, scratch_len: what buf may point into, checked here rather than trusted
 * from headers_k's buf. */
static int inflate_k(const uint8_t *raw, int64_t raw_len, int64_t n, const int64_t *buf, uint8_t *scratch,
                     int64_t scratch_len, int64_t *spos, int64_t *slen) {
    int64_t at = 0;
    for (int64_t s = 0; s < n; s++) {
        for (int j = 0; j < NB; j++) {
            SLEN(s, j) = -1;
            SPOS(s, j) = 0;
            int64_t kind = BUF(s, j, 3);
            if (kind == 0) continue;
            int64_t d = BUF(s, j, 2);
            int64_t src = BUF(s, j, 0);
            int64_t srclen = kind == 1 ? d : BUF(s, j, 1);
            if (src < 0 || src > raw_len || srclen < 0 || srclen > raw_len - src || d < 0 ||
                d > scratch_len - at || at > scratch_len)
                return BAD_ARGS;
            if (kind == 1) {
                copy(scratch, at, raw, src, d);
            } else if (!lz4_frame(raw, src, src + BUF(s, j, 1), scratch, at, d)) {
                return 4;
            }
            SPOS(s, j) = at;
            SLEN(s, j) = d;
            at += (d + 7) & ~(int64_t)7;
        }
    }
    return 0;
}

/* the last of length + 1 int32 offsets at s32[o0:], or -1 */
static int64_t offsets_last(const uint8_t *s32, int64_t o0, int64_t length, int64_t limit) {
    int64_t prev = ld32(s32, o0);
    if (prev < 0) return -1;
    for (int64_t r = 1; r < length + 1; r++) {
        int64_t x = ld32(s32, o0 + r);
        if (x < prev) return -1;
        prev = x;
    }
    return prev <= limit ? prev : -1;
}

/* Each step's columns held to what the writer writes and Arrow requires; rows (per step) and totals (rows,
 * tensor name bytes, phase and dtype bytes, shape values, sample ids, shard values of each half) counted.
 * s16, s32, s64: scratch seen as int16, int32, int64 (made in Python: C's view costs seconds to compile).
 * Returns a status. */
static int check_k(const uint8_t *scratch, int64_t n, const int64_t *bat, const int64_t *node,
                   const int64_t *spos, const int64_t *slen, const int64_t *fixed, int64_t n_fixed, int64_t fcols,
                   int64_t *rows, int64_t *totals) {
    const uint8_t *s16 = scratch, *s32 = scratch, *s64 = scratch;
    const int D = DICT_BUFFERS;
    const int N = DICT_NODES;
    for (int i = 0; i < N_TOTALS; i++) totals[i] = 0;
    for (int64_t s = 0; s < n; s++) {
        int64_t length = BAT(s, 1);
        if (length <= 0) return 5;
        for (int k = 0; k < NODES; k++) {
            int child = k == 13 || k == 15 || k == 18 || k == 21;
            if (!child && NODE(s, N + k, 0) != length) return 5;
        }
        for (int64_t c = 0; c < n_fixed; c++) {
            int64_t k = FIX(c, 0), v = FIX(c, 1), dbuf = FIX(c, 2), width = FIX(c, 3);
            int e = validity(scratch, SPOS(s, D + v), SLEN(s, D + v), NODE(s, N + k, 1), length);
            if (e) return e;
            if (SLEN(s, D + dbuf) < length * width) return 6;
        }
        if (NODE(s, N + 0, 1) || NODE(s, N + 8, 1)) return 9; /* a record without its step or digest */
        /* phase and dtype: string views, every one inline (no data buffer), zero-padded */
        for (int c = 0; c < 2; c++) {
            int k = c == 0 ? 2 : 6;
            int vb = D + (c == 0 ? 5 : 14);
            if (NODE(s, N + k, 1) || SLEN(s, D + (c == 0 ? 4 : 13)) >= 0) return 9;
            if (SLEN(s, vb) < 16 * length) return 6;
            int64_t w0 = SPOS(s, vb) >> 3;
            for (int64_t r = 0; r < length; r++) {
                uint64_t lo = (uint64_t)ld64(s64, w0 + 2 * r);
                uint64_t hi = (uint64_t)ld64(s64, w0 + 2 * r + 1);
                int64_t size = (int64_t)(lo & 0xFFFFFFFFu);
                if (size > 12) return 9;
                /* the bytes after the name are zero (logical shifts: whether the result is 0 does not
                 * depend on the sign bit) */
                if (size < 4) {
                    if ((lo >> (32 + 8 * size)) != 0 || hi != 0) return 9;
                } else if (size < 12 && (hi >> (8 * (size - 4))) != 0) {
                    return 9;
                }
                totals[2 + c] += size;
            }
        }
        /* tensor: a string per record */
        if (NODE(s, N + 5, 1) || SLEN(s, D + 10) >= 0) return 9;
        if (SLEN(s, D + 11) < 4 * (length + 1)) return 6;
        int64_t o0 = SPOS(s, D + 11) >> 2;
        int64_t last = offsets_last(s32, o0, length, max64(SLEN(s, D + 12), 0));
        if (last < 0) return 8;
        totals[1] += last - ld32(s32, o0);
        /* device_digest: a bit per record, never null */
        if (NODE(s, N + 9, 1) || SLEN(s, D + 19) >= 0) return 9;
        if (SLEN(s, D + 20) < ((length + 7) >> 3)) return 6;
        /* the shape dictionary: list<int64> without nulls; every entry's product below 2^62 */
        int64_t dn = NODE(s, 0, 0);
        if (BAT(s, 0) != dn || dn <= 0 || NODE(s, 0, 1) || NODE(s, 1, 1) || SLEN(s, 0) >= 0) return 9;
        if (SLEN(s, 2) >= 0) return 9;
        int64_t dv = NODE(s, 1, 0);
        if (SLEN(s, 1) < 4 * (dn + 1) || max64(SLEN(s, 3), 0) < 8 * dv) return 6;
        o0 = SPOS(s, 1) >> 2;
        if (offsets_last(s32, o0, dn, dv) < 0) return 8;
        int64_t v0 = SPOS(s, 3) >> 3;
        for (int64_t r = 0; r < dn; r++) {
            double prod = 1.0;
            int64_t hi_i = ld32(s32, o0 + r + 1);
            for (int64_t i = ld32(s32, o0 + r); i < hi_i; i++) {
                prod *= fabs((double)ld64(s64, v0 + i));
                if (prod >= BIG) return 11;
            }
        }
        /* the shape's indices: int16, never null, each inside the step's dictionary */
        if (NODE(s, N + 7, 1) || SLEN(s, D + 15) >= 0) return 9;
        if (SLEN(s, D + 16) < 2 * length) return 6;
        int64_t i0 = SPOS(s, D + 16) >> 1;
        int64_t dims = 0;
        for (int64_t r = 0; r < length; r++) {
            int64_t x = ld16(s16, i0 + r);
            if (x < 0 || x >= dn) return 10;
            dims += ld32(s32, o0 + x + 1) - ld32(s32, o0 + x);
        }
        if (dims > SHAPE_DIMS_PER_RECORD * length + SHAPE_DIMS_SLACK) return 14;
        totals[4] += dims;
        /* sketch, sketch64: fixed-size lists of 4 floats, nulls in the list and its child */
        for (int c = 0; c < 2; c++) {
            int k = c == 0 ? 12 : 14;
            int pb = c == 0 ? 25 : 28;
            int64_t width = c == 0 ? 4 : 8;
            int e = validity(scratch, SPOS(s, D + pb), SLEN(s, D + pb), NODE(s, N + k, 1), length);
            if (e) return e;
            if (NODE(s, N + k + 1, 0) != 4 * length) return 5;
            e = validity(scratch, SPOS(s, D + pb + 1), SLEN(s, D + pb + 1), NODE(s, N + k + 1, 1),
                         4 * length);
            if (e) return e;
            if (SLEN(s, D + pb + 2) < 4 * length * width) return 6;
        }
        /* samples, shard: list<int64>, nulls in the list only */
        for (int c = 0; c < 2; c++) {
            int k = c == 0 ? 17 : 20;
            int vb = c == 0 ? 33 : 39;
            int e = validity(scratch, SPOS(s, D + vb), SLEN(s, D + vb), NODE(s, N + k, 1), length);
            if (e) return e;
            int64_t cl = NODE(s, N + k + 1, 0);
            if (NODE(s, N + k + 1, 1) || SLEN(s, D + vb + 2) >= 0) return 9;
            if (SLEN(s, D + vb + 1) < 4 * (length + 1) || max64(SLEN(s, D + vb + 3), 0) < 8 * cl) return 6;
            o0 = SPOS(s, D + vb + 1) >> 2;
            last = offsets_last(s32, o0, length, cl);
            if (last < 0) return 8;
            if (c == 0) {
                totals[5] += last - ld32(s32, o0);
                continue;
            }
            int64_t vpos = SPOS(s, D + vb);
            int has_bitmap = SLEN(s, D + vb) >= 0;
            for (int64_t r = 0; r < length; r++) {
                if (has_bitmap && !((scratch[vpos + (r >> 3)] >> (r & 7)) & 1)) continue;
                int64_t w = ld32(s32, o0 + r + 1) - ld32(s32, o0 + r);
                if (w & 1) return 9;
                totals[6] += w >> 1;
            }
        }
        rows[s] = length;
        totals[0] += length;
    }
    for (int i = 0; i < N_TOTALS; i++)
        if (totals[i] >= MAX_OFFSET) return 13;
    return 0;
}

/* assemble_k does not take on trust what check_k found (the rows and the scratch's contents agree with
 * `where`): each write into the arena outside its output buffer's span, or read outside the scratch, returns
 * BAD_ARGS instead. */
#define NEED(cond)                   \
    do {                             \
        if (!(cond)) return BAD_ARGS; \
    } while (0)

/* The checked steps' columns written into the arena, at where[output buffer] (offset, length; -1: absent);
 * bitmap and offsets say which output buffers are bitmaps and offsets. */
static int assemble_k(const uint8_t *scratch, int64_t scratch_len, int64_t n, const int64_t *node,
                      const int64_t *spos, const int64_t *slen, const int64_t *rows, const int64_t *fixed,
                      int64_t n_fixed, int64_t fcols, const int64_t *ofixed, const int64_t *where, const uint8_t *bitmap,
                      const uint8_t *offsets, uint8_t *arena) {
    const uint8_t *s16 = scratch, *s32 = scratch, *s64 = scratch;
    uint8_t *a32 = arena, *a64 = arena;
    const int D = DICT_BUFFERS;
    const int N = DICT_NODES;
    for (int o = 0; o < N_OUT; o++) { /* the bitmaps are or-ed into, the offsets start at 0 */
        if (WHERE(o, 0) >= 0 && (bitmap[o] || offsets[o])) {
            int64_t end = WHERE(o, 0) + (bitmap[o] ? WHERE(o, 1) : 4);
            for (int64_t i = WHERE(o, 0); i < end; i++) arena[i] = 0;
        }
    }
    int64_t row = 0;
    int64_t tensor_at = 0, phase_at = 0, dtype_at = 0, shape_at = 0, samples_at = 0, shard_at = 0;
    for (int64_t s = 0; s < n; s++) {
        int64_t length = rows[s];
        NEED(length >= 0 && length <= MAX_OFFSET && row + length <= MAX_OFFSET);
        for (int64_t c = 0; c < n_fixed; c++) {
            int64_t k = FIX(c, 0), v = FIX(c, 1), dbuf = FIX(c, 2), width = FIX(c, 3);
            int64_t o = ofixed[2 * c], ov = ofixed[2 * c + 1];
            NEED(WHERE(o, 0) >= 0 && (row + length) * width <= WHERE(o, 1));
            NEED(SLEN(s, D + dbuf) >= length * width);
            copy(arena, WHERE(o, 0) + row * width, scratch, SPOS(s, D + dbuf), length * width);
            if (WHERE(ov, 0) >= 0) {
                int all_set = NODE(s, N + k, 1) == 0;
                NEED(((row + length + 7) >> 3) <= WHERE(ov, 1));
                NEED(all_set || SLEN(s, D + v) >= ((length + 7) >> 3));
                put_bits(arena, WHERE(ov, 0), row, scratch, SPOS(s, D + v), length, all_set);
            }
        }
        /* phase, dtype */
        for (int c = 0; c < 2; c++) {
            int vb = D + (c == 0 ? 5 : 14);
            int oo_o = c == 0 ? O_PHASE_O : O_DTYPE_O, so_o = c == 0 ? O_PHASE_S : O_DTYPE_S;
            int64_t oo = WHERE(oo_o, 0) >> 2;
            int64_t so = WHERE(so_o, 0);
            NEED(WHERE(oo_o, 0) >= 0 && 4 * (row + length + 1) <= WHERE(oo_o, 1) && so >= 0);
            NEED(SLEN(s, vb) >= 16 * length);
            int64_t b0 = SPOS(s, vb);
            int64_t at = c == 0 ? phase_at : dtype_at;
            for (int64_t r = 0; r < length; r++) {
                int64_t q = b0 + 16 * r;
                int64_t size = scratch[q]; /* 0..12, checked: the other three bytes are zero */
                NEED(size <= 12 && at + size <= WHERE(so_o, 1));
                for (int64_t i = 0; i < size; i++) arena[so + at + i] = scratch[q + 4 + i];
                at += size;
                st32(a32, oo + row + r + 1, at);
            }
            if (c == 0)
                phase_at = at;
            else
                dtype_at = at;
        }
        /* tensor */
        NEED(SLEN(s, D + 11) >= 4 * (length + 1));
        int64_t o0 = SPOS(s, D + 11) >> 2;
        int64_t first = ld32(s32, o0);
        int64_t last = ld32(s32, o0 + length);
        NEED(first >= 0 && first <= last && last <= max64(SLEN(s, D + 12), 0));
        NEED(tensor_at + (last - first) <= WHERE(O_TENSOR_S, 1) && WHERE(O_TENSOR_S, 0) >= 0);
        copy(arena, WHERE(O_TENSOR_S, 0) + tensor_at, scratch, SPOS(s, D + 12) + first, last - first);
        int64_t oo = WHERE(O_TENSOR_O, 0) >> 2;
        NEED(WHERE(O_TENSOR_O, 0) >= 0 && 4 * (row + length + 1) <= WHERE(O_TENSOR_O, 1));
        for (int64_t r = 1; r < length + 1; r++) {
            int64_t x = ld32(s32, o0 + r);
            NEED(x >= first && x <= last);
            st32(a32, oo + row + r, tensor_at + x - first);
        }
        tensor_at += last - first;
        /* device_digest */
        NEED(WHERE(O_DEV, 0) >= 0 && ((row + length + 7) >> 3) <= WHERE(O_DEV, 1));
        NEED(SLEN(s, D + 20) >= ((length + 7) >> 3));
        put_bits(arena, WHERE(O_DEV, 0), row, scratch, SPOS(s, D + 20), length, 0);
        /* shape and numel, from the step's dictionary */
        int64_t dn = NODE(s, 0, 0), dv = NODE(s, 1, 0);
        NEED(dn >= 0 && SLEN(s, 1) >= 4 * (dn + 1) && max64(SLEN(s, 3), 0) >= 8 * dv);
        NEED(SLEN(s, D + 16) >= 2 * length);
        int64_t d_o = SPOS(s, 1) >> 2;
        int64_t v0 = SPOS(s, 3) >> 3;
        int64_t i0 = SPOS(s, D + 16) >> 1;
        oo = WHERE(O_SHAPE_O, 0) >> 2;
        int64_t vo = WHERE(O_SHAPE_V, 0) >> 3;
        int64_t no = WHERE(O_NUMEL, 0) >> 3;
        NEED(WHERE(O_SHAPE_O, 0) >= 0 && 4 * (row + length + 1) <= WHERE(O_SHAPE_O, 1));
        NEED(WHERE(O_NUMEL, 0) >= 0 && 8 * (row + length) <= WHERE(O_NUMEL, 1));
        NEED(WHERE(O_SHAPE_V, 0) >= 0);
        for (int64_t r = 0; r < length; r++) {
            int64_t x = ld16(s16, i0 + r);
            NEED(x >= 0 && x < dn);
            uint64_t prod = 1; /* the int64 product, wrapping (check_k bounds it below 2^62) */
            int64_t lo = ld32(s32, d_o + x), hi = ld32(s32, d_o + x + 1);
            NEED(lo >= 0 && lo <= hi && hi <= dv && 8 * (shape_at + hi - lo) <= WHERE(O_SHAPE_V, 1));
            for (int64_t i = lo; i < hi; i++) {
                int64_t dim = ld64(s64, v0 + i);
                st64(a64, vo + shape_at, dim);
                shape_at += 1;
                prod *= (uint64_t)dim;
            }
            st32(a32, oo + row + r + 1, shape_at);
            st64(a64, no + row + r, (int64_t)prod);
        }
        /* sketch, sketch64 */
        for (int c = 0; c < 2; c++) {
            int k = c == 0 ? 12 : 14;
            int pb = c == 0 ? 25 : 28;
            int64_t width = c == 0 ? 4 : 8;
            int ov = c == 0 ? O_SK_V : O_SK64_V;
            int ocv = c == 0 ? O_SK_CV : O_SK64_CV;
            int oc = c == 0 ? O_SK_C : O_SK64_C;
            NEED(WHERE(oc, 0) >= 0 && 4 * (row + length) * width <= WHERE(oc, 1));
            NEED(SLEN(s, D + pb + 2) >= 4 * length * width);
            copy(arena, WHERE(oc, 0) + 4 * row * width, scratch, SPOS(s, D + pb + 2), 4 * length * width);
            if (WHERE(ov, 0) >= 0) {
                int all_set = NODE(s, N + k, 1) == 0;
                NEED(((row + length + 7) >> 3) <= WHERE(ov, 1));
                NEED(all_set || SLEN(s, D + pb) >= ((length + 7) >> 3));
                put_bits(arena, WHERE(ov, 0), row, scratch, SPOS(s, D + pb), length, all_set);
            }
            if (WHERE(ocv, 0) >= 0) {
                int all_set = NODE(s, N + k + 1, 1) == 0;
                NEED(((4 * (row + length) + 7) >> 3) <= WHERE(ocv, 1));
                NEED(all_set || SLEN(s, D + pb + 1) >= ((4 * length + 7) >> 3));
                put_bits(arena, WHERE(ocv, 0), 4 * row, scratch, SPOS(s, D + pb + 1), 4 * length,
                         all_set);
            }
        }
        /* samples */
        NEED(SLEN(s, D + 34) >= 4 * (length + 1));
        o0 = SPOS(s, D + 34) >> 2;
        first = ld32(s32, o0);
        last = ld32(s32, o0 + length);
        NEED(first >= 0 && first <= last && 8 * last <= max64(SLEN(s, D + 36), 0));
        NEED(WHERE(O_SA_C, 0) >= 0 && 8 * (samples_at + last - first) <= WHERE(O_SA_C, 1));
        copy(arena, WHERE(O_SA_C, 0) + 8 * samples_at, scratch, SPOS(s, D + 36) + 8 * first,
             8 * (last - first));
        oo = WHERE(O_SA_O, 0) >> 2;
        NEED(WHERE(O_SA_O, 0) >= 0 && 4 * (row + length + 1) <= WHERE(O_SA_O, 1));
        for (int64_t r = 1; r < length + 1; r++) {
            int64_t x = ld32(s32, o0 + r);
            NEED(x >= first && x <= last);
            st32(a32, oo + row + r, samples_at + x - first);
        }
        samples_at += last - first;
        if (WHERE(O_SA_V, 0) >= 0) {
            int all_set = NODE(s, N + 17, 1) == 0;
            NEED(((row + length + 7) >> 3) <= WHERE(O_SA_V, 1));
            NEED(all_set || SLEN(s, D + 33) >= ((length + 7) >> 3));
            put_bits(arena, WHERE(O_SA_V, 0), row, scratch, SPOS(s, D + 33), length, all_set);
        }
        /* shard: each valid row's list cut in half, offset then logical shape */
        NEED(SLEN(s, D + 40) >= 4 * (length + 1));
        o0 = SPOS(s, D + 40) >> 2;
        int64_t c0 = SPOS(s, D + 42) >> 3;
        int64_t c_len = max64(SLEN(s, D + 42), 0) >> 3;
        int64_t vpos = SPOS(s, D + 39);
        int has_bitmap = SLEN(s, D + 39) >= 0;
        NEED(!has_bitmap || SLEN(s, D + 39) >= ((length + 7) >> 3));
        oo = WHERE(O_SH_O, 0) >> 2;
        int64_t ho = WHERE(O_SH_OFF, 0) >> 3;
        int64_t hs = WHERE(O_SH_SHAPE, 0) >> 3;
        NEED(WHERE(O_SH_O, 0) >= 0 && 4 * (row + length + 1) <= WHERE(O_SH_O, 1));
        NEED(WHERE(O_SH_OFF, 0) >= 0 && WHERE(O_SH_SHAPE, 0) >= 0);
        for (int64_t r = 0; r < length; r++) {
            if (!has_bitmap || ((scratch[vpos + (r >> 3)] >> (r & 7)) & 1)) {
                int64_t a = ld32(s32, o0 + r);
                int64_t b = ld32(s32, o0 + r + 1);
                NEED(a >= 0 && a <= b && b <= c_len);
                int64_t half = (b - a) >> 1;
                NEED(8 * (shard_at + half) <= WHERE(O_SH_OFF, 1) &&
                     8 * (shard_at + half) <= WHERE(O_SH_SHAPE, 1));
                for (int64_t i = 0; i < half; i++) {
                    st64(a64, ho + shard_at + i, ld64(s64, c0 + a + i));
                    st64(a64, hs + shard_at + i, ld64(s64, c0 + a + half + i));
                }
                shard_at += half;
            }
            st32(a32, oo + row + r + 1, shard_at);
        }
        if (WHERE(O_SH_V, 0) >= 0) {
            int all_set = NODE(s, N + 20, 1) == 0;
            NEED(((row + length + 7) >> 3) <= WHERE(O_SH_V, 1));
            NEED(all_set || has_bitmap); /* (its size checked above) */
            put_bits(arena, WHERE(O_SH_V, 0), row, scratch, vpos, length, all_set);
        }
        row += length;
    }
    (void)scratch_len;
    return 0;
}

/* ---------------------------------------------------------------- arguments */

typedef struct {
    Py_buffer view;
    int held;
} Arg;

/* kind: 'i' signed integer, 'u' unsigned, '?' bool */
static int format_ok(const char *fmt, char kind, Py_ssize_t itemsize) {
    if (fmt == NULL) fmt = "B";
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++;
    if (fmt[0] == '\0' || fmt[1] != '\0') return 0;
    const char *set = kind == 'i' ? "bhilqn" : kind == 'u' ? "BHILQN" : "?";
    return strchr(set, fmt[0]) != NULL && (kind != '?' || itemsize == 1);
}

/* `o` as a C-contiguous buffer of `kind` items of `itemsize` bytes, `ndim` dimensions; shape[i] >= 0 must
 * match, -1 is any (the dimension found written back); aligned to its itemsize. ValueError otherwise. */
static int get(Arg *a, PyObject *o, const char *name, int writable, char kind, Py_ssize_t itemsize, int ndim,
               Py_ssize_t *shape) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &a->view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: not a C-contiguous%s buffer", name, writable ? " writable" : "");
        return -1;
    }
    a->held = 1;
    if (a->view.itemsize != itemsize || !format_ok(a->view.format, kind, itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s: items of format %s, %zd bytes; wanted %zd-byte %s", name,
                     a->view.format ? a->view.format : "B", a->view.itemsize, itemsize,
                     kind == 'i' ? "signed integers" : kind == 'u' ? "unsigned integers" : "bools");
        return -1;
    }
    if (a->view.ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: %d dimensions, wanted %d", name, a->view.ndim, ndim);
        return -1;
    }
    for (int i = 0; i < ndim; i++) {
        Py_ssize_t got = a->view.shape ? a->view.shape[i] : a->view.len / itemsize;
        if (shape[i] >= 0 && got != shape[i]) {
            PyErr_Format(PyExc_ValueError, "%s: dimension %d is %zd, wanted %zd", name, i, got, shape[i]);
            return -1;
        }
        shape[i] = got;
    }
    if (((uintptr_t)a->view.buf) % (uintptr_t)itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: not aligned to its items", name);
        return -1;
    }
    return 0;
}

static void release(Arg *args, int count) {
    for (int i = 0; i < count; i++)
        if (args[i].held) {
            PyBuffer_Release(&args[i].view);
            args[i].held = 0;
        }
}

#define I64(a) ((int64_t *)(a).view.buf)
#define U8(a) ((uint8_t *)(a).view.buf)

/* s16, s32, s64 (or a32, a64): views of the byte array `base` (the same memory, its whole length in items) */
static int same_memory(Arg *base, Arg *view, const char *name) {
    Py_ssize_t want = base->view.len / view->view.itemsize;
    if (view->view.buf != base->view.buf || view->view.len != want * view->view.itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: not a view of the whole byte array before it", name);
        return -1;
    }
    return 0;
}

/* spos and slen: each buffer with a length inside the scratch, at a multiple of 8 */
static int spans_ok(const int64_t *spos, const int64_t *slen, int64_t count, int64_t scratch_len) {
    for (int64_t i = 0; i < count; i++) {
        if (slen[i] < 0) continue;
        if (spos[i] < 0 || (spos[i] & 7) || spos[i] > scratch_len || slen[i] > scratch_len - spos[i]) {
            PyErr_SetString(PyExc_ValueError, "spos, slen: a buffer outside the scratch");
            return -1;
        }
    }
    return 0;
}

/* bat, node: lengths and counts as headers_k leaves them, each in [0, 2^31) (the sizes the kernels compute
 * from them multiply them by widths) */
static int lengths_ok(const int64_t *x, int64_t count, const char *name) {
    for (int64_t i = 0; i < count; i++) {
        if (x[i] < 0 || x[i] > MAX_OFFSET) {
            PyErr_Format(PyExc_ValueError, "%s: a length outside [0, 2^31)", name);
            return -1;
        }
    }
    return 0;
}

static int fixed_ok(const int64_t *fixed, int64_t n_fixed, int64_t fcols) {
    if (fcols < 4) {
        PyErr_SetString(PyExc_ValueError, "fixed: fewer than 4 columns");
        return -1;
    }
    for (int64_t c = 0; c < n_fixed; c++) {
        int64_t k = FIX(c, 0), v = FIX(c, 1), dbuf = FIX(c, 2), width = FIX(c, 3);
        if (k < 0 || k >= NODES || v < 0 || v >= BUFFERS || dbuf < 0 || dbuf >= BUFFERS || width <= 0 ||
            width > 64) {
            PyErr_SetString(PyExc_ValueError, "fixed: a node, buffer or width out of range");
            return -1;
        }
    }
    return 0;
}

static PyObject *done(int status, Arg *args, int count) {
    release(args, count);
    if (status == BAD_ARGS) {
        PyErr_SetString(PyExc_ValueError, "arguments that disagree with each other (not the kernels' own)");
        return NULL;
    }
    return PyLong_FromLong(status);
}

static PyObject *py_headers(PyObject *self, PyObject *const *av, Py_ssize_t ac) {
    (void)self;
    if (ac != 12) {
        PyErr_SetString(PyExc_TypeError,
                        "headers(raw, starts, ends, sizes, tpl_d, mask_d, tpl_b, mask_b, pos, bat, node, buf)");
        return NULL;
    }
    Arg a[12];
    memset(a, 0, sizeof a);
    Py_ssize_t sh[12][3] = {{-1}, {-1}, {-1}, {-1}, {-1}, {-1}, {-1}, {-1}, {2, 5}, {-1, 2}, {-1, NN, 2}, {-1, NB, 4}};
    static const char *names[12] = {"raw", "starts", "ends", "sizes", "tpl_d", "mask_d",
                                    "tpl_b", "mask_b", "pos", "bat", "node", "buf"};
    static const char kinds[12] = {'u', 'i', 'i', 'i', 'u', 'u', 'u', 'u', 'i', 'i', 'i', 'i'};
    static const int sizes_[12] = {1, 8, 8, 8, 1, 1, 1, 1, 8, 8, 8, 8};
    static const int ndims[12] = {1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3};
    for (int i = 0; i < 12; i++) {
        if (i >= 2 && i <= 3) sh[i][0] = sh[1][0];      /* ends, sizes: n */
        if (i >= 9) sh[i][0] = sh[1][0];                /* bat, node, buf: n rows */
        if (get(&a[i], av[i], names[i], i >= 9, kinds[i], sizes_[i], ndims[i], sh[i]) < 0) {
            release(a, 12);
            return NULL;
        }
    }
    int64_t n = sh[1][0], raw_len = sh[0][0];
    const int64_t *starts = I64(a[1]), *ends = I64(a[2]), *sizes = I64(a[3]), *pos = I64(a[8]);
    for (int64_t s = 0; s < n; s++) {
        if (starts[s] < 0 || ends[s] < starts[s] || ends[s] > raw_len || sizes[s] < 0 || sizes[s] > raw_len) {
            release(a, 12);
            PyErr_SetString(PyExc_ValueError, "starts, ends, sizes: a step outside raw");
            return NULL;
        }
    }
    for (int m = 0; m < 2; m++) {
        int64_t size = POS(m, 0), nodes = m == 0 ? DICT_NODES : NODES, bufs = m == 0 ? DICT_BUFFERS : BUFFERS;
        int64_t tl = sh[m == 0 ? 4 : 6][0], ml = sh[m == 0 ? 5 : 7][0];
        int ok = size >= 0 && size <= tl && size <= ml;
        for (int k = 1; k <= 4; k++) {
            int64_t width = k <= 2 ? 8 : k == 3 ? 16 * nodes : 16 * bufs;
            ok = ok && POS(m, k) >= 0 && POS(m, k) <= size - width;
        }
        if (!ok) {
            release(a, 12);
            PyErr_SetString(PyExc_ValueError, "pos: a template's field outside it");
            return NULL;
        }
    }
    int64_t scratch_size = 0;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = headers_k(U8(a[0]), n, starts, ends, sizes, U8(a[4]), U8(a[5]), U8(a[6]), U8(a[7]), pos, I64(a[9]),
                  I64(a[10]), I64(a[11]), &scratch_size);
    Py_END_ALLOW_THREADS
    release(a, 12);
    return Py_BuildValue("(iL)", status, (long long)scratch_size);
}

static PyObject *py_inflate(PyObject *self, PyObject *const *av, Py_ssize_t ac) {
    (void)self;
    if (ac != 5) {
        PyErr_SetString(PyExc_TypeError, "inflate(raw, buf, scratch, spos, slen)");
        return NULL;
    }
    Arg a[5];
    memset(a, 0, sizeof a);
    Py_ssize_t sh[5][3] = {{-1}, {-1, NB, 4}, {-1}, {-1, NB}, {-1, NB}};
    static const char *names[5] = {"raw", "buf", "scratch", "spos", "slen"};
    static const char kinds[5] = {'u', 'i', 'u', 'i', 'i'};
    static const int sizes_[5] = {1, 8, 1, 8, 8};
    static const int ndims[5] = {1, 3, 1, 2, 2};
    for (int i = 0; i < 5; i++) {
        if (i >= 3) sh[i][0] = sh[1][0];
        if (get(&a[i], av[i], names[i], i >= 2, kinds[i], sizes_[i], ndims[i], sh[i]) < 0) {
            release(a, 5);
            return NULL;
        }
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = inflate_k(U8(a[0]), sh[0][0], sh[1][0], I64(a[1]), U8(a[2]), sh[2][0], I64(a[3]), I64(a[4]));
    Py_END_ALLOW_THREADS
    return done(status, a, 5);
}

static PyObject *py_check(PyObject *self, PyObject *const *av, Py_ssize_t ac) {
    (void)self;
    if (ac != 11) {
        PyErr_SetString(PyExc_TypeError, "check(scratch, s16, s32, s64, bat, node, spos, slen, fixed, rows, totals)");
        return NULL;
    }
    Arg a[11];
    memset(a, 0, sizeof a);
    Py_ssize_t sh[11][3] = {{-1}, {-1}, {-1}, {-1}, {-1, 2}, {-1, NN, 2}, {-1, NB}, {-1, NB}, {-1, -1}, {-1}, {N_TOTALS}};
    static const char *names[11] = {"scratch", "s16", "s32", "s64", "bat", "node", "spos", "slen", "fixed", "rows", "totals"};
    static const char kinds[11] = {'u', 'i', 'i', 'i', 'i', 'i', 'i', 'i', 'i', 'i', 'i'};
    static const int sizes_[11] = {1, 2, 4, 8, 8, 8, 8, 8, 8, 8, 8};
    static const int ndims[11] = {1, 1, 1, 1, 2, 3, 2, 2, 2, 1, 1};
    for (int i = 0; i < 11; i++) {
        if (i >= 5 && i <= 7) sh[i][0] = sh[4][0];
        if (i == 9) sh[i][0] = sh[4][0];
        if (get(&a[i], av[i], names[i], i >= 9, kinds[i], sizes_[i], ndims[i], sh[i]) < 0) {
            release(a, 11);
            return NULL;
        }
        if (i >= 1 && i <= 3 && same_memory(&a[0], &a[i], names[i]) < 0) {
            release(a, 11);
            return NULL;
        }
    }
    int64_t n = sh[4][0];
    if (spans_ok(I64(a[6]), I64(a[7]), n * NB, sh[0][0]) < 0 || fixed_ok(I64(a[8]), sh[8][0], sh[8][1]) < 0 ||
        lengths_ok(I64(a[4]), 2 * n, "bat") < 0 || lengths_ok(I64(a[5]), n * NN * 2, "node") < 0) {
        release(a, 11);
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = check_k(U8(a[0]), n, I64(a[4]), I64(a[5]), I64(a[6]), I64(a[7]), I64(a[8]), sh[8][0],
                     sh[8][1], I64(a[9]), I64(a[10]));
    Py_END_ALLOW_THREADS
    return done(status, a, 11);
}

static PyObject *py_assemble(PyObject *self, PyObject *const *av, Py_ssize_t ac) {
    (void)self;
    if (ac != 16) {
        PyErr_SetString(PyExc_TypeError,
                        "assemble(scratch, s16, s32, s64, node, spos, slen, rows, fixed, ofixed, where, bitmap, "
                        "offsets, arena, a32, a64)");
        return NULL;
    }
    Arg a[16];
    memset(a, 0, sizeof a);
    Py_ssize_t sh[16][3] = {{-1}, {-1}, {-1}, {-1}, {-1, NN, 2}, {-1, NB}, {-1, NB}, {-1}, {-1, -1}, {-1, 2},
                            {N_OUT, 2}, {N_OUT}, {N_OUT}, {-1}, {-1}, {-1}};
    static const char *names[16] = {"scratch", "s16", "s32", "s64", "node", "spos", "slen", "rows",
                                    "fixed", "ofixed", "where", "bitmap", "offsets", "arena", "a32", "a64"};
    static const char kinds[16] = {'u', 'i', 'i', 'i', 'i', 'i', 'i', 'i', 'i', 'i', 'i', '?', '?', 'u', 'i', 'i'};
    static const int sizes_[16] = {1, 2, 4, 8, 8, 8, 8, 8, 8, 8, 8, 1, 1, 1, 4, 8};
    static const int ndims[16] = {1, 1, 1, 1, 3, 2, 2, 1, 2, 2, 2, 1, 1, 1, 1, 1};
    for (int i = 0; i < 16; i++) {
        if (i >= 5 && i <= 7) sh[i][0] = sh[4][0];
        if (i == 9) sh[i][0] = sh[8][0]; /* ofixed: a row per fixed column */
        if (get(&a[i], av[i], names[i], i >= 13, kinds[i], sizes_[i], ndims[i], sh[i]) < 0) {
            release(a, 16);
            return NULL;
        }
        if (((i >= 1 && i <= 3) && same_memory(&a[0], &a[i], names[i]) < 0) ||
            ((i >= 14) && same_memory(&a[13], &a[i], names[i]) < 0)) {
            release(a, 16);
            return NULL;
        }
    }
    int64_t n = sh[4][0], n_fixed = sh[8][0], arena_len = sh[13][0];
    const int64_t *ofixed = I64(a[9]), *where = I64(a[10]);
    int ok = 1;
    for (int64_t c = 0; c < 2 * n_fixed; c++) ok = ok && ofixed[c] >= 0 && ofixed[c] < N_OUT;
    for (int o = 0; o < N_OUT; o++) {
        if (WHERE(o, 0) < 0) continue;
        /* 8-aligned (the arena's int64 positions are offset >> 3), inside the arena, an offsets buffer
         * holding its first offset */
        ok = ok && (WHERE(o, 0) & 7) == 0 && WHERE(o, 1) >= 0 && WHERE(o, 0) <= arena_len &&
             WHERE(o, 1) <= arena_len - WHERE(o, 0) && (!U8(a[12])[o] || WHERE(o, 1) >= 4);
    }
    if (!ok) {
        release(a, 16);
        PyErr_SetString(PyExc_ValueError, "ofixed, where: an output buffer outside the arena");
        return NULL;
    }
    if (spans_ok(I64(a[5]), I64(a[6]), n * NB, sh[0][0]) < 0 || fixed_ok(I64(a[8]), n_fixed, sh[8][1]) < 0 ||
        lengths_ok(I64(a[4]), n * NN * 2, "node") < 0) {
        release(a, 16);
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = assemble_k(U8(a[0]), sh[0][0], n, I64(a[4]), I64(a[5]), I64(a[6]), I64(a[7]), I64(a[8]), n_fixed, sh[8][1], ofixed,
                   where, U8(a[11]), U8(a[12]), U8(a[13]));
    Py_END_ALLOW_THREADS
    return done(status, a, 16);
}

static PyMethodDef methods[] = {
    {"headers", (PyCFunction)(void (*)(void))py_headers, METH_FASTCALL,
     "headers(raw, starts, ends, sizes, tpl_d, mask_d, tpl_b, mask_b, pos, bat, node, buf) -> (status, "
     "scratch bytes): each step's two message headers read (headers_k)"},
    {"inflate", (PyCFunction)(void (*)(void))py_inflate, METH_FASTCALL,
     "inflate(raw, buf, scratch, spos, slen) -> status: every buffer into the scratch (inflate_k)"},
    {"check", (PyCFunction)(void (*)(void))py_check, METH_FASTCALL,
     "check(scratch, s16, s32, s64, bat, node, spos, slen, fixed, rows, totals) -> status (check_k)"},
    {"assemble", (PyCFunction)(void (*)(void))py_assemble, METH_FASTCALL,
     "assemble(scratch, s16, s32, s64, node, spos, slen, rows, fixed, ofixed, where, bitmap, offsets, arena, "
     "a32, a64) -> 0: the columns written into the arena (assemble_k)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockdecode",
                                    "store/blockdecode.py's kernels in C (see blockdecode.c)", -1, methods};

PyMODINIT_FUNC PyInit__blockdecode(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* what store/blockdecode.py checks against its own layout at import (a stale build is not used) */
    PyObject *layout = Py_BuildValue(
        "{s:i,s:i,s:i,s:i,s:i,s:i,s:L,s:L,s:i,s:i,s:(iiiiiiiiiiiiiiiiiiiiiii)}", "nodes", NODES, "buffers",
        BUFFERS, "dict_nodes", DICT_NODES, "dict_buffers", DICT_BUFFERS, "n_out", N_OUT, "totals", N_TOTALS,
        "lz4_block", (long long)LZ4_BLOCK, "max_offset", (long long)MAX_OFFSET, "shape_dims_per_record",
        SHAPE_DIMS_PER_RECORD, "shape_dims_slack", SHAPE_DIMS_SLACK, "out", O_PHASE_O, O_PHASE_S, O_TENSOR_O,
        O_TENSOR_S, O_DTYPE_O, O_DTYPE_S, O_SHAPE_O, O_SHAPE_V, O_NUMEL, O_DEV, O_SK_V, O_SK_CV, O_SK_C, O_SK64_V,
        O_SK64_CV, O_SK64_C, O_SA_V, O_SA_O, O_SA_C, O_SH_V, O_SH_O, O_SH_OFF, O_SH_SHAPE);
    if (layout == NULL || PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
