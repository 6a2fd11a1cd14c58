// A mixture-of-experts layer on the quantized kernels, part of quant_gemm.c (included after flock_qgemm): the
// router's top k experts of each token, their SiLU-and-mul MLPs and the weighted sum, in one call whose threads
// start once. The experts' MLPs are those of flock_qgemm (the same tiles, so each (token, expert) row is the
// same bits as a call of its own); what one call saves is the per-expert calls' thread starts, quantization and
// Python between them: most of a decode step's mixture layer on a model of small experts.

// A layer's experts: each one's [gate | up] (2 inter rows of hidden) and down (hidden rows of inter) blocks, one
// quant type each, as int64 addresses; the router's choice (top_k by the float32 softmax, renormalized or not)
typedef struct {
    int64_t gate_up_type, gate_up_x8, gate_up_row_bytes, down_type, down_x8, down_row_bytes;
    const int64_t *gate_up, *down;
    int64_t hidden, inter, experts, top_k, renormalize, float32_weights;
} MoeLayer;

typedef struct {  // a step's (token, expert) pairs, sorted by expert (stable), and the experts' runs of them
    int64_t *token, *run_start, *run_expert;  // run_start[runs]: the pairs' count
    float *weight;
    int64_t pairs, runs;
} MoeRoute;

static inline void store_x(void *v, int64_t at, float value, int is_bf16) {
    if (is_bf16) ((bf16 *)v)[at] = f32_to_bf16(value);
    else ((float *)v)[at] = value;
}

static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// Token t's top k experts and weights from its router logits: the float32 softmax, the k largest (the lower
// expert first among equals, largest first), divided by their sum with renormalize; rounded to bf16 as the
// model's dtype unless the model keeps float32 weights (Mixtral).
static void route_token(const MoeLayer *L, const void *logits, int64_t at, int is_bf16, int64_t *chosen,
                        float *weight) {
    const int64_t E = L->experts;
    float p[E], max = -INFINITY, sum = 0.0f;
    char taken[E];
    for (int64_t e = 0; e < E; e++) p[e] = load_x(logits, at + e, is_bf16), max = fmaxf(max, p[e]), taken[e] = 0;
    for (int64_t e = 0; e < E; e++) p[e] = expf(p[e] - max), sum += p[e];
    float kept = 0.0f;
    for (int64_t j = 0; j < L->top_k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        chosen[j] = best, weight[j] = p[best] / sum, taken[best] = 1;
        kept += weight[j];
    }
    for (int64_t j = 0; j < L->top_k; j++) {
        if (L->renormalize) weight[j] /= kept;
        if (is_bf16 && !L->float32_weights) weight[j] = round_bf16(weight[j]);
    }
}

// The m tokens' pairs sorted by expert (a counting sort: each expert's pairs in token order); 0, or -1 where
// memory cannot be had.
static int route(const MoeLayer *L, const void *logits, int64_t ld, int is_bf16, int64_t m, MoeRoute *R) {
    const int64_t P = m * L->top_k, E = L->experts;
    int64_t *chosen = malloc((size_t)P * sizeof(int64_t)), *count = calloc((size_t)E + 1, sizeof(int64_t));
    float *weight = malloc((size_t)P * sizeof(float));
    R->token = malloc((size_t)P * sizeof(int64_t)), R->weight = malloc((size_t)P * sizeof(float));
    R->run_start = malloc((size_t)(E + 1) * sizeof(int64_t)), R->run_expert = malloc((size_t)E * sizeof(int64_t));
    R->pairs = P, R->runs = 0;
    const int ok = chosen && count && weight && R->token && R->weight && R->run_start && R->run_expert;
    if (ok) {
        for (int64_t t = 0; t < m; t++) route_token(L, logits, t * ld, is_bf16, chosen + t * L->top_k,
                                                     weight + t * L->top_k);
        for (int64_t i = 0; i < P; i++) count[chosen[i] + 1]++;
        for (int64_t e = 0; e < E; e++) {
            if (count[e + 1]) R->run_start[R->runs] = count[e], R->run_expert[R->runs++] = e;
            count[e + 1] += count[e];  // count[e]: where expert e's pairs start
        }
        R->run_start[R->runs] = P;
        for (int64_t i = 0; i < P; i++) {
            const int64_t at = count[chosen[i]]++;
            R->token[at] = i / L->top_k, R->weight[at] = weight[i];
        }
    }
    free(chosen), free(count), free(weight);
    return ok ? 0 : -1;
}

static void free_route(MoeRoute *R) { free(R->token), free(R->weight), free(R->run_start), free(R->run_expert); }

// One GEMM of every run's pairs by its expert's weights (`w`: each expert's blocks; n outputs, k inputs), inside
// the parallel region: hq's pair rows (act_row bytes each) in, y's out (dtype rows of n). Runs of AMX_ROWS pairs
// or more take the AMX tiles (AMX builds); the rest, bands of one expert's weights, go to the vector tiles as
// threads come free. Returns nonzero as flock_qgemm does.
#ifdef AMX_TILES
#define ON_TILES(x8, rows) ((x8) && (rows) >= AMX_ROWS)
#else
#define ON_TILES(x8, rows) 0
#endif

