// A mixture-of-experts layer on the bf16 GEMM, part of gemm_bf16.c and gemm_amx.c (included after their
// flock_gemm): the router's top k experts of each token, each expert's run of tokens through its SiLU-and-mul
// gate_up and its down GEMM, and the weighted sum, in one call: no Python between the experts' GEMMs, and the
// layer inside the step program.
#include <stdlib.h>
#include <string.h>

#include "moe_route.h"

// A layer's experts: each one's packed [gate | up] (glu, inter outputs) and down (hidden outputs) weights, as
// int64 addresses, and how its router chooses them
typedef struct {
    const int64_t *gate_up, *down;
    int64_t hidden, inter;
    MoeRouter router;
} GemmMoeLayer;

// Each run's rows of x (k wide, in pair order) times its expert's packed weight (`weights`) into y (n wide):
// the bits of a flock_gemm call per run. On the AVX512-BF16 GEMM (GEMM_TILES) every run's tiles are split evenly
// over the threads of one parallel region; the AMX GEMM takes a call per run.
static int runs_gemm(const MoeRoute *R, const int64_t *weights, const bf16 *x, int64_t k, void *y, int64_t n,
                     int32_t out, int32_t threads) {
#ifdef GEMM_TILES
    int64_t *first = malloc((size_t)(R->runs + 1) * sizeof(int64_t));  // each run's first tile
    if (!first) return -1;
    first[0] = 0;
    for (int64_t r = 0; r < R->runs; r++)
        first[r + 1] = first[r] + gemm_tiles(R->run_start[r + 1] - R->run_start[r], n, out);
    const int64_t tiles = first[R->runs], size = out == OUT_F32 ? 4 : 2;
#pragma omp parallel num_threads(threads) if(threads > 1 && tiles > 1)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t r = 0;
        for (int64_t i = tiles * t / nt; i < tiles * (t + 1) / nt; i++) {
            while (i >= first[r + 1]) r++;
            const int64_t p0 = R->run_start[r];
            gemm_tile(x + p0 * k, k, (const int32_t *)(intptr_t)weights[R->run_expert[r]], (uint8_t *)y + p0 * n * size,
                      n, R->run_start[r + 1] - p0, n, k / 2, out, i - first[r]);
        }
    }
    free(first);
    return 0;
#else
    for (int64_t r = 0; r < R->runs; r++) {
        const int64_t p0 = R->run_start[r], rows = R->run_start[r + 1] - p0;
        const int failed = flock_gemm(x + p0 * k, k, (const int32_t *)(intptr_t)weights[R->run_expert[r]],
                                      (bf16 *)y + p0 * n, n, rows, n, k, out, threads);
        if (failed) return failed;
    }
    return 0;
#endif
}

// y (m rows, ldy apart) = the layer's mixture for the m bf16 tokens x (ldx apart) given their bf16 router logits
// (ld apart), as quant_moe.h's flock_qmoe on bf16 weights (is_bf16 must be 1). y may be x. Returns 0, -1 where
// memory cannot be had, -3 for float32, else flock_gemm's code.
int32_t flock_gemm_moe(const GemmMoeLayer *L, const bf16 *x, int64_t ldx, const bf16 *logits, int64_t ld,
                       int32_t is_bf16, int64_t m, bf16 *y, int64_t ldy, int32_t threads) {
    if (!is_bf16) return -3;
    MoeRoute R;
    if (moe_route(&L->router, logits, ld, 1, m, &R)) return -1;
    const int64_t P = R.pairs, H = L->hidden, I = L->inter;
    bf16 *xs = malloc((size_t)(P * H) * sizeof(bf16) + 2), *h = malloc((size_t)(P * I) * sizeof(bf16) + 2);
    bf16 *ys = malloc((size_t)(P * H) * sizeof(bf16) + 2);
    int failed = xs && h && ys ? 0 : -1;
    for (int64_t p = 0; p < P && !failed; p++) memcpy(xs + p * H, x + R.token[p] * ldx, (size_t)H * sizeof(bf16));
    failed = failed ? failed : runs_gemm(&R, L->gate_up, xs, H, h, I, OUT_GLU, threads);
    failed = failed ? failed : runs_gemm(&R, L->down, h, I, ys, H, OUT_BF16, threads);
    if (!failed) {
#pragma omp parallel num_threads(threads) if(threads > 1 && m * H >= 16384)
        moe_weighted_sum(&R, ys, H, 1, m, y, ldy);
    }
    free(xs), free(h), free(ys), moe_free_route(&R);
    return failed;
}

// flock_gemm_moe as a step-program op (flock/model/program.py): its arguments as int64 words, in order.
int32_t flock_gemm_moe_op(const int64_t *a) {
    return flock_gemm_moe((const GemmMoeLayer *)(intptr_t)a[0], (const bf16 *)(intptr_t)a[1], a[2],
                          (const bf16 *)(intptr_t)a[3], a[4], (int32_t)a[5], a[6], (bf16 *)(intptr_t)a[7], a[8],
                          (int32_t)a[9]);
}
