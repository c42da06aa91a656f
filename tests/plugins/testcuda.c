/* A CUDA test backend with a CONTIGUOUS query contract: attend() copies the
 * q_nope operand it received to the host record (so the GPU layer test can
 * compare it byte for byte) and writes zeros as its output.  Not a real
 * attention: it exists to exercise the runtime's device-side
 * materialisation. */
#include "plugins/testhost.h"

#include <cuda_runtime_api.h>
#include <stdlib.h>

static testhost_record rec;

MLART_API testhost_record *testhost_record_get(void);
testhost_record *testhost_record_get(void)
{
    return &rec;
}

static int tc_create(const mlart_backend_init *init, void **out)
{
    static int token;
    (void)init;
    rec.init = *init;
    rec.creates++;
    *out = &token;
    return 0;
}

static void tc_destroy(void *st)
{
    if (st)
        rec.destroys++;
}

static int tc_plan(void *st, const mlart_plan *plan, size_t *ws)
{
    (void)st;
    rec.plan = *plan;
    rec.plans++;
    *ws = 4096;
    return 0;
}

static int tc_attend(void *st, const mlart_step *s, void *stream)
{
    const mlart_geometry *g = &s->geom;
    const int64_t n = (int64_t)g->heads * s->T * g->qk_nope;
    (void)st;
    rec.step = *s;
    rec.attends++;
    if (n > TESTHOST_MAX_Q)
        return rec.init.error(MLART_EINVAL, "testcuda: q_nope too large to record");
    if (cudaMemcpy(rec.q_nope, s->q_nope.data, (size_t)n * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemsetAsync(s->attn_out.data, 0, (size_t)g->heads * s->T * g->kv_lora * 2,
                        (cudaStream_t)stream) != cudaSuccess ||
        cudaMemsetAsync(s->lse.data, 0, (size_t)g->heads * s->T * 4, (cudaStream_t)stream) !=
            cudaSuccess)
        return rec.init.error(MLART_ECUDA, "testcuda: %s", cudaGetErrorString(cudaGetLastError()));
    rec.q_nope_count = n;
    return 0;
}

static const mlart_backend_vtable table = {
    .abi_version = MLART_BACKEND_ABI_VERSION,
    .struct_size = sizeof(mlart_backend_vtable),
    .name = "testcuda",
    .contract = {.query_bmm = MLART_QBMM_CONTIGUOUS,
                 .weights = MLART_W_DENSE,
                 .output = MLART_OUT_HEAD_MAJOR,
                 .kv_formats = MLART_KV_FORMAT_BIT(MLART_KV_BF16),
                 .head_multiple = 1,
                 .devices = MLART_DEV_CUDA},
    .create = tc_create,
    .destroy = tc_destroy,
    .plan = tc_plan,
    .attend = tc_attend,
};

MLART_API const mlart_backend_vtable *mlart_backend_entry_v1(void);
const mlart_backend_vtable *mlart_backend_entry_v1(void)
{
    return &table;
}
