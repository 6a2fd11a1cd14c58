// silu(g) * u on 16 fp32 lanes (AVX-512): g u / (1 + e^-g), e^-g = 2^t by t's integer part (scalef: 0 or inf past
// the float range) and a degree-5 polynomial of its fraction (1.6e-7 relative error, far below the bf16 rounding
// that follows). The bf16 GEMMs' SiLU-and-mul epilogue.
#pragma once
#include <immintrin.h>

#include "exp2_poly.h"

static inline __m512 silu_mul512(__m512 g, __m512 u) {
    const __m512 t = _mm512_mul_ps(g, _mm512_set1_ps(-1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
    const __m512 p = EXP2_POLY5(f, _mm512_fmadd_ps, _mm512_set1_ps);
    const __m512 e = _mm512_scalef_ps(p, n);
    return _mm512_div_ps(_mm512_mul_ps(g, u), _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
}
