// AMX-INT8 tiles on interleaved (x8) weights, part of quant_gemm.c (included after its formats and helpers).
//
// A task is 32 weight rows (four 8-row groups, two column tiles of 16) x up to TASK_ROWS activation rows. Per
// block the task's weights are unpacked once into B tiles, which every 16-row activation tile of the chunk then
// meets in _tile_dpbsud / _tile_dpbssd (A tiles read in place from the activation blocks), and one float step per
// block adds the int32 sums times the scales while the next tile's products run.
// - The K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_XS: the B tiles already carry each sub-block's integer
//   scale. Weight x scale fits 13 bits (Q3_K's offset 4 and Q6_K's 32 subtracted first; the tables' values are
//   signed), so it is split into its low byte (unsigned) and the rest (a small byte, signed for Q3_K, Q6_K and the
//   tables; Q2_K's is 0): two products over the super-block's 256 values whose sums add up as low + 256 high.
//   Q4_K / Q5_K's minimums times the activations' sums of 32 join in the float step (vpmaddwd), Q2_K's times the
//   sums of 16.
// - The 32-blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): the weights as stored (Q8_0 plus 128) or their nibbles, one
//   product of 32 values per block; the offsets (Q8_0's 128, Q4_0's 8, a minimum) come from the activation sums.
// The integers are those of the vector kernels (dot_*_x8) and the float operations theirs, in their order, so a
// row's result is the same bits whichever kernel multiplies it: how many rows a step has never changes its
// results. Built for CPUs with AMX-INT8, and with FLOCK_EMULATED_AMX (the tiles, the unpacking and the float steps
// in portable C) to test it on any AVX2 CPU.
#include "amx_tiles.h"


#define AMX_ROWS 3      // calls of at least this many activation rows take the tiles (padded to 16)
#define TASK_COLS 32     // weight rows of a task
#define TASK_ROWS 256    // activation rows of a task (a multiple of 16)
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define AVX512_STEPS  // the unpacking, float steps and outputs in AVX-512 (the AMX-INT8 build), else portable C
#endif

enum { LOW, HIGH };  // the kinds of B tiles (and of sums)

typedef uint8_t BTiles[2][2][16][64];  // 64 values' B tiles: kind, column tile (k / 4 rows x 16 x 4)

typedef struct {  // what a block's float step needs of its columns
    float d[TASK_COLS], dmin[TASK_COLS];  // each column's scale, and its minimum's scale (Q4_1 / Q5_1: minimum)
    int16_t mn[8][TASK_COLS][2];          // each column's minimums of sub-blocks 2 p and 2 p + 1 (minimum_pairs)
} BlockScales;

typedef struct {
    BTiles b[4];              // one block's B tiles, values 64 j ..
    int32_t c[2][2][16][16];  // one activation tile's sums: kind, column tile
    BlockScales sc[2];        // the block's scales (one tile of rows: block b's in sc[b % 2], see amx_task_row)
} TileScratch;

typedef struct {
    float acc[TASK_ROWS][TASK_COLS], up[TASK_ROWS][TASK_COLS];
} TaskSums;

// 0 the activations (`rows` rows of kbytes), 1 a B tile (kbytes / 4 rows of 64), 2-3 column tile 0's sums (LOW,
// HIGH), 4-5 tile 1's (`rows` rows of 16 int32). A call of fewer than 16 rows multiplies only those: the tiles
// take time by the rows.
static void amx_configure(int kbytes, int rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) cfg.rows[t] = (uint8_t)rows, cfg.colsb[t] = 64;
    cfg.colsb[0] = (uint16_t)kbytes, cfg.rows[1] = (uint8_t)(kbytes / 4);
    TILE_CONFIG(&cfg);
}

// The scales each super-block's float step needs, of group g's columns: d (the lattice types' times 1 / m) and the
// dmin and minimums of the types with minimums (Q2_K's the high nibbles of its scale bytes). Every build of this
// file has AVX2 and F16C.
static void group_scales(int type, const uint8_t *blk, int g, BlockScales *s) {
    const f16 *d = (const f16 *)blk;  // every type's d[8] first, then Q2_K's, Q4_K's and Q5_K's dmin[8]
    const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d));
    _mm256_storeu_ps(s->d + 8 * g, _mm256_mul_ps(scales, _mm256_set1_ps(d_scale(type))));
    if (!minimum_pairs(type)) return;
    _mm256_storeu_ps(s->dmin + 8 * g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 8))));
    for (int p = 0; p < minimum_pairs(type); p++) {
        const __m128i bytes = type == Q2_K ? _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)
                                  ((const blk_q2_Kx8 *)blk)->sm[p]), 4), _mm_set1_epi8(0xf))
                                           : _mm_loadu_si128((const __m128i *)((const blk_q4_Kx8 *)blk)->mn[p]);
        _mm256_storeu_si256((__m256i *)s->mn[p][8 * g], _mm256_cvtepu8_epi16(bytes));
    }
}

