// Two octets of interleaved rows (16 weight rows) at once on 512-bit VNNI: lanes 0-7 are the first octet's rows,
// 8-15 the second's. The same products and sums, in the same order, as the 8-row kernels run for each octet
// alone, so the same bits, in half their instructions. Only a band's later row tiles take them (flock_qgemm), its
// weights already in cache: no prefetches.
// Part of quant_gemm.c (included after the 8-row kernels).
#pragma once

#if defined(__AVX512VNNI__)

// 32 bytes at a and 32 at b as one vector
AI __m512i join32(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

// 8 halves at a and 8 at b as 16 floats
AI __m512 join_halves(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}

AI __m512i bcast4_x16(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return _mm512_set1_epi32(v);
}

AI void settle_x16(__m512i *v) { __asm__("" : "+v"(*v)); }  // as settle

AI void dot_q8_0_x16(const int R, const uint8_t *wa, const uint8_t *wb, const act32 *const *x, int64_t nb,
                     __m512 *acc) {
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q8_0x8 *ba = (const blk_q8_0x8 *)wa + b, *bb = (const blk_q8_0x8 *)wb + b;
        __m512i sums[MT];
        for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
        for (int v = 0; v < 8; v++) {
            const __m512i q = join32(ba->qs[v], bb->qs[v]);
            for (int r = 0; r < R; r++) {
                sums[r] = _mm512_dpbusd_epi32(sums[r], q, bcast4_x16(x[r][b].q + 4 * v));
                settle_x16(&sums[r]);
            }
        }
        const __m512 d = join_halves((const uint8_t *)ba->d, (const uint8_t *)bb->d);
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, _mm512_set1_ps(x[r][b].d)), acc[r]);
            acc[r] = _mm512_fnmadd_ps(d, _mm512_set1_ps(128 * x[r][b].s), acc[r]);
        }
    }
}

AI void dot_q45_x16(const int R, int type, const uint8_t *wa, const uint8_t *wb, const act32 *const *x, int64_t nb,
                    __m512 *acc) {
    const int five = has_qh(type);
    const __m512i low4 = _mm512_set1_epi8(0xf), bit4 = _mm512_set1_epi8(0x10);
    const int64_t bytes = 8 * x8_row_bytes(type);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *ba = wa + b * bytes, *bb = wb + b * bytes;
        __m512i h = five ? join32(ba + x8_qh_at(type), bb + x8_qh_at(type)) : _mm512_setzero_si512();
        __m512i sums[MT], wide[MT];  // the low and the high nibbles' products, as dot_q45_x8's two chains
        for (int r = 0; r < R; r++) sums[r] = wide[r] = _mm512_setzero_si512();
        for (int v = 0; v < 4; v++) {
            const __m512i q = join32(ba + x8_qs_at(type) + 32 * v, bb + x8_qs_at(type) + 32 * v);
            __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
            if (five) {  // as fifth_bits
                lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(h, 4), bit4));
                hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(h, 3), bit4));
                h = _mm512_srli_epi16(h, 2);
            }
            for (int r = 0; r < R; r++) {
                const int8_t *a = x[r][b].q + 8 * v;
                wide[r] = _mm512_dpbusd_epi32(wide[r], hi, bcast4_x16(a + 4));
                settle_x16(&wide[r]);
                sums[r] = _mm512_dpbusd_epi32(sums[r], lo, bcast4_x16(a));
                settle_x16(&sums[r]);
            }
        }
        const __m512 d = join_halves(ba, bb);
        const __m512 o = has_min(type) ? join_halves(ba + 16, bb + 16) : _mm512_mul_ps(d, _mm512_set1_ps(x8_offset(type)));
        for (int r = 0; r < R; r++) {
            const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(wide[r], sums[r]));
            acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, _mm512_set1_ps(x[r][b].d)), acc[r]);
            acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(x[r][b].s), acc[r]);
        }
    }
}

// 16 bytes at a and 16 at b as 32 int16 (unsigned bytes, or signed ones with sign)
AI __m512i join16_epi16(const void *a, const void *b, int sign) {
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                 _mm_loadu_si128((const __m128i *)b), 1);
    return sign ? _mm512_cvtepi8_epi16(both) : _mm512_cvtepu8_epi16(both);
}

AI __m512i pair_scale_x16(__m512i pairs, int odd) {  // as pair_scale
    const __m512i pick = _mm512_set4_epi64(0x0d0c0d0c09080908, 0x0504050401000100, 0x0d0c0d0c09080908,
                                           0x0504050401000100);
    return _mm512_shuffle_epi8(pairs, odd ? _mm512_add_epi8(pick, _mm512_set1_epi8(2)) : pick);
}

