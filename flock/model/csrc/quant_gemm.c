// GEMMs on GGUF's quantized weight blocks, kept as llama.cpp stores them: y[M][N] = x[M][K] W^T, W [N][K] of
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32) or Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (super-blocks of 256),
// row-major, each row its K / block blocks; also IQ4_XS's and Q3_K's blocks whose indices pick from another table
// of values (the lattice IQ types, rewritten so at load: flock/model/iq_grids.py).
//
// As in llama.cpp, the activations are quantized per row to int8 first, in the same call: blocks of 32 with
// a float scale and the scaled sum of their values for the 32-weight types, super-blocks of 256 with a float
// scale and the integer sums of each 16 for the K-quants. A weight block and an activation block then meet in
// integer dot products (vpmaddubsw: unsigned weight bytes times signed activation bytes, pairs summed to int16,
// then vpmaddwd into int32 with each sub-block's integer scale), one float multiply per block, and the
// weights' offsets (Q4_0's 8, Q6_K's 32, a K-quant's minimum) come from the activation sums.
//
// Every type can also be interleaved once at load (flock_interleave), as llama.cpp repacks them for its CPU
// kernels: 8 rows' blocks side by side, each 32-byte vector 4 weights of each of the 8 rows, the integer
// scales unpacked to bytes. A 4-byte broadcast of the activations then meets 8 rows at once, each sub-block's
// products add up in int16 before its scale, and the 8 rows' sums leave as one float vector.
//
// A tile is 16 weight rows x up to 4 activation rows: each weight block is decoded once into bytes and used for
// the 4 rows. The call's tiles, weight-row major, are split evenly over the threads. Built for AVX2 (the floor
// of every x86 CPU Flock runs on), for VNNI (vpdpbusd: 4 products summed straight into int32, on 256-bit
// vectors: AVX-VNNI, or AVX512-VNNI with VL) and for the baseline (portable C, the same integer arithmetic: the
// reference). FLOCK_EMULATED_VNNI builds the VNNI kernels on AVX2 with vpdpbusd emulated exactly: how CPUs
// without VNNI test them. On CPUs with AMX-INT8, calls of 3 rows or more on interleaved weights take the tiles
// (quant_amx.h), with results the same bits as the vector kernels'; FLOCK_EMULATED_AMX builds those on AVX2.
// A Llama MLP's gate_up weight ([gate | up], 2I rows) gives silu(gate) * up straight from the float sums (glu).
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp2_poly.h"

#ifdef __AVX2__
#pragma GCC target("f16c")  // every AVX2 CPU has it
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif defined(FLOCK_EMULATED_VNNI) && defined(__AVX2__)
#define DPBUSD(acc, u, s) dpbusd_emulated(acc, u, s)
#endif
#if defined(__AMX_INT8__) || (defined(FLOCK_EMULATED_AMX) && defined(__AVX2__))
#define AMX_TILES  // interleaved weights on AMX-INT8 tiles (quant_amx.h)
#endif

typedef uint16_t f16;
typedef uint16_t bf16;