#ifdef AVX512_STEPS
// A B row's 64 bytes from its two groups' 32-byte vectors (columns 0-7 from a, 8-15 from b)
static inline __m512i both(const void *a, const void *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

// The low and high nibbles of the bytes q (weights 8 v + t and 8 v + 4 + t) with, where qh is given, their fifth
// bits: bits 2 v and 2 v + 1 of each byte of qh (the word shifts' bits from the next byte masked off)
static inline void nibbles(__m512i q, const __m512i *qh, int v, __m512i *lo, __m512i *hi) {
    const __m512i low4 = _mm512_set1_epi8(0xf), one = _mm512_set1_epi8(1);
    *lo = _mm512_and_si512(q, low4), *hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
    if (!qh) return;
    *lo = _mm512_or_si512(*lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(*qh, 2 * v), one), 4));
    *hi = _mm512_or_si512(*hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(*qh, 2 * v + 1), one), 4));
}

// A B row's scales for vpmaddubsw: each column's scale at the even bytes (even), at the odd bytes (odd), and
// offset x scale per word (Q6_K's weights are stored plus 32)
typedef struct {
    __m512i even, odd, offset;
} RowScales;

// The `odd` one of each column's pair of sub-block scales (bytes 4 c .. 4 c + 3 of a B row are column c):
// p[8][2] of group a for columns 0-7, of group b for 8-15
static inline RowScales row_scales(const void *pa, const void *pb, int odd, int is_signed, int offset) {
    const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)pa)),
                                                  _mm_loadu_si128((const __m128i *)pb), 1);
    const __m512i words = is_signed ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes);
    const __m512i lane = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                                          12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i pair = _mm512_andnot_si512(_mm512_set1_epi16(1), lane);
    const __m512i idx = _mm512_add_epi16(pair, _mm512_set1_epi16((short)odd));
    const __m512i w = _mm512_permutexvar_epi16(idx, words);  // word x: word (x & ~1) + odd
    return (RowScales){_mm512_and_si512(w, _mm512_set1_epi16(0xff)), _mm512_slli_epi16(w, 8),
                       _mm512_mullo_epi16(w, _mm512_set1_epi16((short)offset))};
}

// B row `row` of `tile`: the bytes u times their column's scale (less offset x scale), as LOW and HIGH bytes. The
// even and odd bytes multiply apart (vpmaddubsw against the scales at one of the two), and each byte of the two
// products moves to its place by a masked in-lane shuffle.
static inline void scaled_row(uint8_t (*b)[2][16][64], int tile, int row, __m512i u, const RowScales *sc, int offset) {
    __m512i even = _mm512_maddubs_epi16(u, sc->even), odd = _mm512_maddubs_epi16(u, sc->odd);
    if (offset) even = _mm512_sub_epi16(even, sc->offset), odd = _mm512_sub_epi16(odd, sc->offset);
    const __m512i up = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14));
    const __m512i down = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15));
    const __mmask64 odd_bytes = 0xaaaaaaaaaaaaaaaaull;
    _mm512_store_si512(b[LOW][tile][row], _mm512_mask_shuffle_epi8(even, odd_bytes, odd, up));
    _mm512_store_si512(b[HIGH][tile][row], _mm512_mask_shuffle_epi8(odd, ~odd_bytes, even, down));
}

// Values 64 j .. of Q4_K / Q5_K / IQ4_XS super-blocks of the tile's groups a and b into b: sub-block sb is values
// 32 sb ..: B rows 8 (sb % 2) .. of 64-block sb / 2. IQ4_XS's indices are looked up as their values plus 128,
// less the offset 128 before the (signed) scale.
static void unpack_q45_K(int type, const uint8_t *ba, const uint8_t *bb, int tile, int j, BTiles b) {
    const int iq4 = is_table(type), offset = iq4 ? 128 : 0;
    const int64_t qs_at = iq4 ? offsetof(blk_iq4_xsx8, qs) : offsetof(blk_q4_Kx8, qs);
    const int64_t sc_at = iq4 ? offsetof(blk_iq4_xsx8, sc) : offsetof(blk_q4_Kx8, sc);
    const uint8_t(*qa)[4][32] = (const void *)(ba + qs_at), (*qb)[4][32] = (const void *)(bb + qs_at);
    const __m512i table = _mm512_xor_si512(  // the values plus 128
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table_values(type))), _mm512_set1_epi8(-128));
    for (int sb = 2 * j; sb < 2 * j + 2; sb++) {
        const int base = 8 * (sb % 2);
        const RowScales scale = row_scales(ba + sc_at + 16 * (sb / 2), bb + sc_at + 16 * (sb / 2), sb % 2, iq4, offset);
        const __m512i h = type == Q5_K ? both(((const blk_q5_Kx8 *)ba)->qh[sb], ((const blk_q5_Kx8 *)bb)->qh[sb])
                                       : _mm512_setzero_si512();
        for (int v = 0; v < 4; v++) {
            __m512i lo, hi;
            nibbles(both(qa[sb][v], qb[sb][v]), type == Q5_K ? &h : NULL, v, &lo, &hi);
            if (iq4) lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
            scaled_row(b, tile, base + 2 * v, lo, &scale, offset);
            scaled_row(b, tile, base + 2 * v + 1, hi, &scale, offset);
        }
    }
}

