// bf16 GEMM on AMX tiles (_tile_dpbf16ps): y[M][N] = x[M][K] W^T, fp32 sums, written as gemm_bf16.c's
// flock_gemm writes them (rounded to bf16 once, fp32, or SiLU-and-mul) from the same packed weight
// (flock.model.gemm.pack: column blocks of 64 outputs, each [K/2][64] 32-bit pairs).
//
// A task is up to 64 rows x one block; K goes in steps of 32 (K % 32 == 0), the B tiles (16 pairs x 16 columns)
// read straight from the packed weight with the stride of one 64-wide pair row, the A tiles (16 rows x 32 bf16)
// straight from x (a call's last rows, short of 16, from each thread's copy of them in a 16-row tile). A task
// multiplies pairs of row tiles (or its one tile) by half blocks on 2 x 2 tiles: two A tiles times two B tiles,
// four loads for four products (one A tile times four B tiles needs five). Tile loads from L2 bound the
// products' rate, so K goes in chunks whose tiles every pair and half of the task reuse from L1, the sums waiting
// in memory between chunks. Tasks of every size, down to a decode step's single rows, prefetch their weights
// ahead of the tiles (the hardware prefetchers alone stream fewer bytes a second). A call of more than 64 rows
// goes row panel (PANEL_ROWS) by panel, block by block within one, so a panel's activations stay in cache while
// each block's weights are read once per panel; its tasks are split evenly over the threads, and a block's
// weights come into L2 ahead of its tiles: small blocks are prefetched by the tasks of the block before (memory
// streams while the tiles work), others by their first task, a chunk ahead. A call of at most 64 rows reads each
// weight once, and each core streams memory at only about half the machine's bandwidth: the threads split the
// weights evenly, by halves of a block's K where the blocks do not divide evenly, one thread going on from the
// other's sums (the same bits as on one thread). The sums leave the tiles through a 64 x 64 fp32 buffer for the
// epilogue (AVX-512; portable C when emulated).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "exp2_poly.h"
#ifdef __AVX512BF16__
#include "silu512.h"
#endif

typedef uint16_t bf16;

#define NC 64           // columns of a weight block
#define TASK_ROWS 64    // rows of a task
#define KC 128          // K of a chunk whose tiles the task's row pairs and half blocks share in L1
#define PANEL_ROWS 256  // rows whose activations share one pass over the weight blocks
#define AHEAD_BYTES (128 << 10)  // blocks up to this size prefetch the next block while they multiply
#define STREAM_AHEAD (32 << 10)  // how far ahead of its tiles a thread of a one-panel call prefetches

enum { OUT_BF16, OUT_F32, OUT_GLU, OUT_ADD };  // as gemm_bf16.c

#ifndef __AVX512BF16__  // the emulated build's epilogue, in portable C
static inline float mul_add(float a, float b, float c) { return a * b + c; }
static inline float same(float x) { return x; }

// silu(g) * u = g u / (1 + 2^t), t = -g log2(e) kept within the normal exponents (the result is 0 or g u
// beyond them), 2^t by t's integer part in the exponent bits and a degree-5 polynomial of its fraction.
static inline float silu_mul(float g, float u) {
    float t = -1.4426950408889634f * g;
    t = t < -126.0f ? -126.0f : t > 126.0f ? 126.0f : t;
    const float n = rintf(t), f = t - n;
    const union { uint32_t u; float f; } two_n = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return g * u / (EXP2_POLY5(f, mul_add, same) * two_n.f + 1.0f);
}

static inline bf16 to_bf16(float x) {  // nearest even, NaN kept NaN
    const union { float f; uint32_t u; } v = {x};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16)(v.u >> 16 | 0x40);
    return (bf16)((v.u + 0x7fffu + (v.u >> 16 & 1u)) >> 16);
}
#endif

// `ncols` outputs of each of `rows` rows from the sums; GLU: output c is silu(sums[c]) * sums[c + 32]. On the
// CPU (AVX-512): 16 columns a vector, rounded by vcvtneps2bf16 as the AVX512-BF16 GEMM rounds; the emulated
// build (any CPU) in portable C.
static void write_rows(const float *sums, int rows, int ncols, int out, void *y, int64_t ldy) {
#ifdef __AVX512BF16__
    const int vecs = out == OUT_GLU ? 2 : 4;
    for (int r = 0; r < rows; r++) {
        const float *s = sums + r * NC;
        for (int j = 0; j < vecs && j * 16 < ncols; j++) {
            const int left = ncols - j * 16;
            const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const __m512 v = _mm512_load_ps(s + j * 16);
            if (out == OUT_F32) _mm512_mask_storeu_ps((float *)y + r * ldy + j * 16, m, v);
            else {
                bf16 *at = (bf16 *)y + r * ldy + j * 16;
                __m512 o = out == OUT_GLU ? silu_mul512(v, _mm512_load_ps(s + j * 16 + NC / 2)) : v;
                if (out == OUT_ADD)
                    o = _mm512_add_ps(o, _mm512_castsi512_ps(_mm512_slli_epi32(
                                             _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, at)), 16)));
                _mm256_mask_storeu_epi16(at, m, (__m256i)_mm512_cvtneps_pbh(o));
            }
        }
    }