typedef struct { f16 d; int8_t qs[32]; } blk_q8_0;
typedef struct { f16 d; uint8_t qs[16]; } blk_q4_0;
typedef struct { f16 d, m; uint8_t qs[16]; } blk_q4_1;
typedef struct { f16 d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;
typedef struct { f16 d, m; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_1;
// Q2_K: 16 sub-blocks of 16, each a byte of 4-bit scale (low) and minimum (high); weight 128 h + 32 j + l is bits
// 2 j of qs[32 h + l]
typedef struct { uint8_t scales[16]; uint8_t qs[64]; f16 d, dmin; } blk_q2_K;
// Q3_K: weight 128 h + 32 j + l is u - 4, u its bits 2 j of qs[32 h + l] and, as bit 2, bit 4 h + j of hmask[l],
// times its sub-block of 16's 6-bit scale less 32 (q3_k_scales) and d
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; f16 d; } blk_q3_K;
typedef struct { f16 d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;
typedef struct { f16 d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; f16 d; } blk_q6_K;
// IQ4_XS: 8 sub-blocks of 32, each a 6-bit scale (less 32: low 4 bits in scales_l, top 2 in scales_h) times the
// int8 values its 4-bit indices pick from IQ4_VALUES (weight i the low nibble of qs[16 j + i], i + 16 the high one)
typedef struct { f16 d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; } blk_iq4_xs;
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// 8 rows interleaved (x8): pair p of sub-blocks holds, per row, the sub-blocks 2p and 2p + 1's byte scales
// (and minimums); a vector v of sub-block s holds, at byte 4 r + t, the weights 8 v + t (low nibble) and
// 8 v + 4 + t (high nibble) of the sub-block in row r.
typedef struct { f16 d[8], dmin[8]; uint8_t sc[4][8][2], mn[4][8][2]; uint8_t qs[8][4][32]; } blk_q4_Kx8;
// Q5_K: Q4_K's, then per sub-block the fifth bits as the 32-blocks keep theirs (bits 2 v and 2 v + 1 of
// byte 4 r + t)
typedef struct { blk_q4_Kx8 low; uint8_t qh[8][32]; } blk_q5_Kx8;
// Q6_K's 16 sub-blocks of 16, each its 96 bytes in a row (read in order): qs vector v holds weights 8 v + t
// and 8 v + 4 + t as Q4_K's do, and bits 2 g of qh byte 4 r + t the top 2 bits of weight 4 g + t.
typedef struct { uint8_t qs[2][32], qh[32]; } q6_sub;
typedef struct { f16 d[8]; int8_t sc[8][8][2]; q6_sub sub[16]; } blk_q6_Kx8;
// Q2_K: the file's scale-and-minimum bytes of sub-blocks 2 p and 2 p + 1 per row; bits 2 g of byte 4 r + t of
// sub-block sb's vector hold weight 4 g + t of the sub-block in row r.
typedef struct { f16 d[8], dmin[8]; uint8_t sm[8][8][2]; uint8_t qs[16][32]; } blk_q2_Kx8;
// Q3_K: Q2_K's planes of the low 2 bits, the scales less 32 as signed bytes; bits g (sub-block 2 p) and 4 + g
// (2 p + 1) of byte 4 r + t of qh[p] the third bits of weights 4 g + t.
typedef struct { f16 d[8]; int8_t sc[8][8][2]; uint8_t qs[16][32]; uint8_t qh[8][32]; } blk_q3_Kx8;
// IQ4_XS: Q4_K's layout of the indices, the scales less 32 as signed bytes, no minimums
typedef struct { f16 d[8]; int8_t sc[4][8][2]; uint8_t qs[8][4][32]; } blk_iq4_xsx8;
// The 32-blocks, after the 8 rows' scales d (and minimums m): Q8_0's vector v holds at byte 4 r + t weight 4 v + t
// of row r plus 128 (unsigned); the 4- and 5-bit types' vector v holds the low 4 bits of weights 8 v + t and
// 8 v + 4 + t as a Q4_K sub-block's do, and bits 2 v and 2 v + 1 of qh byte 4 r + t their fifth bits.
typedef struct { f16 d[8]; uint8_t qs[8][32]; } blk_q8_0x8;
typedef struct { f16 d[8]; uint8_t qs[4][32]; } blk_q4_0x8;
typedef struct { f16 d[8], m[8]; uint8_t qs[4][32]; } blk_q4_1x8;
typedef struct { f16 d[8]; uint8_t qh[32], qs[4][32]; } blk_q5_0x8;
typedef struct { f16 d[8], m[8]; uint8_t qh[32], qs[4][32]; } blk_q5_1x8;

typedef struct { float d, s; int8_t q[32]; } act32;  // s = d * sum(q)
typedef struct { float d; int16_t bsums[16], sums32[8]; int8_t q[256]; } act256;  // the sums of each 16, 32 of q

// ggml's type ids
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       IQ4_XS = 23 };
enum { IQ4_NL = 20 };  // flock_transcode's
// Flock's own ids (100 + the type's ggml id): IQ4_XS's blocks (a scale per 32 weights) or Q3_K's (per 16) holding
// a lattice IQ type's weights, d / m x an odd scale x one of at most 16 (Q3_K's: 8) integers (flock/model/iq_grids.py),
// which index these tables; d as the file has it, 1 / m applied to it as a float (a power of two: exact)
enum { IQ2_XXS_T = 116, IQ3_XXS_T = 118, IQ1_S_T = 119, IQ3_S_T = 121 };
enum { IQ2_XS_T = 117, IQ2_S_T = 122, IQ1_M_T = 129 };
static const int8_t IQ3_S_VALUES[16] = {-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15};
static const int8_t IQ3_XXS_VALUES[16] = {-31, -26, -22, -18, -14, -10, -6, -2, 2, 6, 10, 14, 18, 22, 26, 31};
static const int8_t IQ2_XXS_VALUES[16] = {-43, -25, -8, 8, 25, 43};
static const int8_t IQ1_S_VALUES[16] = {-9, -7, -1, 1, 7, 9};

// Whether the type's blocks are IQ4_XS's: indices into its table of values
static inline int is_table(int type) {
    return type == IQ4_XS || type == IQ3_S_T || type == IQ3_XXS_T || type == IQ2_XXS_T || type == IQ1_S_T;
}
// Whether they are Q3_K's whose 3-bit indices u pick from a table (Q3_K's own weights are u - 4)
static inline int is_q3_table(int type) { return type == IQ2_XS_T || type == IQ2_S_T || type == IQ1_M_T; }
static inline int is_q3(int type) { return type == Q3_K || is_q3_table(type); }
// A Q3_K table's values are looked up plus this offset (unsigned bytes), taken off as Q3_K's 4 is
#define Q3_TABLE_SHIFT 6
#define Q3_TABLE_OFFSET (1 << Q3_TABLE_SHIFT)

static inline const int8_t *table_values(int type) {
    switch (type) {
        case IQ3_S_T: return IQ3_S_VALUES;
        case IQ3_XXS_T: return IQ3_XXS_VALUES;
        case IQ2_XXS_T: case IQ2_XS_T: case IQ2_S_T: return IQ2_XXS_VALUES;
        case IQ1_S_T: case IQ1_M_T: return IQ1_S_VALUES;
        default: return IQ4_VALUES;
    }
}

// What the type's d is multiplied by: 1 / m (1 for every other type)
static inline float d_scale(int type) {
    return type == IQ3_XXS_T ? 0.5f : type > 100 && type != IQ3_S_T ? 0.125f : 1.0f;
}

// The type's 16 values (flock/model/iq_grids.py reads the lattice types' here)
void flock_table_values(int32_t type, int8_t *out) { memcpy(out, table_values(type), 16); }

#define NT 16  // weight rows of a tile
#define MT 4   // activation rows of a tile
#define AI static inline __attribute__((always_inline))

static inline float f16_to_f32(f16 h) {
#ifdef __AVX2__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  // subnormal: value = man * 2^-24
        float v = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &v, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// v rounded to the nearest fp16 value, back as a float: how llama.cpp stores an activation 32-block's scale (Q8_0)
// and its scaled sum (Q8_1)
static inline float round_f16(float v) {
#ifdef __AVX2__
    return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
    return (float)(_Float16)v;
#endif
}


// Q4_K / Q5_K: 8 sub-blocks of 32, each a 6-bit scale and a 6-bit minimum packed in 12 bytes; out: the 8
// scales, then the 8 minimums, a byte each. Sub-blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7
// (minimums); 4-7 take the nibbles of bytes 8-11 and, above them, the top 2 bits of bytes 0-3 / 4-7.
static inline void k_scales(const uint8_t *s, uint8_t out[16]) {
    uint32_t a, b, c, o[4];
    memcpy(&a, s, 4), memcpy(&b, s + 4, 4), memcpy(&c, s + 8, 4);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    o[0] = a & six;
    o[1] = (c & four) | ((a >> 6) & two) << 4;
    o[2] = b & six;
    o[3] = ((c >> 4) & four) | ((b >> 6) & two) << 4;
    memcpy(out, o, 16);
}

// Q3_K: the 16 sub-blocks' 6-bit scales less 32. Sub-blocks 0-7 take the low nibbles of bytes 0-7, 8-15 their
// high nibbles; above each nibble, 2 bits of bytes 8-11.
static inline void q3_k_scales(const uint8_t *s, int8_t out[16]) {
    uint32_t a[3], o[4];
    memcpy(a, s, 12);
    const uint32_t four = 0x0f0f0f0f, two = 0x03030303;
    o[0] = (a[0] & four) | (a[2] & two) << 4;
    o[1] = (a[1] & four) | ((a[2] >> 2) & two) << 4;
    o[2] = ((a[0] >> 4) & four) | ((a[2] >> 4) & two) << 4;
    o[3] = ((a[1] >> 4) & four) | ((a[2] >> 6) & two) << 4;
    memcpy(out, o, 16);
    for (int t = 0; t < 16; t++) out[t] = (int8_t)(out[t] - 32);
}

// Q3_K: each weight's 3 bits u (as Q3_K's weight u - 4)
static inline void q3_k_indices(const blk_q3_K *b, uint8_t u[256]) {
    for (int i = 0; i < 256; i++) {
        const int h = i / 128, j = i % 128 / 32, l = i % 32;
        u[i] = (uint8_t)(((b->qs[32 * h + l] >> (2 * j)) & 3) | ((b->hmask[l] >> (4 * h + j)) & 1) << 2);
    }
}

// Q3_K's blocks: what index u stands for, plus the offset it is stored with (q3_offset: Q3_K's 4)
static inline int q3_offset(int type) { return is_q3_table(type) ? Q3_TABLE_OFFSET : 4; }
static inline uint8_t q3_value(int type, int u) {
    return is_q3_table(type) ? (uint8_t)(table_values(type)[u] + Q3_TABLE_OFFSET) : (uint8_t)u;
}

// IQ4_XS: the 8 sub-blocks' scales less 32
static inline void iq4_xs_scales(const blk_iq4_xs *b, int8_t out[8]) {
    for (int j = 0; j < 8; j++)
        out[j] = (int8_t)((((b->scales_l[j / 2] >> (4 * (j % 2))) & 0xf) | ((b->scales_h >> (2 * j)) & 3) << 4) - 32);
}

static int block_size(int type) { return type >= Q2_K ? 256 : 32; }
// The pairs of minimums a K-quant super-block has: Q4_K / Q5_K 4 (per 32 values), Q2_K 8 (per 16), else 0 (Q3_K's
// offset 4 is its weights')
static inline int minimum_pairs(int type) { return type == Q2_K ? 8 : type == Q4_K || type == Q5_K ? 4 : 0; }

static int64_t block_bytes(int type) {
    switch (type) {
        case Q8_0: return sizeof(blk_q8_0);
        case Q4_0: return sizeof(blk_q4_0);
        case Q4_1: return sizeof(blk_q4_1);
        case Q5_0: return sizeof(blk_q5_0);
        case Q5_1: return sizeof(blk_q5_1);
        case Q4_K: return sizeof(blk_q4_K);
        case Q5_K: return sizeof(blk_q5_K);
        case Q6_K: return sizeof(blk_q6_K);
        case Q2_K: return sizeof(blk_q2_K);
        case Q3_K: case IQ2_XS_T: case IQ2_S_T: case IQ1_M_T: return sizeof(blk_q3_K);
        default: return is_table(type) ? (int64_t)sizeof(blk_iq4_xs) : 0;
    }
}

// The bytes of one row's share of an interleaved super-block (a blk_*x8 holds 8 rows'); 0: not interleaved.
static int64_t x8_row_bytes(int type) {
    switch (type) {
        case Q4_K: return sizeof(blk_q4_Kx8) / 8;
        case Q5_K: return sizeof(blk_q5_Kx8) / 8;
        case Q6_K: return sizeof(blk_q6_Kx8) / 8;
        case Q2_K: return sizeof(blk_q2_Kx8) / 8;
        case Q3_K: case IQ2_XS_T: case IQ2_S_T: case IQ1_M_T: return sizeof(blk_q3_Kx8) / 8;
        case Q8_0: return sizeof(blk_q8_0x8) / 8;
        case Q4_0: return sizeof(blk_q4_0x8) / 8;
        case Q4_1: return sizeof(blk_q4_1x8) / 8;
        case Q5_0: return sizeof(blk_q5_0x8) / 8;
        case Q5_1: return sizeof(blk_q5_1x8) / 8;
        default: return is_table(type) ? (int64_t)sizeof(blk_iq4_xsx8) / 8 : 0;
    }
}

// ---- dequantization (embedding rows; the tests' view of the formats) -------------------------------------------
// The values of one block as unsigned integers u and, per 16 of them, a scale and an offset: w = s u + o.
static void decode_block(int type, const uint8_t *blk, uint8_t *u, float *s, float *o) {
    switch (type) {
        case Q8_0: {
            const blk_q8_0 *b = (const blk_q8_0 *)blk;
            for (int i = 0; i < 32; i++) u[i] = (uint8_t)(b->qs[i] + 128);
            s[0] = s[1] = f16_to_f32(b->d), o[0] = o[1] = -128 * s[0];
            return;
        }
        case Q4_0: case Q4_1: {
            const uint8_t *qs = type == Q4_0 ? ((const blk_q4_0 *)blk)->qs : ((const blk_q4_1 *)blk)->qs;
            for (int i = 0; i < 16; i++) u[i] = qs[i] & 0xf, u[i + 16] = qs[i] >> 4;
            s[0] = s[1] = f16_to_f32(*(const f16 *)blk);
            o[0] = o[1] = type == Q4_0 ? -8 * s[0] : f16_to_f32(((const blk_q4_1 *)blk)->m);
            return;
        }
        case Q5_0: case Q5_1: {
            const uint8_t *qh = type == Q5_0 ? ((const blk_q5_0 *)blk)->qh : ((const blk_q5_1 *)blk)->qh;
            const uint8_t *qs = type == Q5_0 ? ((const blk_q5_0 *)blk)->qs : ((const blk_q5_1 *)blk)->qs;
            uint32_t h;
            memcpy(&h, qh, 4);
            for (int i = 0; i < 16; i++) {
                u[i] = (qs[i] & 0xf) | ((h >> i) & 1) << 4;
                u[i + 16] = (qs[i] >> 4) | ((h >> (i + 16)) & 1) << 4;
            }
            s[0] = s[1] = f16_to_f32(*(const f16 *)blk);
            o[0] = o[1] = type == Q5_0 ? -16 * s[0] : f16_to_f32(((const blk_q5_1 *)blk)->m);
            return;
        }
        case Q4_K: case Q5_K: {
            const int five = type == Q5_K;
            const blk_q4_K *b4 = (const blk_q4_K *)blk;
            const blk_q5_K *b5 = (const blk_q5_K *)blk;
            const uint8_t *qs = five ? b5->qs : b4->qs;
            uint8_t sm[16];
            k_scales(five ? b5->scales : b4->scales, sm);
            const float d = f16_to_f32(b4->d), dmin = f16_to_f32(b4->dmin);
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t q = qs[32 * j + l];
                    const int hl = five ? (b5->qh[l] >> (2 * j)) & 1 : 0, hh = five ? (b5->qh[l] >> (2 * j + 1)) & 1 : 0;
                    u[64 * j + l] = (q & 0xf) | hl << 4;
                    u[64 * j + 32 + l] = (q >> 4) | hh << 4;
                }
            for (int t = 0; t < 16; t++) s[t] = d * sm[t / 2], o[t] = -dmin * sm[8 + t / 2];
            return;
        }
        case Q6_K: {
            const blk_q6_K *b = (const blk_q6_K *)blk;
            const float d = f16_to_f32(b->d);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
                uint8_t *uh = u + 128 * h;
                for (int l = 0; l < 32; l++) {
                    uh[l] = (ql[l] & 0xf) | ((qh[l] >> 0) & 3) << 4;
                    uh[l + 32] = (ql[l + 32] & 0xf) | ((qh[l] >> 2) & 3) << 4;
                    uh[l + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
                    uh[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
                }
            }
            for (int t = 0; t < 16; t++) s[t] = d * b->scales[t], o[t] = -32 * s[t];
            return;
        }
        case Q2_K: {
            const blk_q2_K *b = (const blk_q2_K *)blk;
            for (int i = 0; i < 256; i++) u[i] = (b->qs[32 * (i / 128) + i % 32] >> (2 * (i % 128 / 32))) & 3;
            for (int t = 0; t < 16; t++)
                s[t] = f16_to_f32(b->d) * (b->scales[t] & 0xf), o[t] = -f16_to_f32(b->dmin) * (b->scales[t] >> 4);
            return;
        }
        case Q3_K: case IQ2_XS_T: case IQ2_S_T: case IQ1_M_T: {
            const blk_q3_K *b = (const blk_q3_K *)blk;
            int8_t sc[16];
            q3_k_scales(b->scales, sc);
            q3_k_indices(b, u);
            for (int i = 0; i < 256; i++) u[i] = q3_value(type, u[i]);
            for (int t = 0; t < 16; t++)
                s[t] = f16_to_f32(b->d) * d_scale(type) * sc[t], o[t] = -q3_offset(type) * s[t];
            return;
        }
        default: {  // IQ4_XS's blocks: the values plus 128
            const blk_iq4_xs *b = (const blk_iq4_xs *)blk;
            const int8_t *values = table_values(type);
            int8_t sc[8];
            iq4_xs_scales(b, sc);
            for (int j = 0; j < 8; j++)
                for (int i = 0; i < 16; i++) {
                    u[32 * j + i] = (uint8_t)(values[b->qs[16 * j + i] & 0xf] + 128);
                    u[32 * j + 16 + i] = (uint8_t)(values[b->qs[16 * j + i] >> 4] + 128);
                }
            for (int t = 0; t < 16; t++) s[t] = f16_to_f32(b->d) * d_scale(type) * sc[t / 2], o[t] = -128 * s[t];
            return;
        }
    }
}

// An interleaved 32-block's parts: the minimums m (Q4_1, Q5_1) after the 16 bytes of scales, then the fifth bits
// (Q5_0, Q5_1), then the weight vectors.
static inline int has_min(int type) { return type == Q4_1 || type == Q5_1; }
static inline int has_qh(int type) { return type == Q5_0 || type == Q5_1; }
static inline int x8_qh_at(int type) { return has_min(type) ? 32 : 16; }
static inline int x8_qs_at(int type) { return x8_qh_at(type) + (has_qh(type) ? 32 : 0); }
static inline float x8_offset(int type) { return type == Q8_0 ? -128.0f : type == Q5_0 ? -16.0f : -8.0f; }  // x d

// decode_block for row `lane` of an interleaved block.
static void decode_x8(int type, const uint8_t *blk, int lane, uint8_t *u, float *s, float *o) {
    if (block_size(type) == 32) {
        const uint8_t(*qs)[32] = (const uint8_t(*)[32])(blk + x8_qs_at(type)), *qh = blk + x8_qh_at(type);
        for (int v = 0; v < (type == Q8_0 ? 8 : 4); v++)
            for (int t = 0; t < 4; t++) {
                const uint8_t q = qs[v][4 * lane + t], h = has_qh(type) ? qh[4 * lane + t] >> (2 * v) : 0;
                if (type == Q8_0) u[4 * v + t] = q;
                else u[8 * v + t] = (q & 0xf) | (h & 1) << 4, u[8 * v + 4 + t] = q >> 4 | (h >> 1 & 1) << 4;
            }
        s[0] = s[1] = f16_to_f32(((const f16 *)blk)[lane]);
        o[0] = o[1] = has_min(type) ? f16_to_f32(((const f16 *)blk)[8 + lane]) : x8_offset(type) * s[0];
    } else if (type == Q2_K) {
        const blk_q2_Kx8 *b = (const blk_q2_Kx8 *)blk;
        for (int sb = 0; sb < 16; sb++) {
            for (int i = 0; i < 16; i++) u[16 * sb + i] = (b->qs[sb][4 * lane + i % 4] >> (2 * (i / 4))) & 3;
            const uint8_t sm = b->sm[sb / 2][lane][sb % 2];
            s[sb] = f16_to_f32(b->d[lane]) * (sm & 0xf), o[sb] = -f16_to_f32(b->dmin[lane]) * (sm >> 4);
        }
    } else if (is_q3(type)) {
        const blk_q3_Kx8 *b = (const blk_q3_Kx8 *)blk;
        for (int sb = 0; sb < 16; sb++) {
            for (int i = 0; i < 16; i++) {
                const int at = 4 * lane + i % 4, g = i / 4, third = (b->qh[sb / 2][at] >> (4 * (sb % 2) + g)) & 1;
                u[16 * sb + i] = q3_value(type, ((b->qs[sb][at] >> (2 * g)) & 3) | third << 2);
            }
            s[sb] = f16_to_f32(b->d[lane]) * d_scale(type) * b->sc[sb / 2][lane][sb % 2];
            o[sb] = -q3_offset(type) * s[sb];
        }
    } else if (is_table(type)) {
        const blk_iq4_xsx8 *b = (const blk_iq4_xsx8 *)blk;
        const int8_t *values = table_values(type);
        for (int sb = 0; sb < 8; sb++) {
            for (int v = 0; v < 4; v++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t q = b->qs[sb][v][4 * lane + t];
                    u[32 * sb + 8 * v + t] = (uint8_t)(values[q & 0xf] + 128);
                    u[32 * sb + 8 * v + 4 + t] = (uint8_t)(values[q >> 4] + 128);
                }
            s[2 * sb] = s[2 * sb + 1] = f16_to_f32(b->d[lane]) * d_scale(type) * b->sc[sb / 2][lane][sb % 2];
            o[2 * sb] = o[2 * sb + 1] = -128 * s[2 * sb];
        }
    } else if (type == Q4_K || type == Q5_K) {
        const blk_q4_Kx8 *b = (const blk_q4_Kx8 *)blk;
        const float d = f16_to_f32(b->d[lane]), dmin = f16_to_f32(b->dmin[lane]);
        for (int sb = 0; sb < 8; sb++) {
            for (int v = 0; v < 4; v++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t q = b->qs[sb][v][4 * lane + t];
                    const uint8_t h = type == Q5_K ? ((const blk_q5_Kx8 *)blk)->qh[sb][4 * lane + t] >> (2 * v) : 0;
                    u[32 * sb + 8 * v + t] = (q & 0xf) | (h & 1) << 4;
                    u[32 * sb + 8 * v + 4 + t] = q >> 4 | (h >> 1 & 1) << 4;
                }
            s[2 * sb] = s[2 * sb + 1] = d * b->sc[sb / 2][lane][sb % 2];
            o[2 * sb] = o[2 * sb + 1] = -dmin * b->mn[sb / 2][lane][sb % 2];
        }
    } else {
        const blk_q6_Kx8 *b = (const blk_q6_Kx8 *)blk;
        const float d = f16_to_f32(b->d[lane]);
        for (int sb = 0; sb < 16; sb++) {
            for (int v = 0; v < 2; v++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t q = b->sub[sb].qs[v][4 * lane + t];
                    u[16 * sb + 8 * v + t] = q & 0xf, u[16 * sb + 8 * v + 4 + t] = q >> 4;
                }
            for (int i = 0; i < 16; i++) u[16 * sb + i] |= ((b->sub[sb].qh[4 * lane + i % 4] >> (2 * (i / 4))) & 3) << 4;
            s[sb] = d * b->sc[sb / 2][lane][sb % 2], o[sb] = -32 * s[sb];
        }
    }
}

// One row's blocks into row `lane` of interleaved blocks.
static void interleave_row(int type, const uint8_t *row, int64_t nb, int lane, uint8_t *out) {
    for (int64_t b = 0; b < nb; b++) {
        uint8_t u[256];
        float s[16], o[16];
        decode_block(type, row + b * block_bytes(type), u, s, o);
        if (block_size(type) == 32) {
            uint8_t *dst = out + b * 8 * x8_row_bytes(type), *qh = dst + x8_qh_at(type);
            const f16 *dm = (const f16 *)(row + b * block_bytes(type));  // the scale d (and the minimum m)
            ((f16 *)dst)[lane] = dm[0];
            if (has_min(type)) ((f16 *)dst)[8 + lane] = dm[1];
            uint8_t(*qs)[32] = (uint8_t(*)[32])(dst + x8_qs_at(type));
            for (int t = 0; has_qh(type) && t < 4; t++) qh[4 * lane + t] = 0;
            for (int v = 0; v < (type == Q8_0 ? 8 : 4); v++)
                for (int t = 0; t < 4; t++) {
                    const uint8_t lo = u[8 * v + t], hi = u[8 * v + 4 + t];
                    qs[v][4 * lane + t] = type == Q8_0 ? u[4 * v + t] : (lo & 0xf) | (hi & 0xf) << 4;
                    if (has_qh(type)) qh[4 * lane + t] |= (lo >> 4) << (2 * v) | (hi >> 4) << (2 * v + 1);
                }
        } else if (type == Q2_K) {
            const blk_q2_K *src = (const blk_q2_K *)row + b;
            blk_q2_Kx8 *dst = (blk_q2_Kx8 *)out + b;
            dst->d[lane] = src->d, dst->dmin[lane] = src->dmin;
            for (int sb = 0; sb < 16; sb++) {
                dst->sm[sb / 2][lane][sb % 2] = src->scales[sb];
                for (int t = 0; t < 4; t++) {
                    uint8_t q = 0;
                    for (int g = 0; g < 4; g++) q |= (uint8_t)(u[16 * sb + 4 * g + t] << (2 * g));
                    dst->qs[sb][4 * lane + t] = q;
                }
            }
        } else if (is_q3(type)) {  // the indices, not the values decode_block gave
            const blk_q3_K *src = (const blk_q3_K *)row + b;
            blk_q3_Kx8 *dst = (blk_q3_Kx8 *)out + b;
            int8_t sc[16];
            q3_k_scales(src->scales, sc);
            q3_k_indices(src, u);
            dst->d[lane] = src->d;
            for (int t = 0; t < 4; t++)
                for (int p = 0; p < 8; p++) dst->qh[p][4 * lane + t] = 0;
            for (int sb = 0; sb < 16; sb++) {
                dst->sc[sb / 2][lane][sb % 2] = sc[sb];
                for (int t = 0; t < 4; t++) {
                    uint8_t q = 0;
                    for (int g = 0; g < 4; g++) {
                        const uint8_t v = u[16 * sb + 4 * g + t];
                        q |= (uint8_t)((v & 3) << (2 * g));
                        dst->qh[sb / 2][4 * lane + t] |= (uint8_t)((v >> 2) << (4 * (sb % 2) + g));
                    }
                    dst->qs[sb][4 * lane + t] = q;
                }
            }
        } else if (is_table(type)) {  // the indices, not the values decode_block gave
            const blk_iq4_xs *src = (const blk_iq4_xs *)row + b;
            blk_iq4_xsx8 *dst = (blk_iq4_xsx8 *)out + b;
            int8_t sc[8];
            iq4_xs_scales(src, sc);
            dst->d[lane] = src->d;
            for (int sb = 0; sb < 8; sb++) {
                dst->sc[sb / 2][lane][sb % 2] = sc[sb];
                for (int v = 0; v < 4; v++)
                    for (int t = 0; t < 4; t++) {
                        const int i = 8 * v + t;  // weights i and i + 4 of the sub-block: nibbles of bytes i % 16
                        const uint8_t lo = (src->qs[16 * sb + i % 16] >> (4 * (i / 16))) & 0xf;
                        const uint8_t hi = (src->qs[16 * sb + (i + 4) % 16] >> (4 * ((i + 4) / 16))) & 0xf;
                        dst->qs[sb][v][4 * lane + t] = (uint8_t)(lo | hi << 4);
                    }
            }
        } else if (type == Q4_K || type == Q5_K) {  // Q5_K's d, dmin and scales where Q4_K has them
            const blk_q4_K *src = (const blk_q4_K *)(row + b * block_bytes(type));
            uint8_t *at = out + b * 8 * x8_row_bytes(type);
            blk_q4_Kx8 *dst = (blk_q4_Kx8 *)at;
            uint8_t sm[16];
            k_scales(src->scales, sm);
            dst->d[lane] = src->d, dst->dmin[lane] = src->dmin;
            for (int sb = 0; sb < 8; sb++) {
                dst->sc[sb / 2][lane][sb % 2] = sm[sb], dst->mn[sb / 2][lane][sb % 2] = sm[8 + sb];
                uint8_t *qh = type == Q5_K ? ((blk_q5_Kx8 *)at)->qh[sb] + 4 * lane : NULL;
                for (int t = 0; qh && t < 4; t++) qh[t] = 0;
                for (int v = 0; v < 4; v++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t lo = u[32 * sb + 8 * v + t], hi = u[32 * sb + 8 * v + 4 + t];
                        dst->qs[sb][v][4 * lane + t] = (lo & 0xf) | (hi & 0xf) << 4;
                        if (qh) qh[t] |= (lo >> 4) << (2 * v) | (hi >> 4) << (2 * v + 1);
                    }
            }
        } else {
            const blk_q6_K *src = (const blk_q6_K *)row + b;
            blk_q6_Kx8 *dst = (blk_q6_Kx8 *)out + b;
            dst->d[lane] = src->d;
            for (int sb = 0; sb < 16; sb++) {
                dst->sc[sb / 2][lane][sb % 2] = src->scales[sb];
                for (int v = 0; v < 2; v++)
                    for (int t = 0; t < 4; t++)
                        dst->sub[sb].qs[v][4 * lane + t] = (u[16 * sb + 8 * v + t] & 0xf) | (u[16 * sb + 8 * v + 4 + t] & 0xf) << 4;
                for (int t = 0; t < 4; t++) {
                    uint8_t h = 0;
                    for (int g = 0; g < 4; g++) h |= (u[16 * sb + 4 * g + t] >> 4) << (2 * g);
                    dst->sub[sb].qh[4 * lane + t] = h;
                }
            }
        }
    }
}

// n rows (n a multiple of 8) of blocks, row_bytes apart, as interleaved blocks: 8 rows' block b at
// out + (8 o) * x8 row bytes + b * 8 x8 row bytes, o the octet.
void flock_interleave(int32_t type, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k, uint8_t *out,
                      int32_t threads) {
    const int64_t nb = k / block_size(type), octet_bytes = 8 * nb * x8_row_bytes(type);
#pragma omp parallel for num_threads(threads) if(threads > 1)
    for (int64_t o = 0; o < n / 8; o++)
        for (int lane = 0; lane < 8; lane++)
            interleave_row(type, w + (8 * o + lane) * row_bytes, nb, lane, out + o * octet_bytes);
}

// ---- types the kernels take as another type's blocks of the same values ----------------------------------------
// IQ4_NL (d, 16 bytes of 4-bit indices into a table of int8 values: weight j the low nibble of byte j, weight
// j + 16 the high one) as Q8_0 (d, the 32 values).
static void iq4_nl_as_q8_0(const uint8_t *in, uint8_t *out) {
    memcpy(out, in, 2);
    for (int j = 0; j < 16; j++) {
        out[2 + j] = (uint8_t)IQ4_VALUES[in[2 + j] & 15];
        out[18 + j] = (uint8_t)IQ4_VALUES[in[2 + j] >> 4];
    }
}

// n blocks of type `from` (IQ4_NL) as the blocks of the kernel type that holds their values exactly (Q8_0).
void flock_transcode(int32_t from, const uint8_t *in, int64_t n, uint8_t *out, int32_t threads) {
    if (from != IQ4_NL) return;
#pragma omp parallel for num_threads(threads) if(threads > 1 && n >= 4096)
    for (int64_t b = 0; b < n; b++) iq4_nl_as_q8_0(in + b * 18, out + b * 34);
}

// Where block b of row j starts, and the row's lane in its interleaved super-block (-1: rows layout).
static inline const uint8_t *block_at(int type, int x8, const uint8_t *w, int64_t row_bytes, int64_t j, int64_t b,
                                      int *lane) {
    if (!x8) {
        *lane = -1;
        return w + j * row_bytes + b * block_bytes(type);
    }
    *lane = (int)(j % 8);
    return w + (j - j % 8) * row_bytes + b * 8 * x8_row_bytes(type);
}

static inline void decode_any(int type, const uint8_t *blk, int lane, uint8_t *u, float *s, float *o) {
    if (lane < 0) decode_block(type, blk, u, s, o);
    else decode_x8(type, blk, lane, u, s, o);
}

// Rows `ids` of W ([.][k], row_bytes apart; interleaved with x8) as floats: fp32, or bf16 with out_bf16.
void flock_dequantize_rows(int32_t type, int32_t x8, const uint8_t *w, int64_t row_bytes, const int64_t *ids,
                           int64_t n_ids, int64_t k, void *out, int32_t out_bf16, int32_t threads) {
    const int bs = block_size(type);
    const int64_t nb = k / bs;
#pragma omp parallel for num_threads(threads) if(threads > 1 && n_ids * k >= 65536)
    for (int64_t r = 0; r < n_ids; r++) {
        uint8_t u[256];
        float s[16], o[16];
        for (int64_t b = 0; b < nb; b++) {
            int lane;
            const uint8_t *blk = block_at(type, x8, w, row_bytes, ids[r], b, &lane);
            decode_any(type, blk, lane, u, s, o);
            for (int i = 0; i < bs; i++) {
                const float v = s[i / 16] * u[i] + o[i / 16];
                const int64_t at = r * k + b * bs + i;
                if (out_bf16) ((bf16 *)out)[at] = f32_to_bf16(v);
                else ((float *)out)[at] = v;
            }
        }
    }
}

// ---- activation quantization ---------------------------------------------------------------------------------
static inline float load_x(const void *x, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const bf16 *)x)[i]) : ((const float *)x)[i];
}

