// What runs beside what on AMX tiles: nanoseconds per iteration of tile operations alone, AVX-512 work alone, and
// both in one instruction stream (bench/amx_overlap.py). The operands stay in L1; the tiles are 16 rows x 64 bytes.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "amx_tiles.h"

static uint16_t a_rows[16 * 64] __attribute__((aligned(64)));
static int32_t b_pairs[32 * 64] __attribute__((aligned(64)));
static float sums[16 * 64] __attribute__((aligned(64)));
static __m512 chains[8];

static void products(void) {  // 8 tdpbf16ps on tiles already loaded: the AMX work of a 16 x 64 x 64 product
    for (int k = 0; k < 2; k++) {
        TILE_DPBF16PS(0, 4, 5);
        TILE_DPBF16PS(1, 4, 6);
        TILE_DPBF16PS(2, 4, 7);
        TILE_DPBF16PS(3, 4, 5);
    }
}

static void loads(void) {  // 5 tile loads: one A tile and four B tiles
    TILE_LOAD(4, a_rows, 128);
    TILE_LOAD(5, b_pairs, 256);
    TILE_LOAD(6, b_pairs + 16, 256);
    TILE_LOAD(7, b_pairs + 32, 256);
    TILE_LOAD(5, b_pairs + 48, 256);
}

static void stores(void) {  // 4 tile stores: a 16 x 64 block of fp32 sums
    TILE_STORE(0, sums, 256);
    TILE_STORE(1, sums + 16, 256);
    TILE_STORE(2, sums + 32, 256);
    TILE_STORE(3, sums + 48, 256);
}

static void products_then_stores(void) { products(), stores(); }  // the stores wait for the products' sums

static void product(void) { amx_bf16_x64(a_rows, 64, b_pairs, 64, sums); }  // loads, products and stores

static void vector_work(void) {  // 128 AVX-512 FMAs in 8 independent chains, as a softmax's polynomials
    const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
    __m512 x[8];
    memcpy(x, chains, sizeof x);
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 8; j++) x[j] = _mm512_fmadd_ps(x[j], m, c);
    memcpy(chains, x, sizeof x);
}

static void none(void) {}

typedef void (*Part)(void);
static const Part PARTS[] = {products, loads, stores, products_then_stores, product, vector_work, none};

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

// Nanoseconds per iteration of parts `first` then `second` (indices into PARTS), the best of 7 runs of `iters`;
// negative where Linux refuses the tiles.
double flock_amx_overlap(int first, int second, int iters) {
    if (amx_request_tiles()) return -1.0;
    amx_configure_bf16(16);
    const Part f = PARTS[first], g = PARTS[second];
    double best = 1e30;
    for (int run = 0; run < 7; run++) {
        const double t = now_ns();
        for (int i = 0; i < iters; i++) f(), g();
        const double per = (now_ns() - t) / iters;
        best = per < best ? per : best;
    }
    TILE_RELEASE();
    return best;
}