#else
    for (int r = 0; r < rows; r++) {
        const float *s = sums + r * NC;
        if (out == OUT_F32) {
            memcpy((float *)y + r * ldy, s, (size_t)ncols * sizeof(float));
        } else if (out == OUT_GLU) {
            bf16 *dst = (bf16 *)y + r * ldy;
            for (int c = 0; c < ncols; c++) dst[c] = to_bf16(silu_mul(s[c], s[c + NC / 2]));
        } else if (out == OUT_ADD) {
            bf16 *dst = (bf16 *)y + r * ldy;
            for (int c = 0; c < ncols; c++) {
                const union { uint32_t u; float f; } old = {(uint32_t)dst[c] << 16};
                dst[c] = to_bf16(s[c] + old.f);
            }
        } else {
            bf16 *dst = (bf16 *)y + r * ldy;
            for (int c = 0; c < ncols; c++) dst[c] = to_bf16(s[c]);
        }
    }
#endif
}

// The 2 x 2 products' tiles: 0-3 the sums of two row tiles by columns 0-15 and 16-31 of a half block, 4 and 5
// the two A tiles, 6 and 7 the B tiles; every tile 16 rows (a call's last rows come padded).
static void configure_2x2(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    TILE_CONFIG(&cfg);
}

// Weight lines a task prefetches into L2, `step` bytes each step of K: the next `left` bytes of ranges [from, to),
// read in order (a thread's weights in the order its tasks multiply them).
typedef struct {
    const char *from[3], *to[3];
    int ranges;
} Lines;

typedef struct {
    const Lines *lines;
    int range;
    const char *at;
    int64_t left, step;
} Fetch;

static void add_range(Lines *lines, const char *from, const char *to) {  // at most 3
    lines->from[lines->ranges] = from, lines->to[lines->ranges++] = to;
}

static inline __attribute__((always_inline)) void fetch_step(Fetch *f) {
    const Lines *lines = f->lines;  // locals: stores through f could alias the ranges
    const char *at = f->at, *to = lines->to[f->range];
    int64_t left = f->left;
    for (int64_t b = f->step; b > 0 && left > 0; b -= 64, left -= 64) {
        if (at >= to) {
            if (f->range + 1 == lines->ranges) {
                left = 0;
                break;
            }
            at = lines->from[++f->range], to = lines->to[f->range];
        }
        _mm_prefetch(at, _MM_HINT_T1);
        at += 64;
    }
    f->at = at, f->left = left;
}

// One pair of row tiles (a1 NULL: one tile) times half a block's columns of pairs w, steps k0 to k1 of K, onto the
// sums c (rows NC floats apart) that the chunks before left there (none when k0 is 0).
static void pair_by_half(const bf16 *a0, int64_t lda0, const bf16 *a1, int64_t lda1, const int32_t *w, int64_t k0,
                         int64_t k1, float *c, Fetch *fetch) {
    if (k0 == 0) {
        TILE_ZERO(0);
        TILE_ZERO(1);
        if (a1) {
            TILE_ZERO(2);
            TILE_ZERO(3);
        }
    } else {
        TILE_LOAD(0, c, NC * 4);
        TILE_LOAD(1, c + 16, NC * 4);
        if (a1) {
            TILE_LOAD(2, c + 16 * NC, NC * 4);
            TILE_LOAD(3, c + 16 * NC + 16, NC * 4);
        }
    }
    TILE_LOAD(4, a0 + k0, lda0 * 2);
    TILE_LOAD(6, w + k0 / 2 * NC, NC * 4);
    if (a1) TILE_LOAD(5, a1 + k0, lda1 * 2);
    TILE_LOAD(7, w + k0 / 2 * NC + 16, NC * 4);
    for (int64_t k = k0; k < k1; k += 32) {
        fetch_step(fetch);
        // each operand tile reloaded for the next step as soon as its last product is issued
        const int more = k + 32 < k1;
        const int32_t *wn = w + (k + 32) / 2 * NC;
        TILE_DPBF16PS(0, 4, 6);
        TILE_DPBF16PS(1, 4, 7);
        if (more) TILE_LOAD(4, a0 + k + 32, lda0 * 2);
        if (a1) TILE_DPBF16PS(2, 5, 6);
        if (more) TILE_LOAD(6, wn, NC * 4);
        if (a1) TILE_DPBF16PS(3, 5, 7);
        if (more) {
            if (a1) TILE_LOAD(5, a1 + k + 32, lda1 * 2);
            TILE_LOAD(7, wn + 16, NC * 4);
        }
    }
    TILE_STORE(0, c, NC * 4);
    TILE_STORE(1, c + 16, NC * 4);
    if (a1) {
        TILE_STORE(2, c + 16 * NC, NC * 4);
        TILE_STORE(3, c + 16 * NC + 16, NC * 4);
    }
}

