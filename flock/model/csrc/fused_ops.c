// Fused elementwise ops of the Llama decoder (flock/model/fused_ops.py) for bf16 and fp32 rows, on `threads`
// threads of PyTorch's OpenMP pool (torch.get_num_threads()) when a call has enough elements, else on the
// calling thread.
//
// Each op rounds where the plain PyTorch ops it replaces (flock/model/llama.py, rope.py) round: a bf16 result
// of PyTorch is a float result rounded to bf16 (nearest even), so every intermediate PyTorch stores as a bf16
// tensor is rounded here too (ROUND). Built with -ffp-contract=off (no implicit fused multiply-adds; exp's
// polynomial uses explicit ones where the ISA has FMA), so products and sums round as PyTorch's do: RoPE and
// the residual add are bit-exact; RMSNorm sums its squares in another order and SiLU uses its own exp, so a
// rounding of theirs may flip (a unit or two in the last place, rarely).
// Compiled once per ISA (AVX-512, AVX2 or baseline flags, chosen at run time); gcc vectorizes the loops. Built
// with -fno-trapping-math too: exp's range checks are selects that gcc would otherwise keep as branches (a
// multiply under a condition "could trap"), leaving SiLU scalar.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef uint16_t bf16;

#define PARALLEL_MIN 32768  // elements per call below which waking the thread pool costs more than it saves
// the loop after it, on `threads` threads when the call's `work` (elements) is worth it
#define PARALLEL_FOR _Pragma("omp parallel for schedule(static) num_threads(threads) if(work >= PARALLEL_MIN)")