// A block of n values (a multiple of 32) becomes int8 with the scale d = max |x| / 127: span_amax, then span_round
// with id = 1 / d (0 where d is 0). A NaN among them makes d NaN, so that the products of the row come out NaN, as
// the float ones would.
#ifdef __AVX2__
static inline __m256 load8(const void *x, int64_t at, int is_bf16) {
    if (!is_bf16) return _mm256_loadu_ps((const float *)x + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const bf16 *)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float span_amax(const void *x, int64_t at, int n, int is_bf16) {
    __m256 most[4], nan = _mm256_setzero_ps();  // four maxima: a 256-block's are not one chain of 32
    for (int j = 0; j < 4; j++) most[j] = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 32)
        for (int j = 0; j < 4; j++) {
            const __m256 v = load8(x, at + i + 8 * j, is_bf16);
            most[j] = _mm256_max_ps(most[j], _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
    const __m256 m = _mm256_max_ps(_mm256_max_ps(most[0], most[1]), _mm256_max_ps(most[2], most[3]));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm256_movemask_ps(nan) ? NAN : _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// The n values times id, to the nearest integer (ties to even) saturated to int8, into q; returns their sum.
static inline int span_round(const void *x, int64_t at, int n, int is_bf16, float id, int8_t *q) {
    __m256i total = _mm256_setzero_si256();
    for (int i = 0; i < n; i += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(load8(x, at + i + 8 * j, is_bf16), _mm256_set1_ps(id)),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // the packs work within 128-bit lanes: 4-byte groups come out in the order 0 2 4 6 1 3 5 7
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + i),
                            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        // the bytes plus 128, summed in 64-bit lanes
        total = _mm256_add_epi64(total, _mm256_sad_epu8(_mm256_xor_si256(bytes, _mm256_set1_epi8(-128)),
                                                        _mm256_setzero_si256()));
    }
    __m128i s = _mm_add_epi64(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s = _mm_add_epi64(s, _mm_unpackhi_epi64(s, s));
    return (int)_mm_cvtsi128_si64(s) - 128 * n;
}
#else
static inline float span_amax(const void *x, int64_t at, int n, int is_bf16) {
    float amax = 0.0f;
    int nan = 0;
    for (int i = 0; i < n; i++) {
        const float v = load_x(x, at + i, is_bf16);
        amax = fmaxf(amax, fabsf(v)), nan |= v != v;
    }
    return nan ? NAN : amax;
}

static inline int span_round(const void *x, int64_t at, int n, int is_bf16, float id, int8_t *q) {
    int sum = 0;
    for (int i = 0; i < n; i++) sum += q[i] = (int8_t)nearbyintf(load_x(x, at + i, is_bf16) * id);
    return sum;
}
#endif

// The sums of each 16 of 256 int8 values.
static inline void sums16(const int8_t *q, int16_t *out) {
#ifdef __AVX2__
    for (int t = 0; t < 8; t++) {  // the bytes plus 128 summed by 8s, then pairs of those
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + 32 * t)), _mm256_set1_epi8(-128));
        const __m256i s = _mm256_sad_epu8(v, _mm256_setzero_si256());
        const __m256i pairs = _mm256_add_epi64(s, _mm256_bsrli_epi128(s, 8));
        out[2 * t] = (int16_t)(_mm256_extract_epi64(pairs, 0) - 16 * 128);
        out[2 * t + 1] = (int16_t)(_mm256_extract_epi64(pairs, 2) - 16 * 128);
    }
#else
    for (int t = 0; t < 16; t++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += q[16 * t + i];
        out[t] = (int16_t)sum;
    }
#endif
}