// c[64][64] (+)= `tiles` row tiles of 16 (a[i], lda[i] elements apart) times the block's 64 columns of pairs
// b[k / 2][64], steps k0 to k1 of K (c read when k0 > 0). K goes in chunks of KC; within a chunk each pair of row
// tiles takes each half block in turn, so the chunk's A and B tiles come from L1 after their first load (tile
// loads from L2 bound the products' rate), and the sums wait in c between chunks. `fetch` spreads its lines
// evenly over the steps.
static void x64_by_64(const bf16 *const a[4], const int64_t lda[4], int tiles, const int32_t *b, int64_t k0,
                      int64_t k1, float *c, Fetch *fetch) {
    const int pairs = (tiles + 1) / 2;
    fetch->step = (fetch->left / ((k1 - k0) / 32 * pairs * 2) + 63) / 64 * 64;
    for (int64_t c0 = k0; c0 < k1; c0 += KC) {
        const int64_t c1 = c0 + KC < k1 ? c0 + KC : k1;
        for (int p = 0; p < pairs; p++) {
            const int two = 2 * p + 1 < tiles;
            for (int half = 0; half < 2; half++)
                pair_by_half(a[2 * p], lda[2 * p], two ? a[2 * p + 1] : NULL, two ? lda[2 * p + 1] : 0, b + half * 32,
                             c0, c1, c + p * 32 * NC + half * 32, fetch);
        }
    }
}

int flock_amx_gemm_init(void) { return amx_request_tiles(); }

typedef struct {
    const bf16 *x;
    const int32_t *packed;
    void *y;
    int64_t ldx, ldy, m, n, k, cols, blocks;  // cols: outputs of a block
    int out;
} Call;

// Per thread: whether the tiles are set up for the 2 x 2 products, the call's last rows' tile (NULL: not yet),
// whether memory ran out for them, and the sums.
typedef struct {
    int configured, out_of_memory;
    const bf16 *pad;
    float sums[TASK_ROWS * NC] __attribute__((aligned(64)));
} Worker;

// The last `rows` (< 16) rows of x, K wide, copied into a row tile of 16 rows pad_stride apart (NULL when memory
// ran out). Each thread copies them into its own tile, kept across calls: one copy for all the threads, or a
// fresh one each call, would send its lines from one core's cache to the others' at every call. The rows past
// `rows` hold what earlier calls left there (zeros at first): no output row reads their products.
static __thread bf16 *pad_tile;
static __thread int64_t pad_stride;

static __attribute__((noinline, cold)) const bf16 *padded_rows(const bf16 *x, int64_t ldx, int rows, int64_t k) {
    if (k > pad_stride) {
        free(pad_tile);
        if (!(pad_tile = calloc(16 * k, sizeof(bf16)))) return pad_stride = 0, NULL;
        pad_stride = k;
    }
    for (int r = 0; r < rows; r++) memcpy(pad_tile + r * pad_stride, x + r * ldx, (size_t)k * sizeof(bf16));
    return pad_tile;
}

// Rows r0 .. r0 + rows - 1 (at most TASK_ROWS) times block `block`, steps k0 to k1 of K, onto c (read when
// k0 > 0).
static void multiply(const Call *g, Worker *w, int64_t r0, int rows, int64_t block, int64_t k0, int64_t k1,
                     float *c, Fetch *fetch) {
    const int32_t *b = g->packed + block * (g->k / 2) * NC;
    if (!w->configured) configure_2x2(), w->configured = 1;
    const bf16 *a[4];
    int64_t lda[4];
    const int tiles = (rows + 15) / 16;
    for (int r = 0; r < tiles; r++) a[r] = g->x + (r0 + 16 * r) * g->ldx, lda[r] = g->ldx;
    if (r0 + 16 * tiles > g->m) {
        if (!w->pad && !(w->pad = padded_rows(g->x + (g->m - g->m % 16) * g->ldx, g->ldx, g->m % 16, g->k))) {
            w->out_of_memory = 1;  // (the call fails; its threads go on, so none waits for a hand-off forever)
            return;
        }
        a[tiles - 1] = w->pad, lda[tiles - 1] = pad_stride;
    }
    x64_by_64(a, lda, tiles, b, k0, k1, c, fetch);
}

