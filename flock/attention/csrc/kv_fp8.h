// fp8 KV rows (kv_cache_dtype fp8_e4m3, fp8_e5m2): a (token, KV head) row is head_dim codes and then its fp32
// scale (4 bytes at byte head_dim). Code c stands for fp8(c) * scale; scale is the row's largest |x| over the
// format's largest value (1 for a row of zeros), codes are x / scale rounded to the nearest even and saturated,
// as torch's float8 casts round (flock/kv/fp8.py is the reference). Decoding takes the codes as fp16 bits through
// vcvtph2ps on AVX-512 and builds the fp32 bits with integer operations on AVX2 (subnormal codes from integers):
// neither depends on the denormals-are-zero mode the kernel runs in. Included by cascade_cpu.c after its vector
// helpers.

enum { KV_MODEL, KV_E4M3, KV_E5M2 };  // the caches' elements: the model's dtype, or fp8 codes

#define FP8_MANT(e5m2) ((e5m2) ? 2 : 3)
#define FP8_BIAS(e5m2) ((e5m2) ? 15 : 7)
#define FP8_MAX(e5m2) ((e5m2) ? 57344.0f : 448.0f)
#define FP8_MIN_NORMAL(e5m2) ((e5m2) ? 0x1p-14f : 0x1p-6f)
#define FP8_SUBNORMAL(e5m2) ((e5m2) ? 0x1p-16f : 0x1p-9f)  // the value of subnormal code 1

static inline float fp8_scale(const uint8_t *row, int D) {
    float s;
    memcpy(&s, row + D, 4);
    return s;
}

// Scalar decoding (the portable repack of the emulated AMX build).
static inline float fp8_value(uint8_t c, const int e5m2) {
    const int mant = FP8_MANT(e5m2);
    const uint32_t mag = c & 0x7f;
    float x;
    if (mag < (1u << mant)) {
        x = (float)mag * FP8_SUBNORMAL(e5m2);
    } else {
        const uint32_t bits = (mag << (23 - mant)) + ((uint32_t)(127 - FP8_BIAS(e5m2)) << 23);
        memcpy(&x, &bits, 4);
    }
    return c & 0x80 ? -x : x;
}

#if defined(__AVX512F__)
typedef __m512i vi;
static inline vi vi_set1(int x) { return _mm512_set1_epi32(x); }
static inline vf vabs(vf x) { return _mm512_abs_ps(x); }
static inline vf select_lt(vf x, vf limit, vf a, vf b) {  // x < limit ? a : b, lane by lane
    return _mm512_mask_mov_ps(b, _mm512_cmp_ps_mask(x, limit, _CMP_LT_OQ), a);
}
#define VI(op) _mm512_##op##_epi32
#define VX(op) _mm512_##op##_si512
#define V_CAST_I(x) _mm512_castps_si512(x)
#define V_CAST_F(x) _mm512_castsi512_ps(x)
#define V_CVT_I(x) _mm512_cvtps_epi32(x)
#else
typedef __m256i vi;
static inline vi vi_set1(int x) { return _mm256_set1_epi32(x); }
static inline vi codes_widened(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vf vabs(vf x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
static inline vf select_lt(vf x, vf limit, vf a, vf b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, limit, _CMP_LT_OQ)); }
#define VI(op) _mm256_##op##_epi32
#define VX(op) _mm256_##op##_si256
#define V_CAST_I(x) _mm256_castps_si256(x)
#define V_CAST_F(x) _mm256_castsi256_ps(x)
#define V_CVT_I(x) _mm256_cvtps_epi32(x)
#endif

#if defined(__AVX512F__)
// fp8 codes (one per 16-bit lane) as fp16 bits: e5m2 is fp16's top byte; e4m3's exponent and mantissa sit one bit
// lower (the code as the top byte, shifted right arithmetically, the sign's copy cleared), a value 2^-8 of the
// code's (fp16's exponent bias is 8 more), which the scale factor below makes up. Subnormal codes become fp16
// subnormals, which vcvtph2ps converts exactly whatever the denormals-are-zero mode.
#define FP8_HALF_FACTOR(e5m2) ((e5m2) ? 1.0f : 256.0f)
static inline __m256i fp8_half16(__m256i w, const int e5m2) {
    const __m256i top = _mm256_slli_epi16(w, 8);
    return e5m2 ? top : _mm256_and_si256(_mm256_srai_epi16(top, 1), _mm256_set1_epi16((short)0xbfff));
}

