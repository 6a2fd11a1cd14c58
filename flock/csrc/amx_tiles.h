// AMX tiles for the kernels that use them: the tile configuration, Linux's permission, and the tile operations
// as TILE_* macros. Built with FLOCK_EMULATED_AMX, the macros run the same operations in portable C (each tile
// 16 rows x 64 bytes in thread-local memory, shapes checked as the CPU checks them): how CPUs without AMX test
// the kernels' layouts. TILE_FAULTED() says whether an emulated operation met shapes the CPU would refuse.
// amx_bf16_x64 is the bf16 product the GEMM and the attention kernel share: rows times 64 columns of pairs.
#pragma once
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

#ifdef FLOCK_EMULATED_AMX

static _Thread_local struct {
    TileConfig cfg;
    uint8_t tile[8][16][64];
    int faulted;
} amx_emu;

static inline int amx_request_tiles(void) { return 0; }

static inline void amx_emu_config(const TileConfig *cfg) {
    amx_emu.cfg = *cfg;
    memset(amx_emu.tile, 0, sizeof amx_emu.tile);
    for (int t = 0; t < 8; t++)
        if (cfg->rows[t] > 16 || cfg->colsb[t] > 64) amx_emu.faulted = 1;
}

static inline void amx_emu_load(int t, const void *src, int64_t stride) {
    memset(amx_emu.tile[t], 0, sizeof amx_emu.tile[t]);
    for (int r = 0; r < amx_emu.cfg.rows[t]; r++)
        memcpy(amx_emu.tile[t][r], (const uint8_t *)src + r * stride, amx_emu.cfg.colsb[t]);
}

static inline void amx_emu_store(int t, void *dst, int64_t stride) {
    for (int r = 0; r < amx_emu.cfg.rows[t]; r++)
        memcpy((uint8_t *)dst + r * stride, amx_emu.tile[t][r], amx_emu.cfg.colsb[t]);
}

static inline float amx_emu_bf16(const uint8_t *p) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)(p[0] | p[1] << 8) << 16};
    return v.f;
}

// Whether tiles c += a b have shapes the CPU takes (else a fault, and the product is not done).
static inline int amx_emu_shapes(int c, int a, int b) {
    const TileConfig *g = &amx_emu.cfg;
    if (g->rows[a] == g->rows[c] && g->colsb[a] / 4 == g->rows[b] && g->colsb[b] == g->colsb[c]) return 1;
    amx_emu.faulted = 1;
    return 0;
}

// c[m][n] += sum over pairs k of a[m][2k] b[k][2n] + a[m][2k + 1] b[k][2n + 1] (bf16 in, fp32 sums)
static inline void amx_emu_dpbf16ps(int c, int a, int b) {
    const TileConfig *g = &amx_emu.cfg;
    if (!amx_emu_shapes(c, a, b)) return;
    for (int m = 0; m < g->rows[c]; m++)
        for (int n = 0; n < g->colsb[c] / 4; n++) {
            float acc;
            memcpy(&acc, amx_emu.tile[c][m] + 4 * n, 4);
            for (int k = 0; k < g->colsb[a] / 4; k++)
                acc += amx_emu_bf16(amx_emu.tile[a][m] + 4 * k) * amx_emu_bf16(amx_emu.tile[b][k] + 4 * n) +
                       amx_emu_bf16(amx_emu.tile[a][m] + 4 * k + 2) * amx_emu_bf16(amx_emu.tile[b][k] + 4 * n + 2);
            memcpy(amx_emu.tile[c][m] + 4 * n, &acc, 4);
        }
}

// c[m][n] += sum over k of the 4 products of a[m][4k + j] (signed bytes) and b[k][4n + j] (unsigned, or signed
// with b_signed), in int32
static inline void amx_emu_dpbs(int c, int a, int b, int b_signed) {
    const TileConfig *g = &amx_emu.cfg;
    if (!amx_emu_shapes(c, a, b)) return;
    for (int m = 0; m < g->rows[c]; m++)
        for (int n = 0; n < g->colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, amx_emu.tile[c][m] + 4 * n, 4);
            for (int k = 0; k < g->colsb[a]; k++) {
                const uint8_t w = amx_emu.tile[b][k / 4][4 * n + k % 4];
                acc += (int8_t)amx_emu.tile[a][m][k] * (b_signed ? (int32_t)(int8_t)w : (int32_t)w);
            }
            memcpy(amx_emu.tile[c][m] + 4 * n, &acc, 4);
        }
}

#define TILE_CONFIG(cfg) amx_emu_config(cfg)
#define TILE_LOAD(t, src, stride) amx_emu_load(t, src, stride)
#define TILE_STORE(t, dst, stride) amx_emu_store(t, dst, stride)
#define TILE_ZERO(t) memset(amx_emu.tile[t], 0, sizeof amx_emu.tile[t])
#define TILE_DPBF16PS(c, a, b) amx_emu_dpbf16ps(c, a, b)
#define TILE_DPBSUD(c, a, b) amx_emu_dpbs(c, a, b, 0)
#define TILE_DPBSSD(c, a, b) amx_emu_dpbs(c, a, b, 1)
#define TILE_RELEASE() memset(&amx_emu.cfg, 0, sizeof amx_emu.cfg)
#define TILE_FAULTED() amx_emu.faulted

#else
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands out AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 0 when granted
static inline int amx_request_tiles(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

#define TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define TILE_LOAD(t, src, stride) _tile_loadd(t, src, stride)
#define TILE_STORE(t, dst, stride) _tile_stored(t, dst, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_RELEASE() _tile_release()
#define TILE_FAULTED() 0
#endif

// The bf16 products' tiles: 0-3 a block's sums (16 fp32 columns each), 4 its A rows (`rows` of them), 5-7 B
// tiles (16 pairs x 16 columns).
static inline void amx_configure_bf16(int rows) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)(t < 5 ? rows : 16);
        cfg.colsb[t] = 64;
    }
    TILE_CONFIG(&cfg);
}

// c[r][64] (rows 64 floats apart) = a (the configured rows, lda bf16 apart) times 64 columns of pairs
// b [k / 2][64] over the whole of K (a multiple of 32).
static inline void amx_bf16_x64(const uint16_t *a, int64_t lda, const int32_t *b, int64_t k, float *c) {
    TILE_ZERO(0);  // tile numbers are immediates
    TILE_ZERO(1);
    TILE_ZERO(2);
    TILE_ZERO(3);
    for (int64_t k0 = 0; k0 < k; k0 += 32) {
        const int32_t *w = b + k0 / 2 * 64;
        TILE_LOAD(4, a + k0, lda * 2);
        TILE_LOAD(5, w, 256);
        TILE_LOAD(6, w + 16, 256);
        TILE_LOAD(7, w + 32, 256);
        TILE_DPBF16PS(0, 4, 5);
        TILE_DPBF16PS(1, 4, 6);
        TILE_LOAD(5, w + 48, 256);
        TILE_DPBF16PS(2, 4, 7);
        TILE_DPBF16PS(3, 4, 5);
    }
    TILE_STORE(0, c, 256);
    TILE_STORE(1, c + 16, 256);
    TILE_STORE(2, c + 32, 256);
    TILE_STORE(3, c + 48, 256);
}
