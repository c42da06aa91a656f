/* f32 -> e4m3 on the device, as the fp8_ds_mla records hold their values:
 * the hardware conversion (cvt.rn.satfinite.e4m3x2.f32 on sm_89 and later),
 * round to nearest even, finite values past 448 saturated to +-448.  For
 * every finite float this is mlart_f32_to_e4m3 of ops/numerics.h, bit for
 * bit (attn_kv_write_gpu, test_e4m3_exhaustive: every float whose low 16
 * bits are zero, every subnormal, 2^22 random ones); NaNs may differ in
 * sign.  CUDA C++ only. */
#ifndef MLART_OPS_E4M3_CUDA_CUH
#define MLART_OPS_E4M3_CUDA_CUH

#include <cuda_fp8.h>
#include <stdint.h>

__device__ __forceinline__ uint8_t mlart_e4m3_from_f32(float x)
{
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

#endif /* MLART_OPS_E4M3_CUDA_CUH */
