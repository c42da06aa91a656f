/* V up-projection on sm_90: o[h,t,:] = x[h,t,:] x w_uv[h], written straight
 * into the token-major o[T, H*V] through its [H,T,V] view.  Same kernels as
 * the query absorption (ops/query_bmm.cu) with K = L and N = V. */
#include <cuda_runtime.h>

#include "ops/bmm_cuda.h"
#include "ops/ops.h"
#include "runtime/status.h"

static int v_up_run(const mlart_tensor *x, const mlart_tensor *w, const mlart_tensor *o, int pdl,
                    void *stream)
{
    mlart_bmm_desc s = {};
    mlart_bmm_config cfg = {};
    MLART_CHECK(mlart_v_up_bmm_check(x, w, o));
    if (x->device < 0 || w->device < 0 || o->device < 0)
        return mlart_set_error(MLART_EINVAL, "v_up_bmm_cuda: every tensor must be on a CUDA device");
    s.H = x->shape[0];
    s.T = x->shape[1];
    s.K = x->shape[2];
    s.N = w->shape[2];
    s.a = x->data;
    s.a_sh = x->stride[0];
    s.a_st = x->stride[1];
    s.w = w->data;
    s.w_sh = w->stride[0];
    s.w_sk = w->stride[1];
    s.c = o->data;
    s.c_sh = o->stride[0];
    s.c_st = o->stride[1];
    cfg.path = MLART_BMM_AUTO;
    cfg.pdl = pdl;
    return mlart_bmm_cuda_run(&s, &cfg, stream);
}

extern "C" int mlart_v_up_bmm_cuda(const mlart_tensor *x, const mlart_tensor *w, const mlart_tensor *o,
                                   void *stream)
{
    return v_up_run(x, w, o, 0, stream);
}

extern "C" int mlart_v_up_bmm_cuda_pdl(const mlart_tensor *x, const mlart_tensor *w, const mlart_tensor *o,
                                       void *stream)
{
    return v_up_run(x, w, o, 1, stream);
}
