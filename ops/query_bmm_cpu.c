/* CPU twin of the query absorption (ops/ops.h): out[h,t,:] = a[h,t,:] x w[h],
 * FP32 accumulation over P in order, one bf16 rounding.  Each product of two
 * bf16 values is exact in FP32, so the result does not depend on whether the
 * compiler fuses multiply and add. */
#include <stdlib.h>

#include "ops/numerics.h"
#include "ops/ops.h"
#include "runtime/status.h"

static int on_host(const char *op, const char *name, const mlart_tensor *t)
{
    if (t->device != -1)
        return mlart_set_error(MLART_EINVAL, "%s: %s is on device %d; the CPU twin needs host memory",
                               op, name, t->device);
    return 0;
}

int mlart_query_bmm_cpu(const mlart_tensor *a, const mlart_tensor *w, const mlart_tensor *out,
                        const mlart_tensor *pe_in, const mlart_tensor *pe_out)
{
    int64_t H, T, P, L;
    float *acc;
    MLART_CHECK(mlart_query_bmm_check(a, w, out, pe_in, pe_out));
    MLART_CHECK(on_host("query_bmm_cpu", "a", a)); /* the check made all operands share a device */
    H = a->shape[0];
    T = a->shape[1];
    P = a->shape[2];
    L = w->shape[2];
    acc = malloc(sizeof *acc * (size_t)(L > 0 ? L : 1));
    if (!acc)
        return mlart_set_error(MLART_ENOMEM, "query_bmm_cpu: %lld floats of scratch",
                               (long long)L);
    for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *ar = (const uint16_t *)a->data + h * a->stride[0] + t * a->stride[1];
            uint16_t *orow = (uint16_t *)out->data + h * out->stride[0] + t * out->stride[1];
            for (int64_t l = 0; l < L; l++)
                acc[l] = 0.0f;
            for (int64_t p = 0; p < P; p++) {
                const uint16_t *wr = (const uint16_t *)w->data + h * w->stride[0] + p * w->stride[1];
                float av = mlart_bf16_to_f32(ar[p]);
                for (int64_t l = 0; l < L; l++)
                    acc[l] += av * mlart_bf16_to_f32(wr[l]);
            }
            for (int64_t l = 0; l < L; l++)
                orow[l] = mlart_f32_to_bf16(acc[l]);
        }
    free(acc);
    if (pe_in) {
        int64_t R = pe_in->shape[2];
        for (int64_t t = 0; t < pe_in->shape[0]; t++)
            for (int64_t h = 0; h < pe_in->shape[1]; h++) {
                const uint16_t *src =
                    (const uint16_t *)pe_in->data + t * pe_in->stride[0] + h * pe_in->stride[1];
                uint16_t *dst = (uint16_t *)pe_out->data + t * pe_out->stride[0] + h * pe_out->stride[1];
                for (int64_t r = 0; r < R; r++)
                    dst[r] = src[r];
            }
    }
    return 0;
}
