// AMX-INT8 tiles on the interleaved (x8) blocks, part of quant_gemm.c (included after its formats and helpers).
//
// A task is 16 weight rows (two 8-row groups) x up to 16 activation rows. Per block (per sub-block for the
// K-quants) the two groups' weights are laid out as unsigned bytes in a B tile (K/4 rows of 16 columns x 4
// bytes), the activation rows' int8 values are the A tile, read in place from their blocks, and _tile_dpbsud
// (signed activations x unsigned weights) gives the int32 sums of every pair of rows: the same integers as the
// vector kernels' products. The scales then apply in the same float operations, in the same order, as
// dot_*_x8's, so a row's result is the same bits whichever kernel multiplies it: how many rows a step has never
// changes its results. Built for CPUs with AMX-INT8, and with FLOCK_EMULATED_AMX (the tiles in portable C) to
// test it on any AVX2 CPU.
#include "amx_tiles.h"

#define AMX_ROWS 16  // calls of at least this many activation rows take the tiles

typedef struct {
    int32_t c[16][16];      // the int32 sums: activation row x weight row
    uint8_t b[8][64];       // the B tile: row k holds weights 4k .. 4k + 3 of each of the 16 weight rows
    int32_t isum[16][16];   // a K-quant super-block's scaled sums
} AmxScratch;

// tile 0: the sums (rows x 16 int32), 1: the activations (rows x kbytes), 2: the weights (kbytes / 4 x 64)
static void amx_configure(int rows, int kbytes) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = (uint8_t)rows, cfg.colsb[0] = 64;
    cfg.rows[1] = (uint8_t)rows, cfg.colsb[1] = (uint16_t)kbytes;
    cfg.rows[2] = (uint8_t)(kbytes / 4), cfg.colsb[2] = 64;
    TILE_CONFIG(&cfg);
}

static inline void amx_product(const uint8_t *a, int64_t stride, AmxScratch *s) {
    TILE_LOAD(1, a, stride);
    TILE_LOAD(2, s->b, 64);
    TILE_ZERO(0);
    TILE_DPBSUD(0, 1, 2);
    TILE_STORE(0, s->c, 64);
}

// One 32-byte vector of nibbles (byte 4 r + t: weights j + t low, j + 4 + t high, of row r) as B rows `row` and
// `row + 1` of group g, with the fifth bits (bits `shift` and `shift + 1` of qh's bytes) where qh is given.
static inline void nibble_rows(const uint8_t *q, const uint8_t *qh, int shift, int g, int row, AmxScratch *s) {
    for (int i = 0; i < 32; i++) {
        const uint8_t h = qh ? (uint8_t)(qh[i] >> shift) : 0;
        s->b[row][32 * g + i] = (uint8_t)((q[i] & 0xf) | (h & 1) << 4);
        s->b[row + 1][32 * g + i] = (uint8_t)((q[i] >> 4) | (h & 2) << 3);
    }
}

// The 32-blocks: block b of each group into the B tile, one product, and each row's scale and offset.
static void amx_small(int type, const uint8_t *const *blk, int groups, const uint8_t *x, int64_t act_row, int rows,
                      AmxScratch *s, float acc[16][16]) {
    for (int g = 0; g < groups; g++) {
        if (type == Q8_0) {
            for (int v = 0; v < 8; v++) memcpy(s->b[v] + 32 * g, ((const blk_q8_0x8 *)blk[g])->qs[v], 32);
        } else {
            const uint8_t *qs = blk[g] + x8_qs_at(type), *qh = has_qh(type) ? blk[g] + x8_qh_at(type) : NULL;
            for (int v = 0; v < 4; v++) nibble_rows(qs + 32 * v, qh, 2 * v, g, 2 * v, s);
        }
    }
    amx_product(x + offsetof(act32, q), act_row, s);
    for (int r = 0; r < rows; r++) {
        const act32 *a = (const act32 *)(x + r * act_row);
        for (int g = 0; g < groups; g++)
            for (int i = 0; i < 8; i++) {
                const float d = f16_to_f32(((const f16 *)blk[g])[i]);
                float v = fmaf((float)s->c[r][8 * g + i], d * a->d, acc[r][8 * g + i]);
                if (type == Q8_0) v = fmaf(-d, 128 * a->s, v);
                else v = fmaf(has_min(type) ? f16_to_f32(((const f16 *)blk[g])[8 + i]) : d * x8_offset(type), a->s, v);
                acc[r][8 * g + i] = v;
            }
    }
}