AI __m512i scaled_x16(__m512i sums, __m512i pairs) { return _mm512_mullo_epi32(sums, _mm512_srai_epi32(pairs, 16)); }

AI void dot_q45_K_x16(const int R, int type, const uint8_t *wa, const uint8_t *wb, const act256 *const *x,
                      int64_t nb, __m512 *acc) {
    const int five = type == Q5_K;
    const __m512i low4 = _mm512_set1_epi8(0xf), bit4 = _mm512_set1_epi8(0x10);
    const int64_t bytes = 8 * x8_row_bytes(type);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q4_Kx8 *ba = (const blk_q4_Kx8 *)(wa + b * bytes), *bb = (const blk_q4_Kx8 *)(wb + b * bytes);
        __m512i isum[MT];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        for (int sb = 0; sb < 8; sb++) {
            const __m512i scale = pair_scale_x16(join16_epi16(ba->sc[sb / 2], bb->sc[sb / 2], 0), sb % 2);
            __m512i h = five ? join32(((const blk_q5_Kx8 *)ba)->qh[sb], ((const blk_q5_Kx8 *)bb)->qh[sb])
                             : _mm512_setzero_si512();
            __m512i sums[MT];
            for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
            for (int v = 0; v < 4; v++) {
                const __m512i q = join32(ba->qs[sb][v], bb->qs[sb][v]);
                __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
                if (five) {
                    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(h, 4), bit4));
                    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(h, 3), bit4));
                    h = _mm512_srli_epi16(h, 2);
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *a = x[r][b].q + 32 * sb + 8 * v;
                    sums[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[r], lo, bcast4_x16(a)), hi, bcast4_x16(a + 4));
                    settle_x16(&sums[r]);
                }
            }
            for (int r = 0; r < R; r++) isum[r] = _mm512_add_epi32(isum[r], scaled_x16(sums[r], scale));
        }
        const __m512 d = join_halves((const uint8_t *)ba->d, (const uint8_t *)bb->d);
        const __m512 dmin = join_halves((const uint8_t *)ba->dmin, (const uint8_t *)bb->dmin);
        for (int r = 0; r < R; r++) {
            __m512i mins = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++)
                mins = _mm512_add_epi32(mins, _mm512_madd_epi16(join16_epi16(ba->mn[p], bb->mn[p], 0),
                                                                bcast4_x16((const int8_t *)(x[r][b].sums32 + 2 * p))));
            const __m512 xd = _mm512_set1_ps(x[r][b].d);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, xd), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, xd), acc[r]);
        }
    }
}

AI void dot_q6_K_x16(const int R, const uint8_t *wa, const uint8_t *wb, const act256 *const *x, int64_t nb,
                     __m512 *acc) {
    const __m512i low4 = _mm512_set1_epi8(0xf), top2 = _mm512_set1_epi8(0x30);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q6_Kx8 *ba = (const blk_q6_Kx8 *)wa + b, *bb = (const blk_q6_Kx8 *)wb + b;
        __m512i isum[MT];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) {
            const __m512i pairs = join16_epi16(ba->sc[p], bb->sc[p], 1);
            for (int r = 0; r < R; r++)
                isum[r] = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(
                    _mm512_madd_epi16(pairs, bcast4_x16((const int8_t *)(x[r][b].bsums + 2 * p))), 5));
            for (int h = 0; h < 2; h++) {  // a sub-block's 16 products in one int32 chain, then its scale
                const int sb = 2 * p + h;
                const __m512i qh = join32(ba->sub[sb].qh, bb->sub[sb].qh);
                __m512i sums[MT];
                for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
                for (int half = 0; half < 2; half++) {
                    const __m512i ql = join32(ba->sub[sb].qs[half], bb->sub[sb].qs[half]);
                    const __m512i hi = half ? qh : _mm512_slli_epi16(qh, 4);
                    const __m512i g0 = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(hi, top2));
                    const __m512i g1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                                       _mm512_and_si512(_mm512_srli_epi16(hi, 2), top2));
                    for (int r = 0; r < R; r++) {
                        const int8_t *a = x[r][b].q + 16 * sb + 8 * half;
                        sums[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[r], g0, bcast4_x16(a)), g1,
                                                      bcast4_x16(a + 4));
                        settle_x16(&sums[r]);
                    }
                }
                const __m512i scale = pair_scale_x16(pairs, h);
                for (int r = 0; r < R; r++) isum[r] = _mm512_add_epi32(isum[r], scaled_x16(sums[r], scale));
            }
        }
        const __m512 d = join_halves((const uint8_t *)ba->d, (const uint8_t *)bb->d);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(x[r][b].d)), acc[r]);
    }
}