// Values 64 j .. of Q6_K super-blocks of the tile's groups a and b into b: sub-block sb is values 16 sb ..: B
// rows 4 (sb % 4) .. of 64-block sb / 4, each weight less its offset 32 before the scale
static void unpack_q6_K(const uint8_t *ba, const uint8_t *bb, int tile, int j, BTiles b) {
    const blk_q6_Kx8 *qa = (const blk_q6_Kx8 *)ba, *qb = (const blk_q6_Kx8 *)bb;
    const __m512i low4 = _mm512_set1_epi8(0xf), top2 = _mm512_set1_epi8(0x30);
    for (int sb = 4 * j; sb < 4 * j + 4; sb++) {
        const RowScales scale = row_scales(qa->sc[sb / 2], qb->sc[sb / 2], sb % 2, 1, 32);
        const __m512i qh = both(qa->sub[sb].qh, qb->sub[sb].qh);
        for (int row = 0; row < 4; row++) {
            const __m512i ql = both(qa->sub[sb].qs[row / 2], qb->sub[sb].qs[row / 2]);
            const __m512i nib = _mm512_and_si512(row % 2 ? _mm512_srli_epi16(ql, 4) : ql, low4);
            const __m512i top = _mm512_and_si512(
                2 * row >= 4 ? _mm512_srli_epi16(qh, 2 * row - 4) : _mm512_slli_epi16(qh, 4 - 2 * row), top2);
            scaled_row(b, tile, 4 * (sb % 4) + row, _mm512_or_si512(nib, top), &scale, 32);
        }
    }
}

// Values 64 j .. of Q2_K / Q3_K super-blocks of the tile's groups a and b into b: sub-block sb is values 16 sb ..:
// B row 4 (sb % 4) + g its plane g (weights 4 g ..; Q3_K's with their third bits, less its offset 4; a Q3_K table's
// values looked up plus Q3_TABLE_OFFSET, less that) times its scale (Q2_K's the low nibbles of its scale bytes)
static void unpack_q23_K(int type, const uint8_t *ba, const uint8_t *bb, int tile, int j, BTiles b) {
    const int q3 = is_q3(type), table = is_q3_table(type);
    const __m512i values = _mm512_broadcast_i32x4(_mm256_castsi256_si128(q3_table(type)));
    const blk_q2_Kx8 *qa = (const blk_q2_Kx8 *)ba, *qb = (const blk_q2_Kx8 *)bb;
    const blk_q3_Kx8 *ta = (const blk_q3_Kx8 *)ba, *tb = (const blk_q3_Kx8 *)bb;
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    const __m128i low4 = _mm_set1_epi8(0xf);
    for (int sb = 4 * j; sb < 4 * j + 4; sb++) {
        __attribute__((aligned(16))) uint8_t sa[16], sc[16];
        if (!q3) {
            _mm_store_si128((__m128i *)sa, _mm_and_si128(_mm_loadu_si128((const __m128i *)qa->sm[sb / 2]), low4));
            _mm_store_si128((__m128i *)sc, _mm_and_si128(_mm_loadu_si128((const __m128i *)qb->sm[sb / 2]), low4));
        }
        const RowScales scale = q3 ? row_scales(ta->sc[sb / 2], tb->sc[sb / 2], sb % 2, 1, q3_offset(type))
                                   : row_scales(sa, sc, sb % 2, 0, 0);
        const __m512i q = q3 ? both(ta->qs[sb], tb->qs[sb]) : both(qa->qs[sb], qb->qs[sb]);
        const __m512i qh = q3 ? both(ta->qh[sb / 2], tb->qh[sb / 2]) : _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {
            __m512i u = _mm512_and_si512(_mm512_srli_epi16(q, 2 * g), three);
            if (q3) {  // bit 4 (sb % 2) + g of each qh byte as bit 2
                const int bit = 4 * (sb % 2) + g;
                u = _mm512_or_si512(u, _mm512_and_si512(bit >= 2 ? _mm512_srli_epi16(qh, bit - 2)
                                                                 : _mm512_slli_epi16(qh, 2 - bit), four));
            }
            if (table) u = _mm512_shuffle_epi8(values, u);
            scaled_row(b, tile, 4 * (sb % 4) + g, u, &scale, q3);
        }
    }
}
#else
// Byte i's low and high nibbles (weights 8 v + t and 8 v + 4 + t) with, where qh is given, their fifth bits
static inline void nibble_pair(const uint8_t *q, const uint8_t *qh, int v, int i, int16_t *lo, int16_t *hi) {
    const int h = qh ? qh[i] >> (2 * v) : 0;
    *lo = (int16_t)((q[i] & 0xf) | (h & 1) << 4), *hi = (int16_t)((q[i] >> 4) | (h & 2) << 3);
}

