// bf16 GEMM for CPUs with AVX512-BF16 (vdpbf16ps): y[M][N] = x[M][K] W^T, fp32 accumulation, rounded to bf16
// (nearest even) once at the end, as oneDNN does.
//
// The weight is packed once (flock.model.gemm.pack) as column blocks of 64 outputs, each [K/2][64] 32-bit pairs
// (w[n][2k], w[n][2k + 1]), zero past N: the operand vdpbf16ps takes, read in address order. A register tile
// is 6 rows x 64 columns (24 accumulators); each step broadcasts a pair of every row's inputs and multiplies
// it by 4 vectors of weight pairs. The call's tiles (column block major, so a block's weights stay in cache
// across its row tiles) are split evenly over the threads: oneDNN splits decode shapes by 64-wide column
// blocks, 5 to 4 on a 576-wide output over 2 threads, and pays ~15 us a call, which a decode step of 1-8
// rows feels.
//
// A Llama MLP's gate_up weight ([gate | up], each I outputs) can be packed for SiLU-and-mul (GLU): column block
// b then holds gate outputs 32b .. 32b + 31 in its first two vectors and the same up outputs in its last two,
// and the tile writes silu(gate) * up of its 32 outputs from its fp32 sums: one pass, no [rows][2I] bf16
// intermediate written and read back, and gate and up rounded once instead of three times.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "silu512.h"

typedef uint16_t bf16;

#define MR 6    // rows of a register tile
#define NC 64   // columns of a weight block (4 vectors)

// what a tile writes: its sums rounded to bf16, as fp32, SiLU-and-mul, or added to the bf16 output (rounded once)
enum { OUT_BF16, OUT_F32, OUT_GLU, OUT_ADD };

static inline __attribute__((always_inline)) void tile(const int mr, const int32_t *x, int64_t ldx, const int32_t *w,
                                                       int64_t k2, void *y, int64_t ldy, int ncols, const int out) {
    __m512 acc[MR][4];
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k2; k++) {
        __m512bh b[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) b[j] = (__m512bh)_mm512_loadu_si512(w + k * NC + j * 16);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(x[r * ldx + k]);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
        }
    }
    const int vecs = out == OUT_GLU ? 2 : 4;  // GLU: acc[r][j] gate, acc[r][j + 2] the same outputs' up
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < vecs && j * 16 < ncols; j++) {
            const int left = ncols - j * 16;
            const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            if (out == OUT_F32) _mm512_mask_storeu_ps((float *)y + r * ldy + j * 16, m, acc[r][j]);
            else {
                bf16 *at = (bf16 *)y + r * ldy + j * 16;
                __m512 v = out == OUT_GLU ? silu_mul512(acc[r][j], acc[r][j + 2]) : acc[r][j];
                if (out == OUT_ADD)
                    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                             _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, at)), 16)));
                _mm256_mask_storeu_epi16(at, m, (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
}

#define TILE_ROWS(name, out)                                                                                  \
    static void name(int mr, const int32_t *x, int64_t ldx, const int32_t *w, int64_t k2, void *y, int64_t ldy,  \
                     int ncols) {                                                                              \
        switch (mr) {                                                                                          \
            case 1: tile(1, x, ldx, w, k2, y, ldy, ncols, out); return;                                        \
            case 2: tile(2, x, ldx, w, k2, y, ldy, ncols, out); return;                                        \
            case 3: tile(3, x, ldx, w, k2, y, ldy, ncols, out); return;                                        \
            case 4: tile(4, x, ldx, w, k2, y, ldy, ncols, out); return;                                        \
            case 5: tile(5, x, ldx, w, k2, y, ldy, ncols, out); return;                                        \
            default: tile(6, x, ldx, w, k2, y, ldy, ncols, out); return;                                       \
        }                                                                                                      \
    }
TILE_ROWS(tile_rows, OUT_BF16)
TILE_ROWS(tile_rows_f32, OUT_F32)
TILE_ROWS(tile_rows_glu, OUT_GLU)
TILE_ROWS(tile_rows_add, OUT_ADD)

// Output columns of a block: 64, or with GLU 32 (each a gate and an up column).
static inline int64_t block_cols(int glu) { return glu ? NC / 2 : NC; }

// x: m rows of k bf16 (row stride ldx elements, even); y: m rows of n (row stride ldy): bf16 (OUT_BF16), the
// fp32 sums unrounded (OUT_F32; logits: bf16 would round them to 1/8 at 25 and make ties of a greedy pick), or
// silu(gate) * up in bf16 (OUT_GLU, a weight packed with glu; n = I). Returns 0.
// Tile i of flock_gemm's (column block major, MR rows each).
static void gemm_tile(const bf16 *x, int64_t ldx, const int32_t *packed, void *y, int64_t ldy, int64_t m, int64_t n,
                      int64_t k2, int32_t out, int64_t i) {
    const int64_t row_tiles = (m + MR - 1) / MR, cols = block_cols(out == OUT_GLU);
    const int64_t block = i / row_tiles, r0 = i % row_tiles * MR;
    const int mr = m - r0 < MR ? (int)(m - r0) : MR;
    const int ncols = n - block * cols < cols ? (int)(n - block * cols) : cols;
    const int32_t *xr = (const int32_t *)(x + r0 * ldx), *wb = packed + block * k2 * NC;
    const int64_t at = r0 * ldy + block * cols;
    if (out == OUT_F32) tile_rows_f32(mr, xr, ldx / 2, wb, k2, (float *)y + at, ldy, ncols);
    else (out == OUT_GLU ? tile_rows_glu : out == OUT_ADD ? tile_rows_add : tile_rows)(mr, xr, ldx / 2, wb, k2,
                                                                                       (bf16 *)y + at, ldy, ncols);
}

static int64_t gemm_tiles(int64_t m, int64_t n, int32_t out) {
    const int64_t cols = block_cols(out == OUT_GLU);
    return (n + cols - 1) / cols * ((m + MR - 1) / MR);
}

// x: m rows of k bf16 (row stride ldx elements, even); y: m rows of n (row stride ldy): bf16 (OUT_BF16), the
// fp32 sums unrounded (OUT_F32; logits: bf16 would round them to 1/8 at 25 and make ties of a greedy pick), or
// silu(gate) * up in bf16 (OUT_GLU, a weight packed with glu; n = I). Returns 0.
int flock_gemm(const bf16 *x, int64_t ldx, const int32_t *packed, void *y, int64_t ldy, int64_t m, int64_t n,
               int64_t k, int32_t out, int32_t threads) {
    const int64_t tiles = gemm_tiles(m, n, out);
#pragma omp parallel num_threads(threads) if(threads > 1 && tiles > 1)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t i = tiles * t / nt; i < tiles * (t + 1) / nt; i++)
            gemm_tile(x, ldx, packed, y, ldy, m, n, k / 2, out, i);
    }
    return 0;
}

// flock_gemm as a step-program op (flock/model/program.py): its arguments as int64 words.
int32_t flock_gemm_op(const int64_t *a) {
    return flock_gemm((const bf16 *)(intptr_t)a[0], a[1], (const int32_t *)(intptr_t)a[2], (void *)(intptr_t)a[3],
                      a[4], a[5], a[6], a[7], (int32_t)a[8], (int32_t)a[9]);
}

#define GEMM_TILES  // gemm_moe.h: every expert's tiles in one parallel region
#include "gemm_moe.h"

#include "gemm_lora.h"
