/* CPU twin of the V up-projection (ops/ops.h): o[h,t,:] = x[h,t,:] x w[h],
 * FP32 accumulation over L in order, one bf16 rounding (bf16 products are
 * exact in FP32, so fused or not gives the same bits). */
#include <stdlib.h>

#include "ops/numerics.h"
#include "ops/ops.h"
#include "runtime/status.h"

int mlart_v_up_bmm_cpu(const mlart_tensor *x, const mlart_tensor *w, const mlart_tensor *o)
{
    int64_t H, T, L, V;
    float *acc;
    MLART_CHECK(mlart_v_up_bmm_check(x, w, o));
    if (x->device != -1) /* the check made all operands share a device */
        return mlart_set_error(MLART_EINVAL,
                               "v_up_bmm_cpu: x is on device %d; the CPU twin needs host memory",
                               x->device);
    H = x->shape[0];
    T = x->shape[1];
    L = x->shape[2];
    V = w->shape[2];
    acc = malloc(sizeof *acc * (size_t)(V > 0 ? V : 1));
    if (!acc)
        return mlart_set_error(MLART_ENOMEM, "v_up_bmm_cpu: %lld floats of scratch", (long long)V);
    for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *xr = (const uint16_t *)x->data + h * x->stride[0] + t * x->stride[1];
            uint16_t *orow = (uint16_t *)o->data + h * o->stride[0] + t * o->stride[1];
            for (int64_t v = 0; v < V; v++)
                acc[v] = 0.0f;
            for (int64_t l = 0; l < L; l++) {
                const uint16_t *wr = (const uint16_t *)w->data + h * w->stride[0] + l * w->stride[1];
                float xv = mlart_bf16_to_f32(xr[l]);
                for (int64_t v = 0; v < V; v++)
                    acc[v] += xv * mlart_bf16_to_f32(wr[v]);
            }
            for (int64_t v = 0; v < V; v++)
                orow[v] = mlart_f32_to_bf16(acc[v]);
        }
    free(acc);
    return 0;
}
