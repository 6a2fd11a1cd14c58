// Prefix-sharing (cascade) attention over the paged KV cache for bf16 on x86 CPUs with AMX.
//
// One call per layer. Work comes as segments (built once per step by flock/attention/amx.py):
//   PREFIX : a group's query tokens stacked, against the group's shared prefix, no mask;
//   PARTIAL: one grouped request's query tokens against the rest of its context, causal;
//   DIRECT : one ungrouped request's query tokens against its whole context, causal.
// Row r of a segment is query token (entry) SEG_BEGIN + r / G and query head kv_head * G + r % G, so the G
// query heads sharing a KV head are matrix rows together (GQA without expanding K or V).
//
// A block of up to ROW_TILES x 16 rows of a segment and a run of KV heads (up to SPAN / head_dim, so that
// each position's K and V rows are read as one contiguous run; fewer when one unit would hold too large a share
// of the work) is one unit of work for a thread of PyTorch's OpenMP pool. It walks the KV positions in chunks
// of CHUNK, read from the paged blocks: K rows copied contiguous (AMX A tiles), V rows interleaved in pairs of
// positions (AMX's B layout), the next chunk loaded while the current one is computed. Every 16-row query
// tile computes S^T = K Q^T (AMX; Q^T prepared once), an online softmax in fp32 down the positions (AVX-512,
// 16 rows per vector), and O += P V (AMX, P rounded to bf16 as in flash attention). Positions past the end
// or, causally, past a row's own position get weight zero. PREFIX and PARTIAL rows write a normalised fp32
// partial and its log-sum-exp; a last pass merges each grouped token's two partials.
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"

enum { PREFIX = 0, PARTIAL = 1, DIRECT = 2 };
enum { SEG_BEGIN, SEG_ROWS, SEG_TABLE, SEG_KV_START, SEG_KV_END, SEG_KIND, SEG_FIELDS };

#define CHUNK 128      // KV positions per chunk (a multiple of 32)
#define MAX_D 256      // head_dim: a multiple of 32, at most this
#define SPAN 512       // KV heads x head_dim of one unit (elements per position)
#define ROW_TILES 8    // query tiles of 16 rows per KV head that share one chunk's K and V
#define TILES (ROW_TILES * SPAN / 32)  // query tiles of a unit, at most
#define LOG2E 1.4426950408889634f

typedef uint16_t bf16;

typedef struct {
    const bf16 *q, *k_cache, *v_cache;
    int64_t q_stride_t, q_stride_h;                 // elements
    int64_t kv_stride_b, kv_stride_s, kv_stride_h;  // elements, same for K and V
    const int32_t *segs, *tokens, *positions, *tables;
    int32_t num_segs, num_partial;
    bf16 *out;
    int64_t out_stride_t, out_stride_h;
    float *o_part, *lse_part;  // [2P, H, D], [2P, H]
    int32_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Args;

typedef struct {  // per-thread scratch, 64-byte aligned; a query tile j is head j / tiles_per_head
    bf16 k[2][CHUNK * SPAN];                    // a chunk's K rows: [head][position][dim] (AMX A tiles)
    bf16 vv[2][(CHUNK / 32) * (SPAN / 16) * 512];  // V tiles per head: [token32][dim16] -> 16 position pairs x 16
    bf16 qt[TILES * 512];                       // Q^T tiles: [tile][dim32] -> 16 dim pairs x 16 rows
    bf16 pa[2][(CHUNK / 32) * 512];             // P tiles: [token32] -> 16 rows x 16 position pairs
    float s[2][CHUNK * 16];                     // S^T of a query tile: a position per row, 16 rows
    float o[ROW_TILES * 16 * SPAN];             // running outputs (not yet divided by l): [tile][row][dim]
    float m[TILES * 16], l[TILES * 16];         // running max (raw score units) and sum of weights
    int32_t limit[TILES * 16];                  // last visible key position of each row
    int32_t min_limit[TILES];
    int64_t offset[2][CHUNK];                   // cache offsets of a chunk's rows (first head of the unit)
} Scratch;  // [2]: the chunk being attended and the next one, loaded meanwhile

typedef struct {  // one unit: a segment's rows [row0, row0 + ROW_TILES * 16) and KV heads [h0, h0 + hb)
    const int32_t *seg;
    int row0, h0, hb, tiles_per_head;
} Unit;

typedef struct {  // a chunk of KV positions [start, start + n) in scratch buffer `buf`
    int32_t start;
    int n, buf;
} Chunk;

static const bf16 ZERO_ROW[MAX_D] __attribute__((aligned(64)));

int flock_amx_init(void) { return amx_request_tiles(); }

static inline __m512 exp2_ps(__m512 t) {  // 2^t, relative error 7.5e-5 (P is rounded to bf16 after); -inf: 0
    t = _mm512_max_ps(t, _mm512_set1_ps(-150.0f));  // 2^-150 is 0 (flushed, with FTZ set in the threads)
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);  // [-0.5, 0.5]: a degree-3 minimax polynomial of 2^f (relative error)
    __m512 p = _mm512_set1_ps(0.05517162f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24261117f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693261f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992807f));
    return _mm512_scalef_ps(p, n);
}

