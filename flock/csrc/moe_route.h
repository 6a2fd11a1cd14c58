// A mixture-of-experts layer's routing and weighted sum, for the kernels that run its experts in one call
// (quant_moe.h on quantized experts, gemm_moe.h on bf16 ones). Tokens, logits and outputs are bf16 (is_bf16)
// or float32.
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

typedef struct {  // how a layer's router chooses: the top_k of experts by the float32 softmax
    int64_t experts, top_k, renormalize, float32_weights;
} MoeRouter;

typedef struct {  // a step's (token, expert) pairs, sorted by expert (stable), and the experts' runs of them
    int64_t *token, *run_start, *run_expert;  // run_start[runs]: the pairs' count
    float *weight;
    int64_t pairs, runs;
} MoeRoute;

static inline float moe_load(const void *v, int64_t at, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)v)[at]) : ((const float *)v)[at];
}

static inline void moe_store(void *v, int64_t at, float value, int is_bf16) {
    if (is_bf16) ((uint16_t *)v)[at] = f32_to_bf16(value);
    else ((float *)v)[at] = value;
}

static inline float moe_round(float v, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

// A token's top k experts and weights from its router logits: the float32 softmax, the k largest (the lower
// expert first among equals, largest first), divided by their sum with renormalize; rounded to bf16 as the
// model's dtype unless the model keeps float32 weights (Mixtral).
static void moe_route_token(const MoeRouter *L, const void *logits, int64_t at, int is_bf16, int64_t *chosen,
                            float *weight) {
    const int64_t E = L->experts;
    float p[E], max = -INFINITY, sum = 0.0f, kept = 0.0f;
    char taken[E];
    for (int64_t e = 0; e < E; e++) p[e] = moe_load(logits, at + e, is_bf16), max = fmaxf(max, p[e]), taken[e] = 0;
    for (int64_t e = 0; e < E; e++) p[e] = expf(p[e] - max), sum += p[e];
    for (int64_t j = 0; j < L->top_k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        chosen[j] = best, weight[j] = p[best] / sum, taken[best] = 1;
        kept += weight[j];
    }
    for (int64_t j = 0; j < L->top_k; j++) {
        if (L->renormalize) weight[j] /= kept;
        if (!L->float32_weights) weight[j] = moe_round(weight[j], is_bf16);
    }
}

static void moe_free_route(MoeRoute *R) { free(R->token), free(R->weight), free(R->run_start), free(R->run_expert); }

// The m tokens' pairs sorted by expert (a counting sort: each expert's pairs in token order); 0, or -1 where
// memory cannot be had (R freed).
static int moe_route(const MoeRouter *L, const void *logits, int64_t ld, int is_bf16, int64_t m, MoeRoute *R) {
    const int64_t P = m * L->top_k, E = L->experts;
    int64_t *chosen = malloc((size_t)P * sizeof(int64_t) + 1), *count = calloc((size_t)E + 1, sizeof(int64_t));
    float *weight = malloc((size_t)P * sizeof(float) + 1);
    R->token = malloc((size_t)P * sizeof(int64_t) + 1), R->weight = malloc((size_t)P * sizeof(float) + 1);
    R->run_start = malloc((size_t)(E + 1) * sizeof(int64_t)), R->run_expert = malloc((size_t)E * sizeof(int64_t));
    R->pairs = P, R->runs = 0;
    const int ok = chosen && count && weight && R->token && R->weight && R->run_start && R->run_expert;
    if (ok) {
        for (int64_t t = 0; t < m; t++)
            moe_route_token(L, logits, t * ld, is_bf16, chosen + t * L->top_k, weight + t * L->top_k);
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
    if (!ok) moe_free_route(R);
    return ok ? 0 : -1;
}

// y (m rows of hidden, ldy apart) = each token's pairs' expert outputs ys (rows of hidden, in pair order) times
// their weights, each product rounded to the dtype, added up in expert order (each sum rounded so). Columns are
// split over the threads of the enclosing parallel region (all of them call it).
static void moe_weighted_sum(const MoeRoute *R, const void *ys, int64_t hidden, int is_bf16, int64_t m, void *y,
                             int64_t ldy) {
#pragma omp for schedule(static)
    for (int64_t c0 = 0; c0 < hidden; c0 += 64) {
        const int64_t c1 = c0 + 64 < hidden ? c0 + 64 : hidden;
        for (int64_t t = 0; t < m; t++)
            for (int64_t c = c0; c < c1; c++) moe_store(y, t * ldy + c, 0.0f, is_bf16);
        for (int64_t p = 0; p < R->pairs; p++) {
            const int64_t at = R->token[p] * ldy;
            for (int64_t c = c0; c < c1; c++) {
                const float term = moe_round(moe_load(ys, p * hidden + c, is_bf16) * R->weight[p], is_bf16);
                moe_store(y, at + c, moe_load(y, at + c, is_bf16) + term, is_bf16);
            }
        }
    }
}
