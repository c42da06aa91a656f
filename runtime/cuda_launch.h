/* The launch configuration every kernel of the decode step uses with
 * cudaLaunchKernelEx: grid, block, dynamic shared memory and stream, with
 * programmatic dependent launch (programmatic stream serialization) when
 * `pdl` is set: the kernel may then start while the previous kernel of the
 * stream finishes, and must execute griddepcontrol.wait before it reads
 * what that kernel wrote.  Capturable in a CUDA graph.  `at` holds the
 * attribute and must outlive the launch call.  CUDA C++ only. */
#ifndef MLART_RUNTIME_CUDA_LAUNCH_H
#define MLART_RUNTIME_CUDA_LAUNCH_H

#include <cuda_runtime.h>

static inline cudaLaunchConfig_t mlart_launch_cfg(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int pdl,
                                                  cudaLaunchAttribute at[1])
{
    cudaLaunchConfig_t lc;
    lc.gridDim = grid;
    lc.blockDim = block;
    lc.dynamicSmemBytes = smem;
    lc.stream = stream;
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    lc.attrs = at;
    lc.numAttrs = pdl ? 1 : 0;
    return lc;
}

#endif /* MLART_RUNTIME_CUDA_LAUNCH_H */
