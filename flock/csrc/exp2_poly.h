// 2^f for |f| <= 1/2: a degree-5 polynomial (1.6e-7 relative error) at the caller's vector width, where
// FMA(a, b, c) = a b + c and SET1(x) broadcasts x.
#define EXP2_POLY5(f, FMA, SET1)                                                                               \
    FMA(FMA(FMA(FMA(FMA(SET1(1.3276471e-3f), f, SET1(9.6755410e-3f)), f, SET1(5.5507131e-2f)), f,                \
                SET1(2.4022120e-1f)),                                                                          \
            f, SET1(6.9314694e-1f)),                                                                           \
        f, SET1(1.0000001f))