static inline __m512i fp8_half32(__m512i w, const int e5m2) {
    const __m512i top = _mm512_slli_epi16(w, 8);
    return e5m2 ? top : _mm512_and_si512(_mm512_srai_epi16(top, 1), _mm512_set1_epi16((short)0xbfff));
}

// W codes at p as fp32, times scale.
static inline __attribute__((always_inline)) vf fp8_load(const uint8_t *p, const int e5m2, float scale) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    return vmul(_mm512_cvtph_ps(fp8_half16(w, e5m2)), vset1(scale * FP8_HALF_FACTOR(e5m2)));
}

#if defined(__AVX512BF16__)
// nd (32 or 16) codes at p as bf16 of their values times scale, zeros past nd.
static inline __attribute__((always_inline)) __m512i fp8_load_bf16(const uint8_t *p, int nd, const int e5m2,
                                                                   float scale) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(nd == 32 ? 0xffffffffu : 0xffffu, p));
    const __m512i h = fp8_half32(w, e5m2);
    const vf s = vset1(scale * FP8_HALF_FACTOR(e5m2));
    const vf lo = vmul(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s);
    const vf hi = vmul(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
#endif
#else
// W codes at p as fp32, times scale: the fp32 bits built from the code's fields (subnormal codes from integers).
static inline __attribute__((always_inline)) vf fp8_load(const uint8_t *p, const int e5m2, float scale) {
    const int mant = FP8_MANT(e5m2);
    const vi c = codes_widened(p), mag = VX(and)(c, vi_set1(0x7f));
    const vf normal = V_CAST_F(VI(add)(VI(slli)(mag, 23 - mant), vi_set1((127 - FP8_BIAS(e5m2)) << 23)));
    const vf m = _mm256_cvtepi32_ps(mag);
    const vf x = select_lt(m, vset1((float)(1 << mant)), vmul(m, vset1(FP8_SUBNORMAL(e5m2))), normal);
    const vf signed_x = V_CAST_F(VX(or)(V_CAST_I(x), VI(slli)(VX(and)(c, vi_set1(0x80)), 24)));
    return vmul(signed_x, vset1(scale));
}
#endif

// W values (already divided by their row's scale) as fp8 codes, one per 32-bit lane.
static inline __attribute__((always_inline)) vi fp8_codes(vf x, const int e5m2) {
    const int mant = FP8_MANT(e5m2), shift = 23 - mant;
    const vi sign = VX(and)(VI(srli)(V_CAST_I(x), 24), vi_set1(0x80));
    const vf a = vmin(vabs(x), vset1(FP8_MAX(e5m2)));  // saturated (a NaN too: min returns its second operand)
    const vi bits = V_CAST_I(a);
    const vi round = VI(add)(vi_set1((1 << (shift - 1)) - 1), VX(and)(VI(srli)(bits, shift), vi_set1(1)));
    const vi normal = VI(sub)(VI(srli)(VI(add)(bits, round), shift), vi_set1((127 - FP8_BIAS(e5m2)) << mant));
    const vi sub = V_CVT_I(vmul(a, vset1(1.0f / FP8_SUBNORMAL(e5m2))));  // the rounding mode's: nearest even
    const vf code = select_lt(a, vset1(FP8_MIN_NORMAL(e5m2)), V_CAST_F(sub), V_CAST_F(normal));
    return VX(or)(V_CAST_I(code), sign);
}

// Row x (D values, bf16 or fp32) as an fp8 row at dst: D codes and the scale.
static inline __attribute__((always_inline)) void fp8_row(uint8_t *dst, const void *x, int D, const int in_bf16,
                                                          const int e5m2) {
    vf top = vzero();
    for (int d = 0; d < D; d += W) top = vmax(top, vabs(in_bf16 ? load_bf16((const bf16 *)x + d) : vload((const float *)x + d)));
    const float amax = hmax(top), scale = amax > 0.0f ? amax / FP8_MAX(e5m2) : 1.0f;
    const vf s = vset1(scale);
    for (int d = 0; d < D; d += W) {
        const vf v = in_bf16 ? load_bf16((const bf16 *)x + d) : vload((const float *)x + d);
        const vi c = fp8_codes(vdiv(v, s), e5m2);
#if defined(__AVX512F__)
        _mm_storeu_si128((__m128i *)(dst + d), _mm512_cvtepi32_epi8(c));
#else
        const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        _mm_storel_epi64((__m128i *)(dst + d), _mm_packus_epi16(w, w));
#endif
    }
    memcpy(dst + D, &scale, 4);
}

#undef VI
#undef VX
#undef V_CAST_I
#undef V_CAST_F
#undef V_CVT_I
