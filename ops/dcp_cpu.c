/* Decode-context parallel ops on the host (ops/ops.h): the twins of
 * ops/dcp.cu and the path of a layer on the CPU. */
#include "mlart/comm.h"
#include "ops/numerics.h"
#include "ops/ops.h"
#include "runtime/status.h"

#include <math.h>
#include <string.h>

int mlart_dcp_translate_cpu(const int32_t *idx, int64_t n_idx, const int32_t *seq_lens, int32_t B,
                            int32_t rank, int32_t size, int32_t interleave, int32_t *idx_local,
                            int32_t *lens_local)
{
    for (int64_t i = 0; i < n_idx; i++) {
        int32_t p = idx[i];
        idx_local[i] = p >= 0 && mlart_dcp_owner(p, size, interleave) == rank
                           ? (int32_t)mlart_dcp_local_pos(p, size, interleave)
                           : -1;
    }
    for (int32_t b = 0; b < B; b++)
        lens_local[b] = (int32_t)mlart_dcp_local_len(seq_lens[b] < 0 ? 0 : seq_lens[b], rank, size,
                                                     interleave);
    return 0;
}

int mlart_dcp_gather_heads_cpu(const uint16_t *src, int32_t D, int64_t T, int64_t H, int64_t C,
                               uint16_t *dst)
{
    const size_t row = (size_t)(H * C);
    for (int32_t d = 0; d < D; d++)
        for (int64_t t = 0; t < T; t++)
            memcpy(dst + ((size_t)t * D + (size_t)d) * row, src + ((size_t)d * T + (size_t)t) * row,
                   row * sizeof *src);
    return 0;
}

/* Largest of n LSEs spaced `step` apart, and the sum of exp(lse - max). */
static float lse_max(const float *lse, int32_t n, int64_t step)
{
    float m = -INFINITY;
    for (int32_t s = 0; s < n; s++)
        m = fmaxf(m, lse[s * step]);
    return m;
}

static float lse_sum(const float *lse, int32_t n, int64_t step, float m)
{
    float z = 0.0f;
    for (int32_t s = 0; s < n; s++)
        z += expf(lse[s * step] - m);
    return z;
}

int mlart_dcp_combine_cpu(const uint16_t *parts, const float *lses, int32_t D, int64_t H,
                          int64_t T, int64_t L, uint16_t *out, float *lse_out)
{
    const int64_t rows = H * T;
    for (int64_t r = 0; r < rows; r++) {
        float m = lse_max(lses + r, D, rows), z;
        uint16_t *o = out + r * L;
        if (m == -INFINITY) {
            for (int64_t c = 0; c < L; c++)
                o[c] = 0;
            lse_out[r] = -INFINITY;
            continue;
        }
        z = lse_sum(lses + r, D, rows, m);
        for (int64_t c = 0; c < L; c++) {
            float acc = 0.0f;
            for (int32_t s = 0; s < D; s++)
                acc += expf(lses[s * rows + r] - m) / z *
                       mlart_bf16_to_f32(parts[(s * rows + r) * L + c]);
            o[c] = mlart_f32_to_bf16(acc);
        }
        lse_out[r] = m + logf(z);
    }
    return 0;
}

int mlart_dcp_scale_cpu(const uint16_t *attn, const float *lse_all, int32_t D, int32_t rank,
                        int64_t H, int64_t T, int64_t L, float *scaled, float *lse_out)
{
    const int64_t G = (int64_t)D * H, rows = G * T;
    if (rank < 0 || rank >= D)
        return mlart_set_error(MLART_EINVAL, "dcp scale: rank %d outside [0, %d) (D ranks)",
                               (int)rank, (int)D);
    for (int64_t r = 0; r < rows; r++) {
        float m = lse_max(lse_all + r, D, rows), z = 0.0f, w = 0.0f;
        int64_t head = r / T;
        if (m != -INFINITY) {
            z = lse_sum(lse_all + r, D, rows, m);
            w = expf(lse_all[(int64_t)rank * rows + r] - m) / z;
        }
        for (int64_t c = 0; c < L; c++)
            scaled[r * L + c] = w * mlart_bf16_to_f32(attn[r * L + c]);
        if (head / H == rank)
            lse_out[r - (int64_t)rank * H * T] = m == -INFINITY ? -INFINITY : m + logf(z);
    }
    return 0;
}

int mlart_f32_to_bf16_cpu(const float *in, int64_t n, uint16_t *out)
{
    for (int64_t i = 0; i < n; i++)
        out[i] = mlart_f32_to_bf16(in[i]);
    return 0;
}