static inline float inverse_scale(float d) { return d > 0.0f ? 1.0f / d : 0.0f; }

// 32-blocks scaled a group at a time, each step over the group's blocks before the next: the blocks' maxima,
// divisions and roundings are independent and overlap, where one block at a time waits on each in turn
#define SCALE_GROUP 64

// Row r as the activation blocks weight type `type` meets, as llama.cpp makes them: 32-blocks as its Q8_0 (the
// scale d in fp16) or, for the types with a minimum, Q8_1 (the scaled sum s = d * sum in fp16 as well, from the
// unrounded d); 256-blocks as its Q8_K (a float scale, the integer sums of each 16).
static void quantize_row(const void *x, int64_t ldx, int is_bf16, int64_t r, int64_t k, int type, void *out) {
    const int64_t at = r * ldx;
    if (block_size(type) == 256) {
        for (int64_t b = 0; b < k / 256; b++) {
            act256 *a = (act256 *)out + r * (k / 256) + b;
            a->d = span_amax(x, at + b * 256, 256, is_bf16) / 127.0f;
            span_round(x, at + b * 256, 256, is_bf16, inverse_scale(a->d), a->q);
            sums16(a->q, a->bsums);
            for (int t = 0; t < 8; t++) a->sums32[t] = (int16_t)(a->bsums[2 * t] + a->bsums[2 * t + 1]);
        }
        return;
    }
    act32 *a = (act32 *)out + r * (k / 32);
    for (int64_t b0 = 0; b0 < k / 32; b0 += SCALE_GROUP) {
        const int g = k / 32 - b0 < SCALE_GROUP ? (int)(k / 32 - b0) : SCALE_GROUP;
        float d[SCALE_GROUP], id[SCALE_GROUP];
        for (int j = 0; j < g; j++) d[j] = span_amax(x, at + (b0 + j) * 32, 32, is_bf16);
        for (int j = 0; j < g; j++) d[j] /= 127.0f, id[j] = inverse_scale(d[j]);
        for (int j = 0; j < g; j++) {
            act32 *blk = a + b0 + j;
            const int sum = span_round(x, at + (b0 + j) * 32, 32, is_bf16, id[j], blk->q);
            blk->d = round_f16(d[j]);
            blk->s = has_min(type) ? round_f16(d[j] * (float)sum) : blk->d * (float)sum;  // the latter exact
        }
    }
}

// m rows of x (k floats each, ldx apart; bf16 with is_bf16) as the act32 or act256 rows weight type `type` meets.
void flock_quantize_rows(const void *x, int64_t ldx, int32_t is_bf16, int64_t m, int64_t k, int32_t type,
                         void *out, int32_t threads) {
#pragma omp parallel for num_threads(threads) if(threads > 1 && m * k >= 65536)
    for (int64_t r = 0; r < m; r++) quantize_row(x, ldx, is_bf16, r, k, type, out);
}

// ---- dot products of one weight row with R activation rows ----------------------------------------------------
// x[r]: row r's activation blocks; out[r] = the dot product.
#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Ask for the weight bytes PREFETCH_AHEAD past [p, p + bytes), into L2: a band's first row tile streams its
// weights from memory, and the hardware prefetchers alone leave it short of the bandwidth while the core is busy
// with the products. L2, well ahead: a GLU call alternates between its gate and up rows, which lines a few KiB
// ahead in L1 did not keep up with (half the bandwidth).
#define PREFETCH_AHEAD 8192
// always inlined: a call to it left standing looks free of side effects to gcc, which then deletes it
AI void prefetch_ahead(const void *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch((const char *)p + PREFETCH_AHEAD + at, _MM_HINT_T1);
}

// 32 bytes 0xff where bit i of `bits` is set
static inline __m256i bit_bytes(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ull);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// An accumulator's sum as it stands, in a register. Without it gcc computes every row's products first and sums
// them in a tree, which spills most of them to the stack (20-30% slower).
AI void settle(__m256i *v) { __asm__("" : "+x"(*v)); }

#if defined(FLOCK_EMULATED_VNNI) && !defined(__AVXVNNI__) && !defined(__AVX512VNNI__)
// acc + the sums of each 4 products of unsigned u and signed s bytes, as vpdpbusd: the bytes widened to int16,
// multiplied and summed in int32 by vpmaddwd (exact, no saturation)
AI __m256i dpbusd_emulated(__m256i acc, __m256i u, __m256i s) {
    const __m256i even_u = _mm256_and_si256(u, _mm256_set1_epi16(0xff)), odd_u = _mm256_srli_epi16(u, 8);
    const __m256i even_s = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), odd_s = _mm256_srai_epi16(s, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(even_u, even_s), _mm256_madd_epi16(odd_u, odd_s)));
}
#endif