// B bytes 32 half + i of row `row` (weights of value k0 + 4 row + t, t = i % 4, column i / 4 of the group) for
// 32 weights u[i] times their scales s[i]
static inline void scaled_half_row(uint8_t (*b)[2][16][64], int tile, int half, int row, const int16_t *u,
                                   const int16_t *s) {
    for (int i = 0; i < 32; i++) {
        const int16_t w = (int16_t)(u[i] * s[i]);
        b[LOW][tile][row][32 * half + i] = (uint8_t)w;
        b[HIGH][tile][row][32 * half + i] = (uint8_t)(w >> 8);
    }
}

static void unpack_q45_K_half(int type, const uint8_t *blk, int tile, int half, int j, BTiles b) {
    const int iq4 = is_table(type);  // its indices as their values, its scales signed
    const int8_t *values = table_values(type);
    const blk_q4_Kx8 *q = (const blk_q4_Kx8 *)blk;
    const blk_iq4_xsx8 *x = (const blk_iq4_xsx8 *)blk;
    for (int sb = 2 * j; sb < 2 * j + 2; sb++) {
        const int base = 8 * (sb % 2);
        const uint8_t *qh = type == Q5_K ? ((const blk_q5_Kx8 *)blk)->qh[sb] : NULL;
        int16_t scale[32], lo[32], hi[32];
        for (int i = 0; i < 32; i++) scale[i] = iq4 ? x->sc[sb / 2][i / 4][sb % 2] : q->sc[sb / 2][i / 4][sb % 2];
        for (int v = 0; v < 4; v++) {
            for (int i = 0; i < 32; i++) {
                nibble_pair(iq4 ? x->qs[sb][v] : q->qs[sb][v], qh, v, i, &lo[i], &hi[i]);
                if (iq4) lo[i] = values[lo[i]], hi[i] = values[hi[i]];
            }
            scaled_half_row(b, tile, half, base + 2 * v, lo, scale);
            scaled_half_row(b, tile, half, base + 2 * v + 1, hi, scale);
        }
    }
}

static void unpack_q6_K_half(const uint8_t *blk, int tile, int half, int j, BTiles b) {
    const blk_q6_Kx8 *q = (const blk_q6_Kx8 *)blk;
    for (int sb = 4 * j; sb < 4 * j + 4; sb++) {
        const q6_sub *sub = &q->sub[sb];
        int16_t scale[32], u[32];
        for (int i = 0; i < 32; i++) scale[i] = q->sc[sb / 2][i / 4][sb % 2];
        for (int row = 0; row < 4; row++) {
            for (int i = 0; i < 32; i++) {
                const uint8_t ql = sub->qs[row / 2][i], top = (uint8_t)((sub->qh[i] >> (2 * row)) & 3);
                u[i] = (int16_t)(((row % 2 ? ql >> 4 : ql & 0xf) | top << 4) - 32);
            }
            scaled_half_row(b, tile, half, 4 * (sb % 4) + row, u, scale);
        }
    }
}

// Q3_K's weight u - 4 (a table type's value of index u) at byte i of plane g of sub-block sb
static inline int16_t q3_weight(int type, const blk_q3_Kx8 *t, int sb, int g, int i) {
    const int third = (t->qh[sb / 2][i] >> (4 * (sb % 2) + g)) & 1;
    return (int16_t)(q3_value(type, ((t->qs[sb][i] >> (2 * g)) & 3) | third << 2) - q3_offset(type));
}

static void unpack_q23_K_half(int type, const uint8_t *blk, int tile, int half, int j, BTiles b) {
    const int q3 = is_q3(type);
    const blk_q2_Kx8 *q = (const blk_q2_Kx8 *)blk;
    const blk_q3_Kx8 *t = (const blk_q3_Kx8 *)blk;
    for (int sb = 4 * j; sb < 4 * j + 4; sb++) {
        int16_t scale[32], u[32];
        for (int i = 0; i < 32; i++) scale[i] = q3 ? t->sc[sb / 2][i / 4][sb % 2] : q->sm[sb / 2][i / 4][sb % 2] & 0xf;
        for (int g = 0; g < 4; g++) {
            for (int i = 0; i < 32; i++)
                u[i] = q3 ? q3_weight(type, t, sb, g, i) : (int16_t)((q->qs[sb][i] >> (2 * g)) & 3);
            scaled_half_row(b, tile, half, 4 * (sb % 4) + g, u, scale);
        }
    }
}

static void unpack_q45_K(int type, const uint8_t *ba, const uint8_t *bb, int tile, int j, BTiles b) {
    unpack_q45_K_half(type, ba, tile, 0, j, b);
    unpack_q45_K_half(type, bb, tile, 1, j, b);
}

static void unpack_q23_K(int type, const uint8_t *ba, const uint8_t *bb, int tile, int j, BTiles b) {
    unpack_q23_K_half(type, ba, tile, 0, j, b);
    unpack_q23_K_half(type, bb, tile, 1, j, b);
}

