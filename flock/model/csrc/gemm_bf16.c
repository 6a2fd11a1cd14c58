// bf16 GEMM for CPUs with AVX512-BF16 (vdpbf16ps): y[M][N] = x[M][K] W^T, fp32 accumulation, rounded to bf16
// (nearest even) once at the end, as oneDNN does.
//
// The weight is packed once (flock_gemm_pack) as column blocks of 64 outputs, each [K/2][64] 32-bit pairs
// (w[n][2k], w[n][2k + 1]), zero past N: the operand vdpbf16ps takes, read in address order. A register tile
// is 6 rows x 64 columns (24 accumulators); each step broadcasts a pair of every row's inputs and multiplies
// it by 4 vectors of weight pairs. The call's tiles (column block major, so a block's weights stay in cache
// across its row tiles) are split evenly over the threads: oneDNN splits decode shapes by 64-wide column
// blocks, 5 to 4 on a 576-wide output over 2 threads, and pays ~15 us a call, which a decode step of 1-8
// rows feels.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

#define MR 6    // rows of a register tile
#define NC 64   // columns of a weight block (4 vectors)

static inline __attribute__((always_inline)) void tile(const int mr, const int32_t *x, int64_t ldx, const int32_t *w,
                                                       int64_t k2, void *y, int64_t ldy, int ncols, int f32) {
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
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < 4 && j * 16 < ncols; j++) {
            const int left = ncols - j * 16;
            const __mmask16 m = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            if (f32) _mm512_mask_storeu_ps((float *)y + r * ldy + j * 16, m, acc[r][j]);
            else _mm256_mask_storeu_epi16((bf16 *)y + r * ldy + j * 16, m, (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
        }
}

static void tile_rows(int mr, const int32_t *x, int64_t ldx, const int32_t *w, int64_t k2, void *y, int64_t ldy,
                      int ncols, int f32) {
    switch (mr) {
        case 1: tile(1, x, ldx, w, k2, y, ldy, ncols, f32); return;
        case 2: tile(2, x, ldx, w, k2, y, ldy, ncols, f32); return;
        case 3: tile(3, x, ldx, w, k2, y, ldy, ncols, f32); return;
        case 4: tile(4, x, ldx, w, k2, y, ldy, ncols, f32); return;
        case 5: tile(5, x, ldx, w, k2, y, ldy, ncols, f32); return;
        default: tile(6, x, ldx, w, k2, y, ldy, ncols, f32); return;
    }
}

// w: [N][K] row-major (an nn.Linear weight), K even; packed: (N + 63) / 64 * K / 2 * 64 32-bit elements.
void flock_gemm_pack(const bf16 *w, int64_t n, int64_t k, int32_t *packed) {
    const int64_t k2 = k / 2, blocks = (n + NC - 1) / NC;
    memset(packed, 0, (size_t)(blocks * k2 * NC) * sizeof(int32_t));
    for (int64_t i = 0; i < n; i++) {
        const int32_t *row = (const int32_t *)(w + i * k);
        int32_t *dst = packed + (i / NC) * k2 * NC + i % NC;
        for (int64_t j = 0; j < k2; j++) dst[j * NC] = row[j];
    }
}

// x: m rows of k bf16 (row stride ldx elements, even); y: m rows of n (row stride ldy), bf16, or with f32 the
// fp32 sums unrounded (logits: bf16 would round them to 1/8 at 25 and make ties of a greedy pick).
void flock_gemm(const bf16 *x, int64_t ldx, const int32_t *packed, void *y, int64_t ldy, int64_t m, int64_t n,
                int64_t k, int32_t f32, int32_t threads) {
    const int64_t k2 = k / 2, row_tiles = (m + MR - 1) / MR, tiles = (n + NC - 1) / NC * row_tiles;
#pragma omp parallel num_threads(threads) if(threads > 1 && tiles > 1)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t i = tiles * t / nt; i < tiles * (t + 1) / nt; i++) {
            const int64_t block = i / row_tiles, r0 = i % row_tiles * MR;
            const int mr = m - r0 < MR ? (int)(m - r0) : MR, ncols = n - block * NC < NC ? (int)(n - block * NC) : NC;
            void *out = f32 ? (void *)((float *)y + r0 * ldy + block * NC) : (void *)((bf16 *)y + r0 * ldy + block * NC);
            tile_rows(mr, (const int32_t *)(x + r0 * ldx), ldx / 2, packed + block * k2 * NC, k2, out, ldy, ncols, f32);
        }
    }
}