static int experts_gemm(const MoeRoute *R, int type, int x8, const int64_t *w, int64_t row_bytes, int64_t n,
                        int64_t k, const uint8_t *xq, int64_t act_row, void *y, int out_bf16, int glu, int threads) {
    const int64_t nb = k / block_size(type), bands = (n + NT - 1) / NT;
    int failed = 0;
#ifdef AMX_TILES
    for (int64_t r = 0; r < R->runs; r++) {
        const int64_t p0 = R->run_start[r], rows = R->run_start[r + 1] - p0;
        if (!ON_TILES(x8, rows)) continue;
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
        if (ON_TILES(x8, p1 - p0)) continue;
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

static int64_t act_row_bytes(int type, int64_t k) {
    return k / block_size(type) * (block_size(type) == 32 ? (int64_t)sizeof(act32) : (int64_t)sizeof(act256));
}

// y (m rows, ldy apart) = the layer's mixture for the m tokens x (ldx apart) given their router logits (ld
// apart): each token's top k experts' silu(x Wg^T) * (x Wu^T) Wd^T, each rounded to the dtype, times its weight
// (rounded so), added up in expert order (each sum rounded so). x, logits and y are bf16 with is_bf16, else
// float32. y may be x: every token is quantized before anything is written. Returns -1 where memory cannot be
// had, -2 where an emulated tile operation met shapes the CPU would refuse.
int32_t flock_qmoe(const MoeLayer *L, const void *x, int64_t ldx, const void *logits, int64_t ld, int32_t is_bf16,
                   int64_t m, void *y, int64_t ldy, int32_t threads) {
    MoeRoute R;
    if (route(L, logits, ld, is_bf16, m, &R)) return free_route(&R), -1;
    const int64_t P = R.pairs, size = is_bf16 ? 2 : 4;
    const int64_t gu_row = act_row_bytes((int)L->gate_up_type, L->hidden), d_row = act_row_bytes((int)L->down_type,
                                                                                                 L->inter);
    uint8_t *xq = malloc((size_t)((P + 15) * gu_row)), *hq = malloc((size_t)((P + 15) * d_row));  // whole AMX tiles
    void *h = malloc((size_t)(P * L->inter * size)), *ys = malloc((size_t)(P * L->hidden * size));
    int failed = xq && hq && h && ys ? 0 : -1;
#pragma omp parallel num_threads(threads) if(threads > 1 && !failed)
    {
        int code = 0;
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < P; p++)
                quantize_row((const uint8_t *)x + R.token[p] * ldx * size, 0, is_bf16, 0, L->hidden,
                             (int)L->gate_up_type, xq + p * gu_row);
            code = experts_gemm(&R, (int)L->gate_up_type, (int)L->gate_up_x8, L->gate_up, L->gate_up_row_bytes,
                                L->inter, L->hidden, xq, gu_row, h, is_bf16, 1, threads);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < P; p++)
                quantize_row(h, L->inter, is_bf16, p, L->inter, (int)L->down_type, hq);
            code = code ? code : experts_gemm(&R, (int)L->down_type, (int)L->down_x8, L->down, L->down_row_bytes,
                                              L->hidden, L->inter, hq, d_row, ys, is_bf16, 0, threads);
            // the weighted sum, its columns split over the threads, each token's pairs added in expert order
#pragma omp for schedule(static)
            for (int64_t c0 = 0; c0 < L->hidden; c0 += 64) {
                const int64_t c1 = c0 + 64 < L->hidden ? c0 + 64 : L->hidden;
                for (int64_t t = 0; t < m; t++)
                    for (int64_t c = c0; c < c1; c++) store_x(y, t * ldy + c, 0.0f, is_bf16);
                for (int64_t p = 0; p < P; p++) {
                    const int64_t t = R.token[p];
                    for (int64_t c = c0; c < c1; c++) {
                        float term = load_x(ys, p * L->hidden + c, is_bf16) * R.weight[p];
                        float sum = load_x(y, t * ldy + c, is_bf16) + (is_bf16 ? round_bf16(term) : term);
                        store_x(y, t * ldy + c, sum, is_bf16);
                    }
                }
            }
        }
        if (code) {
#pragma omp atomic write
            failed = code;
        }
    }
    free(xq), free(hq), free(h), free(ys), free_route(&R);
    return failed;
}

// flock_qmoe as a step-program op (flock/model/program.py): its arguments as int64 words, in order.
int32_t flock_qmoe_op(const int64_t *a) {
    return flock_qmoe((const MoeLayer *)(intptr_t)a[0], (const void *)(intptr_t)a[1], a[2],
                      (const void *)(intptr_t)a[3], a[4], (int32_t)a[5], a[6], (void *)(intptr_t)a[7], a[8],
                      (int32_t)a[9]);
}
