// Prefix-sharing (cascade) attention over the paged KV cache on x86-64 CPUs, prefill and decode, bf16 and fp32.
//
// One source, built once per ISA path by flock/attention/cpu.py with different gcc -m flags:
//   avx512bf16: AVX-512 with vdpbf16ps: bf16 inputs multiply as bf16 pairs (QK^T and PV), softmax in fp32;
//   avx512    : AVX-512F, bf16 inputs converted to fp32;
//   avx2      : AVX2 + FMA (the portable floor), 8 lanes.
// fp32 inputs take the fp32 products on every path (weights P kept in fp32, a 1-ulp 2^x). The caches hold the
// inputs' dtype or fp8 rows (kv_fp8.h: codes and a scale a row), turned into values where a chunk is repacked.
//
// One call per layer. Work comes as segments (planned once per step in Python, see cpu.py):
//   a set of query rows against one range of KV positions [kv_start, kv_end) through one block table, causal or
//   not; segment row r is entry BEGIN + r / G and query head kv_head * G + r % G (G query heads share a KV head,
//   so GQA reads each K and V row once for all of them). Its rows write the output (SLOT < 0) or an fp32
//   partial and its log-sum-exp at partial slot SLOT + r / G; a last pass merges each token's partials (a
//   group's prefix and the rest of the request's context, or the pieces of a segment split by KV range).
//
// A unit of work (one OpenMP task, dynamic scheduling, heaviest first) is up to UNIT_ROWS rows of a segment
// and a run of KV heads. It walks the KV range in chunks of CHUNK positions; per chunk and head it repacks K
// and V from the paged blocks (read in place) into the layouts the products want (a segment of SHARED_BLOCKS
// units' rows or more, as a long prefill has, has each chunk packed once, before its units, for all of them),
// then every block of MR rows runs S = Q K^T, an online softmax (lazy rescale: the running max moves only when a
// score exceeds it by more than 2^RESCALE_LOG2 in weight) and O += P V. Both products are one register-tiled
// microkernel, C[MR rows][NV vectors] += A[row][k] (one 32-bit element broadcast) x B[k][NV vectors]:
//   fp32 : QK^T: A = Q rows (fp32), B = K^T [dim][position];       PV: A = P (fp32), B = V [position][dim];
//   bf16 : QK^T: A = Q rows as dim pairs, B = K^T [dim pair][position] (each lane a pair: vdpbf16ps);
//          PV  : A = P rows rounded to bf16, pairs of positions, B = V [position pair][dim] (pairs interleaved).
// With vdpbf16ps, units of at most DIRECT_ROWS rows (decode when few query heads share a KV head) skip the
// repack and read K and V rows in place (direct_head): the repack would be most of their time (the caller's
// direct_rows says where: not on CPUs that repack faster).
//   amx       : AVX512-BF16 with AMX tiles: bf16 (head_dim a multiple of 32) in the pairs layouts, which are
//               the tiles' own (Q rows and P rows are A tiles, K^T and V pairs B tiles), every product on
//               tiles for blocks of 16 rows (amx_scores, amx_values); units of at most FEW_ROWS rows (decode's
//               own parts, unshared requests) read bf16 K and V rows from the cache straight into tiles (fp8
//               rows converted into a stage first), their scores transposed (few_chunk).
//               FLOCK_EMULATED_AMX builds it on AVX2 with the tile operations in portable C (and the pairs
//               repack and weights too): how CPUs without AMX test it.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp2_poly.h"

#if defined(__AMX_BF16__) || (defined(FLOCK_EMULATED_AMX) && defined(__AVX2__))
#define AMX_TILES
#include "amx_tiles.h"
#endif

enum { SEG_BEGIN, SEG_ROWS, SEG_TABLE, SEG_KV_START, SEG_KV_END, SEG_CAUSAL, SEG_SLOT, SEG_FIELDS };

#define CHUNK 64        // KV positions per chunk (a multiple of 32)
#define MAX_D 256       // head_dim: a multiple of 16, at most this
#define SPAN 1024       // KV heads x head_dim of one unit, at most (elements per position) ...
#define ROWS_SPAN (UNIT_ROWS * 512)  // ... and rows x that: a unit of many rows keeps Q and O in L2
#ifdef AMX_TILES
#define UNIT_ROWS 192    // segment rows per unit (a multiple of MR and of the tiles' 16)
#else
#define UNIT_ROWS 120   // segment rows per unit (a multiple of MR)
#endif
#define MAX_HEADS (SPAN / 16)
#define RESCALE_LOG2 8.0f
#define LOG2E 1.4426950408889634f

typedef uint16_t bf16;

typedef struct {
    const void *q, *k_cache, *v_cache;              // bf16 or fp32, as `bf16` says
    int64_t q_stride_t, q_stride_h;                 // elements
    int64_t kv_stride_b, kv_stride_s, kv_stride_h;  // elements, same for K and V
    const int32_t *segs, *tokens, *positions, *tables;
    int32_t num_segs;
    void *out;
    int64_t out_stride_t, out_stride_h;
    float *o_part, *lse_part;                       // [slots, H, D], [slots, H]
    const int32_t *merge_offsets, *merge_slots;     // merge m: slots merge_slots[offsets[m] .. offsets[m + 1]) (< 64)
    const int32_t *merge_tokens;                    // into the output row of step token merge_tokens[m]
    int32_t num_merges;
    int32_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int32_t bf16;                                   // inputs and output: 1 bf16, 0 fp32
    int32_t window;                                 // a causal row at position p sees (p - window, p] (0: all)
    float softcap;                                  // scaled scores x become softcap tanh(x / softcap) (0: none)
    int32_t kv_format;                              // the caches' elements: KV_MODEL (q's dtype) or fp8 rows
    // per entry, the last position a causal row sees (Gemma 3's image tokens: their image's last); NULL: its own
    const int32_t *attend_ends;
    int32_t direct_rows;  // units of at most this many rows (and DIRECT_ROWS) read K and V in place (0: none)
} Args;

// ------------------------------------------------------------------------------------------------ vectors