// A sub-block's running sum of unsigned weight bytes u times signed activation bytes s, and that sum times the
// sub-block's scale: on VNNI int32 lanes of 4 products each (vpdpbusd), times the scale with vpmulld; on AVX2
// int16 pairs (vpmaddubsw, saturating: the callers bound their sums), into int32 by vpmaddwd with the scale.
// `pairs`: each 32-bit lane the scale of its lane twice, as int16 (s, s).
AI __m256i products(__m256i acc, __m256i u, __m256i s) {
#ifdef DPBUSD
    return DPBUSD(acc, u, s);
#else
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
#endif
}

// Whether a Q6_K sub-block's 16 products sum before its scale: in int32 lanes (VNNI) they fit; int16 lanes hold 4
// products of at most 63 * 127, each half's, scaled on its own.
#ifdef DPBUSD
#define WHOLE_SUB_BLOCKS 1
#else
#define WHOLE_SUB_BLOCKS 0
#endif

AI __m256i scaled(__m256i sums, __m256i pairs) {
#ifdef DPBUSD
    return _mm256_mullo_epi32(sums, _mm256_srai_epi32(pairs, 16));
#else
    return _mm256_madd_epi16(sums, pairs);
#endif
}

// The 5-bit types: bits 0 and 1 of each byte of h (a vector's fifth bits) as bit 4 of the low and high nibbles'
// bytes; h then shifted down 2 for the next vector (a byte's lowest bits stay its own for 4 vectors).
AI void fifth_bits(__m256i *lo, __m256i *hi, __m256i *h) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi16(*h, 4), bit4));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_slli_epi16(*h, 3), bit4));
    *h = _mm256_srli_epi16(*h, 2);
}

// products' running sums as int32
AI __m256i widened(__m256i sums) {
#ifdef DPBUSD
    return sums;
#else
    return _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
#endif
}

// The sums of each 4 products of u and s (u times s at most 2 * 128 * 127 per pair on AVX2).
AI __m256i dot4(__m256i u, __m256i s) {
#ifdef DPBUSD
    return DPBUSD(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The 32 unsigned weights of a 32-block and its scale and offset: w = d u + o.
AI __m256i small_block(int type, const uint8_t *blk, float *d, float *o) {
    const __m256i low4 = _mm256_set1_epi8(0xf);
    *d = f16_to_f32(*(const f16 *)blk);
    if (type == Q8_0) {
        *o = 0.0f;  // signed: see dot_small
        return _mm256_loadu_si256((const __m256i *)((const blk_q8_0 *)blk)->qs);
    }
    const uint8_t *qs = type == Q4_0 ? ((const blk_q4_0 *)blk)->qs : type == Q4_1 ? ((const blk_q4_1 *)blk)->qs
                        : type == Q5_0 ? ((const blk_q5_0 *)blk)->qs : ((const blk_q5_1 *)blk)->qs;
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low4);
    if (type == Q5_0 || type == Q5_1) {
        uint32_t h;
        memcpy(&h, type == Q5_0 ? ((const blk_q5_0 *)blk)->qh : ((const blk_q5_1 *)blk)->qh, 4);
        u = _mm256_or_si256(u, _mm256_and_si256(bit_bytes(h), _mm256_set1_epi8(0x10)));
    }
    *o = type == Q4_0 ? -8 * *d : type == Q5_0 ? -16 * *d : f16_to_f32(((const f16 *)blk)[1]);
    return u;
}

AI void dot_small(const int R, const int stream, int type,
                  const uint8_t *w, const act32 *const *x, int64_t nb, float *out) {
    const int64_t bb = block_bytes(type);
    __m256 acc[MT];
    float off[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), off[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        if (stream) prefetch_ahead(w + b * bb, bb);
        float d, o;
        __m256i u = small_block(type, w + b * bb, &d, &o);
        const __m256i wq = u;
        if (type == Q8_0) u = _mm256_sign_epi8(wq, wq);  // |w|; the activations take w's sign
        for (int r = 0; r < R; r++) {
            __m256i a = _mm256_loadu_si256((const __m256i *)x[r][b].q);
            if (type == Q8_0) a = _mm256_sign_epi8(a, wq);
            const __m256i p = dot4(u, a);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x[r][b].d), acc[r]);
            if (type != Q8_0) off[r] += o * x[r][b].s;
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) + off[r];
}

// 32 unsigned weights u of a file row's block times each activation row's values at `at`, pairs scaled (`scale`,
// int16) into the int32 sums
AI void row_products(const int R, __m256i *sum, __m256i u, __m256i scale, const act256 *const *x, int64_t b, int at) {
    for (int r = 0; r < R; r++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(x[r][b].q + at));
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), scale));
        settle(&sum[r]);
    }
}

// The integer sums' start in the file-row kernels of the types whose weights are stored plus an offset 2^shift
// (Q3_K's 4, Q6_K's 32): -offset sum(scale * the activations' sum of 16)
AI void offset_sums(const int R, __m256i *sum, __m256i scales, int shift, const act256 *const *x, int64_t b) {
    for (int r = 0; r < R; r++) {
        const __m256i bsums = _mm256_loadu_si256((const __m256i *)x[r][b].bsums);
        sum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_sll_epi32(_mm256_madd_epi16(bsums, scales),
                                                                         _mm_cvtsi32_si128(shift)));
    }
}

// A block's float step in the file-row kernels of the types without minimums: the integer sums times d
AI void block_step(const int R, __m256 *acc, const __m256i *sum, float d, const act256 *const *x, int64_t b) {
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(d * x[r][b].d), acc[r]);
}

// A K-quant block's float step in the file-row kernels: the integer sums times d, less the minimums (an int16 per
// activation sum of 16, `mins`) times dmin
AI void k_block_step(const int R, __m256 *acc, const __m256i *sum, __m256i mins, float d, float dmin,
                     const act256 *const *x, int64_t b) {
    for (int r = 0; r < R; r++) {
        const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x[r][b].bsums), mins);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(d * x[r][b].d), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin * x[r][b].d), acc[r]);
    }
}

// Q4_K and Q5_K
AI void dot_q45_K(const int R, const int stream, int type,
                  const uint8_t *w, const act256 *const *x, int64_t nb, float *out) {
    const int five = type == Q5_K;
    const int64_t bb = block_bytes(type);
    const __m256i low4 = _mm256_set1_epi8(0xf), one = _mm256_set1_epi8(1);
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (stream) prefetch_ahead(w + b * bb, bb);
        const blk_q4_K *b4 = (const blk_q4_K *)(w + b * bb);
        const blk_q5_K *b5 = (const blk_q5_K *)b4;
        const uint8_t *qs = five ? b5->qs : b4->qs;
        uint8_t sm[16];
        k_scales(five ? b5->scales : b4->scales, sm);
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t *)b4));  // d, dmin
        const float d = _mm_cvtss_f32(dd), dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
        const __m256i sm16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)sm));
        __attribute__((aligned(32))) int16_t sc[16];
        _mm256_store_si256((__m256i *)sc, sm16);
        const __m128i mn = _mm256_extracti128_si256(sm16, 1);  // each sub-block's minimum for its 2 bsums
        const __m256i mins = _mm256_set_m128i(_mm_unpackhi_epi16(mn, mn), _mm_unpacklo_epi16(mn, mn));
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)b5->qh) : _mm256_setzero_si256();
        __m256i sum[MT];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            if (five) {
                const __m256i hl = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), one);
                const __m256i hh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j + 1)), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(hl, 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(hh, 4));
            }
            const __m256i slo = _mm256_set1_epi16(sc[2 * j]), shi = _mm256_set1_epi16(sc[2 * j + 1]);
            for (int r = 0; r < R; r++) {
                const __m256i a0 = _mm256_loadu_si256((const __m256i *)(x[r][b].q + 64 * j));
                const __m256i a1 = _mm256_loadu_si256((const __m256i *)(x[r][b].q + 64 * j + 32));
                const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), slo),
                                                   _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), shi));
                sum[r] = _mm256_add_epi32(sum[r], p);
                settle(&sum[r]);
            }
        }
        k_block_step(R, acc, sum, mins, d, dmin, x, b);
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

AI void dot_q6_K(const int R, const int stream, const uint8_t *w, const act256 *const *x, int64_t nb, float *out) {
    const __m256i low4 = _mm256_set1_epi8(0xf), low2 = _mm256_set1_epi8(3);
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (stream) prefetch_ahead(w + b * sizeof(blk_q6_K), sizeof(blk_q6_K));
        const blk_q6_K *blk = (const blk_q6_K *)w + b;
        const float d = f16_to_f32(blk->d);
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->scales));
        __m256i sum[MT];
        offset_sums(R, sum, scales, 5, x, b);
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * h));
            __m256i u[4];
            u[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_slli_epi16(_mm256_and_si256(qh, low2), 4));
            u[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), low2), 4));
            u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), low2), 4));
            u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), low2), 4));
            __m256i s[4];
            for (int t = 0; t < 4; t++)
                s[t] = _mm256_set_m128i(_mm_set1_epi16(blk->scales[8 * h + 2 * t + 1]),
                                        _mm_set1_epi16(blk->scales[8 * h + 2 * t]));
            for (int r = 0; r < R; r++)
                for (int t = 0; t < 4; t++) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(x[r][b].q + 128 * h + 32 * t));
                    sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u[t], a), s[t]));
                    settle(&sum[r]);
                }
        }
        block_step(R, acc, sum, d, x, b);
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

// Q2_K: each 32 weights of a 2-bit plane two sub-blocks, the low and the high 128 bits of a vector
AI void dot_q2_K(const int R, const int stream, const uint8_t *w, const act256 *const *x, int64_t nb, float *out) {
    const __m256i three = _mm256_set1_epi8(3), low4 = _mm256_set1_epi8(0xf);
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (stream) prefetch_ahead(w + b * sizeof(blk_q2_K), sizeof(blk_q2_K));
        const blk_q2_K *blk = (const blk_q2_K *)w + b;
        const __m128i sm = _mm_loadu_si128((const __m128i *)blk->scales);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), _mm256_castsi256_si128(low4)));
        __attribute__((aligned(16))) uint8_t sc[16];
        _mm_store_si128((__m128i *)sc, _mm_and_si128(sm, _mm256_castsi256_si128(low4)));
        __m256i sum[MT];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * h));
            for (int j = 0; j < 4; j++) {
                const __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), three);
                const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * j + 1]),
                                                       _mm_set1_epi16(sc[8 * h + 2 * j]));
                row_products(R, sum, u, scale, x, b, 128 * h + 32 * j);
            }
        }
        const float d = f16_to_f32(blk->d), dmin = f16_to_f32(blk->dmin);
        k_block_step(R, acc, sum, mins, d, dmin, x, b);
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

// A Q3_K table type's 8 values plus Q3_TABLE_OFFSET in each lane (zeros for Q3_K)
AI __m256i q3_table(int type) {
    if (!is_q3_table(type)) return _mm256_setzero_si256();
    return _mm256_add_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table_values(type))),
                           _mm256_set1_epi8(Q3_TABLE_OFFSET));
}

// Q3_K's third bits: bit `bit` of each byte of h as bit 2 (the word shifts' bits from the next byte masked off)
AI __m256i third_bits(__m256i h, int bit) {
    return _mm256_and_si256(bit >= 2 ? _mm256_srli_epi16(h, bit - 2) : _mm256_slli_epi16(h, 2 - bit),
                            _mm256_set1_epi8(4));
}

