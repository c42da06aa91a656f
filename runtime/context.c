/* Context: the device a set of layers lives on (host or one CUDA ordinal). */
#include "runtime/status.h"

#include <stdlib.h>

#ifdef MLART_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

struct mlart_context {
    int device; /* -1 host, else CUDA ordinal */
};

int mlart_cuda_device_count(int *count)
{
    if (!count)
        return mlart_set_error(MLART_EINVAL, "mlart_cuda_device_count: NULL count");
#ifdef MLART_WITH_CUDA
    {
        int n = 0;
        cudaError_t err = cudaGetDeviceCount(&n);
        if (err != cudaSuccess) {
            (void)cudaGetLastError();
            /* no driver (35), only the driver stub (34) or no device (100): a CPU machine */
            if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice ||
                err == cudaErrorStubLibrary) {
                mlart_log(MLART_LOG_DEBUG, "cudaGetDeviceCount: %s (%d): no CUDA device",
                          cudaGetErrorName(err), (int)err);
                *count = 0;
                return 0;
            }
            return mlart_set_error(MLART_ECUDA, "cudaGetDeviceCount failed: %s (%d): %s",
                                   cudaGetErrorName(err), (int)err, cudaGetErrorString(err));
        }
        *count = n;
        return 0;
    }
#else
    *count = 0;
    return 0;
#endif
}

int mlart_context_create(int device, mlart_context **out)
{
    mlart_context *ctx;
    if (!out)
        return mlart_set_error(MLART_EINVAL, "mlart_context_create: NULL out");
    if (device < -1)
        return mlart_set_error(MLART_EINVAL, "mlart_context_create: device %d (want -1 for the "
                               "host or a CUDA ordinal >= 0)", device);
    if (device >= 0) {
        int n;
        MLART_CHECK(mlart_cuda_device_count(&n));
        if (device >= n)
            return mlart_set_error(MLART_ENODEV, "CUDA device %d requested but %d device%s "
                                   "usable%s", device, n, n == 1 ? " is" : "s are",
#ifdef MLART_WITH_CUDA
                                   ""
#else
                                   " (this build has no CUDA)"
#endif
            );
#ifdef MLART_WITH_CUDA
        {
            cudaError_t err = cudaSetDevice(device);
            if (err != cudaSuccess)
                return mlart_set_error(MLART_ECUDA, "cudaSetDevice(%d): %s", device,
                                       cudaGetErrorString(err));
        }
#endif
    }
    ctx = calloc(1, sizeof *ctx);
    if (!ctx)
        return mlart_set_error(MLART_ENOMEM, "mlart_context_create: out of memory");
    ctx->device = device;
    *out = ctx;
    return 0;
}

void mlart_context_destroy(mlart_context *ctx)
{
    free(ctx);
}

int mlart_context_device(const mlart_context *ctx)
{
    return ctx ? ctx->device : -1;
}