AI void dot_iq4_xs_x16(const int R, int type, const uint8_t *wa, const uint8_t *wb, const act256 *const *x,
                       int64_t nb, __m512 *acc) {
    const __m512i low4 = _mm512_set1_epi8(0xf);
    const __m512i table = _mm512_xor_si512(  // the values plus 128
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table_values(type))), _mm512_set1_epi8(-128));
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_iq4_xsx8 *ba = (const blk_iq4_xsx8 *)wa + b, *bb = (const blk_iq4_xsx8 *)wb + b;
        __m512i isum[MT], pairs[4];
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++) {
            pairs[p] = join16_epi16(ba->sc[p], bb->sc[p], 1);
            for (int r = 0; r < R; r++)
                isum[r] = _mm512_sub_epi32(isum[r], _mm512_slli_epi32(
                    _mm512_madd_epi16(pairs[p], bcast4_x16((const int8_t *)(x[r][b].sums32 + 2 * p))), 7));
        }
        for (int sb = 0; sb < 8; sb++) {
            __m512i sums[MT];
            for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
            for (int v = 0; v < 4; v++) {
                const __m512i q = join32(ba->qs[sb][v], bb->qs[sb][v]);
                const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(q, low4));
                const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
                for (int r = 0; r < R; r++) {
                    const int8_t *a = x[r][b].q + 32 * sb + 8 * v;
                    sums[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[r], lo, bcast4_x16(a)), hi,
                                                  bcast4_x16(a + 4));
                    settle_x16(&sums[r]);
                }
            }
            const __m512i scale = pair_scale_x16(pairs[sb / 2], sb % 2);
            for (int r = 0; r < R; r++) isum[r] = _mm512_add_epi32(isum[r], scaled_x16(sums[r], scale));
        }
        const __m512 d = _mm512_mul_ps(join_halves((const uint8_t *)ba->d, (const uint8_t *)bb->d),
                                       _mm512_set1_ps(d_scale(type)));
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(x[r][b].d)), acc[r]);
    }
}

AI void dot_q23_K_x16(const int R, const int form, int type, const uint8_t *wa, const uint8_t *wb,
                      const act256 *const *x, int64_t nb, __m512 *acc) {
    const int q3 = form != Q2_K, table = is_q3_table(form);  // as dot_q23_K_x8's
    const __m512i three = _mm512_set1_epi8(3), low4 = _mm512_set1_epi16(0xf), four = _mm512_set1_epi8(4);
    const __m512i values = _mm512_broadcast_i32x4(_mm256_castsi256_si128(q3_table(type)));
    const int64_t bytes = 8 * x8_row_bytes(type);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q2_Kx8 *ba = (const blk_q2_Kx8 *)(wa + b * bytes), *bb = (const blk_q2_Kx8 *)(wb + b * bytes);
        const blk_q3_Kx8 *ta = (const blk_q3_Kx8 *)ba, *tb = (const blk_q3_Kx8 *)bb;
        __m512i isum[MT], mins[MT];
        for (int r = 0; r < R; r++) isum[r] = mins[r] = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) {
            const __m512i sm = q3 ? join16_epi16(ta->sc[p], tb->sc[p], 1) : join16_epi16(ba->sm[p], bb->sm[p], 0);
            const __m512i pairs = q3 ? sm : _mm512_and_si512(sm, low4), mn = q3 ? sm : _mm512_srli_epi16(sm, 4);
            const __m512i qh = q3 ? join32(ta->qh[p], tb->qh[p]) : _mm512_setzero_si512();
            for (int r = 0; r < R; r++) {
                const __m512i sums16 = bcast4_x16((const int8_t *)(x[r][b].bsums + 2 * p));
                mins[r] = _mm512_add_epi32(mins[r], _mm512_madd_epi16(mn, sums16));
            }
            for (int h = 0; h < 2; h++) {
                const int sb = 2 * p + h;
                const __m512i q = q3 ? join32(ta->qs[sb], tb->qs[sb]) : join32(ba->qs[sb], bb->qs[sb]);
                __m512i sums[MT];
                for (int r = 0; r < R; r++) sums[r] = _mm512_setzero_si512();
                for (int g = 0; g < 4; g++) {
                    __m512i u = _mm512_and_si512(_mm512_srli_epi16(q, 2 * g), three);
                    if (q3) {  // as third_bits
                        const int bit = 4 * h + g;
                        u = _mm512_or_si512(u, _mm512_and_si512(bit >= 2 ? _mm512_srli_epi16(qh, bit - 2)
                                                                         : _mm512_slli_epi16(qh, 2 - bit), four));
                    }
                    if (table) u = _mm512_shuffle_epi8(values, u);
                    for (int r = 0; r < R; r++) {
                        sums[r] = _mm512_dpbusd_epi32(sums[r], u, bcast4_x16(x[r][b].q + 16 * sb + 4 * g));
                        settle_x16(&sums[r]);
                    }
                }
                const __m512i scale = pair_scale_x16(pairs, h);
                for (int r = 0; r < R; r++) isum[r] = _mm512_add_epi32(isum[r], scaled_x16(sums[r], scale));
            }
        }
        const __m512 d = _mm512_mul_ps(join_halves((const uint8_t *)ba->d, (const uint8_t *)bb->d),
                                       _mm512_set1_ps(d_scale(type)));
        const __m512 dmin = q3 ? d : join_halves((const uint8_t *)ba->dmin, (const uint8_t *)bb->dmin);
        for (int r = 0; r < R; r++) {
            const __m512 xd = _mm512_set1_ps(x[r][b].d);
            if (q3) isum[r] = _mm512_sub_epi32(isum[r], table ? _mm512_slli_epi32(mins[r], Q3_TABLE_SHIFT)
                                                              : _mm512_slli_epi32(mins[r], 2));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, xd), acc[r]);
            if (!q3) acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[r]), _mm512_mul_ps(dmin, xd), acc[r]);
        }
    }
}