static void unpack_q6_K(const uint8_t *ba, const uint8_t *bb, int tile, int j, BTiles b) {
    unpack_q6_K_half(ba, tile, 0, j, b);
    unpack_q6_K_half(bb, tile, 1, j, b);
}
#endif

// The 32-blocks of the tile's groups a and b as one B tile of 8 rows into dst: Q8_0's weights plus 128 as they
// are stored; the 4- and 5-bit types' low nibbles (rows 2 v) and high nibbles (rows 2 v + 1) of vector v, with
// their fifth bits
static void unpack_small(int type, const uint8_t *ba, const uint8_t *bb, int tile, BTiles dst) {
    uint8_t (*b)[16][64] = dst[LOW];
#ifdef AVX512_STEPS
    if (type == Q8_0) {
        for (int v = 0; v < 8; v++)
            _mm512_store_si512(b[tile][v], both(((const blk_q8_0x8 *)ba)->qs[v], ((const blk_q8_0x8 *)bb)->qs[v]));
        return;
    }
    const __m512i h = has_qh(type) ? both(ba + x8_qh_at(type), bb + x8_qh_at(type)) : _mm512_setzero_si512();
    for (int v = 0; v < 4; v++) {
        __m512i lo, hi;
        nibbles(both(ba + x8_qs_at(type) + 32 * v, bb + x8_qs_at(type) + 32 * v), has_qh(type) ? &h : NULL, v, &lo,
                &hi);
        _mm512_store_si512(b[tile][2 * v], lo);
        _mm512_store_si512(b[tile][2 * v + 1], hi);
    }
#else
    for (int half = 0; half < 2; half++) {
        const uint8_t *blk = half ? bb : ba;
        if (type == Q8_0) {
            for (int v = 0; v < 8; v++) memcpy(&b[tile][v][32 * half], ((const blk_q8_0x8 *)blk)->qs[v], 32);
            continue;
        }
        const uint8_t *q = blk + x8_qs_at(type), *qh = has_qh(type) ? blk + x8_qh_at(type) : NULL;
        for (int v = 0; v < 4; v++)
            for (int i = 0; i < 32; i++) {
                int16_t lo, hi;
                nibble_pair(q + 32 * v, qh, v, i, &lo, &hi);
                b[tile][2 * v][32 * half + i] = (uint8_t)lo, b[tile][2 * v + 1][32 * half + i] = (uint8_t)hi;
            }
    }
#endif
}

// The 32-blocks' scales d of group g's columns, and Q4_1 / Q5_1's minimums m (as dmin)
static void small_scales(int type, const uint8_t *blk, int g, BlockScales *s) {
    _mm256_storeu_ps(s->d + 8 * g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk)));
    if (has_min(type)) _mm256_storeu_ps(s->dmin + 8 * g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))));
}

// One activation tile (32 int8 values a row) times the 32-blocks' B tiles b.
static inline void amx_products_small(const uint8_t *a, int64_t act_row, int tiles, const BTiles b) {
    TILE_ZERO(2);
    TILE_LOAD(0, a, act_row);
    TILE_LOAD(1, b[LOW][0], 64);
    TILE_DPBSUD(2, 0, 1);
    if (tiles < 2) return;
    TILE_ZERO(4);
    TILE_LOAD(1, b[LOW][1], 64);
    TILE_DPBSUD(4, 0, 1);
}

static inline void amx_zero_sums(void) {
    TILE_ZERO(2);
    TILE_ZERO(3);
    TILE_ZERO(4);
    TILE_ZERO(5);
}

// One activation tile's 64 values (16 rows of act_row bytes from a) times their B tiles b, added to the sums.
static inline void amx_products_64(int type, const uint8_t *a, int64_t act_row, int tiles, const BTiles b) {
    const int signed_high = is_q3(type) || type == Q6_K || is_table(type);  // their high bytes are signed
    TILE_LOAD(0, a, act_row);
    TILE_LOAD(1, b[LOW][0], 64);
    TILE_DPBSUD(2, 0, 1);
    TILE_LOAD(1, b[HIGH][0], 64);
    if (signed_high) TILE_DPBSSD(3, 0, 1);
    else TILE_DPBSUD(3, 0, 1);
    if (tiles < 2) return;
    TILE_LOAD(1, b[LOW][1], 64);
    TILE_DPBSUD(4, 0, 1);
    TILE_LOAD(1, b[HIGH][1], 64);
    if (signed_high) TILE_DPBSSD(5, 0, 1);
    else TILE_DPBSUD(5, 0, 1);
}

// One activation tile (16 rows of act_row bytes from a: the super-block's int8 values) times the block's B tiles.
static inline void amx_products(int type, const uint8_t *a, int64_t act_row, int tiles, TileScratch *s) {
    amx_zero_sums();
    for (int j = 0; j < 4; j++) amx_products_64(type, a + 64 * j, act_row, tiles, s->b[j]);
}

