/* Device helpers of the sm_90 kernels that stage operands with the copy
 * engine (TMA and bulk copies) and multiply them with wgmma: the shared-
 * memory mbarrier a stage is counted on, the proxy fence between ordinary
 * shared-memory writes and the tensor cores' reads, and the compiler fence
 * that keeps accumulator registers in place while wgmma owns them.  Used
 * by ops/query_bmm_wgmma.cu and backends/b12x_mla_sparse/b12x_wgmma.cu.
 * CUDA C++ only. */
#ifndef MLART_RUNTIME_CUDA_ASYNC_H
#define MLART_RUNTIME_CUDA_ASYNC_H

#include <stdint.h>

namespace mlart_sm90 {

/* An mbarrier in shared memory expecting `count` arrivals a phase. */
__device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

/* Wait until the phase of the given parity has completed. */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity)
{
    asm volatile("{\n.reg .pred done;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

/* One arrival. */
__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

/* One arrival that also expects `bytes` from the copy engine this phase. */
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

/* Ordinary shared-memory writes (and cp.async data) of this thread become
 * visible to the async proxy (wgmma, TMA) after a following barrier. */
__device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* Keeps the compiler from moving reads or writes of an accumulator across
 * the wgmma issue and wait points (the registers belong to the tensor
 * cores in between).  Emits no instruction. */
template <int N> __device__ __forceinline__ void reg_fence(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

} /* namespace mlart_sm90 */

#endif /* MLART_RUNTIME_CUDA_ASYNC_H */
