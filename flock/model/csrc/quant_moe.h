// A mixture-of-experts layer on the quantized kernels, part of quant_gemm.c (included after flock_qgemm): the
// router's top k experts of each token, their SiLU-and-mul MLPs and the weighted sum, in one call whose threads
// start once. The experts' MLPs are those of flock_qgemm (the same tiles, so each (token, expert) row is the
// same bits as a call of its own); what one call saves is the per-expert calls' thread starts, quantization and
// Python between them: most of a decode step's mixture layer on a model of small experts.

#include "moe_route.h"

// A layer's experts: each one's [gate | up] (2 inter rows of hidden) and down (hidden rows of inter) blocks, one
// quant type each, as int64 addresses, and how its router chooses them
typedef struct {
    int64_t gate_up_type, gate_up_x8, gate_up_row_bytes, down_type, down_x8, down_row_bytes;
    const int64_t *gate_up, *down;
    int64_t hidden, inter;
    MoeRouter router;
} MoeLayer;

// One GEMM of every run's pairs by its expert's weights (`w`: each expert's blocks; n outputs, k inputs), inside
// the parallel region: xq's pair rows (act_row bytes each) in, y's out (dtype rows of n). Runs of AMX_ROWS pairs
// or more take the AMX tiles (AMX builds); the rest, bands of one expert's weights, go to the vector tiles as
// threads come free. Returns nonzero as flock_qgemm does.
static int experts_gemm(const MoeRoute *R, int type, int x8, const int64_t *w, int64_t row_bytes, int64_t n,
                        int64_t k, const uint8_t *xq, int64_t act_row, void *y, int out_bf16, int glu, int threads) {
    const int64_t nb = k / block_size(type), bands = (n + NT - 1) / NT;
    int failed = 0;
#ifdef AMX_TILES
    for (int64_t r = 0; r < R->runs; r++) {
        const int64_t p0 = R->run_start[r], rows = R->run_start[r + 1] - p0;
        if (!ON_TILES(type, x8, rows)) continue;
        const uint8_t *we = (const uint8_t *)(intptr_t)w[R->run_expert[r]];
        const int code = amx_gemm(type, we, row_bytes, n, xq + p0 * act_row, act_row, nb, rows,
                                  (uint8_t *)y + p0 * n * (out_bf16 ? 2 : 4), n, out_bf16, glu);
        if (code) failed = code < 0 ? -1 : -2;
    }
#endif
    const int64_t units = R->runs * bands, chunk = bands_per_task(R->pairs / (R->runs ? R->runs : 1) / MT + 1,
                                                                  units, threads);
#pragma omp for schedule(dynamic, chunk)
    for (int64_t i = 0; i < units; i++) {
        const int64_t r = i / bands, n0 = i % bands * NT, p0 = R->run_start[r], p1 = R->run_start[r + 1];
        if (ON_TILES(type, x8, p1 - p0)) continue;
        const uint8_t *we = (const uint8_t *)(intptr_t)w[R->run_expert[r]];
        for (int64_t m0 = p0; m0 < p1; m0 += MT) {
            const int rows = p1 - m0 < MT ? (int)(p1 - m0) : MT;
            const void *x[MT];
            for (int j = 0; j < rows; j++) x[j] = xq + (m0 + j) * act_row;
            vector_tile(type, x8, we, row_bytes, n, n0, nb, m0 == p0, x, rows, y, m0 * n, n, out_bf16, glu);
        }
    }
    return failed;
}

// y (m rows, ldy apart) = the layer's mixture for the m tokens x (ldx apart) given their router logits (ld
// apart): each token's top k experts' silu(x Wg^T) * (x Wu^T) Wd^T, each rounded to the dtype, times its weight
// (rounded so), added up in expert order (each sum rounded so). x, logits and y are bf16 with is_bf16, else
// float32. y may be x: every token is quantized before anything is written. Returns -1 where memory cannot be
// had, -2 where an emulated tile operation met shapes the CPU would refuse.
int32_t flock_qmoe(const MoeLayer *L, const void *x, int64_t ldx, const void *logits, int64_t ld, int32_t is_bf16,
                   int64_t m, void *y, int64_t ldy, int32_t threads) {
    MoeRoute R;
    if (moe_route(&L->router, logits, ld, is_bf16, m, &R)) return -1;
    const int64_t P = R.pairs, size = is_bf16 ? 2 : 4;
    const int64_t gu_row = act_row_bytes((int)L->gate_up_type, L->hidden), d_row = act_row_bytes((int)L->down_type,
                                                                                                 L->inter);
    uint8_t *xq = malloc((size_t)((P + 15) * gu_row)), *hq = malloc((size_t)((P + 15) * d_row));  // whole AMX tiles
    void *h = malloc((size_t)(P * L->inter * size)), *ys = malloc((size_t)(P * L->hidden * size));
    int failed = xq && hq && h && ys ? 0 : -1;
    if (!failed) {
        // every thread meets every worksharing loop below, whatever its own GEMMs returned
#pragma omp parallel num_threads(threads) if(threads > 1)
        {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < P; p++)
                quantize_row((const uint8_t *)x + R.token[p] * ldx * size, 0, is_bf16, 0, L->hidden,
                             (int)L->gate_up_type, xq + p * gu_row);
            const int gate_up = experts_gemm(&R, (int)L->gate_up_type, (int)L->gate_up_x8, L->gate_up,
                                             L->gate_up_row_bytes, L->inter, L->hidden, xq, gu_row, h, is_bf16, 1,
                                             threads);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < P; p++)
                quantize_row(h, L->inter, is_bf16, p, L->inter, (int)L->down_type, hq);
            const int down = experts_gemm(&R, (int)L->down_type, (int)L->down_x8, L->down, L->down_row_bytes,
                                          L->hidden, L->inter, hq, d_row, ys, is_bf16, 0, threads);
            moe_weighted_sum(&R, ys, L->hidden, is_bf16, m, y, ldy);
            if (gate_up || down) {
#pragma omp atomic write
                failed = gate_up ? gate_up : down;
            }
        }
    }
    free(xq), free(hq), free(h), free(ys), moe_free_route(&R);
    return failed;
}

// flock_qmoe as a step-program op (flock/model/program.py): its arguments as int64 words, in order.
int32_t flock_qmoe_op(const int64_t *a) {
    return flock_qmoe((const MoeLayer *)(intptr_t)a[0], (const void *)(intptr_t)a[1], a[2],
                      (const void *)(intptr_t)a[3], a[4], (int32_t)a[5], a[6], (void *)(intptr_t)a[7], a[8],
                      (int32_t)a[9]);
}