static void write_task(const Call *g, const float *sums, int64_t r0, int rows, int64_t block) {
    const int ncols = g->n - block * g->cols < g->cols ? (int)(g->n - block * g->cols) : (int)g->cols;
    const int64_t at = r0 * g->ldy + block * g->cols;
    write_rows(sums, rows, ncols, g->out,
               g->out == OUT_F32 ? (void *)((float *)g->y + at) : (void *)((bf16 *)g->y + at), g->ldy);
}

// Calls of more than TASK_ROWS rows: tasks of up to TASK_ROWS rows x one block, row panel by panel, block by
// block within one, split evenly over the threads. A block nobody prefetched fetches itself a chunk ahead of
// its tiles, and the first chunk of the thread's next block; on small blocks each row task prefetches its share
// of the next block.
static void panels(const Call *g, Worker *w, int t, int nt) {
    const int64_t k = g->k, blocks = g->blocks, row_tasks = (g->m + TASK_ROWS - 1) / TASK_ROWS;
    const int64_t panel_tasks = PANEL_ROWS / TASK_ROWS, tasks = blocks * row_tasks, last = tasks * (t + 1) / nt;
    const int64_t bytes = k / 2 * NC * 4, chunk = (k < KC ? k : KC) / 2 * NC * 4;
    int64_t cached = -1, fetched = -1;  // the block the last task multiplied, the one prefetched for the next
    for (int64_t i = tasks * t / nt; i < last; i++) {
        const int64_t panel = i / (blocks * panel_tasks), first = panel * panel_tasks;
        const int64_t j = i - first * blocks, in_panel = row_tasks - first < panel_tasks ? row_tasks - first
                                                                                         : panel_tasks;
        const int64_t block = j / in_panel, r0 = (first + j % in_panel) * TASK_ROWS, q = j % in_panel;
        const int rows = g->m - r0 < TASK_ROWS ? (int)(g->m - r0) : TASK_ROWS;
        const int64_t next_task = i + in_panel - q;
        const int next_here = block + 1 < blocks && next_task < last && next_task / (blocks * panel_tasks) == panel;
        const int own = block != cached && block != fetched, ahead = next_here && bytes <= AHEAD_BYTES;
        const char *b = (const char *)(g->packed + block * (k / 2) * NC), *next = b + bytes;
        Lines lines = {{b + chunk}, {b + chunk}, 1};
        if (ahead) {
            const int64_t share = (bytes / in_panel + 63) / 64 * 64;
            lines.from[0] = own ? b + chunk : next + q * share;
            lines.to[0] = next + (q + 1 < in_panel ? (q + 1) * share : bytes);
        } else if (own) {
            lines.to[0] = next + (next_here ? chunk : 0);
        }
        Fetch fetch = {&lines, 0, lines.from[0], lines.to[0] - lines.from[0], 0};
        multiply(g, w, r0, rows, block, 0, k, w->sums, &fetch);
        fetched = ahead ? block + 1 : -1;
        cached = block;
        write_task(g, w->sums, r0, rows, block);
    }
}

// Where one thread's share of a call's blocks starts or ends in the middle of one: that block's sums over the
// first half of K, which the thread that goes on from them waits for.
typedef struct {
    float sums[TASK_ROWS * NC] __attribute__((aligned(64)));
    int ready;
} HandOff;