// The dot products of 16 interleaved rows (octets at wa and wb) with R activation rows: out[16 r + i] for row i.
// 0 where this build has no 512-bit kernels (the caller then runs each octet).
static int dot_x16(int R, int type, const uint8_t *wa, const uint8_t *wb, const void *const *x, int64_t nb,
                   float *out) {
    __m512 acc[MT];
#define X16_TYPES(r)                                                                                \
    switch (type) {                                                                                 \
        case Q4_K: dot_q45_K_x16(r, Q4_K, wa, wb, (const act256 *const *)x, nb, acc); break;        \
        case Q5_K: dot_q45_K_x16(r, Q5_K, wa, wb, (const act256 *const *)x, nb, acc); break;        \
        case Q6_K: dot_q6_K_x16(r, wa, wb, (const act256 *const *)x, nb, acc); break;               \
        case IQ4_XS: case IQ3_S_T: case IQ3_XXS_T: case IQ2_XXS_T: case IQ1_S_T:                    \
            dot_iq4_xs_x16(r, type, wa, wb, (const act256 *const *)x, nb, acc); break;              \
        case Q2_K: dot_q23_K_x16(r, Q2_K, Q2_K, wa, wb, (const act256 *const *)x, nb, acc); break;  \
        case Q3_K: dot_q23_K_x16(r, Q3_K, Q3_K, wa, wb, (const act256 *const *)x, nb, acc); break;  \
        case IQ2_XS_T: case IQ2_S_T: case IQ1_M_T:                                                  \
            dot_q23_K_x16(r, IQ2_XS_T, type, wa, wb, (const act256 *const *)x, nb, acc); break;         \
        case Q8_0: dot_q8_0_x16(r, wa, wb, (const act32 *const *)x, nb, acc); break;                \
        case Q4_0: dot_q45_x16(r, Q4_0, wa, wb, (const act32 *const *)x, nb, acc); break;           \
        case Q4_1: dot_q45_x16(r, Q4_1, wa, wb, (const act32 *const *)x, nb, acc); break;           \
        case Q5_0: dot_q45_x16(r, Q5_0, wa, wb, (const act32 *const *)x, nb, acc); break;           \
        default: dot_q45_x16(r, Q5_1, wa, wb, (const act32 *const *)x, nb, acc); break;             \
    }
    switch (R) {
        case 1: X16_TYPES(1); break;
        case 2: X16_TYPES(2); break;
        case 3: X16_TYPES(3); break;
        default: X16_TYPES(4); break;
    }
#undef X16_TYPES
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
    return 1;
}
#else
static int dot_x16(int R, int type, const uint8_t *wa, const uint8_t *wb, const void *const *x, int64_t nb,
                   float *out) {
    (void)R, (void)type, (void)wa, (void)wb, (void)x, (void)nb, (void)out;
    return 0;
}
#endif