static inline float bf16_load(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 bf16_store(float f) {  // round to nearest even; NaN stays a quiet NaN (as c10::BFloat16)
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? (bf16)((u >> 16) | 0x40u) : (bf16)rounded;
}

static inline float f32_load(float f) { return f; }
static inline float f32_store(float f) { return f; }

static inline float pow2i(int32_t n) {  // 2^n for n in [-126, 127]
    uint32_t u = (uint32_t)(n + 127) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#ifdef __FMA__
#define FMA(a, b, c) fmaf(a, b, c)
#else
#define FMA(a, b, c) ((a) * (b) + (c))  // the baseline build: no FMA unit to use, and libm's fmaf is a call
#endif

static inline float exp_approx(float x) {  // e^x within ~1 ulp (Cephes expf); inf above, 0 below the float range
    float xc = x < -87.33654f ? -87.33654f : x;
    xc = xc > 88.72284f ? 88.72284f : xc;
    float n = FMA(xc, 1.44269504f, 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
    float r = FMA(n, -0.693359375f, xc);
    r = FMA(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = FMA(p, r, 1.3981999507e-3f);
    p = FMA(p, r, 8.3334519073e-3f);
    p = FMA(p, r, 4.1665795894e-2f);
    p = FMA(p, r, 1.6666665459e-1f);
    p = FMA(p, r, 5.0000001201e-1f);
    float y = FMA(p * r, r, r) + 1.0f;
    int32_t k = (int32_t)n;  // in [-126, 128]: 2^128 as 2^127 * 2
    y = y * pow2i(k > 127 ? 127 : k) * (k > 127 ? 2.0f : 1.0f);
    y = x > 88.72284f ? INFINITY : y;
    return x < -87.33654f ? 0.0f : y;
}

static inline float silu(float g) { return g / (1.0f + exp_approx(-g)); }

// GELU's tanh approximation (Gemma's GeGLU): g (1 + tanh(z)) / 2 = g e / (1 + e), e = e^2z, z = sqrt(2 / pi) (g +
// 0.044715 g^3): no cancellation in 1 + tanh(z) far below 0, where PyTorch's loses its digits; -inf gives NaN, as
// PyTorch's. e / (1 + e) is 1 from 80 on (never inf / inf), 0 below the float range (not exp_approx's clamp).
static inline float gelu_tanh(float g) {
    float a = 1.5957691216f * (g + 0.044715f * g * g * g);
    float e = a < -87.0f ? 0.0f : exp_approx(a < 80.0f ? a : 80.0f);
    return g == -INFINITY ? NAN : g * (e / (1.0f + e));
}

// out = act(gate) * up of rows [gate | up], each `cols` wide, act's result rounded as PyTorch's tensor of it
#define ACT_AND_MUL(OP, NAME, T, LOAD, STORE, ACT)                                                            \
    void flock_##OP##_##NAME(const T *x, int64_t x_stride, T *out, int64_t out_stride, int64_t rows,          \
                             int64_t cols, int32_t threads) {                                                 \
        int64_t work = rows * cols;                                                                           \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++) {                                                                  \
            const T *gate = x + i * x_stride, *up = gate + cols;                                              \
            T *o = out + i * out_stride;                                                                      \
            _Pragma("omp simd")                                                                               \
            for (int64_t j = 0; j < cols; j++) o[j] = STORE(NAME##_round(ACT(LOAD(gate[j]))) * LOAD(up[j]));   \
        }                                                                                                     \
    }

#define DEFINE_OPS(NAME, T, LOAD, STORE)                                                                      \
    static inline float NAME##_round(float v) { return LOAD(STORE(v)); }                                      \
                                                                                                              \
    static inline void NAME##_normalize(const T *x, const T *w, T *out, int64_t cols, float sum, float eps) {  \
        float inv = 1.0f / sqrtf(sum / (float)cols + eps);                                                    \
        _Pragma("omp simd")                                                                                   \
        for (int64_t j = 0; j < cols; j++)                                                                    \
            out[j] = STORE(LOAD(w[j]) * NAME##_round(LOAD(x[j]) * inv));                                      \
    }                                                                                                         \
                                                                                                              \
    /* out = weight * (x / rms(x)) for one row of `cols`, statistics in fp32 (out may be x) */                \
    static inline void NAME##_norm_row(const T *x, const T *w, T *out, int64_t cols, float eps) {             \
        float sum = 0.0f;                                                                                     \
        _Pragma("omp simd reduction(+:sum)")                                                                  \
        for (int64_t j = 0; j < cols; j++) {                                                                  \
            float v = LOAD(x[j]);                                                                             \
            sum += v * v;                                                                                     \
        }                                                                                                     \
        NAME##_normalize(x, w, out, cols, sum, eps);                                                          \
    }                                                                                                         \
                                                                                                              \
    void flock_rms_norm_##NAME(const T *x, int64_t x_stride, T *out, int64_t out_stride, const T *w,          \
                               int64_t rows, int64_t cols, float eps, int32_t threads) {                      \
        int64_t work = rows * cols;                                                                           \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++)                                                                    \
            NAME##_norm_row(x + i * x_stride, w, out + i * out_stride, cols, eps);                            \
    }                                                                                                         \
                                                                                                              \
    /* x = weight * (x / rms(x)) in place for each of the `heads` head_dim-wide vectors that begin each row   \
       (Qwen3's norms of q and k) */                                                                          \
    void flock_head_rms_norm_##NAME(T *x, int64_t x_stride, const T *w, int64_t rows, int32_t heads,          \
                                    int32_t head_dim, float eps, int32_t threads) {                           \
        int64_t work = rows * heads * head_dim;                                                               \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++)                                                                    \
            for (int32_t h = 0; h < heads; h++) {                                                             \
                T *xh = x + i * x_stride + (int64_t)h * head_dim;                                             \
                NAME##_norm_row(xh, w, xh, head_dim, eps);                                                    \
            }                                                                                                 \
    }                                                                                                         \
                                                                                                              \
    /* residual = x + residual; x = weight * (residual / rms(residual)); both in place */                     \
    void flock_add_rms_norm_##NAME(T *x, int64_t x_stride, T *residual, int64_t res_stride, const T *w,       \
                                   int64_t rows, int64_t cols, float eps, int32_t threads) {                  \
        int64_t work = rows * cols;                                                                           \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++) {                                                                  \
            T *xr = x + i * x_stride, *rr = residual + i * res_stride;                                        \
            float sum = 0.0f;                                                                                 \
            _Pragma("omp simd reduction(+:sum)")                                                              \
            for (int64_t j = 0; j < cols; j++) {                                                              \
                T s = STORE(LOAD(xr[j]) + LOAD(rr[j]));                                                       \
                rr[j] = s;                                                                                    \
                float v = LOAD(s);                                                                            \
                sum += v * v;                                                                                 \
            }                                                                                                 \
            NAME##_normalize(rr, w, xr, cols, sum, eps);                                                     \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    /* Rotate-half rotary embedding, in place, on the first `heads` heads of each row (q then k of a fused  \
       qkv row): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, each product rounded as PyTorch's, over the    \
       first rotary_dim dims of each head (a partial rotary factor: the rest pass as they are). */            \
    void flock_rope_##NAME(T *x, int64_t x_stride, const int64_t *positions, const T *cos, const T *sin,     \
                           int64_t table_stride, int64_t rows, int32_t heads, int32_t head_dim,               \
                           int32_t rotary_dim, int32_t threads) {                                             \
        int32_t half = rotary_dim / 2;                                                                        \
        int64_t work = rows * heads * head_dim;                                                               \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++) {                                                                  \
            const T *c = cos + positions[i] * table_stride, *s = sin + positions[i] * table_stride;          \
            for (int32_t h = 0; h < heads; h++) {                                                             \
                T *lo = x + i * x_stride + (int64_t)h * head_dim, *hi = lo + half;                            \
                _Pragma("omp simd")                                                                           \
                for (int32_t j = 0; j < half; j++) {                                                          \
                    float x1 = LOAD(lo[j]), x2 = LOAD(hi[j]), cj = LOAD(c[j]), sj = LOAD(s[j]);              \
                    lo[j] = STORE(NAME##_round(x1 * cj) + NAME##_round(-x2 * sj));                            \
                    hi[j] = STORE(NAME##_round(x2 * cj) + NAME##_round(x1 * sj));                             \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    /* x *= factor in place (Granite's residual_multiplier on a block's output), rounded as PyTorch's */       \
    void flock_scale_##NAME(T *x, int64_t x_stride, int64_t rows, int64_t cols, float factor, int32_t threads) { \
        int64_t work = rows * cols;                                                                           \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++) {                                                                  \
            T *xr = x + i * x_stride;                                                                         \
            _Pragma("omp simd")                                                                               \
            for (int64_t j = 0; j < cols; j++) xr[j] = STORE(LOAD(xr[j]) * factor);                           \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    /* x += sigmoid(gate) * shared for each row, its gate one value (Qwen2-MoE's shared expert), each op       \
       rounded as PyTorch's */                                                                                \
    void flock_add_gated_##NAME(T *x, int64_t x_stride, const T *shared, int64_t s_stride, const T *gate,     \
                                int64_t g_stride, int64_t rows, int64_t cols, int32_t threads) {              \
        int64_t work = rows * cols;                                                                           \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++) {                                                                  \
            T *xr = x + i * x_stride;                                                                         \
            const T *sr = shared + i * s_stride;                                                              \
            const float g = NAME##_round(1.0f / (1.0f + exp_approx(-LOAD(gate[i * g_stride]))));              \
            _Pragma("omp simd")                                                                               \
            for (int64_t j = 0; j < cols; j++) xr[j] = STORE(LOAD(xr[j]) + NAME##_round(g * LOAD(sr[j])));    \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    ACT_AND_MUL(silu_and_mul, NAME, T, LOAD, STORE, silu)                                                     \
    ACT_AND_MUL(gelu_and_mul, NAME, T, LOAD, STORE, gelu_tanh)                                                \
                                                                                                              \
    /* row rows[i] of x keeps the columns whose bit is set in row i of mask (xgrammar's token bitmask: 32     \
       columns a word, the lowest bit first); the others become -inf */                                       \
    void flock_apply_bitmask_##NAME(T *x, int64_t x_stride, const int32_t *mask, int64_t mask_stride,         \
                                    const int64_t *rows, int64_t n, int64_t cols, int32_t threads) {          \
        int64_t work = n * cols;                                                                              \
        const T ninf = STORE(-INFINITY);                                                                      \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            T *r = x + rows[i] * x_stride;                                                                    \
            const uint32_t *m = (const uint32_t *)(mask + i * mask_stride);                                   \
            for (int64_t j0 = 0; j0 < cols; j0 += 32) {                                                       \
                uint32_t bits = m[j0 / 32];                                                                   \
                if (bits == 0xFFFFFFFFu) continue;                                                            \
                int64_t len = cols - j0 < 32 ? cols - j0 : 32;                                                \
                _Pragma("omp simd")                                                                           \
                for (int64_t b = 0; b < len; b++) r[j0 + b] = (bits >> b) & 1u ? r[j0 + b] : ninf;            \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
                                                                                                              \
    /* out[i] = the first index of row i's largest value, a NaN counting as the largest (torch.argmax) */     \
    void flock_argmax_##NAME(const T *x, int64_t x_stride, int64_t *out, int64_t rows, int64_t cols,          \
                             int32_t threads) {                                                               \
        int64_t work = rows * cols;                                                                           \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++) out[i] = first_max_##NAME(x + i * x_stride, cols);                 \
    }                                                                                                         \
                                                                                                              \
    /* out[i] = how many values of row i exceed v[i] (x > v, as PyTorch compares: a NaN on either side none) */ \
    void flock_count_above_##NAME(const T *x, int64_t x_stride, const float *v, int64_t *out, int64_t rows,   \
                                  int64_t cols, int32_t threads) {                                            \
        int64_t work = rows * cols;                                                                           \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++) {                                                                  \
            const T *r = x + i * x_stride;                                                                    \
            const float bound = v[i];                                                                         \
            int64_t above = 0;                                                                                \
            _Pragma("omp simd reduction(+:above)")                                                            \
            for (int64_t j = 0; j < cols; j++) above += LOAD(r[j]) > bound;                                   \
            out[i] = above;                                                                                   \
        }                                                                                                     \
    }

