/* Host-side number formats shared by the CPU twins, the reference backend and
 * the tests: bf16 and fp8 e4m3 (the "fn" variant: max 448, no infinities,
 * 0x7f/0xff = NaN), round-to-nearest-even.  Device code uses cuda_bf16.h and
 * cuda_fp8.h, which round the same way. */
#ifndef MLART_OPS_NUMERICS_H
#define MLART_OPS_NUMERICS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float mlart_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t mlart_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet and NaN */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float mlart_e4m3_to_f32(uint8_t b)
{
    int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7)
        return NAN;
    v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
    return (b & 0x80) ? -v : v;
}

/* Round-to-nearest-even; magnitudes past the largest finite value saturate
 * to +-448 (a caller that picks its scale never gets there). */
static inline uint8_t mlart_f32_to_e4m3(float x)
{
    uint8_t sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    int e, m, E;
    if (isnan(x))
        return (uint8_t)(sign | 0x7f);
    if (a >= 464.0f) /* 448 + half a step */
        return (uint8_t)(sign | 0x7e);
    if (a < 0.015625f) { /* below 2^-6: subnormal, quantum 2^-9 */
        m = (int)rintf(a * 512.0f); /* 8 rounds up into the smallest normal, same bits */
        return (uint8_t)(sign | m);
    }
    (void)frexpf(a, &e); /* a = f * 2^e, f in [0.5, 1) */
    m = (int)rintf((ldexpf(a, 1 - e) - 1.0f) * 8.0f);
    E = e + 6;
    if (m == 8) {
        m = 0;
        E++;
    }
    return (uint8_t)(sign | (E << 3) | m);
}

#endif /* MLART_OPS_NUMERICS_H */