#include "transpose16.h"

// Cache offsets (elements) of positions [start, start + n) of one KV head: one table lookup per block.
static void row_offsets(const Args *a, int64_t *off, int32_t table, int32_t start, int n, int kvh) {
    const int bs = a->block_size;
    int32_t block = start / bs, slot = start % bs;
    int64_t base = (int64_t)a->tables[table + block] * a->kv_stride_b + (int64_t)kvh * a->kv_stride_h;
    for (int t = 0; t < n; t++) {
        if (slot == bs) {
            slot = 0;
            base = (int64_t)a->tables[table + ++block] * a->kv_stride_b + (int64_t)kvh * a->kv_stride_h;
        }
        off[t] = base + (int64_t)slot++ * a->kv_stride_s;
    }
}

static inline bf16 *k_rows(Scratch *w, int buf, int D, int h) { return w->k[buf] + h * CHUNK * D; }
static inline bf16 *v_tiles(Scratch *w, int buf, int D, int h) {
    return w->vv[buf] + h * (CHUNK / 32) * (D / 16) * 512;
}

static inline void copy_row(bf16 *dst, const bf16 *src, int D) {  // D a multiple of 32; inlined, not memcpy
    for (int d = 0; d < D; d += 32) _mm512_storeu_si512(dst + d, _mm512_loadu_si512(src + d));
}

static inline int chunk_pairs(const Chunk *c) { return (c->n + 31) / 32 * 16; }

// Pairs of positions [from, to) of chunk c: K rows copied head-major (one head's rows contiguous: a 2^k
// stride between them would alias in L1), V rows interleaved in pairs; past c->n V is zeros (K rows there are
// never used: those scores are masked).
static void load_pairs(const Args *a, Scratch *w, const Unit *u, const Chunk *c, int from, int to) {
    const int D = a->head_dim, dv = D / 16, n = c->n;
    const int64_t *off = w->offset[c->buf], sh = a->kv_stride_h;
    // pairs of two rows' dims [32i, 32i + 16) and [32i + 16, 32i + 32): element 2j of r0, then of r1 (+32)
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int pr = from; pr < to; pr++) {
        const int t0 = 2 * pr, t1 = t0 + 1;
        for (int h = 0; h < u->hb; h++) {
            const bf16 *r0 = t0 < n ? a->v_cache + off[t0] + h * sh : ZERO_ROW;
            const bf16 *r1 = t1 < n ? a->v_cache + off[t1] + h * sh : ZERO_ROW;
            bf16 *k = k_rows(w, c->buf, D, h);
            if (t0 < n) copy_row(k + t0 * D, a->k_cache + off[t0] + h * sh, D);
            if (t1 < n) copy_row(k + t1 * D, a->k_cache + off[t1] + h * sh, D);
            bf16 *dst = v_tiles(w, c->buf, D, h) + (pr / 16) * dv * 512 + (pr % 16) * 32;
            for (int i = 0; i < dv; i += 2) {
                __m512i a0 = _mm512_loadu_si512(r0 + 16 * i), a1 = _mm512_loadu_si512(r1 + 16 * i);
                _mm512_store_si512(dst + i * 512, _mm512_permutex2var_epi16(a0, lo, a1));
                _mm512_store_si512(dst + (i + 1) * 512, _mm512_permutex2var_epi16(a0, hi, a1));
            }
        }
    }
}

