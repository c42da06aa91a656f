/* Device-side clock reads for timing stamps.  CUDA C++ only. */
#ifndef MLART_RUNTIME_CUDA_CLOCK_H
#define MLART_RUNTIME_CUDA_CLOCK_H

/* The SM clock (%clock64) once v has arrived: an instruction that reads v
 * comes first (0 when v is NaN), so the stamp cannot be taken before the
 * work that produced v is done. */
__device__ __forceinline__ unsigned long long mlart_clock_after(float v)
{
    unsigned long long c;
    asm volatile("{\n .reg .pred p;\n setp.ne.f32 p, %1, %1;\n mov.u64 %0, 0;\n @!p mov.u64 %0, %%clock64;\n}\n"
                 : "=l"(c)
                 : "f"(v)
                 : "memory");
    return c;
}

#endif