static inline void amx_store_sums(int tiles, int high, TileScratch *s) {  // tile numbers must be constants
    TILE_STORE(2, s->c[LOW][0], 64);
    if (high) TILE_STORE(3, s->c[HIGH][0], 64);
    if (tiles < 2) return;
    TILE_STORE(4, s->c[LOW][1], 64);
    if (high) TILE_STORE(5, s->c[HIGH][1], 64);
}

// The stored sums of `rows` activation rows (act256 x[r]) into acc: the float step of the K-quants' 8-row kernels,
// with `mins` pairs of minimums times the activations' sums of 32 (4: Q4_K / Q5_K) or of 16 (8: Q2_K).
static inline void amx_float_step(int mins, const uint8_t *x, int64_t act_row, int rows, int tiles,
                                  const TileScratch *restrict s, const BlockScales *restrict sc,
                                  float (*restrict acc)[TASK_COLS]) {
    for (int r = 0; r < rows; r++) {
        const act256 *xr = (const act256 *)(x + r * act_row);
        const int16_t *part = mins == 8 ? xr->bsums : xr->sums32;  // the activations' sums the minimums meet
#ifdef AVX512_STEPS
        __m512i sums[8];  // pairs p of those sums in each 32-bit lane
        for (int p = 0; p < mins; p++) {
            int32_t pair;
            memcpy(&pair, part + 2 * p, 4);
            sums[p] = _mm512_set1_epi32(pair);
        }
#endif
        for (int t = 0; t < tiles; t++) {
            const int32_t *lo = s->c[LOW][t][r], *hi = s->c[HIGH][t][r];
            const float *d = sc->d + 16 * t, *dmin = sc->dmin + 16 * t;
            float *a = acc[r] + 16 * t;
#ifdef AVX512_STEPS
            const __m512 xd = _mm512_set1_ps(xr->d);
            const __m512i isum = _mm512_add_epi32(_mm512_loadu_si512(lo), _mm512_slli_epi32(_mm512_loadu_si512(hi), 8));
            __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_loadu_ps(d), xd),
                                       _mm512_loadu_ps(a));
            if (mins) {
                __m512i m = _mm512_setzero_si512();
                for (int p = 0; p < mins; p++)
                    m = _mm512_dpwssd_epi32(m, _mm512_loadu_si512(sc->mn[p][16 * t]), sums[p]);
                v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(_mm512_loadu_ps(dmin), xd), v);
            }
            _mm512_storeu_ps(a, v);
#else
            for (int e = 0; e < 16; e++) {
                const float v = fmaf((float)(lo[e] + 256 * hi[e]), d[e] * xr->d, a[e]);
                int32_t m = 0;
                for (int p = 0; p < mins; p++)
                    m += sc->mn[p][16 * t + e][0] * part[2 * p] + sc->mn[p][16 * t + e][1] * part[2 * p + 1];
                a[e] = mins ? fmaf(-(float)m, dmin[e] * xr->d, v) : v;
            }
#endif
        }
    }
}

// The stored sums of `rows` activation rows (act32 x[r]) into acc: the float step of dot_q8_0_x8 / dot_q45_x8.
static inline void amx_float_small(int type, const uint8_t *x, int64_t act_row, int rows, int tiles,
                                   const TileScratch *restrict s, const BlockScales *restrict sc,
                                   float (*restrict acc)[TASK_COLS]) {
    const float offset = x8_offset(type);
    for (int r = 0; r < rows; r++) {
        const act32 *xr = (const act32 *)(x + r * act_row);
        for (int t = 0; t < tiles; t++) {
            const int32_t *sum = s->c[LOW][t][r];
            const float *d = sc->d + 16 * t, *m = sc->dmin + 16 * t;
            float *a = acc[r] + 16 * t;
#ifdef AVX512_STEPS
            const __m512 vd = _mm512_loadu_ps(d), xs = _mm512_set1_ps(xr->s);
            __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(sum)),
                                       _mm512_mul_ps(vd, _mm512_set1_ps(xr->d)), _mm512_loadu_ps(a));
            if (type == Q8_0) v = _mm512_fnmadd_ps(vd, _mm512_set1_ps(128 * xr->s), v);
            else {
                const __m512 o = has_min(type) ? _mm512_loadu_ps(m) : _mm512_mul_ps(vd, _mm512_set1_ps(offset));
                v = _mm512_fmadd_ps(o, xs, v);
            }
            _mm512_storeu_ps(a, v);
#else
            for (int e = 0; e < 16; e++) {
                const float v = fmaf((float)sum[e], d[e] * xr->d, a[e]);
                if (type == Q8_0) a[e] = fmaf(-d[e], 128 * xr->s, v);
                else a[e] = fmaf(has_min(type) ? m[e] : d[e] * offset, xr->s, v);
            }
#endif
        }
    }
}

static inline void prefetch_bytes(const uint8_t *p, int64_t n) {
    for (int64_t at = 0; at < n; at += 64) __builtin_prefetch(p + at);
}