static void prefetch_pairs(const Args *a, Scratch *w, const Unit *u, const Chunk *c, int from, int to) {
    const int lines = (a->head_dim * 2 + 63) / 64;
    const int64_t *off = w->offset[c->buf];
    for (int t = 2 * from; t < 2 * to && t < c->n; t++)
        for (int h = 0; h < u->hb; h++) {
            const char *kr = (const char *)(a->k_cache + off[t] + h * a->kv_stride_h);
            const char *vr = (const char *)(a->v_cache + off[t] + h * a->kv_stride_h);
            for (int i = 0; i < lines; i++) {
                _mm_prefetch(kr + 64 * i, _MM_HINT_T0);
                _mm_prefetch(vr + 64 * i, _MM_HINT_T0);
            }
        }
}

// Query rows [row0, row0 + 16) of the segment, for head h0 + j / tiles_per_head, into query tile j,
// transposed to pairs of dims (padding rows are zeros and see every key).
static void load_queries(const Args *a, Scratch *w, const Unit *u, int row0, int j) {
    const int D = a->head_dim, G = a->num_heads / a->num_kv_heads, kvh = u->h0 + j / u->tiles_per_head;
    const int32_t *seg = u->seg;
    const bf16 *src[16];
    int32_t lo = INT32_MAX;
    for (int i = 0; i < 16; i++) {
        int r = row0 + i;
        int32_t limit = INT32_MAX;
        src[i] = ZERO_ROW;
        if (r < seg[SEG_ROWS]) {
            int32_t e = seg[SEG_BEGIN] + r / G;
            src[i] = a->q + a->tokens[e] * a->q_stride_t + (int64_t)(kvh * G + r % G) * a->q_stride_h;
            if (seg[SEG_KIND] != PREFIX) limit = a->positions[e];
        }
        w->limit[j * 16 + i] = limit;
        lo = limit < lo ? limit : lo;
    }
    w->min_limit[j] = lo;
    for (int c = 0; c < D / 32; c++) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src[i] + 32 * c);
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_store_si512(w->qt + (j * (D / 32) + c) * 512 + 32 * i, r[i]);
    }
}

// tile register numbers are immediates: pick the one holding dim step k of Q^T (tmm4 .. tmm7)
#define DOT_Q(acc, a, k)                  \
    switch (k) {                          \
        case 0: _tile_dpbf16ps(acc, a, 4); break; \
        case 1: _tile_dpbf16ps(acc, a, 5); break; \
        case 2: _tile_dpbf16ps(acc, a, 6); break; \
        default: _tile_dpbf16ps(acc, a, 7);       \
    }

static inline void load_q_tile(int k, const bf16 *src) {
    switch (k) {
        case 0: _tile_loadd(4, src, 64); break;
        case 1: _tile_loadd(5, src, 64); break;
        case 2: _tile_loadd(6, src, 64); break;
        default: _tile_loadd(7, src, 64);
    }
}

// S^T = K Q^T for the chunk's positions, two 16-position tiles at a time; Q^T stays in tmm4..7 (head_dim
// <= 128) or is reloaded per dim step.
static void scores(Scratch *w, const bf16 *k_head, float *out, int j, int D, int n16) {
    const int dk = D / 32, resident = dk <= 4, stride = D * sizeof(bf16);
    const bf16 *qt = w->qt + j * dk * 512;
    if (resident)
        for (int k = 0; k < dk; k++) load_q_tile(k, qt + k * 512);
    for (int u = 0; u < n16; u += 2) {
        const int two = u + 1 < n16;
        const bf16 *k0 = k_head + u * 16 * D;
        _tile_zero(0);
        _tile_zero(1);
        for (int k = 0; k < dk; k++) {
            int b = k;
            if (!resident) {
                _tile_loadd(4, qt + k * 512, 64);
                b = 0;
            }
            _tile_loadd(2, k0 + 32 * k, stride);
            DOT_Q(0, 2, b);
            if (two) {
                _tile_loadd(3, k0 + 16 * D + 32 * k, stride);
                DOT_Q(1, 3, b);
            }
        }
        _tile_stored(0, out + u * 256, 64);
        if (two) _tile_stored(1, out + (u + 1) * 256, 64);
    }
}