// First index of the largest value of row x (of a NaN, if it has one): one vectorized pass for the maximum
// (and whether a NaN is there), then a search by blocks of ARGMAX_BLOCK, each tested whole (vectorized: what
// it looks for known at compile time) before its scan.
#define ARGMAX_BLOCK 64
#define IS_FIRST(v, top, nan) ((nan) ? (v) != (v) : (v) == (top))
#define DEFINE_FIRST_MAX(NAME, T, LOAD)                                                                       \
    static inline __attribute__((always_inline)) int64_t first_of_##NAME(const T *x, int64_t n, float top,   \
                                                                         const int nan) {                     \
        for (int64_t j0 = 0; j0 < n; j0 += ARGMAX_BLOCK) {                                                    \
            int64_t j1 = j0 + ARGMAX_BLOCK < n ? j0 + ARGMAX_BLOCK : n;                                       \
            int hit = 0;                                                                                      \
            _Pragma("omp simd reduction(|:hit)")                                                              \
            for (int64_t j = j0; j < j1; j++) hit |= IS_FIRST(LOAD(x[j]), top, nan);                          \
            if (hit)                                                                                          \
                for (int64_t j = j0; j < j1; j++)                                                             \
                    if (IS_FIRST(LOAD(x[j]), top, nan)) return j;                                             \
        }                                                                                                     \
        return 0;  /* n == 0 */                                                                               \
    }                                                                                                         \
                                                                                                              \
    static int64_t first_max_##NAME(const T *x, int64_t n) {                                                 \
        float top = -INFINITY;                                                                                \
        int nan = 0;                                                                                          \
        _Pragma("omp simd reduction(max:top) reduction(|:nan)")                                               \
        for (int64_t j = 0; j < n; j++) {                                                                     \
            float v = LOAD(x[j]);                                                                             \
            nan |= v != v;                                                                                    \
            top = v > top ? v : top;                                                                          \
        }                                                                                                     \
        return nan ? first_of_##NAME(x, n, top, 1) : first_of_##NAME(x, n, top, 0);                           \
    }
