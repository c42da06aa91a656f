/* Host-side number formats shared by the CPU twins, the reference backend and
 * the tests: bf16 and fp8 e4m3 (the "fn" variant: max 448, no infinities,
 * 0x7f/0xff = NaN), round-to-nearest-even.  Device code uses cuda_bf16.h and
 * cuda_fp8.h, which round the same way. */
#ifndef MLART_OPS_NUMERICS_H
#define MLART_OPS_NUMERICS_H

#include <math.h>
#include <stddef.h>
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

/* Double to bf16 with a single rounding (RNE): round to float by
 * round-to-odd first, so the second rounding cannot create a false tie. */
static inline uint16_t mlart_f64_to_bf16(double d)
{
    float f = (float)d;
    uint32_t u;
    if (isnan(d))
        return 0x7fc0;
    if ((double)f != d && !isinf(d)) {
        memcpy(&u, &f, sizeof u);
        if (fabs((double)f) > fabs(d))
            u -= 1; /* rounded away from zero: step back toward it */
        u |= 1u;    /* inexact: sticky bit */
        memcpy(&f, &u, sizeof f);
    }
    return mlart_f32_to_bf16(f);
}

/* ---- fp8_ds_mla cache records ------------------------------------------
 * One token: L e4m3 latent values, then L/128 fp32 tile scales, then R bf16
 * rope values (656 bytes at L=512, R=64; the public FlashMLA sparse record).
 * A tile's value v is stored as e4m3_rne(v / scale) and read back as
 * e4m3 * scale. */
#define MLART_FP8_DS_MLA_TILE 128

static inline size_t mlart_fp8_ds_mla_record_bytes(int L, int R)
{
    return (size_t)L + sizeof(float) * (size_t)(L / MLART_FP8_DS_MLA_TILE) +
           sizeof(uint16_t) * (size_t)R;
}

/* Tile scale 2^ceil(log2(amax/448)), exactly: the smallest power of two s
 * with 448*s >= amax, found by exact comparisons (no log, no rounded
 * quotient).  An all-zero tile (amax == 0) gets scale 1.0: every value
 * encodes to +-0 whatever the scale, and 1.0 keeps the scale a normal
 * number for readers that take its reciprocal.  Non-finite amax: NaN (the
 * writer refuses such rows before calling this). */
static inline float mlart_fp8_ds_mla_tile_scale(float amax)
{
    int e, k;
    if (!isfinite(amax))
        return NAN;
    if (!(amax > 0.0f))
        return 1.0f;
    (void)frexpf(amax, &e); /* 2^(e-1) <= amax < 2^e */
    /* 448 = 1.75 * 2^8: 448*2^(e-10) < 2^(e-1) <= amax < 448*2^(e-8),
     * so the answer is e-9 or e-8. */
    k = e - 9;
    if (ldexp(448.0, k) < (double)amax)
        k++;
    if (k < -149) /* below the smallest float; only float subnormal amax */
        k = -149;
    return ldexpf(1.0f, k);
}

/* Encode one row of L+R bf16 values (latent then rope) into a record. */
static inline void mlart_fp8_ds_mla_encode(const uint16_t *row, int L, int R, uint8_t *rec)
{
    int tiles = L / MLART_FP8_DS_MLA_TILE;
    for (int t = 0; t < tiles; t++) {
        const uint16_t *src = row + t * MLART_FP8_DS_MLA_TILE;
        uint8_t *dst = rec + t * MLART_FP8_DS_MLA_TILE;
        float amax = 0.0f, scale;
        int e;
        for (int i = 0; i < MLART_FP8_DS_MLA_TILE; i++) {
            float a = fabsf(mlart_bf16_to_f32(src[i]));
            if (a > amax)
                amax = a;
        }
        scale = mlart_fp8_ds_mla_tile_scale(amax);
        (void)frexpf(scale, &e); /* scale = 2^(e-1): divide exactly by scaling */
        for (int i = 0; i < MLART_FP8_DS_MLA_TILE; i++)
            dst[i] = mlart_f32_to_e4m3(ldexpf(mlart_bf16_to_f32(src[i]), 1 - e));
        memcpy(rec + L + sizeof(float) * (size_t)t, &scale, sizeof scale);
    }
    memcpy(rec + L + sizeof(float) * (size_t)tiles, row + L, sizeof(uint16_t) * (size_t)R);
}

/* Decode a record into L+R floats (latent dequantised, then rope).  Exact:
 * an e4m3 value times a power of two fits a float (barring underflow of
 * the tiniest products). */
static inline void mlart_fp8_ds_mla_decode(const uint8_t *rec, int L, int R, float *out)
{
    int tiles = L / MLART_FP8_DS_MLA_TILE;
    for (int t = 0; t < tiles; t++) {
        float scale;
        memcpy(&scale, rec + L + sizeof(float) * (size_t)t, sizeof scale);
        for (int i = 0; i < MLART_FP8_DS_MLA_TILE; i++)
            out[t * MLART_FP8_DS_MLA_TILE + i] =
                mlart_e4m3_to_f32(rec[t * MLART_FP8_DS_MLA_TILE + i]) * scale;
    }
    for (int r = 0; r < R; r++) {
        uint16_t h;
        memcpy(&h, rec + L + sizeof(float) * (size_t)tiles + sizeof h * (size_t)r, sizeof h);
        out[(size_t)L + (size_t)r] = mlart_bf16_to_f32(h); /* L + R may pass INT_MAX */
    }
}

#endif /* MLART_OPS_NUMERICS_H */