// O += P V for one query tile, straight on its rows in memory, four 16-dim column tiles at a time (tmm0..3)
// with the P tile in tmm4 loaded once per 32 positions.
static void values(const bf16 *vv, const bf16 *pa, float *o, int D, int n32) {
    const int dv = D / 16, stride = D * sizeof(float);
    for (int d0 = 0; d0 < dv; d0 += 4) {
        const int nd = dv - d0 < 4 ? dv - d0 : 4;
        _tile_loadd(0, o + 16 * d0, stride);
        if (nd > 1) _tile_loadd(1, o + 16 * (d0 + 1), stride);
        if (nd > 2) _tile_loadd(2, o + 16 * (d0 + 2), stride);
        if (nd > 3) _tile_loadd(3, o + 16 * (d0 + 3), stride);
        for (int t = 0; t < n32; t++) {
            const bf16 *v = vv + (t * dv + d0) * 512;
            _tile_loadd(4, pa + t * 512, 64);
            _tile_loadd(5, v, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (nd > 1) {
                _tile_loadd(6, v + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (nd > 2) {
                _tile_loadd(7, v + 1024, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (nd > 3) {
                _tile_loadd(5, v + 1536, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, o + 16 * d0, stride);
        if (nd > 1) _tile_stored(1, o + 16 * (d0 + 1), stride);
        if (nd > 2) _tile_stored(2, o + 16 * (d0 + 2), stride);
        if (nd > 3) _tile_stored(3, o + 16 * (d0 + 3), stride);
    }
}

#define RESCALE_LOG2 8.0f  // see softmax()

// Weights P = 2^(S c - mc) of one query tile, rounded to bf16 and transposed into A tiles (`pa`); adds the
// rows' sums of the rounded weights (what P V uses, so that O / l is exact) to `sum` and returns the rows'
// score maxima over the chunk.
static __m512 weights(const float *sc, bf16 *pa, int n, __m512 cc, __m512 mc, __m512 *sum) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
    __m512 mx0 = neg_inf, mx1 = neg_inf, acc = *sum;
    for (int t32 = 0; t32 < (n + 31) / 32; t32++) {
        const float *s = sc + 512 * t32;
        const int valid = n - 32 * t32;  // positions of this step that exist (weight 0 past them)
        __m512i x[16];
        const int pairs = valid < 32 ? (valid + 1) / 2 : 16;
        for (int p = pairs; p < 16; p++) x[p] = _mm512_setzero_si512();  // past the end: weight 0
        for (int p = 0; p < pairs; p++) {
            __m512 s0 = _mm512_load_ps(s + 32 * p), s1 = _mm512_load_ps(s + 32 * p + 16);
            if (valid < 32) {
                s0 = 2 * p < valid ? s0 : neg_inf;
                s1 = 2 * p + 1 < valid ? s1 : neg_inf;
            }
            mx0 = _mm512_max_ps(mx0, s0);
            mx1 = _mm512_max_ps(mx1, s1);
            __m512 p0 = exp2_ps(_mm512_fmsub_ps(s0, cc, mc)), p1 = exp2_ps(_mm512_fmsub_ps(s1, cc, mc));
            __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);  // [p0 | p1] as bf16
            x[p] = _mm512_permutexvar_epi16(interleave, (__m512i)pb);  // dword m: (P[m][t], P[m][t + 1])
            acc = _mm512_dpbf16_ps(acc, (__m512bh)x[p], ones);
        }
        transpose16(x);  // row m: its 16 position pairs
        for (int m = 0; m < 16; m++) _mm512_store_si512(pa + t32 * 512 + 32 * m, x[m]);
    }
    *sum = acc;
    return _mm512_max_ps(mx0, mx1);
}

// Online softmax of query tile qi's scores S^T (`sc`) down the positions (AVX-512, its 16 rows at once): P
// in `pa`, the row sums and, on a rescale, O updated. The running max only moves when a row's new max
// exceeds it by more than 2^RESCALE_LOG2 in weight: weights then stay below 2^RESCALE_LOG2 (safe in fp32 and
// bf16), and most chunks take one pass with the max they found (a second pass when it moved).
static void softmax(const Args *a, Scratch *w, float *sc, bf16 *pa, int qi, int32_t start, int n) {
    const int D = a->head_dim;
    float *o = w->o + qi * 16 * D;
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
    const __m512 cc = _mm512_set1_ps(a->scale * LOG2E);
    if (start + n - 1 > w->min_limit[qi]) {  // causal: hide positions past each row's own
        const __m512i limit = _mm512_loadu_si512(w->limit + qi * 16);
        for (int t = 0; t < n; t++) {
            __mmask16 hidden = _mm512_cmplt_epi32_mask(limit, _mm512_set1_epi32(start + t));
            _mm512_store_ps(sc + 16 * t, _mm512_mask_mov_ps(_mm512_load_ps(sc + 16 * t), hidden, neg_inf));
        }
    }
    const __m512 m_old = _mm512_loadu_ps(w->m + qi * 16);
    __m512 sum = _mm512_loadu_ps(w->l + qi * 16), mx;
    if (_mm512_cmp_ps_mask(m_old, neg_inf, _CMP_EQ_OQ) == 0) {  // every row has a max: try it
        __m512 tried = sum;
        mx = weights(sc, pa, n, cc, _mm512_mul_ps(m_old, cc), &tried);
        if (!_mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_sub_ps(mx, m_old), cc), _mm512_set1_ps(RESCALE_LOG2),
                                _CMP_GT_OQ)) {
            _mm512_storeu_ps(w->l + qi * 16, tried);
            return;
        }
    } else {
        __m512 mx0 = neg_inf, mx1 = neg_inf;
        for (int t = 0; t + 1 < n; t += 2) {
            mx0 = _mm512_max_ps(mx0, _mm512_load_ps(sc + 16 * t));
            mx1 = _mm512_max_ps(mx1, _mm512_load_ps(sc + 16 * t + 16));
        }
        if (n & 1) mx0 = _mm512_max_ps(mx0, _mm512_load_ps(sc + 16 * (n - 1)));
        mx = _mm512_max_ps(mx0, mx1);
    }
    __mmask16 grow = _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_sub_ps(mx, m_old), cc),
                                        _mm512_set1_ps(RESCALE_LOG2), _CMP_GT_OQ);
    grow |= _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_EQ_OQ);
    const __m512 m_new = _mm512_mask_mov_ps(m_old, grow, mx);
    _mm512_storeu_ps(w->m + qi * 16, m_new);
    // a row with nothing visible yet keeps max -inf; its weights use 0 in its place and are all exactly 0
    const __m512 safe_new = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), zero);
    const __m512 alpha = _mm512_mask_mov_ps(exp2_ps(_mm512_sub_ps(_mm512_mul_ps(m_old, cc), _mm512_mul_ps(safe_new, cc))),
                                            _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_EQ_OQ), zero);
    float al[16];
    _mm512_storeu_ps(al, alpha);
    for (int i = 0; i < 16; i++) {
        if (!((grow >> i) & 1)) continue;
        __m512 ai = _mm512_set1_ps(al[i]);
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(o + i * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d), ai));
    }
    sum = _mm512_mul_ps(_mm512_loadu_ps(w->l + qi * 16), alpha);
    weights(sc, pa, n, cc, _mm512_mul_ps(safe_new, cc), &sum);
    _mm512_storeu_ps(w->l + qi * 16, sum);
}