// Q3_K: as Q2_K, the third bits from hmask; the offset 4 as Q6_K's 32: -4 sum(scale * bsum). Its table types'
// indices looked up (vpshufb) as their values plus Q3_TABLE_OFFSET, taken off alike.
AI void dot_q3_K(const int R, const int stream, int type, const uint8_t *w, const act256 *const *x, int64_t nb,
                 float *out) {
    const int table = is_q3_table(type);
    const __m256i three = _mm256_set1_epi8(3), values = q3_table(type);
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (stream) prefetch_ahead(w + b * sizeof(blk_q3_K), sizeof(blk_q3_K));
        const blk_q3_K *blk = (const blk_q3_K *)w + b;
        int8_t sc8[16];
        q3_k_scales(blk->scales, sc8);
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc8));
        __attribute__((aligned(32))) int16_t sc[16];
        _mm256_store_si256((__m256i *)sc, scales);
        __m256i sum[MT];
        offset_sums(R, sum, scales, table ? Q3_TABLE_SHIFT : 2, x, b);
        const __m256i hmask = _mm256_loadu_si256((const __m256i *)blk->hmask);
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * h));
            for (int j = 0; j < 4; j++) {
                __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), three),
                                            third_bits(hmask, 4 * h + j));
                if (table) u = _mm256_shuffle_epi8(values, u);
                const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * j + 1]),
                                                       _mm_set1_epi16(sc[8 * h + 2 * j]));
                row_products(R, sum, u, scale, x, b, 128 * h + 32 * j);
            }
        }
        block_step(R, acc, sum, f16_to_f32(blk->d) * d_scale(type), x, b);
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

// IQ4_XS's blocks: the values looked up (vpshufb) as signed bytes; their sizes times the activations with the
// values' signs (as dot_small's Q8_0), each sub-block's pairs then into int32 with its scale.
AI void dot_iq4_xs(const int R, const int stream, int type, const uint8_t *w, const act256 *const *x, int64_t nb,
                   float *out) {
    const __m256i low4 = _mm256_set1_epi8(0xf);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table_values(type)));
    __m256 acc[MT];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (stream) prefetch_ahead(w + b * sizeof(blk_iq4_xs), sizeof(blk_iq4_xs));
        const blk_iq4_xs *blk = (const blk_iq4_xs *)w + b;
        int8_t sc[8];
        iq4_xs_scales(blk, sc);
        __m256i sum[MT];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m128i packed = _mm_loadu_si128((const __m128i *)(blk->qs + 16 * j));
            const __m256i idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low4);
            const __m256i v = _mm256_shuffle_epi8(table, idx), size = _mm256_sign_epi8(v, v);
            const __m256i scale = _mm256_set1_epi16(sc[j]);
            for (int r = 0; r < R; r++) {
                const __m256i a = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x[r][b].q + 32 * j)), v);
                sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(size, a), scale));
                settle(&sum[r]);
            }
        }
        block_step(R, acc, sum, f16_to_f32(blk->d) * d_scale(type), x, b);
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

// ---- 8 interleaved rows with R activation rows: acc[r] gets the 8 rows' dot products with row r ---------------
static inline __m256i bcast4(const int8_t *q) {  // 4 activation bytes to each 32-bit lane
    int32_t v;
    memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

// Each row's pair (s, s') of int16 scales as (s, s) (even) or (s', s') (odd) in its 32-bit lane.
static inline __m256i pair_scale(__m256i pairs, int odd) {
    const __m256i even = _mm256_set_epi32(0x0d0c0d0c, 0x09080908, 0x05040504, 0x01000100, 0x0d0c0d0c, 0x09080908,
                                          0x05040504, 0x01000100);
    return _mm256_shuffle_epi8(pairs, odd ? _mm256_add_epi8(even, _mm256_set1_epi8(2)) : even);
}

// Q4_K and Q5_K (whose fifth bits join the nibbles as the 32-blocks' do)
AI void dot_q45_K_x8(const int R, const int stream, int type,
                     const uint8_t *w, const act256 *const *x, int64_t nb, __m256 *acc) {
    const int five = type == Q5_K;
    const __m256i low4 = _mm256_set1_epi8(0xf);
    const int64_t bb = 8 * x8_row_bytes(type);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q4_Kx8 *blk = (const blk_q4_Kx8 *)(w + b * bb);
        if (stream) prefetch_ahead(blk, bb);
        __m256i isum[MT];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int sb = 0; sb < 8; sb++) {
            const __m256i scale = pair_scale(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)blk->sc[sb / 2])),
                                             sb % 2);
            __m256i h = five ? _mm256_loadu_si256((const __m256i *)((const blk_q5_Kx8 *)blk)->qh[sb])
                             : _mm256_setzero_si256();
            // per int16 at most 16 products of 15 * 127 before the scale; 5 bits: 8 of 31 * 127
            __m256i sums[MT];
            for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)blk->qs[sb][v]);
                __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                if (five) fifth_bits(&lo, &hi, &h);
                for (int r = 0; r < R; r++) {
                    const int8_t *a = x[r][b].q + 32 * sb + 8 * v;
                    sums[r] = products(products(sums[r], lo, bcast4(a)), hi, bcast4(a + 4));
                    settle(&sums[r]);
                    if (five && v == 1)
                        isum[r] = _mm256_add_epi32(isum[r], scaled(sums[r], scale)), sums[r] = _mm256_setzero_si256();
                }
            }
            for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], scaled(sums[r], scale));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->dmin));
        for (int r = 0; r < R; r++) {
            __m256i mins = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {
                const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)blk->mn[p]));
                mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mn, bcast4((const int8_t *)(x[r][b].sums32 + 2 * p))));
            }
            const __m256 xd = _mm256_set1_ps(x[r][b].d);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, xd), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, xd), acc[r]);
        }
    }
}

AI void dot_q6_K_x8(const int R, const int stream, const uint8_t *w, const act256 *const *x, int64_t nb, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0xf), top2 = _mm256_set1_epi8(0x30);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q6_Kx8 *blk = (const blk_q6_Kx8 *)w + b;
        if (stream) prefetch_ahead(blk, sizeof(*blk));
        __m256i isum[MT];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int p = 0; p < 8; p++) {
            const __m256i pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->sc[p]));
            for (int r = 0; r < R; r++)  // the offset 32: -32 sum(scale * bsum)
                isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(
                    _mm256_madd_epi16(pairs, bcast4((const int8_t *)(x[r][b].bsums + 2 * p))), 5));
            for (int h = 0; h < 2; h++) {
                const int sb = 2 * p + h;
                const __m256i qh = _mm256_loadu_si256((const __m256i *)blk->sub[sb].qh);
                const __m256i scale = pair_scale(pairs, h);
                __m256i sums[MT];
                for (int half = 0; half < 2; half++) {  // weights 8 v + t, then 8 v + 4 + t, of vectors v = 2 half, + 1
                    const __m256i ql = _mm256_loadu_si256((const __m256i *)blk->sub[sb].qs[half]);
                    const __m256i hi = half ? qh : _mm256_slli_epi16(qh, 4);
                    const __m256i g0 = _mm256_or_si256(_mm256_and_si256(ql, low4), _mm256_and_si256(hi, top2));
                    const __m256i g1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), low4),
                                                       _mm256_and_si256(_mm256_srli_epi16(hi, 2), top2));
                    for (int r = 0; r < R; r++) {
                        const int8_t *a = x[r][b].q + 16 * sb + 8 * half;
                        const __m256i from = half && WHOLE_SUB_BLOCKS ? sums[r] : _mm256_setzero_si256();
                        sums[r] = products(products(from, g0, bcast4(a)), g1, bcast4(a + 4));
                        if (half || !WHOLE_SUB_BLOCKS) isum[r] = _mm256_add_epi32(isum[r], scaled(sums[r], scale));
                        settle(&isum[r]);
                    }
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d));
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(x[r][b].d)), acc[r]);
    }
}

// Q2_K and Q3_K (`form`, a constant: Q2_K, Q3_K or any of Q3_K's table types, whose values `type` names): a
// sub-block's 4 planes of 2-bit weights (4 g + t at bits 2 g; Q3_K's third bits from qh) against the activations
// 4 g .. 4 g + 3, its 16 products summed before its scale; Q2_K's minimums, and Q3_K's offset 4 (a table's
// Q3_TABLE_OFFSET) times its scales, against the activations' sums of 16.
AI void dot_q23_K_x8(const int R, const int stream, const int form, int type, const uint8_t *w,
                     const act256 *const *x, int64_t nb, __m256 *acc) {
    const int q3 = form != Q2_K, table = is_q3_table(form);
    const __m256i three = _mm256_set1_epi8(3), values = q3_table(type);
    const __m256 d_scale8 = _mm256_set1_ps(d_scale(type));
    const __m128i low4 = _mm_set1_epi8(0xf);
    const int64_t bytes = 8 * x8_row_bytes(type);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q2_Kx8 *b2 = (const blk_q2_Kx8 *)(w + b * bytes);
        const blk_q3_Kx8 *b3 = (const blk_q3_Kx8 *)b2;
        if (stream) prefetch_ahead(b2, bytes);
        __m256i isum[MT], mins[MT];
        for (int r = 0; r < R; r++) isum[r] = mins[r] = _mm256_setzero_si256();
        for (int p = 0; p < 8; p++) {
            const __m128i sm = _mm_loadu_si128((const __m128i *)(q3 ? (const void *)b3->sc[p] : b2->sm[p]));
            const __m256i pairs = q3 ? _mm256_cvtepi8_epi16(sm) : _mm256_cvtepu8_epi16(_mm_and_si128(sm, low4));
            const __m256i mn = q3 ? pairs : _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), low4));
            const __m256i qh = q3 ? _mm256_loadu_si256((const __m256i *)b3->qh[p]) : _mm256_setzero_si256();
            for (int r = 0; r < R; r++) {
                const __m256i sums16 = bcast4((const int8_t *)(x[r][b].bsums + 2 * p));
                mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(mn, sums16));
            }
            for (int h = 0; h < 2; h++) {
                const int sb = 2 * p + h;
                const __m256i q = _mm256_loadu_si256((const __m256i *)(q3 ? b3->qs[sb] : b2->qs[sb]));
                const __m256i scale = pair_scale(pairs, h);
                __m256i sums[MT];  // per int16 (AVX2) at most 8 products of 7 * 127
                for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
                for (int g = 0; g < 4; g++) {
                    __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * g), three);
                    if (q3) u = _mm256_or_si256(u, third_bits(qh, 4 * h + g));
                    if (table) u = _mm256_shuffle_epi8(values, u);
                    for (int r = 0; r < R; r++) {
                        sums[r] = products(sums[r], u, bcast4(x[r][b].q + 16 * sb + 4 * g));
                        settle(&sums[r]);
                    }
                    for (int r = 0; table && !WHOLE_SUB_BLOCKS && r < R; r++) {  // int16 lanes: a pair of 107 * 127
                        isum[r] = _mm256_add_epi32(isum[r], scaled(sums[r], scale));
                        sums[r] = _mm256_setzero_si256();
                    }
                }
                for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], scaled(sums[r], scale));
            }
        }
        const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b2->d)), d_scale8);
        const __m256 dmin = q3 ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b2->dmin));
        for (int r = 0; r < R; r++) {
            const __m256 xd = _mm256_set1_ps(x[r][b].d);
            if (q3) isum[r] = _mm256_sub_epi32(isum[r], table ? _mm256_slli_epi32(mins[r], Q3_TABLE_SHIFT)
                                                              : _mm256_slli_epi32(mins[r], 2));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, xd), acc[r]);
            if (!q3) acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_mul_ps(dmin, xd), acc[r]);
        }
    }
}