DEFINE_FIRST_MAX(bf16, bf16, bf16_load)
DEFINE_FIRST_MAX(f32, float, f32_load)

// Draw one token of row x from softmax(x / temperature) by inverse transform sampling with the uniform u, as
// flock.sample.sampler.draw does in PyTorch: the weights e^(x/t - max) summed by chunks of SAMPLE_CHUNK, the
// chunk where the running sum first exceeds u times the total, then the token inside it (never one of weight
// 0). Returns -1 for a row it cannot draw from (a NaN, or no finite maximum): the caller decides then.
#define SAMPLE_CHUNK 256
// x / t as the draw scales it; `unit` (t == 1, the default temperature) skips the division, exactly.
#define SCALED(v, t, unit) ((unit) ? (v) : (v) / (t))
#define DEFINE_SAMPLE(NAME, T, LOAD)                                                                          \
    /* the largest x / t of row x: the largest x over t (division by t > 0 keeps the order, rounded too); NaN   \
       for a row holding a NaN or no finite maximum */                                                        \
    static inline __attribute__((always_inline)) float row_top_##NAME(const T *x, int64_t n, float t,         \
                                                                       const int unit) {                      \
        float top = -INFINITY;                                                                                \
        int nan = 0;                                                                                          \
        _Pragma("omp simd reduction(max:top) reduction(|:nan)")                                               \
        for (int64_t j = 0; j < n; j++) {                                                                     \
            float v = LOAD(x[j]);                                                                             \
            nan |= v != v;                                                                                    \
            top = v > top ? v : top;                                                                          \
        }                                                                                                     \
        top = SCALED(top, t, unit);                                                                           \
        return nan || !(top > -INFINITY) || top == INFINITY ? NAN : top;                                      \
    }                                                                                                         \
                                                                                                              \
    /* The weights e^(x/t - top) of row x (top: its largest x / t) summed by chunks of SAMPLE_CHUNK into the   \
       running totals ends[] (*last: the last chunk of any weight); the total, or -1 for a NaN or no finite    \
       maximum. */                                                                                            \
    static inline __attribute__((always_inline)) double weigh_row_##NAME(const T *x, int64_t n, float t,      \
                                                                          const int unit, float *top_out,     \
                                                                          double *ends, int64_t *last) {      \
        const float top = row_top_##NAME(x, n, t, unit);                                                      \
        if (top != top) return -1;                                                                            \
        int64_t chunks = (n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;                                               \
        double total = 0;                                                                                     \
        *last = 0;                                                                                            \
        for (int64_t c = 0; c < chunks; c++) {                                                                \
            int64_t j1 = (c + 1) * SAMPLE_CHUNK < n ? (c + 1) * SAMPLE_CHUNK : n;                             \
            float mass = 0;                                                                                   \
            _Pragma("omp simd reduction(+:mass)")                                                             \
            for (int64_t j = c * SAMPLE_CHUNK; j < j1; j++)                                                   \
                mass += exp_approx(SCALED(LOAD(x[j]), t, unit) - top);                                        \
            total += mass;                                                                                    \
            ends[c] = total;                                                                                  \
            if (mass > 0) *last = c;                                                                          \
        }                                                                                                     \
        *top_out = top;                                                                                       \
        return total;                                                                                         \
    }                                                                                                         \
                                                                                                              \
    static inline __attribute__((always_inline)) int64_t sample_row_##NAME(const T *x, int64_t n, float t,   \
                                                                             double u, double *ends,          \
                                                                             const int unit) {                \
        float top;                                                                                            \
        int64_t last;                                                                                         \
        const double total = weigh_row_##NAME(x, n, t, unit, &top, ends, &last);                              \
        if (total < 0) return -1;                                                                             \
        double target = u * total;                                                                            \
        int64_t c = 0;                                                                                        \
        while (c < last && ends[c] <= target) c++;                                                            \
        double run = c > 0 ? ends[c - 1] : 0;                                                                 \
        int64_t j1 = (c + 1) * SAMPLE_CHUNK < n ? (c + 1) * SAMPLE_CHUNK : n, pick = -1;                      \
        for (int64_t j = c * SAMPLE_CHUNK; j < j1; j++) {                                                     \
            double w = exp_approx(SCALED(LOAD(x[j]), t, unit) - top);                                         \
            if (w <= 0) continue;                                                                             \
            pick = j;                                                                                         \
            run += w;                                                                                         \
            if (run > target) break;                                                                          \
        }                                                                                                     \
        return pick;                                                                                          \
    }                                                                                                         \
                                                                                                              \
    void flock_sample_##NAME(const T *x, int64_t x_stride, const float *temperature, const double *u,         \
                             int64_t *out, int64_t rows, int64_t cols, int32_t threads) {                     \
        int64_t work = rows * cols;                                                                           \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++) {                                                                  \
            double ends[(cols + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK];                                            \
            const float t = temperature[i];                                                                   \
            out[i] = t == 1.0f ? sample_row_##NAME(x + i * x_stride, cols, t, u[i], ends, 1)                  \
                               : sample_row_##NAME(x + i * x_stride, cols, t, u[i], ends, 0);                 \
        }                                                                                                     \
    }
