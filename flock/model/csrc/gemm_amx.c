// bf16 GEMM on AMX tiles (_tile_dpbf16ps): y[M][N] = x[M][K] W^T, fp32 sums, written as gemm_bf16.c's
// flock_gemm writes them (rounded to bf16 once, fp32, or SiLU-and-mul) from the same packed weight
// (flock.model.gemm.pack: column blocks of 64 outputs, each [K/2][64] 32-bit pairs).
//
// A task is up to 16 rows x one block: four accumulator tiles (16 rows x 16 fp32 each), the rows' A tile (16 rows
// x 32 bf16, read straight from x) and the block's four B tiles (16 pairs x 16 columns), read straight from the
// packed weight with the stride of one 64-wide pair row, K in steps of 32 (K % 32 == 0). The tiles are configured
// with the task's row count, so a decode step's few rows multiply only those rows. Tasks go row panel
// (PANEL_TILES x 16 rows) by panel, block by block within one, so a panel's activations stay in cache while
// each block's weights are read once per panel; they are split evenly over the threads. The sums leave the
// tiles through a 16 x 64 fp32 buffer for the epilogue, portable C that the compiler vectorizes.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "amx_tiles.h"
#include "exp2_poly.h"

typedef uint16_t bf16;

#define NC 64           // columns of a weight block
#define PANEL_TILES 8   // row tiles of 16 whose activations share one pass over the weight blocks

enum { OUT_BF16, OUT_F32, OUT_GLU };  // as gemm_bf16.c

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

// `ncols` outputs of each of `rows` rows from the sums; GLU: output c is silu(sums[c]) * sums[c + 32]
static void write_rows(const float *sums, int rows, int ncols, int out, void *y, int64_t ldy) {
    for (int r = 0; r < rows; r++) {
        const float *s = sums + r * NC;
        if (out == OUT_F32) {
            memcpy((float *)y + r * ldy, s, (size_t)ncols * sizeof(float));
        } else if (out == OUT_GLU) {
            bf16 *dst = (bf16 *)y + r * ldy;
            for (int c = 0; c < ncols; c++) dst[c] = to_bf16(silu_mul(s[c], s[c + NC / 2]));
        } else {
            bf16 *dst = (bf16 *)y + r * ldy;
            for (int c = 0; c < ncols; c++) dst[c] = to_bf16(s[c]);
        }
    }
}

int flock_amx_gemm_init(void) { return amx_request_tiles(); }

// As gemm_bf16.c's flock_gemm, for K % 32 == 0. Returns 0; 1 for a K it does not take; 2 where an emulated
// tile operation met shapes the CPU would refuse.
int flock_gemm(const bf16 *x, int64_t ldx, const int32_t *packed, void *y, int64_t ldy, int64_t m, int64_t n,
               int64_t k, int32_t out, int32_t threads) {
    if (k % 32) return 1;
    const int64_t cols = out == OUT_GLU ? NC / 2 : NC, blocks = (n + cols - 1) / cols, row_tiles = (m + 15) / 16;
    const int64_t tasks = blocks * row_tiles, panel_tasks = blocks * PANEL_TILES;
    int faulted = 0;
#pragma omp parallel num_threads(threads) if(threads > 1 && tasks > 1)
    {
        float sums[16 * NC] __attribute__((aligned(64)));
        int configured = 0;  // the row count the tiles hold
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t i = tasks * t / nt; i < tasks * (t + 1) / nt; i++) {
            const int64_t panel = i / panel_tasks, first = panel * PANEL_TILES, j = i - panel * panel_tasks;
            const int64_t tiles = row_tiles - first < PANEL_TILES ? row_tiles - first : PANEL_TILES;
            const int64_t block = j / tiles, r0 = (first + j % tiles) * 16;
            const int rows = m - r0 < 16 ? (int)(m - r0) : 16;
            const int ncols = n - block * cols < cols ? (int)(n - block * cols) : (int)cols;
            if (rows != configured) amx_configure_bf16(configured = rows);
            amx_bf16_x64(x + r0 * ldx, ldx, packed + block * (k / 2) * NC, k, sums);
            const int64_t at = r0 * ldy + block * cols;
            write_rows(sums, rows, ncols, out, out == OUT_F32 ? (void *)((float *)y + at) : (void *)((bf16 *)y + at),
                       ldy);
        }
        if (configured) TILE_RELEASE();
        if (TILE_FAULTED()) {
#pragma omp atomic write
            faulted = 1;
        }
    }
    return faulted ? 2 : 0;
}