// IQ4_XS: the values plus 128 looked up (vpshufb) as unsigned bytes, times the activations, less 128 times each
// sub-block's activation sum (as Q6_K's offset 32). On AVX2 the int16 pairs of bytes up to 241 would saturate, so
// each value is looked up as its two nibbles (as Q8_0 splits its bytes), which meet the same broadcast activations.
AI void dot_iq4_xs_x8(const int R, const int stream, int type, const uint8_t *w, const act256 *const *x, int64_t nb,
                      __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0xf);
    const __m256i table = _mm256_xor_si256(  // the values plus 128
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table_values(type))), _mm256_set1_epi8(-128));
    const __m256 d_scale8 = _mm256_set1_ps(d_scale(type));
#ifndef DPBUSD
    const __m256i table_lo = _mm256_and_si256(table, low4);
    const __m256i table_hi = _mm256_and_si256(_mm256_srli_epi16(table, 4), low4);
#endif
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_iq4_xsx8 *blk = (const blk_iq4_xsx8 *)w + b;
        if (stream) prefetch_ahead(blk, sizeof(*blk));
        __m256i isum[MT], pairs[4];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            pairs[p] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->sc[p]));
            for (int r = 0; r < R; r++)  // the offset 128: -128 sum(scale * sum of 32)
                isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(
                    _mm256_madd_epi16(pairs[p], bcast4((const int8_t *)(x[r][b].sums32 + 2 * p))), 7));
        }
        for (int sb = 0; sb < 8; sb++) {
            const __m256i scale = pair_scale(pairs[sb / 2], sb % 2);
            __m256i sums[MT];  // per int16 (AVX2) at most 16 products of 15 * 127
            for (int r = 0; r < R; r++) sums[r] = _mm256_setzero_si256();
#ifndef DPBUSD
            __m256i high[MT];  // the high nibbles' products
            for (int r = 0; r < R; r++) high[r] = _mm256_setzero_si256();
#endif
            for (int v = 0; v < 4; v++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)blk->qs[sb][v]);
                const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
#ifdef DPBUSD
                const __m256i wl = _mm256_shuffle_epi8(table, lo), wh = _mm256_shuffle_epi8(table, hi);
                for (int r = 0; r < R; r++) {
                    const int8_t *a = x[r][b].q + 32 * sb + 8 * v;
                    sums[r] = products(products(sums[r], wl, bcast4(a)), wh, bcast4(a + 4));
                    settle(&sums[r]);
                }
#else
                const __m256i ll = _mm256_shuffle_epi8(table_lo, lo), lh = _mm256_shuffle_epi8(table_hi, lo);
                const __m256i hl = _mm256_shuffle_epi8(table_lo, hi), hh = _mm256_shuffle_epi8(table_hi, hi);
                for (int r = 0; r < R; r++) {
                    const int8_t *a = x[r][b].q + 32 * sb + 8 * v;
                    const __m256i a0 = bcast4(a), a4 = bcast4(a + 4);
                    sums[r] = products(products(sums[r], ll, a0), hl, a4);
                    high[r] = products(products(high[r], lh, a0), hh, a4);
                    settle(&sums[r]), settle(&high[r]);
                }
#endif
            }
            for (int r = 0; r < R; r++) {
#ifndef DPBUSD
                isum[r] = _mm256_add_epi32(isum[r], _mm256_slli_epi32(scaled(high[r], scale), 4));
#endif
                isum[r] = _mm256_add_epi32(isum[r], scaled(sums[r], scale));
            }
        }
        const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d)), d_scale8);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(x[r][b].d)), acc[r]);
    }
}

// Q8_0: the weights plus 128 (unsigned bytes) times the activations, less 128 times their sum. On AVX2 the int16
// pairs of bytes up to 255 would saturate, so each byte is split into its nibbles (w + 128 = 16 h + l), which
// meet the same broadcast activations.
AI void dot_q8_0_x8(const int R, const int stream, const uint8_t *w, const act32 *const *x, int64_t nb, __m256 *acc) {
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q8_0x8 *blk = (const blk_q8_0x8 *)w + b;
        if (stream) prefetch_ahead(blk, sizeof(*blk));
        __m256i lo[MT], hi[MT];
        for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
        for (int v = 0; v < 8; v++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)blk->qs[v]);
#ifdef DPBUSD
            for (int r = 0; r < R; r++) {
                lo[r] = products(lo[r], q, bcast4(x[r][b].q + 4 * v));
                settle(&lo[r]);
            }
#else
            const __m256i low4 = _mm256_set1_epi8(0xf);
            const __m256i l = _mm256_and_si256(q, low4), h = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            for (int r = 0; r < R; r++) {  // 16 products of at most 15 * 127 per int16
                const __m256i a = bcast4(x[r][b].q + 4 * v);
                lo[r] = products(lo[r], l, a), hi[r] = products(hi[r], h, a);
                settle(&lo[r]), settle(&hi[r]);
            }
#endif
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d));
        for (int r = 0; r < R; r++) {
#ifdef DPBUSD
            const __m256i sum = lo[r];
#else
            const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(hi[r], _mm256_set1_epi16(16)), widened(lo[r]));
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x[r][b].d)), acc[r]);
            acc[r] = _mm256_fnmadd_ps(d, _mm256_set1_ps(128 * x[r][b].s), acc[r]);
        }
    }
}

// Q4_0, Q4_1, Q5_0 and Q5_1: the weights times the activations, plus the offset (-8 d, -16 d, or the minimum m)
// times their sum.
AI void dot_q45_x8(const int R, const int stream, int type,
                   const uint8_t *w, const act32 *const *x, int64_t nb, __m256 *acc) {
    const int five = has_qh(type);
    const __m256i low4 = _mm256_set1_epi8(0xf);
    const int64_t bb = 8 * x8_row_bytes(type);
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb, *qs = blk + x8_qs_at(type);
        if (stream) prefetch_ahead(blk, bb);
        __m256i h = five ? _mm256_loadu_si256((const __m256i *)(blk + x8_qh_at(type))) : _mm256_setzero_si256();
        // per int16 at most 16 products of 15 * 127; 5 bits: 8 of 31 * 127, then into int32 (wide)
        __m256i sums[MT], wide[MT];
        for (int r = 0; r < R; r++) sums[r] = wide[r] = _mm256_setzero_si256();
        for (int v = 0; v < 4; v++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * v));
            __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            if (five) fifth_bits(&lo, &hi, &h);
            for (int r = 0; r < R; r++) {
                const int8_t *a = x[r][b].q + 8 * v;
#ifdef DPBUSD  // int32 sums: the low and the high nibbles' products in two chains, each half as long
                wide[r] = DPBUSD(wide[r], hi, bcast4(a + 4));
                settle(&wide[r]);
                sums[r] = DPBUSD(sums[r], lo, bcast4(a));
                settle(&sums[r]);
#else
                sums[r] = products(products(sums[r], lo, bcast4(a)), hi, bcast4(a + 4));
                settle(&sums[r]);
                if (five && v == 1) wide[r] = widened(sums[r]), sums[r] = _mm256_setzero_si256();
#endif
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 o = has_min(type) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                                       : _mm256_mul_ps(d, _mm256_set1_ps(x8_offset(type)));
        for (int r = 0; r < R; r++) {
            const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(wide[r], widened(sums[r])));
            acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_set1_ps(x[r][b].d)), acc[r]);
            acc[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(x[r][b].s), acc[r]);
        }
    }
}
#endif

// The baseline: per block, the integer dot product of each 16 weights with the activations, then w = s u + o.
// w: the row's first block, or with lane >= 0 its interleaved super-blocks' (row `lane` of each).
static void dot_scalar(int R, int type, const uint8_t *w, int lane, const void *const *x, int64_t nb, float *out) {
    const int bs = block_size(type);
    const int64_t bb = lane < 0 ? block_bytes(type) : 8 * x8_row_bytes(type);
    double acc[MT] = {0};
    for (int64_t b = 0; b < nb; b++) {
        uint8_t u[256];
        float s[16], o[16];
        decode_any(type, w + b * bb, lane, u, s, o);
        for (int r = 0; r < R; r++) {
            const int8_t *q = bs == 32 ? ((const act32 *)x[r])[b].q : ((const act256 *)x[r])[b].q;
            const float da = bs == 32 ? ((const act32 *)x[r])[b].d : ((const act256 *)x[r])[b].d;
            float sum = 0.0f, offset = 0.0f;
            for (int t = 0; t < bs / 16; t++) {
                int32_t dot = 0, qsum = 0;
                for (int i = 16 * t; i < 16 * t + 16; i++) dot += u[i] * q[i], qsum += q[i];
                sum += s[t] * (float)dot;
                offset += o[t] * (float)qsum;
            }
            // a 32-block's offset times its activations' stored scaled sum, as the vector kernels take it
            acc[r] += bs == 32 ? (double)(da * sum + o[0] * ((const act32 *)x[r])[b].s) : (double)(da * (sum + offset));
        }
    }
    for (int r = 0; r < R; r++) out[r] = (float)acc[r];
}

static void dot_rows(int R, int stream, int type, const uint8_t *w, const void *const *x, int64_t nb, float *out) {
#ifdef __AVX2__
    // R and the type as constants of each inlined body
#define ROWS(call, T)                 \
    switch (R) {                      \
        case 1: call(1, T); return;   \
        case 2: call(2, T); return;   \
        case 3: call(3, T); return;   \
        default: call(4, T); return;  \
    }
#define SMALL(r, T) dot_small(r, stream, T, w, (const act32 *const *)x, nb, out)
#define K45(r, T) dot_q45_K(r, stream, T, w, (const act256 *const *)x, nb, out)
#define K6(r, T) dot_q6_K(r, stream, w, (const act256 *const *)x, nb, out)
#define IQ4(r, T) dot_iq4_xs(r, stream, type, w, (const act256 *const *)x, nb, out)
#define K2(r, T) dot_q2_K(r, stream, w, (const act256 *const *)x, nb, out)
#define K3(r, T) dot_q3_K(r, stream, T, w, (const act256 *const *)x, nb, out)
#define K3T(r, T) dot_q3_K(r, stream, type, w, (const act256 *const *)x, nb, out)
    switch (type) {
        case Q8_0: ROWS(SMALL, Q8_0)
        case Q4_0: ROWS(SMALL, Q4_0)
        case Q4_1: ROWS(SMALL, Q4_1)
        case Q5_0: ROWS(SMALL, Q5_0)
        case Q5_1: ROWS(SMALL, Q5_1)
        case Q4_K: ROWS(K45, Q4_K)
        case Q5_K: ROWS(K45, Q5_K)
        case IQ4_XS: case IQ3_S_T: case IQ3_XXS_T: case IQ2_XXS_T: case IQ1_S_T: ROWS(IQ4, IQ4_XS)
        case Q2_K: ROWS(K2, Q2_K)
        case Q3_K: ROWS(K3, Q3_K)
        case IQ2_XS_T: case IQ2_S_T: case IQ1_M_T: ROWS(K3T, Q3_K)
        default: ROWS(K6, Q6_K)
    }
#else
    dot_scalar(R, type, w, -1, x, nb, out);
#endif
}