DEFINE_SAMPLE(bf16, bf16, bf16_load)
DEFINE_SAMPLE(f32, float, f32_load)

// Top-k and top-p (vLLM's order: a row's k most likely tokens, then the most likely of those while the mass
// before each is under top_p of theirs) and the draw, on one row: the weights e^(x/t - top) as `sample` weighs
// them, ranked by x (ties by index). Each token falls in a bucket of 1/NUCLEUS_RES of (top - x/t), the last
// bucket holding the rest; buckets above a cut are kept whole by their summed mass, and only the bucket a cut
// falls in is sorted. The draw is the inverse CDF over the whole buckets' tokens in index order, then the cut
// bucket's kept tokens in rank order. Returns -1 where the caller must draw the row: a NaN or no finite maximum,
// a tie at the k-th token (PyTorch keeps every token equal to it), or memory ran out.
#define NUCLEUS_BUCKETS 1024
#define NUCLEUS_RES 32.0f

typedef struct {
    float x;
    int32_t j;
    float w;
} Ranked;

static int ranked_order(const void *a, const void *b) {  // x descending, then index ascending
    const Ranked *p = a, *q = b;
    if (p->x != q->x) return p->x > q->x ? -1 : 1;
    return (p->j > q->j) - (p->j < q->j);
}

typedef struct {  // a thread's scratch for one row: weights, buckets, a bucket's ranked tokens
    float *w;
    uint16_t *bucket;
    Ranked *ranked;
    int64_t size;
} NucleusScratch;

static __thread NucleusScratch nucleus_scratch;

static NucleusScratch *nucleus_room(int64_t n) {  // NULL when memory ran out
    NucleusScratch *s = &nucleus_scratch;
    if (s->size >= n) return s;
    free(s->w), free(s->bucket), free(s->ranked);
    s->w = malloc((size_t)n * sizeof(float));
    s->bucket = malloc((size_t)n * sizeof(uint16_t));
    s->ranked = malloc((size_t)n * sizeof(Ranked));
    s->size = s->w && s->bucket && s->ranked ? n : 0;
    return s->size ? s : NULL;
}

// Per bucket, its tokens' summed weights (and with `count`, how many): two interleaved sets of sums, so that a
// run of tokens in one bucket does not wait on its own sums.
static void bucket_sums(const float *w, const uint16_t *bucket, int64_t n, double *mass, int64_t *count) {
    double odd[NUCLEUS_BUCKETS] = {0};
    int64_t j = 0;
    if (count) {
        int32_t odd_count[NUCLEUS_BUCKETS] = {0};
        for (; j + 1 < n; j += 2) {
            const int b0 = bucket[j], b1 = bucket[j + 1];
            mass[b0] += w[j], odd[b1] += w[j + 1];
            count[b0]++, odd_count[b1]++;
        }
        for (int b = 0; b < NUCLEUS_BUCKETS; b++) count[b] += odd_count[b];
        if (j < n) count[bucket[j]]++;
    } else {
        for (; j + 1 < n; j += 2) mass[bucket[j]] += w[j], odd[bucket[j + 1]] += w[j + 1];
    }
    if (j < n) mass[bucket[j]] += w[j];
    for (int b = 0; b < NUCLEUS_BUCKETS; b++) mass[b] += odd[b];
}

