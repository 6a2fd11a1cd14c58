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
    for (int64_t r = 0; r < R.runs && !failed; r++) {
        const int64_t p0 = R.run_start[r], rows = R.run_start[r + 1] - p0, e = R.run_expert[r];
        failed = flock_gemm(xs + p0 * H, H, (const int32_t *)(intptr_t)L->gate_up[e], h + p0 * I, I, rows, I, H,
                            OUT_GLU, threads);
        failed = failed ? failed : flock_gemm(h + p0 * I, I, (const int32_t *)(intptr_t)L->down[e], ys + p0 * H, H,
                                              rows, H, I, OUT_BF16, threads);
    }
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