// All query tiles of the unit against chunk `cur`, software-pipelined so that AMX results are not read
// back (nor AVX-512 results loaded into tiles) right after they are written: scores of tile j + 1 and P V of
// tile j - 1 around the softmax of tile j. Meanwhile chunk `next` is loaded, one part per tile (prefetched a
// tile ahead), so that its memory reads overlap the arithmetic.
static void attend_chunk(const Args *a, Scratch *w, const Unit *u, const Chunk *cur, const Chunk *next) {
    const int D = a->head_dim, n16 = (cur->n + 15) / 16, n32 = (cur->n + 31) / 32, b = cur->buf;
    const int tiles = u->hb * u->tiles_per_head, tph = u->tiles_per_head;
    const int pairs = next->n > 0 ? chunk_pairs(next) : 0;
#define PART(j) ((j) * pairs / tiles)
    prefetch_pairs(a, w, u, next, 0, PART(1));
    scores(w, k_rows(w, b, D, 0), w->s[0], 0, D, n16);
    for (int j = 0; j < tiles; j++) {
        if (j + 1 < tiles) scores(w, k_rows(w, b, D, (j + 1) / tph), w->s[(j + 1) & 1], j + 1, D, n16);
        softmax(a, w, w->s[j & 1], w->pa[j & 1], j, cur->start, cur->n);
        if (j > 0) values(v_tiles(w, b, D, (j - 1) / tph), w->pa[(j - 1) & 1], w->o + (j - 1) * 16 * D, D, n32);
        if (j + 2 <= tiles) prefetch_pairs(a, w, u, next, PART(j + 1), PART(j + 2));
        load_pairs(a, w, u, next, PART(j), PART(j + 1));
    }
#undef PART
    values(v_tiles(w, b, D, (tiles - 1) / tph), w->pa[(tiles - 1) & 1], w->o + (tiles - 1) * 16 * D, D, n32);
}