// Whether tokens [j0, j1) hold one of bucket b (a vector pass that lets scans skip most of a row).
static inline int holds_bucket(const uint16_t *bucket, int64_t j0, int64_t j1, int64_t b) {
    int any = 0;
    _Pragma("omp simd reduction(|:any)")
    for (int64_t j = j0; j < j1; j++) any |= bucket[j] == b;
    return any;
}

// The draw among the tokens of buckets [0, cut), in index order: the token where their running sum of weights
// first exceeds target, found by chunk sums, then inside one chunk (the last such token of weight > 0 when
// rounding leaves target unreached).
static int64_t draw_whole(const float *w, const uint16_t *bucket, int64_t n, int64_t cut, double target) {
    double run = 0;
    int64_t pick = -1;
    for (int64_t c0 = 0; c0 < n; c0 += SAMPLE_CHUNK) {
        const int64_t c1 = c0 + SAMPLE_CHUNK < n ? c0 + SAMPLE_CHUNK : n;
        float sum = 0;
        _Pragma("omp simd reduction(+:sum)")
        for (int64_t j = c0; j < c1; j++) sum += bucket[j] < cut ? w[j] : 0.0f;
        if (!(sum > 0)) continue;
        if (run + sum <= target) {
            run += sum;
            continue;
        }
        for (int64_t j = c0; j < c1; j++) {
            if (bucket[j] >= cut || w[j] <= 0) continue;
            pick = j;
            run += w[j];
            if (run > target) return pick;
        }
    }
    for (int64_t j = n - 1; pick < 0 && j >= 0; j--)
        if (bucket[j] < cut && w[j] > 0) pick = j;
    return pick;
}

#define DEFINE_NUCLEUS(NAME, T, LOAD)                                                                         \
    /* the tokens of bucket b, ranked (how many) */                                                           \
    static int64_t rank_bucket_##NAME(const T *x, const NucleusScratch *s, int64_t n, int64_t b) {            \
        int64_t m = 0;                                                                                        \
        for (int64_t j0 = 0; j0 < n; j0 += 64) {                                                              \
            const int64_t j1 = j0 + 64 < n ? j0 + 64 : n;                                                     \
            if (!holds_bucket(s->bucket, j0, j1, b)) continue;                                                \
            for (int64_t j = j0; j < j1; j++)                                                                 \
                if (s->bucket[j] == b) s->ranked[m++] = (Ranked){LOAD(x[j]), (int32_t)j, s->w[j]};            \
        }                                                                                                     \
        qsort(s->ranked, (size_t)m, sizeof(Ranked), ranked_order);                                            \
        return m;                                                                                             \
    }                                                                                                         \
                                                                                                              \
    static int64_t nucleus_row_##NAME(const T *x, int64_t n, float t, int64_t k, double p, double u,          \
                                      const int unit) {                                                       \
        const float top = row_top_##NAME(x, n, t, unit);                                                      \
        NucleusScratch *s = top != top ? NULL : nucleus_room(n);                                              \
        if (!s) return -1;                                                                                    \
        float *w = s->w;                                                                                      \
        uint16_t *bucket = s->bucket;                                                                         \
        _Pragma("omp simd")                                                                                   \
        for (int64_t j = 0; j < n; j++) {                                                                     \
            const float y = SCALED(LOAD(x[j]), t, unit) - top, b = -y * NUCLEUS_RES;                          \
            w[j] = exp_approx(y);                                                                             \
            bucket[j] = b < NUCLEUS_BUCKETS - 1 ? (uint16_t)b : NUCLEUS_BUCKETS - 1;                          \
        }                                                                                                     \
        double mass[NUCLEUS_BUCKETS] = {0};                                                                   \
        int64_t count[NUCLEUS_BUCKETS] = {0};                                                                 \
        bucket_sums(w, bucket, n, mass, k > 0 && k < n ? count : NULL);                                       \
        /* the cut: buckets [0, cut) whole, then the first c ranked tokens of bucket `cut` */              \
        int64_t cut = NUCLEUS_BUCKETS - 1, ranked = -1, limit = n;                                            \
        double above = 0, total = 0;                                                                          \
        if (k > 0 && k < n) {                                                                                 \
            int64_t before = 0;                                                                               \
            for (cut = 0; before + count[cut] < k; cut++) before += count[cut], total += mass[cut];          \
            ranked = rank_bucket_##NAME(x, s, n, cut);                                                        \
            limit = k - before;                                                                               \
            if (limit < ranked && SCALED(s->ranked[limit - 1].x, t, unit) == SCALED(s->ranked[limit].x, t, unit)) \
                return -1;                                                                                    \
            for (int64_t i = 0; i < limit; i++) total += s->ranked[i].w;                                      \
        } else {                                                                                              \
            for (int64_t b = 0; b < NUCLEUS_BUCKETS; b++) total += mass[b];                                   \
        }                                                                                                     \
        const double want = p < 1 ? p * total : INFINITY;                                                     \
        int64_t b = 0;                                                                                        \
        while (b < cut && above + mass[b] < want) above += mass[b++];                                         \
        if (b != cut) limit = n, cut = b, ranked = -1;                                                        \
        if (ranked < 0) ranked = rank_bucket_##NAME(x, s, n, cut);                                            \
        double kept = above;                                                                                  \
        int64_t c = 0;                                                                                        \
        while (c < ranked && c < limit && kept < want) kept += s->ranked[c++].w;                              \
        /* the draw: the whole buckets' tokens in index order, then the cut bucket's kept ones in rank order */ \
        const double target = u * kept;                                                                       \
        if (target < above) return draw_whole(w, bucket, n, cut, target);                                     \
        int64_t pick = -1;                                                                                    \
        double run = above;                                                                                   \
        for (int64_t i = 0; i < c; i++) {                                                                     \
            if (s->ranked[i].w <= 0) continue;                                                                \
            pick = s->ranked[i].j;                                                                            \
            run += s->ranked[i].w;                                                                            \
            if (run > target) break;                                                                          \
        }                                                                                                     \
        return pick >= 0 ? pick : draw_whole(w, bucket, n, cut, above);                                      \
    }                                                                                                         \
                                                                                                              \
    void flock_nucleus_sample_##NAME(const T *x, int64_t x_stride, const float *temperature,                  \
                                     const int64_t *top_k, const double *top_p, const double *u, int64_t *out,\
                                     int64_t rows, int64_t cols, int32_t threads) {                           \
        int64_t work = rows * cols;                                                                           \
        PARALLEL_FOR                                                                                          \
        for (int64_t i = 0; i < rows; i++) {                                                                  \
            const float t = temperature[i];                                                                   \
            out[i] = t == 1.0f ? nucleus_row_##NAME(x + i * x_stride, cols, t, top_k[i], top_p[i], u[i], 1)  \
                               : nucleus_row_##NAME(x + i * x_stride, cols, t, top_k[i], top_p[i], u[i], 0);  \
        }                                                                                                     \
    }