// The next activation tile's block (16 rows of act_row bytes from x) into L1 while this one multiplies.
static inline void prefetch_rows(const uint8_t *x, int64_t act_row, int64_t size) {
    for (int r = 0; r < 16; r++) prefetch_bytes(x + r * act_row, size + 63);
}

static const uint8_t zero_group[8 * 210] __attribute__((aligned(64)));  // a missing group: zero weights, scales

// Column tile t's two groups of 8 weight rows (from w, row_bytes apart) at block b
static inline void tile_groups(const uint8_t *w, int64_t row_bytes, int groups, int t, int64_t b, int64_t blk_bytes,
                               const uint8_t **ga, const uint8_t **gb) {
    *ga = w + 16 * t * row_bytes + b * blk_bytes;
    *gb = 2 * t + 1 < groups ? *ga + 8 * row_bytes : zero_group;
}

// Values 64 j .. of block b of the K-quant weights (groups of 8 rows from w) as B tiles into dst; with j 0, the
// block's scales into sc. Part j of the next block's weights goes on its way from memory.
static void unpack_kq_64(int type, const uint8_t *w, int64_t row_bytes, int groups, int64_t b, int64_t nb, int j,
                         BTiles dst, BlockScales *sc) {
    const int64_t blk_bytes = 8 * x8_row_bytes(type), part = (blk_bytes / 4 + 63) / 64 * 64;
    for (int t = 0; t < (groups + 1) / 2; t++) {
        const uint8_t *ga, *gb;
        tile_groups(w, row_bytes, groups, t, b, blk_bytes, &ga, &gb);
        if (b + 1 < nb) {
            const int64_t at = j * part, n = j < 3 ? part : blk_bytes - at;
            prefetch_bytes(ga + blk_bytes + at, n);
            if (gb != zero_group) prefetch_bytes(gb + blk_bytes + at, n);
        }
        if (type == Q6_K) unpack_q6_K(ga, gb, t, j, dst);
        else if (type == Q2_K || is_q3(type)) unpack_q23_K(type, ga, gb, t, j, dst);
        else unpack_q45_K(type, ga, gb, t, j, dst);
        if (j == 0) group_scales(type, ga, 2 * t, sc), group_scales(type, gb, 2 * t + 1, sc);
    }
}

// Block b of the 32-block weights (groups of 8 rows from w) as B tiles into dst and its scales into sc; the next
// block on its way from memory.
static void unpack_small_block(int type, const uint8_t *w, int64_t row_bytes, int groups, int64_t b, int64_t nb,
                               BTiles dst, BlockScales *sc) {
    const int64_t blk_bytes = 8 * x8_row_bytes(type);
    for (int t = 0; t < (groups + 1) / 2; t++) {
        const uint8_t *ga, *gb;
        tile_groups(w, row_bytes, groups, t, b, blk_bytes, &ga, &gb);
        if (b + 1 < nb) {
            prefetch_bytes(ga + blk_bytes, blk_bytes);
            if (gb != zero_group) prefetch_bytes(gb + blk_bytes, blk_bytes);
        }
        unpack_small(type, ga, gb, t, dst);
        small_scales(type, ga, 2 * t, sc), small_scales(type, gb, 2 * t + 1, sc);
    }
}

// acc[r][e] for a K-quant task of at most 16 activation rows (one tile, as decode steps have). Its products are
// short, so rather than a block's unpacking, then its products, then its float step, the task goes in steps of 64
// values: each step's products, then the float step of the block before (after a block's first products), then
// the unpacking of the next step's values, all while the tiles multiply. The steps' B tiles take s->b in turn:
// a step's unpacking overwrites the tiles read three steps before (tile loads wait for the products before them,
// and an unpacking into tiles just read waited for those loads).
static void amx_task_row(int type, const uint8_t *w, int64_t row_bytes, int groups, const uint8_t *x,
                         int64_t act_row, int64_t nb, int rows, TileScratch *s, float (*acc)[TASK_COLS]) {
    const int tiles = (groups + 1) / 2, mins = minimum_pairs(type);
    const int64_t act_size = sizeof(act256), steps = 4 * nb;
    memset(acc, 0, (size_t)rows * sizeof acc[0]);
    unpack_kq_64(type, w, row_bytes, groups, 0, nb, 0, s->b[0], &s->sc[0]);
    for (int64_t i = 0; i < steps; i++) {
        const int64_t b = i / 4, next = i + 1;
        const int j = (int)(i % 4);
        const uint8_t *xb = x + b * act_size;
        if (j == 0) amx_zero_sums();
        amx_products_64(type, xb + offsetof(act256, q) + 64 * j, act_row, tiles, s->b[j]);
        if (j == 0 && b > 0) amx_float_step(mins, xb - act_size, act_row, rows, tiles, s, &s->sc[(b - 1) % 2], acc);
        if (next < steps)
            unpack_kq_64(type, w, row_bytes, groups, next / 4, nb, (int)(next % 4), s->b[next % 4],
                         next % 4 ? NULL : &s->sc[next / 4 % 2]);
        if (j == 3) amx_store_sums(tiles, 1, s);
    }
    amx_float_step(mins, x + (nb - 1) * act_size, act_row, rows, tiles, s, &s->sc[(nb - 1) % 2], acc);
}