static inline void store_bf16(bf16 *dst, const float *src, float mul, int D) {
    __m512 m = _mm512_set1_ps(mul);
    for (int d = 0; d < D; d += 16)
        _mm256_storeu_si256((void *)(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + d), m)));
}

static void finish_rows(const Args *a, Scratch *w, const Unit *u, int row0, int nrows) {
    const int D = a->head_dim, G = a->num_heads / a->num_kv_heads, H = a->num_heads;
    const int32_t *seg = u->seg;
    for (int h = 0; h < u->hb; h++)
        for (int i = 0; i < nrows; i++) {
            int r = row0 + i, row = h * u->tiles_per_head * 16 + i;
            int32_t e = seg[SEG_BEGIN] + r / G, head = (u->h0 + h) * G + r % G;
            const float *o = w->o + row * D;
            float l = w->l[row], inv = 1.0f / l;
            if (seg[SEG_KIND] == DIRECT) {
                store_bf16(a->out + a->tokens[e] * a->out_stride_t + head * a->out_stride_h, o, inv, D);
                continue;
            }
            float *dst = a->o_part + ((int64_t)e * H + head) * D;
            __m512 m = _mm512_set1_ps(inv);
            for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), m));
            a->lse_part[(int64_t)e * H + head] = w->m[row] * a->scale + logf(l);
        }
}

static void run_unit(const Args *a, Scratch *w, Unit *u) {
    const int G = a->num_heads / a->num_kv_heads, D = a->head_dim;
    const int32_t *seg = u->seg;
    const int row0 = u->row0, rows_left = seg[SEG_ROWS] - row0;
    const int nrows = rows_left < ROW_TILES * 16 ? rows_left : ROW_TILES * 16;
    u->tiles_per_head = (nrows + 15) / 16;
    const int tiles = u->hb * u->tiles_per_head;
    int32_t kv_end = seg[SEG_KV_END];
    if (seg[SEG_KIND] != PREFIX) {  // nothing past the block's last query position
        int32_t last = a->positions[seg[SEG_BEGIN] + (row0 + nrows - 1) / G] + 1;
        if (last < kv_end) kv_end = last;
    }
    for (int j = 0; j < tiles; j++) load_queries(a, w, u, row0 + 16 * (j % u->tiles_per_head), j);
    for (int i = 0; i < tiles * 16; i++) {
        w->m[i] = -INFINITY;
        w->l[i] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * tiles * 16 * D);
    Chunk cur = {seg[SEG_KV_START], kv_end - seg[SEG_KV_START] < CHUNK ? kv_end - seg[SEG_KV_START] : CHUNK, 0};
    row_offsets(a, w->offset[0], seg[SEG_TABLE], cur.start, cur.n, u->h0);
    load_pairs(a, w, u, &cur, 0, chunk_pairs(&cur));
    while (cur.n > 0) {
        int32_t start = cur.start + cur.n;
        Chunk next = {start, kv_end - start < CHUNK ? kv_end - start : CHUNK, !cur.buf};
        if (next.n > 0) row_offsets(a, w->offset[next.buf], seg[SEG_TABLE], next.start, next.n, u->h0);
        attend_chunk(a, w, u, &cur, &next);
        cur = next;
    }
    finish_rows(a, w, u, row0, nrows);
}