DEFINE_NUCLEUS(bf16, bf16, bf16_load)
DEFINE_NUCLEUS(f32, float, f32_load)

DEFINE_OPS(bf16, bf16, bf16_load, bf16_store)
DEFINE_OPS(f32, float, f32_load, f32_store)

// ------------------------------------------------------------------------------------------- step program

static inline float word_f32(int64_t word) {  // a float passed as its bits in an int64 word
    uint32_t u = (uint32_t)word;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// The norms, rope, the GLU activations, a scale, a gated add and a bias add as ops of a step program (flock/model/program.py): their
// arguments as int64 words.
#define DEFINE_PROGRAM_OPS(NAME, T, LOAD, STORE)                                                              \
    int32_t flock_rms_norm_op_##NAME(const int64_t *a) {                                                      \
        flock_rms_norm_##NAME((const T *)(intptr_t)a[0], a[1], (T *)(intptr_t)a[2], a[3],                     \
                              (const T *)(intptr_t)a[4], a[5], a[6], word_f32(a[7]), (int32_t)a[8]);           \
        return 0;                                                                                             \
    }                                                                                                         \
    int32_t flock_add_rms_norm_op_##NAME(const int64_t *a) {                                                  \
        flock_add_rms_norm_##NAME((T *)(intptr_t)a[0], a[1], (T *)(intptr_t)a[2], a[3],                       \
                                  (const T *)(intptr_t)a[4], a[5], a[6], word_f32(a[7]), (int32_t)a[8]);       \
        return 0;                                                                                             \
    }                                                                                                         \
    int32_t flock_head_rms_norm_op_##NAME(const int64_t *a) {                                                 \
        flock_head_rms_norm_##NAME((T *)(intptr_t)a[0], a[1], (const T *)(intptr_t)a[2], a[3], (int32_t)a[4],  \
                                   (int32_t)a[5], word_f32(a[6]), (int32_t)a[7]);                             \
        return 0;                                                                                             \
    }                                                                                                         \
    int32_t flock_rope_op_##NAME(const int64_t *a) {                                                          \
        flock_rope_##NAME((T *)(intptr_t)a[0], a[1], (const int64_t *)(intptr_t)a[2],                        \
                          (const T *)(intptr_t)a[3], (const T *)(intptr_t)a[4], a[5], a[6], (int32_t)a[7],     \
                          (int32_t)a[8], (int32_t)a[9], (int32_t)a[10]);                                      \
        return 0;                                                                                             \
    }                                                                                                         \
    int32_t flock_silu_and_mul_op_##NAME(const int64_t *a) {                                                  \
        flock_silu_and_mul_##NAME((const T *)(intptr_t)a[0], a[1], (T *)(intptr_t)a[2], a[3], a[4], a[5],       \
                                  (int32_t)a[6]);                                                             \
        return 0;                                                                                             \
    }                                                                                                         \
    int32_t flock_gelu_and_mul_op_##NAME(const int64_t *a) {                                                  \
        flock_gelu_and_mul_##NAME((const T *)(intptr_t)a[0], a[1], (T *)(intptr_t)a[2], a[3], a[4], a[5],       \
                                  (int32_t)a[6]);                                                             \
        return 0;                                                                                             \
    }                                                                                                         \
    int32_t flock_scale_op_##NAME(const int64_t *a) {                                                         \
        flock_scale_##NAME((T *)(intptr_t)a[0], a[1], a[2], a[3], word_f32(a[4]), (int32_t)a[5]);              \
        return 0;                                                                                             \
    }                                                                                                         \
    int32_t flock_add_gated_op_##NAME(const int64_t *a) {                                                     \
        flock_add_gated_##NAME((T *)(intptr_t)a[0], a[1], (const T *)(intptr_t)a[2], a[3],                    \
                               (const T *)(intptr_t)a[4], a[5], a[6], a[7], (int32_t)a[8]);                   \
        return 0;                                                                                             \
    }                                                                                                         \
    /* x (a[3] rows, a[1] apart) += bias (a[2], a[4] wide), as PyTorch's out += bias */                       \
    int32_t flock_add_bias_op_##NAME(const int64_t *a) {                                                      \
        T *x = (T *)(intptr_t)a[0];                                                                           \
        const T *b = (const T *)(intptr_t)a[2];                                                               \
        for (int64_t i = 0; i < a[3]; i++)                                                                    \
            for (int64_t j = 0; j < a[4]; j++) x[i * a[1] + j] = STORE(LOAD(x[i * a[1] + j]) + LOAD(b[j]));   \
        return 0;                                                                                             \
    }