// acc[r][e] = weight row e (groups of 8 rows from w, row_bytes apart) times activation row r, for `rows` rows
// (of act_row bytes from x, the buffer padded to whole tiles). Each activation tile's float step runs while the
// next tile's products are under way.
static void amx_task(int type, const uint8_t *w, int64_t row_bytes, int groups, const uint8_t *x, int64_t act_row,
                     int64_t nb, int rows, TileScratch *s, float (*acc)[TASK_COLS]) {
    const int kq = block_size(type) == 256, mins = minimum_pairs(type);
    if (kq && rows <= 16) {
        amx_task_row(type, w, row_bytes, groups, x, act_row, nb, rows, s, acc);
        return;
    }
    const int64_t act_size = kq ? (int64_t)sizeof(act256) : (int64_t)sizeof(act32);
    const int64_t q_at = kq ? (int64_t)offsetof(act256, q) : (int64_t)offsetof(act32, q);
    const int tiles = (groups + 1) / 2, m_tiles = (rows + 15) / 16;
    BlockScales *sc = &s->sc[0];
    memset(acc, 0, (size_t)rows * sizeof acc[0]);
    for (int64_t b = 0; b < nb; b++) {
        if (kq)
            for (int j = 0; j < 4; j++) unpack_kq_64(type, w, row_bytes, groups, b, nb, j, s->b[j], j ? NULL : sc);
        else
            unpack_small_block(type, w, row_bytes, groups, b, nb, s->b[b % 4], sc);
        const uint8_t *xb = x + b * act_size;
        for (int mt = 0; mt <= m_tiles; mt++) {
            if (mt < m_tiles) {
                if (kq) amx_products(type, xb + 16 * mt * act_row + q_at, act_row, tiles, s);
                else amx_products_small(xb + 16 * mt * act_row + q_at, act_row, tiles, s->b[b % 4]);
            }
            if (mt + 1 < m_tiles) prefetch_rows(xb + 16 * (mt + 1) * act_row, act_row, act_size);
            if (mt > 0) {
                const int r0 = 16 * (mt - 1), n = rows - r0 < 16 ? rows - r0 : 16;
                if (kq) amx_float_step(mins, xb + r0 * act_row, act_row, n, tiles, s, sc, acc + r0);
                else amx_float_small(type, xb + r0 * act_row, act_row, n, tiles, s, sc, acc + r0);
            }
            if (mt < m_tiles) amx_store_sums(tiles, kq, s);
        }
    }
}

// flock_qgemm's K-quant tiles on AMX, inside its parallel region: the same outputs as its vector loop (xq holds
// whole tiles of activation rows). Returns nonzero where an emulated tile operation met shapes the CPU would
// refuse, -1 where its scratch cannot be had.
static int amx_gemm(int type, const uint8_t *w, int64_t row_bytes, int64_t n, const uint8_t *xq, int64_t act_row,
                    int64_t nb, int64_t m, void *y, int64_t ldy, int out_bf16, int glu) {
    const int64_t blocks = (n + TASK_COLS - 1) / TASK_COLS, tasks = (m + TASK_ROWS - 1) / TASK_ROWS * blocks;
    TileScratch *s = aligned_alloc(64, sizeof(TileScratch));
    TaskSums *sums = aligned_alloc(64, sizeof(TaskSums));
    int configured = 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; i++) {
        if (!s || !sums) continue;
        if (!configured) amx_configure(block_size(type) == 256 ? 64 : 32, m < 16 ? (int)m : 16), configured = 1;
        const int64_t n0 = i % blocks * TASK_COLS, m0 = i / blocks * TASK_ROWS;  // a chunk's rows stay in L2
        const int rows = m - m0 < TASK_ROWS ? (int)(m - m0) : TASK_ROWS;
        const int groups = n - n0 < TASK_COLS ? (int)(n - n0) / 8 : TASK_COLS / 8, cols = 8 * groups;
        const uint8_t *x = xq + m0 * act_row;
        amx_task(type, w + n0 * row_bytes, row_bytes, groups, x, act_row, nb, rows, s, sums->acc);
        if (glu) {
            amx_task(type, w + (n0 + n) * row_bytes, row_bytes, groups, x, act_row, nb, rows, s, sums->up);
            for (int r = 0; r < rows; r++) silu_mul_rows(sums->acc[r], sums->up[r], cols);
        }
        for (int r = 0; r < rows; r++) write_row(y, (m0 + r) * ldy + n0, sums->acc[r], cols, out_bf16);
    }
    if (configured) TILE_RELEASE();
    const int ok = s && sums;
    free(s);
    free(sums);
    return ok ? TILE_FAULTED() : -1;
}