// The dot products of 8 interleaved rows with R activation rows: out[8 r + i] for row i.
static void dot_octet(int R, int stream, int type, const uint8_t *w, const void *const *x, int64_t nb, float *out) {
#ifdef __AVX2__
    __m256 acc[MT];
#define OCTET(r)                                                                                      \
    switch (type) {                                                                                   \
        case Q4_K: dot_q45_K_x8(r, stream, Q4_K, w, (const act256 *const *)x, nb, acc); break;        \
        case Q5_K: dot_q45_K_x8(r, stream, Q5_K, w, (const act256 *const *)x, nb, acc); break;        \
        case Q6_K: dot_q6_K_x8(r, stream, w, (const act256 *const *)x, nb, acc); break;               \
        case IQ4_XS: case IQ3_S_T: case IQ3_XXS_T: case IQ2_XXS_T: case IQ1_S_T:                      \
            dot_iq4_xs_x8(r, stream, type, w, (const act256 *const *)x, nb, acc); break;              \
        case Q2_K: dot_q23_K_x8(r, stream, Q2_K, Q2_K, w, (const act256 *const *)x, nb, acc); break;  \
        case Q3_K: dot_q23_K_x8(r, stream, Q3_K, Q3_K, w, (const act256 *const *)x, nb, acc); break;  \
        case IQ2_XS_T: case IQ2_S_T: case IQ1_M_T:                                                    \
            dot_q23_K_x8(r, stream, IQ2_XS_T, type, w, (const act256 *const *)x, nb, acc); break;         \
        case Q8_0: dot_q8_0_x8(r, stream, w, (const act32 *const *)x, nb, acc); break;                \
        case Q4_0: dot_q45_x8(r, stream, Q4_0, w, (const act32 *const *)x, nb, acc); break;           \
        case Q4_1: dot_q45_x8(r, stream, Q4_1, w, (const act32 *const *)x, nb, acc); break;           \
        case Q5_0: dot_q45_x8(r, stream, Q5_0, w, (const act32 *const *)x, nb, acc); break;           \
        default: dot_q45_x8(r, stream, Q5_1, w, (const act32 *const *)x, nb, acc); break;             \
    }
    switch (R) {
        case 1: OCTET(1); break;
        case 2: OCTET(2); break;
        case 3: OCTET(3); break;
        default: OCTET(4); break;
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
#else
    for (int i = 0; i < 8; i++) {
        float sums[MT];
        dot_scalar(R, type, w, i, x, nb, sums);
        for (int r = 0; r < R; r++) out[8 * r + i] = sums[r];
    }
#endif
}

#include "quant_x16.h"

// The kernels this build runs: 3 AMX tiles (and VNNI or AVX2 for fewer rows), 2 VNNI, 1 AVX2, 0 the baseline.
int32_t flock_qgemm_level(void) {
#ifdef AMX_TILES
    return 3;
#elif defined(DPBUSD)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

// The scalar dot products on any build (the reference the AVX2 ones are tested against).
void flock_qdot_scalar(int32_t type, const uint8_t *w, const void *x, int64_t k, float *out) {
    const void *rows[1] = {x};
    dot_scalar(1, type, w, -1, rows, k / block_size(type), out);
}

static inline float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

#ifdef __AVX2__
// silu(g) * u of 8 lanes: g u / (1 + e^-g), e^-g = 2^t by t's integer part (t clamped to the float exponents)
// and a degree-5 polynomial of its fraction (1.6e-7 relative error): scalar expf was a large part of a
// prefill's GLU GEMM.
AI __m256 silu_mul8(__m256 g, __m256 u) {
    __m256 t = _mm256_mul_ps(g, _mm256_set1_ps(-1.4426950408889634f));
    t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(126.0f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(t, n);
    const __m256 p = EXP2_POLY5(f, _mm256_fmadd_ps, _mm256_set1_ps);
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
    return _mm256_div_ps(_mm256_mul_ps(g, u), _mm256_add_ps(e, _mm256_set1_ps(1.0f)));
}
#endif

static void silu_mul_rows(float *g, const float *u, int count) {
    int e = 0;
#ifdef __AVX2__
    for (; e + 8 <= count; e += 8)
        _mm256_storeu_ps(g + e, silu_mul8(_mm256_loadu_ps(g + e), _mm256_loadu_ps(u + e)));
#endif
    for (; e < count; e++) g[e] = silu_mul(g[e], u[e]);
}

// y[at ..] = v[0 .. cols): fp32, or bf16 (f32_to_bf16's rounding)
static inline void write_row(void *y, int64_t at, const float *v, int cols, int out_bf16) {
    int e = 0;
#ifdef __AVX512BW__
    for (; e + 16 <= cols; e += 16) {
        const __m512 f = _mm512_loadu_ps(v + e);
        if (!out_bf16) {
            _mm512_storeu_ps((float *)y + at + e, f);
            continue;
        }
        const __m512i bits = _mm512_castps_si512(f);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
        _mm256_storeu_si256((__m256i *)((bf16 *)y + at + e), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
    }
#endif
    for (; e < cols; e++)
        if (out_bf16) ((bf16 *)y)[at + e] = f32_to_bf16(v[e]);
        else ((float *)y)[at + e] = v[e];
}

#ifdef AMX_TILES
#include "quant_amx.h"
// Whether a call of `rows` rows takes the tiles: on interleaved weights
#define ON_TILES(type, x8, rows) ((x8) && (rows) >= AMX_ROWS)
#else
#define ON_TILES(type, x8, rows) 0
#endif

// 0 where the kernels may run (AMX builds: Linux granted the tile state)
int32_t flock_qgemm_init(void) {
#ifdef AMX_TILES
    return amx_request_tiles();
#else
    return 0;
#endif
}

// One tile of the vector kernels: weight rows n0 .. n0 + NT (of n; with glu, gate rows, their up rows n
// further) times the R activation rows x, out to y from element y_at on (rows ldy apart). `first`: the band's
// first tile, which streams its weights from memory.
static void vector_tile(int type, int x8, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t n0, int64_t nb,
                        int first, const void *const *x, int R, void *y, int64_t y_at, int64_t ldy, int out_bf16,
                        int glu) {
    for (int64_t j = n0, step; j < n0 + NT && j < n; j += step) {
        float sums[MT * 16], up[MT * 16];  // sums[step * r + i]: row j + i
        // two octets at once (dot_x16, where the build has it) once a band's first row tile has brought its
        // weights into cache: from memory, one octet after the other reads them faster
        const int pair = x8 && !first && j + 16 <= n0 + NT && j + 16 <= n;
        const uint8_t *wj = w + j * row_bytes, *uj = w + (j + n) * row_bytes;
        step = pair && dot_x16(R, type, wj, wj + 8 * row_bytes, x, nb, sums) ? 16 : x8 ? 8 : 1;
        if (step == 8) dot_octet(R, first, type, wj, x, nb, sums);
        else if (step == 1) dot_rows(R, first, type, wj, x, nb, sums);
        if (glu) {
            if (step == 16) dot_x16(R, type, uj, uj + 8 * row_bytes, x, nb, up);
            else if (step == 8) dot_octet(R, first, type, uj, x, nb, up);
            else dot_rows(R, first, type, uj, x, nb, up);
            silu_mul_rows(sums, up, R * step);
        }
        for (int r = 0; r < R; r++) write_row(y, y_at + r * ldy + j, sums + step * r, step, out_bf16);
    }
}

// The bytes of a row's activation blocks for weights of this type.
static int64_t act_row_bytes(int type, int64_t k) {
    return k / block_size(type) * (block_size(type) == 32 ? (int64_t)sizeof(act32) : (int64_t)sizeof(act256));
}

// Weight bands a thread takes at a time. A band's first row tile streams its weights from memory, and a thread's
// stream restarts with every task it takes (the hardware prefetchers start over at each jump): about 2 tasks a
// thread, still taken as threads come free. From ONE_BAND_ROWS rows on, a band's products dwarf its stream's
// restarts, and one band at a time keeps the threads even when one of them is held up.
#define ONE_BAND_ROWS 256
static int64_t bands_per_task(int64_t m_tiles, int64_t bands, int threads) {
    if (m_tiles * MT >= ONE_BAND_ROWS) return 1;
    const int64_t even = bands / (2 * (threads > 1 ? threads : 1));
    return even > 4 ? even : 4;
}

// y (m rows, ldy apart; fp32, or bf16 with out_bf16) = x W^T for x: m rows of k floats (ldx apart; bf16 with
// x_bf16), quantized here as the type needs, and the n weight rows of w (row_bytes each; interleaved with x8).
// With glu, w holds 2n rows [gate | up] and y gets silu(gate) * up. Interleaved weights take the AMX tiles (AMX
// builds) from AMX_ROWS rows. Returns -1 where memory for the activations (or the tiles' scratch) cannot be had,
// -2 where an emulated tile operation met shapes the CPU would refuse.
int32_t flock_qgemm(int32_t type, int32_t x8, const uint8_t *w, int64_t row_bytes, int64_t n, int64_t k,
                    const void *x, int64_t ldx, int32_t x_bf16, int64_t m, void *y, int64_t ldy, int32_t out_bf16,
                    int32_t glu, int32_t threads) {
    const int64_t nb = k / block_size(type), act_row = act_row_bytes(type, k);
    const int64_t m_tiles = (m + MT - 1) / MT, tiles = (n + NT - 1) / NT * m_tiles;
    const int64_t chunk = bands_per_task(m_tiles, tiles / m_tiles, threads) * m_tiles;
    void *xq = malloc((size_t)((m + 15) / 16 * 16 * act_row));  // whole tiles of rows for the AMX tiles
    if (!xq) return -1;
    int failed = 0;
    // a few rows are quantized before the threads start: the barrier after a shared quantization would hold
    // the first thread until the others have woken up
    const int few = m * k < 65536;
    if (few)
        for (int64_t r = 0; r < m; r++) quantize_row(x, ldx, x_bf16, r, k, type, xq);
#pragma omp parallel num_threads(threads) if(threads > 1 && tiles > 1)
    {
        if (!few) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) quantize_row(x, ldx, x_bf16, r, k, type, xq);
        }
        int tiled = 0;
#ifdef AMX_TILES
        if (ON_TILES(type, x8, m)) {
            tiled = 1;
            const int code = amx_gemm(type, w, row_bytes, n, xq, act_row, nb, m, y, ldy, out_bf16, glu);
            if (code) {
#pragma omp atomic write
                failed = code < 0 ? -1 : -2;
            }
        }
#endif
        // whole bands of one weight tile's m tiles (its weights stay in cache), taken as threads come free: a
        // thread that starts late (woken from sleep) or shares its core leaves no other waiting at the end
#pragma omp for schedule(dynamic, chunk)
        for (int64_t i = 0; i < tiles * !tiled; i++) {
            const int64_t n0 = i / m_tiles * NT, m0 = i % m_tiles * MT;
            const int R = m - m0 < MT ? (int)(m - m0) : MT;
            const void *x[MT];
            for (int r = 0; r < R; r++) x[r] = (const uint8_t *)xq + (m0 + r) * act_row;
            vector_tile(type, x8, w, row_bytes, n, n0, nb, m0 == 0, x, R, y, m0 * ldy, ldy, out_bf16, glu);
        }
    }
    free(xq);
    return failed;
}

// flock_qgemm as a step-program op (flock/model/program.py): its arguments as int64 words, in order.
int32_t flock_qgemm_op(const int64_t *a) {
    return flock_qgemm((int32_t)a[0], (int32_t)a[1], (const uint8_t *)(intptr_t)a[2], a[3], a[4], a[5],
                       (const void *)(intptr_t)a[6], a[7], (int32_t)a[8], a[9], (void *)(intptr_t)a[10], a[11],
                       (int32_t)a[12], (int32_t)a[13], (int32_t)a[14]);
}

#include "quant_moe.h"