DEFINE_PROGRAM_OPS(bf16, bf16, bf16_load, bf16_store)
DEFINE_PROGRAM_OPS(f32, float, f32_load, f32_store)

// The rows of the step's token ids (int64, a[3] of them) looked up in an embedding table of a[2] rows (a[1]
// bytes apart), a[7] bytes of each copied to dst (a[5], rows a[6] bytes apart). Fails (1) on an id outside
// the table, before anything is written.
int32_t flock_embed_op(const int64_t *a) {
    const char *table = (const char *)(intptr_t)a[0];
    const int64_t *ids = (const int64_t *)(intptr_t)a[3];
    char *dst = (char *)(intptr_t)a[5];
    for (int64_t i = 0; i < a[4]; i++)
        if (ids[i] < 0 || ids[i] >= a[2]) return 1;
    for (int64_t i = 0; i < a[4]; i++) memcpy(dst + i * a[6], table + ids[i] * a[1], (size_t)a[7]);
    return 0;
}

typedef int32_t (*program_op)(const int64_t *args);

#define PROGRAM_WIDTH 16       // int64 words of a record: the op's address and up to 15 arguments
#define PROGRAM_ROWS INT64_MIN  // an argument word that the step's row count replaces

// Record i's op on its arguments, PROGRAM_ROWS words replaced by `rows`.
static int32_t run_record(const int64_t *records, int64_t i, int64_t rows) {
    const int64_t *r = records + i * PROGRAM_WIDTH;
    int64_t args[PROGRAM_WIDTH - 1];
    for (int j = 0; j < PROGRAM_WIDTH - 1; j++) args[j] = r[j + 1] == PROGRAM_ROWS ? rows : r[j + 1];
    return ((program_op)(intptr_t)r[0])(args);
}

// Run a step program of `rows` rows: n records of PROGRAM_WIDTH int64 words, each an op's address and then its
// arguments (ops of any of Flock's kernel libraries). Returns 0, or i + 1 where record i's op failed (the rest
// do not run).
int64_t flock_run_program(const int64_t *records, int64_t n, int64_t rows) {
    for (int64_t i = 0; i < n; i++)
        if (run_record(records, i, rows)) return i + 1;
    return 0;
}

// flock_run_program, adding each record's wall nanoseconds to ns[i] (bench/step_profile.py's split of a step).
int64_t flock_run_program_timed(const int64_t *records, int64_t n, int64_t rows, int64_t *ns) {
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (int64_t i = 0; i < n; i++) {
        int32_t failed = run_record(records, i, rows);
        clock_gettime(CLOCK_MONOTONIC, &end);
        ns[i] += (end.tv_sec - start.tv_sec) * 1000000000LL + (end.tv_nsec - start.tv_nsec);
        start = end;
        if (failed) return i + 1;
    }
    return 0;
}