// Calls of at most TASK_ROWS rows read every weight once: the threads split the weights evenly by halves of a
// block's K (a thread's first and last block may be halves). A thread multiplies its last block's first half
// first and hands its sums over, then its whole blocks, then its first block's second half from the sums handed
// to it, so each sum is added in the same order as on one thread. The weights stream into L2 STREAM_AHEAD bytes
// ahead of the tiles.
static void one_panel(const Call *g, Worker *w, int t, int nt, HandOff *handoffs) {
    const int64_t k = g->k, blocks = g->blocks, halves = 2 * blocks;
    const int64_t u0 = halves * t / nt, u1 = halves * (t + 1) / nt, bytes = k / 2 * NC * 4;
    if (u0 >= u1) return;
    const int64_t kh = k / 64 * 32, half_bytes = kh / 2 * NC * 4;  // the first half: kh steps of K
    const int64_t lead = u0 % 2 ? u0 / 2 : -1, trail = u1 % 2 ? u1 / 2 : -1, full0 = (u0 + 1) / 2, full1 = u1 / 2;
    const int rows = (int)g->m;
    // the thread's weights in the order it multiplies them
    const char *base = (const char *)g->packed;
    Lines lines = {{0}, {0}, 0};
    if (trail >= 0) add_range(&lines, base + trail * bytes, base + trail * bytes + half_bytes);
    if (full1 > full0) add_range(&lines, base + full0 * bytes, base + full1 * bytes);
    if (lead >= 0) add_range(&lines, base + lead * bytes + half_bytes, base + (lead + 1) * bytes);
    // the first task prefetches its own weights and STREAM_AHEAD bytes more, each later one as many as it reads
    int64_t extra = STREAM_AHEAD;
    Fetch fetch = {&lines, 0, lines.from[0], 0, 0};
    if (trail >= 0) {
        HandOff *h = &handoffs[t];
        fetch.left = half_bytes + extra, extra = 0;
        multiply(g, w, 0, rows, trail, 0, kh, h->sums, &fetch);
        __atomic_store_n(&h->ready, 1, __ATOMIC_RELEASE);
    }
    for (int64_t block = full0; block < full1; block++) {
        fetch.left = bytes + extra, extra = 0;
        multiply(g, w, 0, rows, block, 0, k, w->sums, &fetch);
        write_task(g, w->sums, 0, rows, block);
    }
    if (lead >= 0) {
        HandOff *h = &handoffs[t - 1];
        for (int spins = 1; !__atomic_load_n(&h->ready, __ATOMIC_ACQUIRE); spins++)
            if (spins % 1024) _mm_pause();
            else sched_yield();  // more threads than cores: the one handing over may be waiting for this core
        fetch.left = bytes - half_bytes + extra;
        multiply(g, w, 0, rows, lead, kh, k, h->sums, &fetch);
        write_task(g, h->sums, 0, rows, lead);
    }
}

// As gemm_bf16.c's flock_gemm, for K % 32 == 0. Returns 0; 1 for a K it does not take; 2 where an emulated
// tile operation met shapes the CPU would refuse; 3 when memory ran out.
int flock_gemm(const bf16 *x, int64_t ldx, const int32_t *packed, void *y, int64_t ldy, int64_t m, int64_t n,
               int64_t k, int32_t out, int32_t threads) {
    if (k % 32) return 1;
    if (m <= 0 || n <= 0) return 0;
    const int64_t cols = out == OUT_GLU ? NC / 2 : NC, blocks = (n + cols - 1) / cols;
    const int one = m <= TASK_ROWS && k >= 64;  // one_panel's calls (halves of K need two steps of 32)
    const int64_t units = one ? (blocks > 1 ? 2 * blocks : 1) : blocks * ((m + TASK_ROWS - 1) / TASK_ROWS);
    if (threads > units) threads = (int)units;
    HandOff *handoffs = NULL;
    if (one && threads > 1 && !(handoffs = aligned_alloc(64, sizeof(HandOff) * threads))) return 3;
    for (int t = 0; handoffs && t < threads; t++) handoffs[t].ready = 0;
    const Call g = {x, packed, y, ldx, ldy, m, n, k, cols, blocks, out};
    int failed = 0;
#pragma omp parallel num_threads(threads) if(threads > 1)
    {
        Worker w;
        w.configured = w.out_of_memory = 0, w.pad = NULL;
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (one && nt > 1) one_panel(&g, &w, t, nt, handoffs);
        else panels(&g, &w, t, nt);
        if (w.configured) TILE_RELEASE();
        if (TILE_FAULTED() || w.out_of_memory) {
#pragma omp atomic write
            failed = w.out_of_memory ? 3 : 2;
        }
    }
    free(handoffs);
    return failed;
}

// flock_gemm as a step-program op (flock/model/program.py): its arguments as int64 words.
int32_t flock_gemm_op(const int64_t *a) {
    return flock_gemm((const bf16 *)(intptr_t)a[0], a[1], (const int32_t *)(intptr_t)a[2], (void *)(intptr_t)a[3],
                      a[4], a[5], a[6], a[7], (int32_t)a[8], (int32_t)a[9]);
}

#include "gemm_moe.h"

#include "gemm_lora.h"