static void merge_partials(const Args *a, int32_t e) {
    const int D = a->head_dim, H = a->num_heads, P = a->num_partial;
    for (int h = 0; h < H; h++) {
        float la = a->lse_part[(int64_t)e * H + h], lb = a->lse_part[(int64_t)(e + P) * H + h];
        float wa = 1.0f / (1.0f + expf(lb - la));
        const float *oa = a->o_part + ((int64_t)e * H + h) * D, *ob = a->o_part + ((int64_t)(e + P) * H + h) * D;
        bf16 *dst = a->out + a->tokens[e] * a->out_stride_t + h * a->out_stride_h;
        __m512 va = _mm512_set1_ps(wa), vb = _mm512_set1_ps(1.0f - wa);
        for (int d = 0; d < D; d += 16) {
            __m512 o = _mm512_fmadd_ps(_mm512_loadu_ps(oa + d), va, _mm512_mul_ps(_mm512_loadu_ps(ob + d), vb));
            _mm256_storeu_si256((void *)(dst + d), (__m256i)_mm512_cvtneps_pbh(o));
        }
    }
}

static inline int row_blocks(const int32_t *seg) { return (seg[SEG_ROWS] + ROW_TILES * 16 - 1) / (ROW_TILES * 16); }

// KV heads per unit: as many as fit in SPAN (contiguous reads), fewer when the heaviest unit would hold more
// than half a thread's share of the work (one long group would otherwise keep one thread busy alone).
static int heads_per_unit(const Args *a, int threads) {
    int hb = SPAN / a->head_dim < a->num_kv_heads ? SPAN / a->head_dim : a->num_kv_heads;
    double total = 0, heaviest = 0;
    for (int i = 0; i < a->num_segs; i++) {
        const int32_t *seg = a->segs + i * SEG_FIELDS;
        double work = (double)seg[SEG_ROWS] * (seg[SEG_KV_END] - seg[SEG_KV_START] + 64);
        total += work;
        heaviest = work / row_blocks(seg) > heaviest ? work / row_blocks(seg) : heaviest;
    }
    while (hb > 1 && heaviest * hb / a->num_kv_heads > total / (2 * threads)) hb = (hb + 1) / 2;
    return hb;
}

static Scratch *thread_scratch(void) {
    static __thread Scratch *w = NULL;
    if (w == NULL) w = aligned_alloc(64, (sizeof(Scratch) + 63) / 64 * 64);
    return w;
}

// Returns 0, or -1 for a head_dim this kernel does not take, -2 when out of memory.
int flock_amx_cascade(const Args *a) {
    if (a->head_dim % 32 || a->head_dim > MAX_D) return -1;
    const int hb = heads_per_unit(a, omp_get_max_threads()), runs = (a->num_kv_heads + hb - 1) / hb;
    int units = 0;
    for (int i = 0; i < a->num_segs; i++) units += row_blocks(a->segs + i * SEG_FIELDS) * runs;
    Unit *unit = malloc(sizeof(Unit) * (units > 0 ? units : 1));
    if (unit == NULL) return -2;
    for (int i = 0, n = 0; i < a->num_segs; i++)  // segments come heaviest first: so do the units
        for (int b = 0; b < row_blocks(a->segs + i * SEG_FIELDS); b++)
            for (int r = 0; r < runs; r++, n++) {
                int h0 = r * hb;
                unit[n] = (Unit){a->segs + i * SEG_FIELDS, b * ROW_TILES * 16, h0,
                                 a->num_kv_heads - h0 < hb ? a->num_kv_heads - h0 : hb, 0};
            }
    int failed = 0;
#pragma omp parallel
    {
        // flush denormals to zero (FTZ, DAZ): tiny weights would otherwise cost microcode assists
        const unsigned int csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
        Scratch *w = thread_scratch();
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            amx_configure_bf16(16);  // every tile 16 rows x 64 bytes
        }
#pragma omp for schedule(dynamic, 1)
        for (int u = 0; u < units; u++)
            if (w != NULL) run_unit(a, w, &unit[u]);
#pragma omp for schedule(static)
        for (int e = 0; e < a->num_partial; e++) merge_partials(a, e);
        _tile_release();
        _mm_setcsr(csr);
    }
    free(unit);
    return failed ? -2 : 0;
}
