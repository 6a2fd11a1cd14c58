// A 16 x 16 matrix of 32-bit elements transposed in 16 AVX-512 registers (cascade_cpu.c's K repack; flock.native
// hashes the headers beside a source with it).
#pragma once
#include <immintrin.h>

static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // lane j of r[4a + b] now holds column 4j + b of rows 4a .. 4a + 3
    for (int b = 0; b < 4; b++) {
        t[b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88);
        t[4 + b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xdd);
        t[8 + b] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
        t[12 + b] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xdd);
    }
    for (int b = 0; b < 8; b++) {
        r[b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0x88);
        r[8 + b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0xdd);
    }
}