#if defined(__AVX512F__)
#define W 16
#define MR 6   // rows of a register tile (UNIT_ROWS is a multiple of it)
#define NV 4   // vectors of a register tile (6 x 4 accumulators of 32 registers)
typedef __m512 vf;
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vfms(vf a, vf b, vf c) { return _mm512_fmsub_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline float hmax(vf x) { return _mm512_reduce_max_ps(x); }
static inline int any_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
static inline float hsum(vf x) { return _mm512_reduce_add_ps(x); }
static inline vf keep_first(vf x, int n, vf fill) {  // lanes >= n replaced by fill
    __mmask16 k = n >= 16 ? 0xffff : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
    return _mm512_mask_mov_ps(fill, k, x);
}
static inline vf load_bf16(const bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void store_bf16(bf16 *p, vf x) {  // round to nearest even
    __m512i b = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(b));
}
static inline vf round_bf16(vf x) {  // to the nearest even bf16, kept as fp32
    __m512i b = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline vf exp2_int(vf t) {  // t rounded to an integer, and 2^(t - n) from the caller: see vexp2
    return _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vf scale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }

#include "transpose16.h"
static inline void transpose_w(vf x[W]) { transpose16((__m512i *)x); }
#else
#define W 8
#define MR 6
#define NV 2   // 6 x 2 accumulators of 16 registers
typedef __m256 vf;
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfms(vf a, vf b, vf c) { return _mm256_fmsub_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline float hmax(vf x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline int any_gt(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
static inline float hsum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf keep_first(vf x, int n, vf fill) {
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
    return _mm256_blendv_ps(fill, x, keep);
}
static inline vf load_bf16(const bf16 *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void store_bf16(bf16 *p, vf x) {
    __m256i b = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
static inline vf round_bf16(vf x) {
    __m256i b = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline vf exp2_int(vf t) { return _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf scale2(vf p, vf n) {  // p * 2^n, n an integer in [-126, 127]
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline void transpose_w(vf x[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(x[2 * i], x[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(x[2 * i], x[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        x[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}
#endif

// 2^t for t <= 2^RESCALE_LOG2 (callers zero the weights of hidden positions themselves). `precise` (fp32
// inputs): a degree-5 polynomial, 1.6e-7 relative error; otherwise degree 3, 7.5e-5 (below bf16 rounding). On
// AMX CPUs the degree-3 one is of the fraction above floor(t) (vreduceps), which vscalefps's 2^floor(t)
// completes: two instructions fewer than rounding to nearest and subtracting, and no clamp.
static inline __attribute__((always_inline)) vf vexp2(vf t, const int precise) {
#if defined(__AMX_BF16__)
    if (!precise) {
        const vf f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        vf p = vset1(0.07802403f);
        p = vfma(p, f, vset1(0.22606707f));
        p = vfma(p, f, vset1(0.69583399f));
        p = vfma(p, f, vset1(0.99992513f));
        return _mm512_scalef_ps(p, t);
    }
#endif
    t = vmax(vset1(-126.0f), t);  // a NaN stays NaN: max returns its second operand where either is NaN
    vf n = exp2_int(t), f = vsub(t, n);
    vf p;
    if (precise) {
        p = EXP2_POLY5(f, vfma, vset1);
    } else {
        p = vset1(0.05517162f);
        p = vfma(p, f, vset1(0.24261117f));
        p = vfma(p, f, vset1(0.693261f));
        p = vfma(p, f, vset1(0.99992807f));
    }
    return scale2(p, n);
}

#include "kv_fp8.h"

// ------------------------------------------------------------------------------------------------ microkernel

#define INLINE static inline __attribute__((always_inline))

// C[mr][nv W] = (acc_in ? C : 0) + sum over i < k of A[r][i] B[i][.], with A's 32-bit elements broadcast (an
// fp32 value, or with `pairs` two bf16 multiplied pairwise by vdpbf16ps) and B's rows nv vectors. lda, ldb and
// ldc count 32-bit elements. mr, nv, pairs and acc_in are constants where it is inlined: the accumulators
// stay in registers.
INLINE void tile(const int mr, const int nv, const int pairs, const int acc_in, const float *a, int64_t lda,
                 const float *b, int64_t ldb, float *c, int64_t ldc, int k) {
    (void)pairs;  // only with vdpbf16ps
    vf acc[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++) acc[r][j] = acc_in ? vload(c + r * ldc + j * W) : vzero();
    for (int i = 0; i < k; i++) {
        vf bv[NV];
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++) bv[j] = vload(b + i * ldb + j * W);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
#if defined(__AVX512BF16__)
            if (pairs) {
                const __m512bh av = (__m512bh)_mm512_set1_epi32(((const int32_t *)a)[r * lda + i]);
#pragma GCC unroll 4
                for (int j = 0; j < nv; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, (__m512bh)bv[j]);
                continue;
            }
#endif
            const vf av = vset1(a[r * lda + i]);
#pragma GCC unroll 4
            for (int j = 0; j < nv; j++) acc[r][j] = vfma(av, bv[j], acc[r][j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nv; j++) vstore(c + r * ldc + j * W, acc[r][j]);
}

#define T(m, n) case (m) * 8 + (n): tile(m, n, PAIRS, ACC, a, lda, b, ldb, c, ldc, k); return;
#if W == 16
#define TILES T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(2, 1) T(2, 2) T(2, 3) T(2, 4) T(3, 1) T(3, 2) T(3, 3) T(3, 4) \
              T(4, 1) T(4, 2) T(4, 3) T(4, 4) T(5, 1) T(5, 2) T(5, 3) T(5, 4) T(6, 1) T(6, 2) T(6, 3) T(6, 4)
#else
#define TILES T(1, 1) T(1, 2) T(2, 1) T(2, 2) T(3, 1) T(3, 2) T(4, 1) T(4, 2) T(5, 1) T(5, 2) T(6, 1) T(6, 2)
#endif
#define TILE_FN(name, pairs, acc)                                                                   \
    static void name(int mr, int nv, const float *a, int64_t lda, const float *b, int64_t ldb,      \
                     float *c, int64_t ldc, int k) {                                                \
        enum { PAIRS = pairs, ACC = acc };                                                          \
        switch (mr * 8 + nv) { TILES }                                                              \
    }
TILE_FN(tile_qk, 0, 0)
TILE_FN(tile_pv, 0, 1)
#if defined(__AVX512BF16__)
TILE_FN(tile_qk_pairs, 1, 0)
TILE_FN(tile_pv_pairs, 1, 1)
#else  // never called: the pairs format needs vdpbf16ps
#define tile_qk_pairs tile_qk
#define tile_pv_pairs tile_pv
#endif

#ifdef AMX_TILES
#define BLOCK_ROWS 16  // rows of a block: a tile's (the pairs layouts), else a register tile's
static __thread int tile_rows;  // the rows the tiles are configured for (0: none)

static void tiles_for(int rows) {
    if (rows != tile_rows) amx_configure_bf16(tile_rows = rows);
}

// S[rows][CHUNK] = Q (rows of D bf16, D a multiple of 32) K^T, K^T as pairs [D / 2][CHUNK]
static void amx_scores(int rows, const bf16 *q, int D, const int32_t *kt, float *s) {
    _Static_assert(CHUNK == 64, "the tiles' 64 columns");
    tiles_for(rows);
    amx_bf16_x64(q, D, kt, D, s);
}

// O[rows][D] += P V over the chunk's first `npos` positions (a multiple of 32): P rows of CHUNK bf16, V as
// pairs [CHUNK / 2][D]
static void amx_values(int rows, const bf16 *p, const int32_t *v, int D, float *o, int npos) {
    tiles_for(rows);
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int four = D - d0 >= 64;  // else two tiles (D is a multiple of 32)
        TILE_LOAD(0, o + d0, D * 4);
        TILE_LOAD(1, o + d0 + 16, D * 4);
        if (four) {
            TILE_LOAD(2, o + d0 + 32, D * 4);
            TILE_LOAD(3, o + d0 + 48, D * 4);
        }
        for (int k0 = 0; k0 < npos; k0 += 32) {
            const int32_t *b = v + k0 / 2 * D + d0;
            TILE_LOAD(4, p + k0, CHUNK * 2);
            TILE_LOAD(5, b, D * 4);
            TILE_LOAD(6, b + 16, D * 4);
            TILE_DPBF16PS(0, 4, 5);
            TILE_DPBF16PS(1, 4, 6);
            if (four) {
                TILE_LOAD(7, b + 32, D * 4);
                TILE_LOAD(5, b + 48, D * 4);
                TILE_DPBF16PS(2, 4, 7);
                TILE_DPBF16PS(3, 4, 5);
            }
        }
        TILE_STORE(0, o + d0, D * 4);
        TILE_STORE(1, o + d0 + 16, D * 4);
        if (four) {
            TILE_STORE(2, o + d0 + 32, D * 4);
            TILE_STORE(3, o + d0 + 48, D * 4);
        }
    }
}
#else
#define BLOCK_ROWS MR
#endif

// ------------------------------------------------------------------------------------------------ work

typedef struct {  // per-thread scratch, 64-byte aligned
    float kt[CHUNK * SPAN];     // K^T of a chunk, per head: fp32 [dim][CHUNK], or bf16 pairs [dim / 2][CHUNK]
    float v[CHUNK * SPAN];      // V, per head: fp32 [position][dim], or bf16 [position / 2][dim][2]
    float q[UNIT_ROWS * SPAN];  // the unit's query rows as the products take them: [head][row][dim]
    float o[UNIT_ROWS * SPAN];  // running outputs (not yet divided by l): [head][row][dim]
    float s[BLOCK_ROWS * CHUNK];  // scores of a row block
    float p[BLOCK_ROWS * CHUNK];  // its weights: fp32, or bf16 (rows of CHUNK, in the first half)
    float m[MAX_HEADS * UNIT_ROWS];      // running max of each row (score units)
    float l[MAX_HEADS * UNIT_ROWS * W];  // and its sum of weights, by lanes
    int32_t limit[UNIT_ROWS];   // last position each row sees
    int32_t first[UNIT_ROWS];   // and its first (a sliding window's; else 0)
    int64_t offset[2][CHUNK];   // cache offsets of a chunk's positions (first head of the unit); [2]: and the next
#ifdef AMX_TILES  // a unit of at most FEW_ROWS rows (few_chunk); its O sums in kt, which it does not repack into
    int32_t fq[SPAN / 32 * 256];  // Q^T as pairs: [head][32 dims][16 dim pairs][16 rows]
    int32_t pe[CHUNK * 16], po[CHUNK * 16];  // the weights spread as A tiles: [position / 16][lane][16]
    float fm[MAX_HEADS * 16], fl[MAX_HEADS * 16];  // running max and sum of weights, [head set][lane]
    bf16 stage[CHUNK / 16][16 * MAX_D];  // K or V rows a tile cannot read in place, zeros past staged[]
    int32_t staged[CHUNK / 16];          // bytes of each stage copied into last
#endif
} Scratch;

typedef struct {  // a chunk's K^T and V in the products' layouts (see Scratch), CHUNK * D floats a head
    float *kt, *v;
} Packed;

typedef struct {  // rows [row0, row0 + nrows) of a segment, KV heads [h0, h0 + hb)
    const int32_t *seg;
    int row0, nrows, h0, hb;
    double work;
    float *shared;  // the segment's chunks, every KV head, packed once for all its units (NULL: each packs its own)
} Unit;


// Cache offsets (elements) of positions [start, start + n) of one KV head: one table lookup per block.
static void row_offsets(const Args *a, int64_t *off, int32_t table, int64_t start, int n, int kvh) {
    const int bs = a->block_size;
    int64_t block = start / bs, slot = start % bs;
    int64_t base = (int64_t)a->tables[table + block] * a->kv_stride_b + (int64_t)kvh * a->kv_stride_h;
    for (int t = 0; t < n; t++) {
        if (slot == bs) {
            slot = 0;
            base = (int64_t)a->tables[table + ++block] * a->kv_stride_b + (int64_t)kvh * a->kv_stride_h;
        }
        off[t] = base + slot++ * a->kv_stride_s;
    }
}

// K and V rows to prefetch a few at a time while other work runs (a burst of hundreds would stall the core
// on its line-fill buffers): rows off[0 .. n) (elements of es bytes) of k and of v, `bytes` from each.
typedef struct {
    const char *k, *v;
    int es;
    const int64_t *off;
    int n, t;
    int64_t bytes, at;
} Prefetch;

// Positions off[0 .. n) of the cache, the unit's run of hb heads from each.
static Prefetch prefetch_plan(const Args *a, const int64_t *off, int n, int hb) {
    const int es = a->kv_format != KV_MODEL ? 1 : a->bf16 ? 2 : 4;  // fp8 rows: codes, then the scale's 4 bytes
    const int64_t bytes = ((int64_t)(hb - 1) * a->kv_stride_h + a->head_dim) * es + (es == 1 ? 4 : 0);
    return (Prefetch){a->k_cache, a->v_cache, es, off, n, 0, bytes, 0};
}

// A shared segment's packed chunk: each of the hb heads' K^T and V (off: room for hb offsets).
static Prefetch packed_plan(const Args *a, Packed p, int64_t *off, int hb, int pairs) {
    const int64_t head = (int64_t)CHUNK * a->head_dim;
    for (int h = 0; h < hb; h++) off[h] = h * head;
    return (Prefetch){(const char *)p.kt, (const char *)p.v, 4, off, hb, 0, head * (pairs ? 2 : 4), 0};
}

// Into L2: a chunk ahead of all of a unit's heads outgrows L1 beside the chunk being computed, and prefetches
// into L1 stalled longer on the fill buffers (on Zen 4 a long context's decode took 1.5x the time).
#define KV_HINT _MM_HINT_T1

static void prefetch_some(Prefetch *p, int lines) {
    for (; lines > 0 && p->t < p->n; lines -= 2) {
        _mm_prefetch(p->k + p->off[p->t] * p->es + p->at, KV_HINT);
        _mm_prefetch(p->v + p->off[p->t] * p->es + p->at, KV_HINT);
        p->at += 64;
        if (p->at >= p->bytes) p->at = 0, p->t++;
    }
}

INLINE vf load_row(const void *base, int64_t i, const int in_bf16) {
    return in_bf16 ? load_bf16((const bf16 *)base + i) : vload((const float *)base + i);
}

// Dims [d, d + W) of the cache row at element `row` as fp32 (an fp8 row's values rounded to bf16 for bf16 models,
// as every path of theirs takes them).
INLINE vf load_kv(const void *cache, int64_t row, int d, int D, const int kv, const int in_bf16) {
    if (kv == KV_MODEL) return load_row(cache, row + d, in_bf16);
    const uint8_t *r = (const uint8_t *)cache + row;
    const vf x = fp8_load(r + d, kv == KV_E5M2, fp8_scale(r, D));
    return in_bf16 ? round_bf16(x) : x;
}

// A chunk of the unit's heads as fp32, K^T transposed W x W at a time (positions past n are zeros), V rows
// copied. Reads go position by position over the run of heads: whole blocks of the cache in address order.
INLINE void repack_kv(const Args *a, Packed p, const int64_t *off, int n, int hb, const int in_bf16, const int kv) {
    const int D = a->head_dim;
    const int64_t sh = a->kv_stride_h;
    for (int t0 = 0; t0 < n; t0 += W)
        for (int h = 0; h < hb; h++)
            for (int d0 = 0; d0 < D; d0 += W) {
                vf x[W];
                for (int i = 0; i < W; i++)
                    x[i] = t0 + i < n ? load_kv(a->k_cache, off[t0 + i] + h * sh, d0, D, kv, in_bf16) : vzero();
                transpose_w(x);
                for (int i = 0; i < W; i++) vstore(p.kt + h * CHUNK * D + (d0 + i) * CHUNK + t0, x[i]);
            }
    for (int t = 0; t < n; t++)
        for (int h = 0; h < hb; h++)
            for (int d0 = 0; d0 < D; d0 += W)
                vstore(p.v + h * CHUNK * D + t * D + d0, load_kv(a->v_cache, off[t] + h * sh, d0, D, kv, in_bf16));
}

INLINE void repack(const Args *a, Packed p, const int64_t *off, int n, int hb, const int in_bf16) {
    switch (a->kv_format) {
        case KV_E4M3: repack_kv(a, p, off, n, hb, in_bf16, KV_E4M3); return;
        case KV_E5M2: repack_kv(a, p, off, n, hb, in_bf16, KV_E5M2); return;
        default: repack_kv(a, p, off, n, hb, in_bf16, KV_MODEL); return;
    }
}

#if defined(__AVX512BF16__)
// Dims [d, d + nd) (nd 32 or 16) of the bf16 or fp8 cache row at element `row` as bf16, zeros past nd.
INLINE __m512i kv_bf16(const void *cache, int64_t row, int d, int nd, int D, const int kv) {
    if (kv == KV_MODEL) return _mm512_maskz_loadu_epi16(nd == 32 ? 0xffffffffu : 0xffffu, (const bf16 *)cache + row + d);
    const uint8_t *r = (const uint8_t *)cache + row;
    return fp8_load_bf16(r + d, nd, kv == KV_E5M2, fp8_scale(r, D));
}

// A bf16 chunk of the unit's heads as pairs: K^T as [dim pair][position] (16 x 16 transposes of 32-bit pairs),
// V as [position pair][dim][2] (two rows interleaved); positions past n are zeros. Reads as in repack().
INLINE void repack_pairs_kv(const Args *a, Packed p, const int64_t *off, int n, int hb, const int kv) {
    const int D = a->head_dim;
    const int64_t sh = a->kv_stride_h;
    for (int t0 = 0; t0 < n; t0 += 16)
        for (int h = 0; h < hb; h++) {
            int32_t *kt = (int32_t *)p.kt + h * CHUNK * D;
            for (int d0 = 0; d0 < D; d0 += 32) {
                const int nd = D - d0 >= 32 ? 32 : 16;  // dims in this block (head_dim is a multiple of 16)
                __m512i x[16];
                for (int i = 0; i < 16; i++)
                    x[i] = t0 + i < n ? kv_bf16(a->k_cache, off[t0 + i] + h * sh, d0, nd, D, kv) : _mm512_setzero_si512();
                transpose16(x);
                for (int i = 0; i < nd / 2; i++) _mm512_storeu_si512(kt + (d0 / 2 + i) * CHUNK + t0, x[i]);
            }
        }
    // element 2j: dim j of the first row, 2j + 1: of the second (+32: the second source)
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int t = 0; t < n; t += 2)
        for (int h = 0; h < hb; h++) {
            int32_t *dst = (int32_t *)p.v + h * CHUNK * D + (t / 2) * D;
            for (int d0 = 0; d0 < D; d0 += 32) {
                const int nd = D - d0 >= 32 ? 32 : 16;
                const __m512i a0 = kv_bf16(a->v_cache, off[t] + h * sh, d0, nd, D, kv);
                const __m512i a1 = t + 1 < n ? kv_bf16(a->v_cache, off[t + 1] + h * sh, d0, nd, D, kv) : _mm512_setzero_si512();
                _mm512_storeu_si512(dst + d0, _mm512_permutex2var_epi16(a0, lo, a1));
                if (nd == 32) _mm512_storeu_si512(dst + d0 + 16, _mm512_permutex2var_epi16(a0, hi, a1));
            }
        }
}
#elif defined(AMX_TILES)
// Dim d of the cache row at element `row`, as bf16.
static inline bf16 kv_dim(const void *cache, int64_t row, int d, int D, const int kv) {
    if (kv == KV_MODEL) return ((const bf16 *)cache)[row + d];
    const uint8_t *r = (const uint8_t *)cache + row;
    return f32_to_bf16(fp8_value(r[d], kv == KV_E5M2) * fp8_scale(r, D));
}

// The same layouts in portable C (the emulated AMX build, on AVX2).
INLINE void repack_pairs_kv(const Args *a, Packed p, const int64_t *off, int n, int hb, const int kv) {
    const int D = a->head_dim;
    for (int h = 0; h < hb; h++) {
        bf16 *kt = (bf16 *)((int32_t *)p.kt + h * CHUNK * D);
        bf16 *v = (bf16 *)((int32_t *)p.v + h * CHUNK * D);
        for (int t = 0; t < (n + 15) / 16 * 16; t++) {
            const int64_t at = off[t < n ? t : 0] + h * a->kv_stride_h;  // past n: a row read, zeros written
            for (int d = 0; d < D; d++) {
                kt[(d / 2 * CHUNK + t) * 2 + d % 2] = t < n ? kv_dim(a->k_cache, at, d, D, kv) : 0;
                v[(t / 2) * 2 * D + 2 * d + t % 2] = t < n ? kv_dim(a->v_cache, at, d, D, kv) : 0;
            }
        }
    }
}
#endif
#if defined(__AVX512BF16__) || defined(AMX_TILES)
static void repack_pairs(const Args *a, Packed p, const int64_t *off, int n, int hb) {
    switch (a->kv_format) {
        case KV_E4M3: repack_pairs_kv(a, p, off, n, hb, KV_E4M3); return;
        case KV_E5M2: repack_pairs_kv(a, p, off, n, hb, KV_E5M2); return;
        default: repack_pairs_kv(a, p, off, n, hb, KV_MODEL); return;
    }
}
#else  // never called: the pairs format needs vdpbf16ps or AMX
#define repack_pairs(a, p, off, n, hb) repack(a, p, off, n, hb, 1)
#endif

#ifdef AMX_TILES
// V pairs zero from position n up to the next multiple of 32 (P V's last tile of positions reads them with
// weight 0; stale values could be inf or NaN).
static void zero_v_tail(const Args *a, Packed p, int n, int hb) {
    const int D = a->head_dim, from = (n + 1) / 2, to = (n + 31) / 32 * 16;
    for (int h = 0; h < hb && from < to; h++)
        memset((int32_t *)p.v + h * CHUNK * D + from * D, 0, (size_t)(to - from) * D * sizeof(int32_t));
}
#endif

// Lanes of vector j (positions j W ...) before position `front` replaced by fill.
static inline vf drop_before(vf x, int j, int front, vf fill) {
    const int k = front - j * W;
    return k <= 0 ? x : k >= W ? fill : keep_first(fill, k, x);
}

// One row's weights 2^((s - m) c) (mc = m c) from its scores s: nvis visible vectors (the last with `last`
// lanes; positions before `front` hidden too, a sliding window's), zeros elsewhere up to pvec vectors, stored at
// p as P V reads them, their sum added to its lanes l (with pairs: of the bf16-rounded weights, the ones P V
// uses). `full`: every vector visible, no masks.
INLINE void row_weights(const float *s, void *p, float *l, vf c, vf mc, int nvis, int last, int front, int pvec,
                        const int pairs, const int precise, const int full) {
    (void)pairs;  // the pairs layouts need vdpbf16ps or AMX
    const vf zero = vzero();
    vf sum = vload(l);
#define EXP(j) vexp2(vfms(vload(s + (j) * W), c, mc), precise)
#define SUFFIX(j) ((j) + 1 < nvis || ((j) + 1 == nvis && last == W) ? EXP(j) \
                   : (j) < nvis ? keep_first(EXP(j), last, zero) : zero)
#define WEIGHTS(j) (full ? EXP(j) : drop_before(SUFFIX(j), j, front, zero))
#if defined(__AVX512BF16__)
    if (pairs) {
        const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
        for (int j = 0; j < pvec; j += 2) {
            const __m512bh pb = _mm512_cvtne2ps_pbh(WEIGHTS(j + 1), WEIGHTS(j));
            _mm512_storeu_si512((bf16 *)p + j * W, (__m512i)pb);
            sum = _mm512_dpbf16_ps(sum, pb, ones);
        }
        vstore(l, sum);
        return;
    }
#elif defined(AMX_TILES)
    if (pairs) {  // rounded to bf16, and their sum of the rounded weights (the ones P V uses)
        for (int j = 0; j < pvec; j++) {
            store_bf16((bf16 *)p + j * W, WEIGHTS(j));
            sum = vadd(sum, load_bf16((bf16 *)p + j * W));
        }
        vstore(l, sum);
        return;
    }
#endif
    for (int j = 0; j < pvec; j++) {
        const vf pj = WEIGHTS(j);
        vstore((float *)p + j * W, pj);
        sum = vadd(sum, pj);
    }
#undef WEIGHTS
#undef SUFFIX
#undef EXP
    vstore(l, sum);
}

// A row's first n scores s (unscaled) capped as Gemma 2 caps its scaled ones: s = (cap / scale) tanh(s scale /
// cap), by tanh|y| = (1 - e) / (1 + e), e = 2^(-2 |y| log2 e), its sign y's (y / max(|y|, tiny): 0 at 0).
static void cap_scores(float *s, int n, float scale, float cap) {
    const vf in = vset1(scale / cap), out = vset1(cap / scale), one = vset1(1.0f), tiny = vset1(1e-30f);
    const vf m2l = vset1(-2.0f * LOG2E), zero = vzero();
    for (int j = 0; j < n; j += W) {
        const vf y = vmul(vload(s + j), in), a = vmax(y, vsub(zero, y));
        const vf e = vexp2(vmul(a, m2l), 1);
        const vf t = vdiv(vsub(one, e), vadd(one, e));
        vstore(s + j, vmul(vmul(t, vdiv(y, vmax(a, tiny))), out));
    }
}

// Row `idx`'s running max moved up to `top`: its O and sum of weights scaled down to match.
static void raise_max(Scratch *w, int D, int idx, float top, float cc) {
    const vf alpha = vset1(exp2f((w->m[idx] - top) * cc));
    float *o = w->o + (int64_t)idx * D, *l = w->l + (int64_t)idx * W;
    for (int d = 0; d < D; d += W) vstore(o + d, vmul(vload(o + d), alpha));
    vstore(l, vmul(vload(l), alpha));
    w->m[idx] = top;
}

#if defined(__AVX512BF16__)
// softmax() for a block of bf16 rows that all see the chunk's CHUNK positions (no cap): each row's four vectors
// of scores in registers, no masks, as row_weights weighs them.
static void softmax_whole(Scratch *w, int mr, int hrow, int D, float cc, float rise) {
    _Static_assert(CHUNK == 4 * W, "four vectors of scores a row");
    const vf c = vset1(cc);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
    for (int r = 0; r < mr; r++) {
        const float *s = w->s + r * CHUNK;
        const vf x0 = vload(s), x1 = vload(s + W), x2 = vload(s + 2 * W), x3 = vload(s + 3 * W);
        const vf mx = vmax(vmax(x0, x1), vmax(x2, x3));
        const int idx = hrow + r;
        if (w->m[idx] == -INFINITY) w->m[idx] = hmax(mx);
        else if (any_gt(mx, vset1(w->m[idx] + rise))) raise_max(w, D, idx, hmax(mx), cc);
        const vf mc = vset1(w->m[idx] * cc);
        const __m512bh p0 = _mm512_cvtne2ps_pbh(vexp2(vfms(x1, c, mc), 0), vexp2(vfms(x0, c, mc), 0));
        const __m512bh p1 = _mm512_cvtne2ps_pbh(vexp2(vfms(x3, c, mc), 0), vexp2(vfms(x2, c, mc), 0));
        bf16 *p = (bf16 *)w->p + r * CHUNK;
        _mm512_storeu_si512(p, (__m512i)p0);
        _mm512_storeu_si512(p + 2 * W, (__m512i)p1);
        float *l = w->l + (int64_t)idx * W;
        vstore(l, _mm512_dpbf16_ps(_mm512_dpbf16_ps(vload(l), p0, ones), p1, ones));
    }
}
#endif

// Weights of one row block's scores (positions [0, nb) of the chunk starting at c0): per row, the positions it
// sees, its running max (moved only when a score exceeds it by 2^RESCALE_LOG2 in weight, O and l rescaled
// then: most chunks keep it), and its weights (row_weights), hidden positions exactly 0.
INLINE void softmax(const Args *a, Scratch *w, int mr, int row, int hrow, int64_t c0, int nb, const int pairs,
                    const int precise) {
    const int D = a->head_dim;
    const float cc = a->scale * LOG2E;
    const vf ninf = vset1(-INFINITY), c = vset1(cc);
    const float rise = RESCALE_LOG2 / cc;  // the running max moves when a score exceeds it by this
#if defined(__AVX512BF16__)
    int whole = pairs && !precise && nb == CHUNK && a->softcap <= 0.0f;
    for (int r = 0; r < mr && whole; r++) whole = w->limit[row + r] - c0 + 1 >= CHUNK && w->first[row + r] <= c0;
    if (whole) {
        softmax_whole(w, mr, hrow, D, cc, rise);
        return;
    }
#endif
    const int pvec = pairs ? (nb + 31) / 32 * (32 / W) : (nb + W - 1) / W;  // pairs: whole 32-position runs
    for (int r = 0; r < mr; r++) {
        const float *s = w->s + r * CHUNK;
        if (a->softcap > 0.0f) cap_scores(w->s + r * CHUNK, nb, a->scale, a->softcap);
        const int64_t seen = (int64_t)w->limit[row + r] - c0 + 1, hidden = (int64_t)w->first[row + r] - c0;
        const int front = hidden <= 0 ? 0 : hidden < nb ? (int)hidden : nb;  // positions before the window
        int vis = seen < nb ? (int)seen : nb;
        vis = vis > front ? vis : 0;
        const int nvis = vis > 0 ? (vis + W - 1) / W : 0;
        const int last = vis - (nvis - 1) * W;  // lanes the last visible vector has
        float *m = w->m + hrow + r, *l = w->l + (int64_t)(hrow + r) * W;
#define SCORE(j) drop_before((j) + 1 < nvis || last == W ? vload(s + (j) * W) \
                             : keep_first(vload(s + (j) * W), last, ninf), j, front, ninf)
        if (nvis > 0) {
            vf mx = SCORE(front / W);
            for (int j = front / W + 1; j < nvis; j++) mx = vmax(mx, SCORE(j));
            if (*m == -INFINITY) {  // the row's first visible scores: O and l are zeros
                *m = hmax(mx);
            } else if (any_gt(mx, vset1(*m + rise))) {
                raise_max(w, D, hrow + r, hmax(mx), cc);
            }
        }
#undef SCORE
        const vf mc = vset1(*m * cc);
        void *p = pairs ? (void *)((bf16 *)w->p + r * CHUNK) : (void *)(w->p + r * CHUNK);
        if (nvis == pvec && last == W && front == 0) row_weights(s, p, l, c, mc, nvis, last, 0, pvec, pairs, precise, 1);
        else row_weights(s, p, l, c, mc, nvis, last, front, pvec, pairs, precise, 0);
    }
}

static void finish(const Args *a, Scratch *w, const Unit *u) {
    const int D = a->head_dim, G = a->num_heads / a->num_kv_heads, H = a->num_heads;
    const int32_t *seg = u->seg;
    for (int h = 0; h < u->hb; h++)
        for (int r = 0; r < u->nrows; r++) {
            const int row = u->row0 + r, idx = h * UNIT_ROWS + r, head = (u->h0 + h) * G + row % G;
            const int32_t e = seg[SEG_BEGIN] + row / G;
            const float l = hsum(vload(w->l + (int64_t)idx * W));
            const vf inv = vset1(l == 0.0f ? 0.0f : 1.0f / l);  // no position seen: 0; a NaN stays NaN
            const float *o = w->o + (int64_t)idx * D;
            if (seg[SEG_SLOT] < 0) {
                const int64_t dst = (int64_t)a->tokens[e] * a->out_stride_t + (int64_t)head * a->out_stride_h;
                for (int d = 0; d < D; d += W) {
                    const vf x = vmul(vload(o + d), inv);
                    if (a->bf16) store_bf16((bf16 *)a->out + dst + d, x);
                    else vstore((float *)a->out + dst + d, x);
                }
                continue;
            }
            const int64_t slot = (int64_t)seg[SEG_SLOT] + row / G;
            float *dst = a->o_part + (slot * H + head) * D;
            for (int d = 0; d < D; d += W) vstore(dst + d, vmul(vload(o + d), inv));
            a->lse_part[slot * H + head] = l == 0.0f ? -INFINITY : w->m[idx] * a->scale + logf(l);
        }
}

// The last position a causal entry sees.
static inline int32_t last_seen(const Args *a, int32_t e) {
    return a->attend_ends ? a->attend_ends[e] : a->positions[e];
}

// The KV positions unit u attends: its segment's range, causally cut after its last row's position (and, with a
// sliding window, before the chunk where its first row's window starts: chunks stay on the segment's grid, which
// a segment's chunks packed once for all its units are laid out on).
static void kv_range(const Args *a, const Unit *u, int64_t *kv0, int64_t *kv1) {
    const int G = a->num_heads / a->num_kv_heads;
    const int32_t *seg = u->seg;
    *kv0 = seg[SEG_KV_START];
    *kv1 = seg[SEG_KV_END];
    if (seg[SEG_CAUSAL]) {
        const int64_t last = (int64_t)last_seen(a, seg[SEG_BEGIN] + (u->row0 + u->nrows - 1) / G) + 1;
        *kv1 = last < *kv1 ? last : *kv1;
        const int64_t first = (int64_t)a->positions[seg[SEG_BEGIN] + u->row0 / G] - a->window + 1;
        if (a->window > 0 && first > *kv0) *kv0 += (first - *kv0) / CHUNK * CHUNK;
    }
}

#if defined(__AVX512BF16__)
#define DIRECT_ROWS 2

// Head h of a chunk of a unit of at most DIRECT_ROWS rows, straight from the cache. Scores: per row and
// position, the query's dim pairs times the K row's (vdpbf16ps), 16 positions' partial sums reduced to one
// vector by a transpose-add tree. P V: per position, its weight broadcast as a bf16 pair (p, 0) and (0, p)
// times the V row's dim pairs gives the even and the odd dims, interleaved into O once per chunk.
INLINE void direct_head_nd(const Args *a, Scratch *w, const int64_t *off, int64_t c0, int n, int h, int nrows,
                           const int nd) {
    const int D = a->head_dim, hrow = h * UNIT_ROWS;
    const __mmask16 tail = D % 32 ? 0x00ff : 0xffff;  // dim pairs of the last vector
    const int64_t sh = (int64_t)h * a->kv_stride_h;
    const bf16 *kc = a->k_cache, *vc = a->v_cache;
    const int64_t seen = (int64_t)w->limit[nrows - 1] - c0 + 1;  // rows are in position order
    if (seen <= 0) return;
    const int nb = seen < n ? (int)seen : n;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
#define FOLD(x, y) _mm512_add_ps(_mm512_permutex2var_ps(x, even, y), _mm512_permutex2var_ps(x, odd, y))
    for (int r = 0; r < nrows; r++) {
        __m512i q[MAX_D / 32];
        for (int j = 0; j < nd; j++)
            q[j] = _mm512_maskz_loadu_epi32(j + 1 < nd ? 0xffff : tail, (const int32_t *)w->q + (int64_t)(hrow + r) * (D / 2) + j * 16);
        for (int t0 = 0; t0 < nb; t0 += 16) {
            vf acc[16];
            const int m = nb - t0 < 16 ? nb - t0 : 16;
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {
                acc[i] = vzero();
                const bf16 *k = kc + off[t0 + (i < m ? i : 0)] + sh;  // past the end: a row read, its sums unused
                if (r == 0)  // its V row, read by P V after the softmax: in flight during these products (~2%)
                    for (int b = 0; b < D * 2; b += 64) _mm_prefetch((const char *)(k - kc + vc) + b, _MM_HINT_T0);
#pragma GCC unroll 8
                for (int j = 0; j < nd; j++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)q[j],
                                              (__m512bh)_mm512_maskz_loadu_epi32(j + 1 < nd ? 0xffff : tail, k + j * 32));
            }
            for (int i = 0; i < 8; i++) acc[i] = FOLD(acc[2 * i], acc[2 * i + 1]);
            for (int i = 0; i < 4; i++) acc[i] = FOLD(acc[2 * i], acc[2 * i + 1]);
            for (int i = 0; i < 2; i++) acc[i] = FOLD(acc[2 * i], acc[2 * i + 1]);
            vstore(w->s + r * CHUNK + t0, FOLD(acc[0], acc[1]));
        }
    }
#undef FOLD
    softmax(a, w, nrows, 0, hrow, c0, nb, 1, 0);
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int r = 0; r < nrows; r++) {
        const uint16_t *p = (const uint16_t *)w->p + r * CHUNK;
        // two sets of accumulators, for even and odd positions: one would wait on vdpbf16ps' latency
        vf ev[2][MAX_D / 32], od[2][MAX_D / 32];
#pragma GCC unroll 8
        for (int j = 0; j < nd; j++) ev[0][j] = od[0][j] = ev[1][j] = od[1][j] = vzero();
        for (int t = 0; t < nb; t += 2) {
            const int32_t p0 = p[t], p1 = t + 1 < nb ? p[t + 1] : 0;  // past the end: weight 0
            const __m512bh pe0 = (__m512bh)_mm512_set1_epi32(p0), po0 = (__m512bh)_mm512_set1_epi32(p0 << 16);
            const __m512bh pe1 = (__m512bh)_mm512_set1_epi32(p1), po1 = (__m512bh)_mm512_set1_epi32(p1 << 16);
            const bf16 *v0 = vc + off[t] + sh, *v1 = vc + off[t + 1 < nb ? t + 1 : t] + sh;
#pragma GCC unroll 8
            for (int j = 0; j < nd; j++) {
                const __mmask16 m = j + 1 < nd ? 0xffff : tail;
                const __m512bh x0 = (__m512bh)_mm512_maskz_loadu_epi32(m, v0 + j * 32);
                const __m512bh x1 = (__m512bh)_mm512_maskz_loadu_epi32(m, v1 + j * 32);
                ev[0][j] = _mm512_dpbf16_ps(ev[0][j], x0, pe0);
                od[0][j] = _mm512_dpbf16_ps(od[0][j], x0, po0);
                ev[1][j] = _mm512_dpbf16_ps(ev[1][j], x1, pe1);
                od[1][j] = _mm512_dpbf16_ps(od[1][j], x1, po1);
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < nd; j++) ev[0][j] = vadd(ev[0][j], ev[1][j]), od[0][j] = vadd(od[0][j], od[1][j]);
        float *o = w->o + (int64_t)(hrow + r) * D;
        for (int j = 0; j < nd; j++) {
            vstore(o + 32 * j, vadd(vload(o + 32 * j), _mm512_permutex2var_ps(ev[0][j], lo, od[0][j])));
            if (D - 32 * j >= 32)
                vstore(o + 32 * j + 16, vadd(vload(o + 32 * j + 16), _mm512_permutex2var_ps(ev[0][j], hi, od[0][j])));
        }
    }
}

static void direct_head(const Args *a, Scratch *w, const int64_t *off, int64_t c0, int n, int h, int nrows) {
    switch ((a->head_dim + 31) / 32) {
        case 1: direct_head_nd(a, w, off, c0, n, h, nrows, 1); return;
        case 2: direct_head_nd(a, w, off, c0, n, h, nrows, 2); return;
        case 3: direct_head_nd(a, w, off, c0, n, h, nrows, 3); return;
        case 4: direct_head_nd(a, w, off, c0, n, h, nrows, 4); return;
        case 5: direct_head_nd(a, w, off, c0, n, h, nrows, 5); return;
        case 6: direct_head_nd(a, w, off, c0, n, h, nrows, 6); return;
        case 7: direct_head_nd(a, w, off, c0, n, h, nrows, 7); return;
        default: direct_head_nd(a, w, off, c0, n, h, nrows, 8); return;
    }
}
#else
#define DIRECT_ROWS 0
#define direct_head(a, w, off, c0, n, h, nrows) ((void)0)
#endif

#ifdef AMX_TILES
// Units of at most FEW_ROWS rows (decode: a request's query heads on each KV head) read K and V rows from the cache
// straight into tiles, repacking nothing. Scores come transposed, S^T = K Q^T: 16 positions' K rows are the A tile
// and the unit's Q^T pairs the B tile, so a set of heads' scores lie as [position][lane], lane = head of the set x
// rows + row, and the softmax runs down the positions a vector of lanes at a time. Each 16 positions' weights are
// then transposed to the lanes' rows and spread as bf16 pairs (p, 0) and (0, p): A tiles that, times 16 V rows
// as the B tile (dim pairs), give O's even and its odd dims.
#define FEW_ROWS 16
#if W == 16
typedef __mmask16 vmask;
static inline vmask vin(vf x, vf lo, vf hi) {  // lo <= x <= hi
    return _mm512_cmp_ps_mask(lo, x, _CMP_LE_OQ) & _mm512_cmp_ps_mask(x, hi, _CMP_LE_OQ);
}
static inline vf vsel(vmask k, vf a, vf b) { return _mm512_mask_blend_ps(k, b, a); }  // k ? a : b
static inline vf vshr16(vf x) { return _mm512_castsi512_ps(_mm512_srli_epi32(_mm512_castps_si512(x), 16)); }
#else
typedef __m256 vmask;
static inline vmask vin(vf x, vf lo, vf hi) {
    return _mm256_and_ps(_mm256_cmp_ps(lo, x, _CMP_LE_OQ), _mm256_cmp_ps(x, hi, _CMP_LE_OQ));
}
static inline vf vsel(vmask k, vf a, vf b) { return _mm256_blendv_ps(b, a, k); }
static inline vf vshr16(vf x) { return _mm256_castsi256_ps(_mm256_srli_epi32(_mm256_castps_si256(x), 16)); }
#endif

// Heads of a set: as many as give its rows at most 16 lanes.
static inline int set_heads(const Unit *u) { return 16 / u->nrows < u->hb ? 16 / u->nrows : u->hb; }

// Tiles 0: S^T (16 positions x rows), 1: 16 K rows (A) or V rows (B), 2: Q^T pairs (B), 3-4: O's even and odd
// dims (rows x 16), 5-6: the weights spread (A, rows x 16 position pairs).
static void tiles_for_few(int rows) {
    if (tile_rows == 100 + rows) return;
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const uint8_t r[8] = {16, 16, 16, rows, rows, rows, rows, 16};
    const uint16_t c[8] = {rows * 4, 64, rows * 4, 64, 64, 64, 64, 64};
    for (int t = 0; t < 8; t++) cfg.rows[t] = r[t], cfg.colsb[t] = c[t];
    TILE_CONFIG(&cfg);
    tile_rows = 100 + rows;
}

// Cache row `row` (elements) as D bf16 at dst: copied, or an fp8 row's values (rounded to bf16, as the repack
// gives them).
static void stage_row(const Args *a, const void *cache, int64_t row, bf16 *dst) {
    const int D = a->head_dim, kv = a->kv_format;
    if (kv == KV_MODEL) {
        memcpy(dst, (const bf16 *)cache + row, (size_t)D * 2);
        return;
    }
#if defined(__AVX512BF16__)
    for (int d = 0; d < D; d += 32) _mm512_storeu_si512(dst + d, kv_bf16(cache, row, d, 32, D, kv));
#else
    for (int d = 0; d < D; d++) dst[d] = kv_dim(cache, row, d, D, kv);
#endif
}

// 16 rows of head offset sh from chunk position t0 as a tile reads them (row stride in bytes in *ld): the cache's
// own when they are bf16 rows 16 slots in a row, else staged, zeros past n (stale slots could hold inf or NaN).
static const bf16 *few_rows(const Args *a, const void *cache, const int64_t *off, int t0, int n, int64_t sh,
                            Scratch *w, int64_t *ld) {
    const int D = a->head_dim, m = n - t0 < 16 ? n - t0 : 16;
    if (a->kv_format == KV_MODEL && m == 16 && off[t0 + 15] - off[t0] == 15 * a->kv_stride_s) {
        *ld = a->kv_stride_s * 2;
        return (const bf16 *)cache + off[t0] + sh;
    }
    bf16 *stage = w->stage[t0 / 16];
    for (int t = 0; t < m; t++) stage_row(a, cache, off[t0 + t] + sh, stage + t * D);
    int32_t *staged = &w->staged[t0 / 16];
    if (*staged > m * D * 2) memset((char *)stage + m * D * 2, 0, (size_t)(*staged - m * D * 2));
    *staged = m * D * 2;
    *ld = D * 2;
    return stage;
}

// The unit's Q^T pairs, its running max and sums, O zeroed.
static void few_start(const Args *a, Scratch *w, const Unit *u) {
    const int D = a->head_dim, G = a->num_heads / a->num_kv_heads, R = u->nrows, groups = D / 32;
    const int32_t *seg = u->seg;
    for (int h = 0; h < u->hb; h++) {
        const int32_t *src[16];
        for (int r = 0; r < R; r++) {
            const int row = u->row0 + r;
            src[r] = (const int32_t *)((const bf16 *)a->q + (int64_t)a->tokens[seg[SEG_BEGIN] + row / G] * a->q_stride_t +
                                       (int64_t)((u->h0 + h) * G + row % G) * a->q_stride_h);
        }
        for (int g = 0; g < groups; g++) {
            int32_t *dst = w->fq + (h * groups + g) * 256;
#if W == 16
            __m512i x[16];
            for (int r = 0; r < 16; r++) x[r] = r < R ? _mm512_loadu_si512(src[r] + g * 16) : _mm512_setzero_si512();
            transpose16(x);
            for (int k = 0; k < 16; k++) _mm512_storeu_si512(dst + k * 16, x[k]);
#else
            for (int r = 0; r < R; r++)
                for (int k = 0; k < 16; k++) dst[k * 16 + r] = src[r][g * 16 + k];
#endif
        }
    }
    const int hs = set_heads(u), sets = (u->hb + hs - 1) / hs;
    for (int i = 0; i < sets * 16; i++) w->fm[i] = -INFINITY, w->fl[i] = 0.0f;
    memset(w->kt, 0, sizeof(float) * u->hb * D * R);
}

// The set of heads from head h0 (`heads` of them): the weights of its scores S^T (positions [0, n) of the
// chunk at c0), the running max moved lazily as in softmax(), then as A tiles in pe and po.
static void few_softmax(const Args *a, Scratch *w, const Unit *u, int h0, int heads, int64_t c0, int n) {
    const int R = u->nrows, lanes = heads * R, nsub = (n + 15) / 16, groups = a->head_dim / 32, set = h0 / set_heads(u);
    const float cc = a->scale * LOG2E, rise = RESCALE_LOG2 / cc;
    float *st = w->s, *m = w->fm + set * 16, *l = w->fl + set * 16;
    if (a->softcap > 0.0f) cap_scores(st, nsub * 256, a->scale, a->softcap);
    float lo[16], hi[16];  // per lane, the chunk's positions it sees: [lo, hi] (none: lo > hi)
    for (int i = 0; i < 16; i++) {
        lo[i] = i < lanes ? (float)(w->first[i % R] - c0) : 1.0f;
        hi[i] = i < lanes ? (float)(w->limit[i % R] - c0) : 0.0f;
    }
    const vf ninf = vset1(-INFINITY), c = vset1(cc);
    for (int v = 0; v < lanes; v += W) {
        const vf lov = vload(lo + v), hiv = vload(hi + v);
        vf mx = ninf;
        for (int p = 0; p < n; p++) mx = vmax(mx, vsel(vin(vset1((float)p), lov, hiv), vload(st + p * 16 + v), ninf));
        if (any_gt(mx, vadd(vload(m + v), vset1(rise)))) {
            float top[W];
            vstore(top, mx);
            for (int i = 0; i < W && v + i < lanes; i++) {
                if (!(top[i] > m[v + i] + rise)) continue;
                const float alpha = m[v + i] == -INFINITY ? 0.0f : exp2f((m[v + i] - top[i]) * cc);
                const int h = h0 + (v + i) / R, r = (v + i) % R;
                for (int g = 0; g < 2 * groups; g++)  // both parities of each 32 dims
                    for (int d = 0; d < 16; d++) w->kt[((h * groups * 2 + g) * R + r) * 16 + d] *= alpha;
                l[v + i] *= alpha;
                m[v + i] = top[i];
            }
        }
        const vf mc = vmul(vload(m + v), c);
        vf sum = vload(l + v);
        for (int p = 0; p < nsub * 16; p++) {
            vf wt = vzero();
            if (p < n)
                wt = round_bf16(vsel(vin(vset1((float)p), lov, hiv), vexp2(vfms(vload(st + p * 16 + v), c, mc), 0), wt));
            sum = vadd(sum, wt);
            vstore(st + p * 16 + v, wt);
        }
        vstore(l + v, sum);
    }
    // rows of a lane's weights rounded to bf16 are its (0, p) pairs; shifted down 16 bits, its (p, 0) pairs
    for (int b = 0; b < nsub; b++)
        for (int pb = 0; pb < 16; pb += W)
            for (int lb = 0; lb < lanes; lb += W) {
                vf x[W];
                for (int i = 0; i < W; i++) x[i] = vload(st + (b * 16 + pb + i) * 16 + lb);
                transpose_w(x);
                for (int i = 0; i < W; i++) {
                    vstore((float *)w->po + (b * 16 + lb + i) * 16 + pb, x[i]);
                    vstore((float *)w->pe + (b * 16 + lb + i) * 16 + pb, vshr16(x[i]));
                }
            }
}

// Chunk c0 (n positions, cache offsets off of the unit's first head) of a unit of at most FEW_ROWS rows.
static void few_chunk(const Args *a, Scratch *w, const Unit *u, const int64_t *off, int64_t c0, int n,
                      Prefetch *ahead) {
    const int D = a->head_dim, R = u->nrows, groups = D / 32, nsub = (n + 15) / 16;
    const int hs = set_heads(u);
    const int64_t lines = (int64_t)ahead->n * ((ahead->bytes + 63) / 64) * 2;  // spread over every tile product
    const int calls = 2 * u->hb * nsub * groups, slice = (int)((lines + calls - 1) / calls);
    const int64_t sh = a->kv_stride_h;
    tiles_for_few(R);
    for (int h0 = 0; h0 < u->hb; h0 += hs) {
        const int heads = u->hb - h0 < hs ? u->hb - h0 : hs;
        for (int j = 0; j < heads; j++) {
            const int h = h0 + j;
            for (int b = 0; b < nsub; b++) {
                int64_t ld;
                const bf16 *k = few_rows(a, a->k_cache, off, b * 16, n, h * sh, w, &ld);
                TILE_ZERO(0);
                for (int g = 0; g < groups; g++) {
                    TILE_LOAD(1, k + g * 32, ld);
                    TILE_LOAD(2, w->fq + (h * groups + g) * 256, 64);
                    TILE_DPBF16PS(0, 1, 2);
                    prefetch_some(ahead, slice);
                }
                TILE_STORE(0, w->s + b * 256 + j * R, 64);
            }
        }
        few_softmax(a, w, u, h0, heads, c0, n);
        for (int j = 0; j < heads; j++) {
            const int h = h0 + j;
            const bf16 *v[CHUNK / 16];
            int64_t ld[CHUNK / 16];
            for (int b = 0; b < nsub; b++) v[b] = few_rows(a, a->v_cache, off, b * 16, n, h * sh, w, &ld[b]);
            for (int g = 0; g < groups; g++) {
                float *o = w->kt + (h * groups + g) * 2 * R * 16;
                TILE_LOAD(3, o, 64);
                TILE_LOAD(4, o + R * 16, 64);
                for (int b = 0; b < nsub; b++) {
                    TILE_LOAD(1, v[b] + g * 32, ld[b]);
                    TILE_LOAD(5, w->pe + (b * 16 + j * R) * 16, 64);
                    TILE_LOAD(6, w->po + (b * 16 + j * R) * 16, 64);
                    TILE_DPBF16PS(3, 5, 1);
                    TILE_DPBF16PS(4, 6, 1);
                    prefetch_some(ahead, slice);
                }
                TILE_STORE(3, o, 64);
                TILE_STORE(4, o + R * 16, 64);
            }
        }
    }
}

// O, m and l of the unit in the layouts finish() reads.
static void few_finish(const Args *a, Scratch *w, const Unit *u) {
    const int D = a->head_dim, R = u->nrows, groups = D / 32, hs = set_heads(u);
    for (int h = 0; h < u->hb; h++)
        for (int r = 0; r < R; r++) {
            const int idx = h * UNIT_ROWS + r, lane = h / hs * 16 + h % hs * R + r;
            w->m[idx] = w->fm[lane];
            vstore(w->l + (int64_t)idx * W, vzero());
            w->l[(int64_t)idx * W] = w->fl[lane];
            for (int g = 0; g < groups; g++) {
                const float *e = w->kt + ((h * groups + g) * 2 * R + r) * 16, *o = e + R * 16;
                float *dst = w->o + (int64_t)idx * D + g * 32;
#if W == 16
                const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
                const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
                vstore(dst, _mm512_permutex2var_ps(vload(e), lo, vload(o)));
                vstore(dst + 16, _mm512_permutex2var_ps(vload(e), hi, vload(o)));
#else
                for (int d = 0; d < 16; d++) dst[2 * d] = e[d], dst[2 * d + 1] = o[d];
#endif
            }
        }
    finish(a, w, u);
}
#else
#define FEW_ROWS 0
#endif

// The packed chunk at c0 of unit u's shared segment, the unit's heads.
static Packed shared_chunk(const Args *a, const Unit *u, int64_t c0) {
    const int64_t head = (int64_t)CHUNK * a->head_dim, H = a->num_kv_heads;
    float *at = u->shared + (c0 - u->seg[SEG_KV_START]) / CHUNK * 2 * H * head;
    return (Packed){at + u->h0 * head, at + (H + u->h0) * head};
}

// The units of a call, heaviest first, handed out one at a time to the threads.
typedef struct {
    const Unit *unit;
    int units;
    int *claimed;  // units handed out so far (shared by the threads)
    int next;      // this thread's next unit: claimed when its current unit reaches its last chunk (-1: not yet)
} Queue;

static int claim(Queue *q) { return __atomic_fetch_add(q->claimed, 1, __ATOMIC_RELAXED); }

// Unit u. The unit this thread runs after it is claimed (q->next) as u starts its last chunk, and its first
// chunk prefetched during that one; claimed any earlier, a thread would hold two units while another has none.
// `warm`: u's first chunk was prefetched so.
INLINE void run_unit(const Args *a, Scratch *w, const Unit *u, Queue *q, int warm, const int pairs,
                     const int in_bf16) {
    const int D = a->head_dim, G = a->num_heads / a->num_kv_heads, nrows = u->nrows;
    const int qd = pairs ? D / 2 : D;  // 32-bit elements of a query row in scratch
    const int32_t *seg = u->seg;
#ifdef AMX_TILES
    const int few = pairs && D % 32 == 0 && nrows <= FEW_ROWS && u->shared == NULL;
#else
    const int few = 0;
#endif
    for (int r = 0; r < nrows; r++) {
        const int row = u->row0 + r;
        const int32_t e = seg[SEG_BEGIN] + row / G;
        w->limit[r] = seg[SEG_CAUSAL] ? last_seen(a, e) : INT32_MAX;
        w->first[r] = seg[SEG_CAUSAL] && a->window > 0 ? a->positions[e] - a->window + 1 : 0;
        for (int h = 0; h < u->hb && !few; h++) {
            const int64_t src = (int64_t)a->tokens[e] * a->q_stride_t + (int64_t)((u->h0 + h) * G + row % G) * a->q_stride_h;
            float *dst = w->q + (int64_t)(h * UNIT_ROWS + r) * qd;
            if (pairs)  // copied inline: a library call per row and head costs more than its copy
                for (int d = 0; d < D; d += 16)
                    _mm256_storeu_si256((__m256i *)((bf16 *)dst + d),
                                        _mm256_loadu_si256((const __m256i *)((const bf16 *)a->q + src + d)));
            else for (int d = 0; d < D; d += W) vstore(dst + d, load_row(a->q, src + d, in_bf16));
            w->m[h * UNIT_ROWS + r] = -INFINITY;
            vstore(w->l + (int64_t)(h * UNIT_ROWS + r) * W, vzero());
            for (int d = 0; d < D; d += W) vstore(w->o + (int64_t)(h * UNIT_ROWS + r) * D + d, vzero());
        }
    }
    int64_t kv0, kv1;
    kv_range(a, u, &kv0, &kv1);
    int buf = 0;
    // (fp8 rows are converted once a chunk by the repack: in place, each row's would be converted again per row)
    const int direct = pairs && nrows <= DIRECT_ROWS && nrows <= a->direct_rows && a->kv_format == KV_MODEL;
    // a direct unit reads K and V rows in place through its own row offsets, also in a segment packed once
    const int packed_once = u->shared != NULL && !direct;
#ifdef AMX_TILES
    if (few) few_start(a, w, u);
#endif
    if (kv0 < kv1 && !packed_once) {
        const int n0 = kv1 - kv0 < CHUNK ? kv1 - kv0 : CHUNK;
        row_offsets(a, w->offset[0], seg[SEG_TABLE], kv0, n0, u->h0);
        if (!warm) {
            Prefetch first = prefetch_plan(a, w->offset[0], n0, u->hb);
            prefetch_some(&first, INT32_MAX);
        }
    }
#ifdef AMX_TILES
    const int tiles = pairs && D % 32 == 0;  // the products on AMX tiles, 16 rows a block
#else
    const int tiles = 0;
#endif
    const int rb = tiles ? BLOCK_ROWS : MR;
    const int steps = 3 * u->hb * ((nrows + rb - 1) / rb) + 1;  // prefetch slices per chunk
    for (int64_t c0 = kv0; c0 < kv1; c0 += CHUNK, buf = !buf) {
        const int n = kv1 - c0 < CHUNK ? kv1 - c0 : CHUNK;
        const int64_t c1 = c0 + CHUNK;
        const int n1 = c1 >= kv1 ? 0 : kv1 - c1 < CHUNK ? kv1 - c1 : CHUNK;
        // what comes next streams in while this chunk is computed: this unit's next chunk or the next unit's first
        Prefetch ahead = {0};
        if (n1 > 0 && packed_once) {
            ahead = packed_plan(a, shared_chunk(a, u, c1), w->offset[!buf], u->hb, pairs);
        } else if (n1 > 0) {
            row_offsets(a, w->offset[!buf], seg[SEG_TABLE], c1, n1, u->h0);
            ahead = prefetch_plan(a, w->offset[!buf], n1, u->hb);
        } else if ((q->next = claim(q)) < q->units && q->unit[q->next].shared == NULL) {
            const Unit *next = &q->unit[q->next];
            int64_t nk0, nk1;
            kv_range(a, next, &nk0, &nk1);
            const int nn = nk1 - nk0 < CHUNK ? nk1 - nk0 : CHUNK;
            if (nn > 0) row_offsets(a, w->offset[!buf], next->seg[SEG_TABLE], nk0, nn, next->h0);
            ahead = prefetch_plan(a, w->offset[!buf], nn > 0 ? nn : 0, next->hb);
        }
        const int slice = (int)((ahead.n * ((ahead.bytes + 63) / 64) * 2 + steps - 1) / steps);
        Packed packed = {w->kt, w->v};
        if (packed_once) {
            packed = shared_chunk(a, u, c0);
        } else if (!pairs) {
            repack(a, packed, w->offset[buf], n, u->hb, in_bf16);
        } else if (!direct && !few) {
            repack_pairs(a, packed, w->offset[buf], n, u->hb);
#ifdef AMX_TILES
            if (tiles) zero_v_tail(a, packed, n, u->hb);
#endif
        }
        prefetch_some(&ahead, slice);
#ifdef AMX_TILES
        if (few) few_chunk(a, w, u, w->offset[buf], c0, n, &ahead);
#endif
        for (int h = 0; h < u->hb && !few; h++) {
            if (direct) {
                direct_head(a, w, w->offset[buf], c0, n, h, nrows);
                prefetch_some(&ahead, slice);
                continue;
            }
            const float *kt = packed.kt + h * CHUNK * D, *v = packed.v + h * CHUNK * D;
            for (int r0 = 0; r0 < nrows; r0 += rb) {
                prefetch_some(&ahead, slice);
                const int mr = nrows - r0 < rb ? nrows - r0 : rb, hrow = h * UNIT_ROWS + r0;
                const int64_t seen = (int64_t)w->limit[r0 + mr - 1] - c0 + 1;  // rows are in position order
                if (seen <= 0) continue;
                const int nb = seen < n ? (int)seen : n;  // positions any row of the block sees
                const float *q = w->q + (int64_t)hrow * qd;
                const int nvec = (nb + W - 1) / W;
#ifdef AMX_TILES
                if (tiles) amx_scores(mr, (const bf16 *)q, D, (const int32_t *)kt, w->s);
#endif
                for (int j0 = 0; j0 < nvec && !tiles; j0 += NV) {
                    const int nv = nvec - j0 < NV ? nvec - j0 : NV;
                    (pairs ? tile_qk_pairs : tile_qk)(mr, nv, q, qd, kt + j0 * W, CHUNK, w->s + j0 * W, CHUNK, qd);
                }
                prefetch_some(&ahead, slice);
                softmax(a, w, mr, r0, hrow, c0, nb, pairs, !in_bf16);
                prefetch_some(&ahead, slice);
                const int ksteps = pairs ? (nb + 1) / 2 : nb, pd = pairs ? CHUNK / 2 : CHUNK;
#ifdef AMX_TILES
                if (tiles)
                    amx_values(mr, (const bf16 *)w->p, (const int32_t *)v, D, w->o + (int64_t)hrow * D,
                               (nb + 31) / 32 * 32);
#endif
                for (int d0 = 0; d0 < D / W && !tiles; d0 += NV) {
                    const int nv = D / W - d0 < NV ? D / W - d0 : NV;
                    (pairs ? tile_pv_pairs : tile_pv)(mr, nv, w->p, pd, v + d0 * W, D,
                                                      w->o + (int64_t)hrow * D + d0 * W, D, ksteps);
                }
            }
        }
        prefetch_some(&ahead, INT32_MAX);
    }
#ifdef AMX_TILES
    if (few) {
        few_finish(a, w, u);
        return;
    }
#endif
    finish(a, w, u);
}

typedef struct {  // a chunk of a shared segment, every KV head, packed before the units run
    const int32_t *seg;
    int64_t c0;
    int n;
    float *at;
} Job;

// Job j's chunk of every KV head, packed into its place in the shared pool as a unit would pack it.
INLINE void pack_job(const Args *a, Scratch *w, const Job *j, const int pairs, const int in_bf16) {
    const int H = a->num_kv_heads, D = a->head_dim;
    const Packed p = {j->at, j->at + (int64_t)H * CHUNK * D};
    row_offsets(a, w->offset[0], j->seg[SEG_TABLE], j->c0, j->n, 0);
    if (!pairs) {
        repack(a, p, w->offset[0], j->n, H, in_bf16);
        return;
    }
    repack_pairs(a, p, w->offset[0], j->n, H);
#ifdef AMX_TILES
    if (D % 32 == 0) zero_v_tail(a, p, j->n, H);
#endif
}

typedef void (*RunUnit)(const Args *, Scratch *, const Unit *, Queue *, int);
typedef void (*PackJob)(const Args *, Scratch *, const Job *);
#if defined(__AVX512BF16__)
static void run_bf16(const Args *a, Scratch *w, const Unit *u, Queue *q, int warm) {
    run_unit(a, w, u, q, warm, 1, 1);
}
static void pack_bf16(const Args *a, Scratch *w, const Job *j) { pack_job(a, w, j, 1, 1); }
#elif defined(AMX_TILES)  // emulated: the pairs layouts only where the tiles take them
static void run_bf16(const Args *a, Scratch *w, const Unit *u, Queue *q, int warm) {
    if (a->head_dim % 32 == 0) run_unit(a, w, u, q, warm, 1, 1);
    else run_unit(a, w, u, q, warm, 0, 1);
}
static void pack_bf16(const Args *a, Scratch *w, const Job *j) { pack_job(a, w, j, a->head_dim % 32 == 0, 1); }
#else
static void run_bf16(const Args *a, Scratch *w, const Unit *u, Queue *q, int warm) {
    run_unit(a, w, u, q, warm, 0, 1);
}
static void pack_bf16(const Args *a, Scratch *w, const Job *j) { pack_job(a, w, j, 0, 1); }
#endif
static void run_fp32(const Args *a, Scratch *w, const Unit *u, Queue *q, int warm) {
    run_unit(a, w, u, q, warm, 0, 0);
}
static void pack_fp32(const Args *a, Scratch *w, const Job *j) { pack_job(a, w, j, 0, 0); }

// A token's partials (its group's prefix and the rest of its context, or the pieces of a split segment)
// weighted by exp(lse - max lse).
static void merge(const Args *a, int mi) {
    const int D = a->head_dim, H = a->num_heads;
    const int32_t *slots = a->merge_slots + a->merge_offsets[mi];
    const int count = a->merge_offsets[mi + 1] - a->merge_offsets[mi];
    const int64_t token = a->merge_tokens[mi];
    for (int h = 0; h < H; h++) {
        float top = -INFINITY, total = 0.0f, wt[64];
        for (int i = 0; i < count; i++) {
            const float x = a->lse_part[(int64_t)slots[i] * H + h];
            top = x > top ? x : top;
        }
        for (int i = 0; i < count; i++) {
            const float x = a->lse_part[(int64_t)slots[i] * H + h];
            wt[i] = x == -INFINITY ? 0.0f : expf(x - top);
            total += wt[i];
        }
        const int64_t dst = token * a->out_stride_t + (int64_t)h * a->out_stride_h;
        for (int d = 0; d < D; d += W) {
            vf o = vzero();
            for (int i = 0; i < count; i++)
                o = vfma(vload(a->o_part + ((int64_t)slots[i] * H + h) * D + d), vset1(wt[i] / total), o);
            if (a->bf16) store_bf16((bf16 *)a->out + dst + d, o);
            else vstore((float *)a->out + dst + d, o);
        }
    }
}

// ------------------------------------------------------------------------------------------------ entry

static inline int row_blocks(const int32_t *seg) { return (seg[SEG_ROWS] + UNIT_ROWS - 1) / UNIT_ROWS; }

static double unit_work(const Args *a, const int32_t *seg, int row0, int nrows) {
    const Unit u = {seg, row0, nrows, 0, 1, 0, NULL};
    int64_t kv0, kv1;
    kv_range(a, &u, &kv0, &kv1);
    return (double)nrows * ((double)(kv1 - kv0) + CHUNK);
}

static int heavier_first(const void *x, const void *y) {
    const double a = ((const Unit *)x)->work, b = ((const Unit *)y)->work;
    return (a < b) - (a > b);
}

// KV heads per unit of segment seg: at most `most`, and few enough that its rows x heads x head_dim fit in
// ROWS_SPAN.
static int segment_heads(const Args *a, const int32_t *seg, int most) {
    const int rows = seg[SEG_ROWS] < UNIT_ROWS ? seg[SEG_ROWS] : UNIT_ROWS;
    const int fit = ROWS_SPAN / (rows > 0 ? rows : 1) / a->head_dim;
    return fit < 1 ? 1 : fit < most ? fit : most;
}

// Segment seg's units, of at most `most` KV heads each, into unit (NULL: only counted); their count.
static int segment_units(const Args *a, const int32_t *seg, int most, Unit *unit) {
    const int hb = segment_heads(a, seg, most), runs = (a->num_kv_heads + hb - 1) / hb;
    int n = 0;
    for (int b = 0; b < row_blocks(seg); b++) {
        const int row0 = b * UNIT_ROWS, nrows = seg[SEG_ROWS] - row0 < UNIT_ROWS ? seg[SEG_ROWS] - row0 : UNIT_ROWS;
        const double work = unit_work(a, seg, row0, nrows);
        for (int r = 0; r < runs; r++, n++) {
            const int h0 = r * hb, heads = a->num_kv_heads - h0 < hb ? a->num_kv_heads - h0 : hb;
            if (unit != NULL) unit[n] = (Unit){seg, row0, nrows, h0, heads, work * heads, NULL};
        }
    }
    return n;
}

// Every segment's units of at most `most` KV heads, heaviest first (NULL when out of memory); their count in
// *units.
static Unit *plan_units(const Args *a, int most, int *units) {
    int n = 0;
    for (int i = 0; i < a->num_segs; i++) n += segment_units(a, a->segs + i * SEG_FIELDS, most, NULL);
    Unit *unit = malloc(sizeof(Unit) * (n > 0 ? n : 1));
    if (unit == NULL) return NULL;
    for (int i = 0, k = 0; i < a->num_segs; i++) k += segment_units(a, a->segs + i * SEG_FIELDS, most, unit + k);
    qsort(unit, n, sizeof(Unit), heavier_first);  // dynamic scheduling balances the tail
    *units = n;
    return unit;
}

// When the last of `threads` threads finishes (in units of work), each taking the next unit as it frees up.
static double makespan(const Unit *unit, int units, int threads) {
    double load[threads], last = 0;
    for (int t = 0; t < threads; t++) load[t] = 0;
    for (int u = 0; u < units; u++) {
        int t = 0;
        for (int i = 1; i < threads; i++) t = load[i] < load[t] ? i : t;
        load[t] += unit[u].work;
        last = load[t] > last ? load[t] : last;
    }
    return last;
}

#define BALANCE 1.1  // a split of KV heads over more units must finish this much sooner to be taken

// The call's units, heaviest first (NULL when out of memory), their count in *units. Each holds as many KV heads
// as fit in SPAN (each position's K and V rows read as one run: whole blocks of the cache in address order,
// which decode reads faster than a head at a time) unless fewer balance the threads better: the most heads whose
// units finish within BALANCE of the best split's, or of an even split of the work.
static Unit *balanced_units(const Args *a, int threads, int *units) {
    const int most = SPAN / a->head_dim < a->num_kv_heads ? SPAN / a->head_dim : a->num_kv_heads;
    double total = 0, best = INFINITY, span[8];
    int heads[8], n = 0;
    for (int hb = most;; hb = (hb + 1) / 2) {
        Unit *unit = plan_units(a, hb, units);
        if (unit == NULL) return NULL;
        for (int u = 0; n == 0 && u < *units; u++) total += unit[u].work;
        // (an even split plus the heaviest unit bounds it: where that is close enough, no need to count)
        const double bound = *units > 0 ? total / threads + unit[0].work : 0;
        span[n] = bound <= BALANCE * total / threads ? bound : makespan(unit, *units, threads);
        heads[n] = hb;
        best = span[n] < best ? span[n] : best;
        const int even = span[n++] <= BALANCE * total / threads;
        if (even && n == 1) return unit;
        free(unit);
        if (even || hb == 1) break;
    }
    int c = 0;
    while (span[c] > BALANCE * best) c++;
    return plan_units(a, heads[c], units);
}

#define SHARED_BLOCKS 4           // row blocks (of UNIT_ROWS) from which a segment's chunks are packed once
#define SHARED_FLOATS (16 << 20)  // the most the shared segments' packed chunks take (64 MiB)

// The shared segments' packed chunks: one buffer per calling thread, kept across calls (its pages faulted in once)
// and grown as needed; NULL where that fails (then every unit packs its own chunks).
static float *shared_pool(int64_t floats) {
    static __thread float *pool = NULL;
    static __thread int64_t size = 0;
    if (floats > size) {
        free(pool);
        pool = aligned_alloc(64, (size_t)(floats * sizeof(float) + 63) / 64 * 64);
        size = pool != NULL ? floats : 0;
    }
    return pool;
}

// Segments of SHARED_BLOCKS row blocks or more have each chunk packed once, before the units, for all their units
// (a long prefill's units would each pack every chunk they read): as many as fit in SHARED_FLOATS, in order. The
// jobs that pack them (NULL: none), their count in *count; the units of those segments point at their chunks.
static Job *plan_shared(const Args *a, Unit *unit, int units, int *count) {
    const int64_t per_chunk = 2 * (int64_t)a->num_kv_heads * CHUNK * a->head_dim;
    int64_t *first = malloc(sizeof(int64_t) * (a->num_segs > 0 ? a->num_segs : 1)), chunks = 0;
    *count = 0;
    if (first == NULL) return NULL;
    for (int i = 0; i < a->num_segs; i++) {
        const int32_t *seg = a->segs + i * SEG_FIELDS;
        const int64_t n = ((int64_t)seg[SEG_KV_END] - seg[SEG_KV_START] + CHUNK - 1) / CHUNK;
        const int shared = row_blocks(seg) >= SHARED_BLOCKS && n > 0 && (chunks + n) * per_chunk <= SHARED_FLOATS;
        first[i] = shared ? chunks : -1;
        chunks += first[i] >= 0 ? n : 0;
    }
    float *pool = chunks > 0 ? shared_pool(chunks * per_chunk) : NULL;
    Job *job = pool != NULL ? malloc(sizeof(Job) * chunks) : NULL;
    for (int i = 0; job != NULL && i < a->num_segs; i++) {
        const int32_t *seg = a->segs + i * SEG_FIELDS;
        for (int64_t c0 = seg[SEG_KV_START], k = first[i]; first[i] >= 0 && c0 < seg[SEG_KV_END]; c0 += CHUNK, k++) {
            const int n = seg[SEG_KV_END] - c0 < CHUNK ? (int)(seg[SEG_KV_END] - c0) : CHUNK;
            job[(*count)++] = (Job){seg, c0, n, pool + k * per_chunk};
        }
    }
    for (int u = 0; job != NULL && u < units; u++) {
        const int64_t k = first[(unit[u].seg - a->segs) / SEG_FIELDS];
        unit[u].shared = k >= 0 ? pool + k * per_chunk : NULL;
    }
    free(first);
    return job;
}

static Scratch *thread_scratch(void) {
    static __thread Scratch *w = NULL;
    if (w != NULL) return w;
    w = aligned_alloc(64, (sizeof(Scratch) + 63) / 64 * 64);
#ifdef AMX_TILES
    if (w != NULL) memset(w->stage, 0, sizeof w->stage), memset(w->staged, 0, sizeof w->staged);
#endif
    return w;
}

// The step's new K and V rows into their cache slots (index_copy_ took ~60 us a layer for 400 tokens of
// strided rows). Strides and sizes in bytes; a slot holds one token's heads contiguously in both caches.
void flock_cpu_write_kv(const char *k, int64_t k_stride, const char *v, int64_t v_stride, char *k_cache,
                        char *v_cache, int64_t slot_bytes, const int64_t *slots, int64_t tokens, int64_t row_bytes) {
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(k_cache + slots[t] * slot_bytes, k + t * k_stride, (size_t)row_bytes);
        memcpy(v_cache + slots[t] * slot_bytes, v + t * v_stride, (size_t)row_bytes);
    }
}

// flock_cpu_write_kv as a step-program op (flock/model/program.py): its arguments as int64 words.
int32_t flock_cpu_write_kv_op(const int64_t *a) {
    flock_cpu_write_kv((const char *)(intptr_t)a[0], a[1], (const char *)(intptr_t)a[2], a[3], (char *)(intptr_t)a[4],
                       (char *)(intptr_t)a[5], a[6], (const int64_t *)(intptr_t)a[7], a[8], a[9]);
    return 0;
}

// The same into fp8 caches (kv_format KV_E4M3 or KV_E5M2): each of a token's `heads` rows of D values (bf16 or
// fp32; strides in bytes) quantized to a row of D codes and its scale (see kv_fp8.h).
void flock_cpu_write_kv_fp8(const char *k, int64_t k_stride, const char *v, int64_t v_stride, uint8_t *k_cache,
                            uint8_t *v_cache, int64_t slot_bytes, const int64_t *slots, int64_t tokens, int32_t heads,
                            int32_t D, int32_t in_bf16, int32_t kv_format) {
    const int es = in_bf16 ? 2 : 4, e5m2 = kv_format == KV_E5M2;
#pragma omp parallel for schedule(static) if (tokens >= 256)
    for (int64_t t = 0; t < tokens; t++)
        for (int h = 0; h < heads; h++) {
            const int64_t at = slots[t] * slot_bytes + (int64_t)h * (D + 4);
            if (e5m2) {
                fp8_row(k_cache + at, k + t * k_stride + (int64_t)h * D * es, D, in_bf16, 1);
                fp8_row(v_cache + at, v + t * v_stride + (int64_t)h * D * es, D, in_bf16, 1);
            } else {
                fp8_row(k_cache + at, k + t * k_stride + (int64_t)h * D * es, D, in_bf16, 0);
                fp8_row(v_cache + at, v + t * v_stride + (int64_t)h * D * es, D, in_bf16, 0);
            }
        }
}

int32_t flock_cpu_write_kv_fp8_op(const int64_t *a) {
    flock_cpu_write_kv_fp8((const char *)(intptr_t)a[0], a[1], (const char *)(intptr_t)a[2], a[3],
                           (uint8_t *)(intptr_t)a[4], (uint8_t *)(intptr_t)a[5], a[6], (const int64_t *)(intptr_t)a[7],
                           a[8], (int32_t)a[9], (int32_t)a[10], (int32_t)a[11], (int32_t)a[12]);
    return 0;
}

int flock_cpu_unit_rows(void) { return UNIT_ROWS; }

// 0 where the kernel may run (AMX builds: Linux granted the tile state)
int flock_cpu_init(void) {
#ifdef AMX_TILES
    return amx_request_tiles();
#else
    return 0;
#endif
}

int flock_cpu_tiles(void) {  // 1: bf16 products on AMX tiles
#ifdef AMX_TILES
    return 1;
#else
    return 0;
#endif
}
int flock_cpu_chunk(void) { return CHUNK; }

// Returns 0, or -1 for a shape this kernel does not take, -2 when out of memory, -4 where an emulated tile
// operation met shapes the CPU would refuse.
int flock_cpu_cascade(const Args *a) {
    if (a->head_dim % 16 || a->head_dim > MAX_D || a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads) return -1;
    const RunUnit run = a->bf16 ? run_bf16 : run_fp32;
    int units = 0;
    Unit *unit = balanced_units(a, omp_get_max_threads(), &units);
    if (unit == NULL) return -2;
    int jobs;
    Job *job = plan_shared(a, unit, units, &jobs);
    const PackJob pack = a->bf16 ? pack_bf16 : pack_fp32;
    int failed = 0, claimed = 0;
#pragma omp parallel
    {
        // flush denormals to zero (FTZ, DAZ): tiny weights would otherwise cost microcode assists
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
        Scratch *w = thread_scratch();
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int j = 0; j < jobs; j++)
            if (w != NULL) pack(a, w, &job[j]);
        // dynamic scheduling, each thread claiming its next unit during its current one's last chunk
        Queue q = {unit, units, &claimed, -1};
        int cur = w != NULL ? claim(&q) : units, warm = 0;
        while (cur < units) {
            q.next = -1;
            run(a, w, &unit[cur], &q, warm);
            warm = q.next >= 0;
            cur = warm ? q.next : claim(&q);
        }
#ifdef AMX_TILES
        if (tile_rows) TILE_RELEASE(), tile_rows = 0;
        if (TILE_FAULTED()) {
#pragma omp atomic write
            failed = 3;
        }
#endif
#pragma omp barrier
#pragma omp for schedule(static)
        for (int m = 0; m < a->num_merges; m++) merge(a, m);
        _mm_setcsr(csr);
    }
    free(unit);
    free(job);
    return failed ? -1 - failed : 0;
}

// flock_cpu_cascade as a step-program op: a[0] the step's Args, whose caches are those of a[1] (K) and a[2] (V).
int32_t flock_cpu_cascade_op(const int64_t *a) {
    Args layer = *(const Args *)(intptr_t)a[0];
    layer.k_cache = (const void *)(intptr_t)a[1];
    layer.v_cache = (const void *)(intptr_t)a[2];
    return flock_cpu_cascade(&layer);
}

#include "plan.h"