// The K-quants: per sub-block (32 weights; Q6_K's 16) one product, its sums times each row's integer scale; per
// super-block the float scales, and Q4_K / Q5_K's minimums (Q6_K's offset 32 enters the integer sums first).
static void amx_k(int type, const uint8_t *const *blk, int groups, const uint8_t *x, int64_t act_row, int rows,
                  AmxScratch *s, float acc[16][16]) {
    const int six = type == Q6_K, subs = six ? 16 : 8, width = six ? 16 : 32;
    for (int r = 0; r < rows; r++) {
        const act256 *a = (const act256 *)(x + r * act_row);
        for (int g = 0; g < groups; g++)
            for (int i = 0; i < 8; i++) {
                int32_t offset = 0;
                if (six) {
                    const blk_q6_Kx8 *q = (const blk_q6_Kx8 *)blk[g];
                    for (int p = 0; p < 8; p++)
                        offset += q->sc[p][i][0] * a->bsums[2 * p] + q->sc[p][i][1] * a->bsums[2 * p + 1];
                }
                s->isum[r][8 * g + i] = -32 * offset;
            }
    }
    for (int sb = 0; sb < subs; sb++) {
        for (int g = 0; g < groups; g++) {
            if (six) {
                const q6_sub *sub = &((const blk_q6_Kx8 *)blk[g])->sub[sb];
                for (int row = 0; row < 4; row++)
                    for (int i = 0; i < 32; i++) {
                        const uint8_t ql = sub->qs[row / 2][i];
                        const uint8_t top = (uint8_t)((sub->qh[i] >> (2 * row)) & 3);
                        s->b[row][32 * g + i] = (uint8_t)((row % 2 ? ql >> 4 : ql & 0xf) | top << 4);
                    }
            } else {
                const blk_q4_Kx8 *q = (const blk_q4_Kx8 *)blk[g];
                const uint8_t *qh = type == Q5_K ? ((const blk_q5_Kx8 *)blk[g])->qh[sb] : NULL;
                for (int v = 0; v < 4; v++) nibble_rows(q->qs[sb][v], qh, 2 * v, g, 2 * v, s);
            }
        }
        amx_product(x + offsetof(act256, q) + width * sb, act_row, s);
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < groups; g++)
                for (int i = 0; i < 8; i++) {
                    const int32_t scale = six ? ((const blk_q6_Kx8 *)blk[g])->sc[sb / 2][i][sb % 2]
                                              : ((const blk_q4_Kx8 *)blk[g])->sc[sb / 2][i][sb % 2];
                    s->isum[r][8 * g + i] += scale * s->c[r][8 * g + i];
                }
    }
    for (int r = 0; r < rows; r++) {
        const act256 *a = (const act256 *)(x + r * act_row);
        for (int g = 0; g < groups; g++)
            for (int i = 0; i < 8; i++) {
                const float d = f16_to_f32(((const f16 *)blk[g])[i]);
                float v = fmaf((float)s->isum[r][8 * g + i], d * a->d, acc[r][8 * g + i]);
                if (!six) {
                    const blk_q4_Kx8 *q = (const blk_q4_Kx8 *)blk[g];
                    int32_t mins = 0;
                    for (int p = 0; p < 4; p++)
                        mins += q->mn[p][i][0] * a->sums32[2 * p] + q->mn[p][i][1] * a->sums32[2 * p + 1];
                    v = fmaf(-(float)mins, f16_to_f32(q->dmin[i]) * a->d, v);
                }
                acc[r][8 * g + i] = v;
            }
    }
}

// acc[r][8 g + i]: weight row 8 g + i of the task (groups of 8 rows, `row_bytes` apart per row) times activation
// row r (rows of act_row bytes from x).
static void amx_dot(int type, const uint8_t *w, int64_t row_bytes, int groups, const uint8_t *x, int64_t act_row,
                    int64_t nb, int rows, AmxScratch *s, float acc[16][16]) {
    const int64_t bb = 8 * x8_row_bytes(type), ab = type >= Q4_K ? (int64_t)sizeof(act256) : (int64_t)sizeof(act32);
    memset(s->b, 0, sizeof s->b);  // with one group the other's columns stay zero
    memset(acc, 0, 16 * sizeof acc[0]);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk[2] = {w + b * bb, w + 8 * row_bytes + b * bb};
        if (type >= Q4_K) amx_k(type, blk, groups, x + b * ab, act_row, rows, s, acc);
        else amx_small(type, blk, groups, x + b * ab, act_row, rows, s, acc);
    }
}

// flock_qgemm's tiles on AMX, inside its parallel region: the same outputs as its vector loop. Returns nonzero
// where an emulated tile operation met shapes the CPU would refuse.
static int amx_gemm(int type, const uint8_t *w, int64_t row_bytes, int64_t n, const uint8_t *xq, int64_t act_row,
                    int64_t nb, int64_t m, void *y, int64_t ldy, int out_bf16, int glu) {
    const int64_t m_tiles = (m + 15) / 16, tiles = (n + 15) / 16 * m_tiles;
    AmxScratch s;
    float acc[16][16], up[16][16];
    int configured = 0;  // the row count the tiles hold
#pragma omp for schedule(dynamic, m_tiles >= 4 ? m_tiles : 4 * m_tiles)
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t n0 = i / m_tiles * 16, m0 = i % m_tiles * 16;
        const int rows = m - m0 < 16 ? (int)(m - m0) : 16, groups = n - n0 < 16 ? 1 : 2;
        if (rows != configured) amx_configure(configured = rows, type == Q6_K ? 16 : 32);
        const uint8_t *x = xq + m0 * act_row;
        amx_dot(type, w + n0 * row_bytes, row_bytes, groups, x, act_row, nb, rows, &s, acc);
        if (glu) {
            amx_dot(type, w + (n0 + n) * row_bytes, row_bytes, groups, x, act_row, nb, rows, &s, up);
            for (int r = 0; r < rows; r++) silu_mul_rows(acc[r], up[r], 8 * groups);
        }
        for (int r = 0; r < rows; r++)
            for (int e = 0; e < 8 * groups; e++) {
                const int64_t at = (m0 + r) * ldy + n0 + e;
                if (out_bf16) ((bf16 *)y)[at] = f32_to_bf16(acc[r][e]);
                else ((float *)y)[at] = acc[r][e];
            }
    }
    if (configured) TILE_RELEASE();
    return TILE_FAULTED();
}
