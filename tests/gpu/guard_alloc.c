#include "guard_alloc.h"

#include <stdint.h>
#include <cuda.h> /* types only: the functions come through the runtime */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

typedef CUresult (*fn_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*fn_free_va)(CUdeviceptr, size_t);
typedef CUresult (*fn_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                              unsigned long long);
typedef CUresult (*fn_release)(CUmemGenericAllocationHandle);
typedef CUresult (*fn_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*fn_unmap)(CUdeviceptr, size_t);
typedef CUresult (*fn_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*fn_granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);

static struct {
    int ready;
    fn_reserve reserve;
    fn_free_va free_va;
    fn_create create;
    fn_release release;
    fn_map map;
    fn_unmap unmap;
    fn_set_access set_access;
    fn_granularity granularity;
    size_t gran;
} drv;

static char guard_err[256];

const char *mlart_guard_error(void)
{
    return guard_err;
}

static int entry(const char *name, void **fn)
{
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !*fn) {
        snprintf(guard_err, sizeof guard_err, "driver entry point %s: %s (query %d)", name,
                 cudaGetErrorString(e), (int)q);
        return -1;
    }
    return 0;
}

static void prop_for(CUmemAllocationProp *p, int device)
{
    memset(p, 0, sizeof *p);
    p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p->location.id = device;
}

int mlart_guard_init(int device)
{
    CUmemAllocationProp prop;
    CUresult r;
    if (drv.ready)
        return 0;
    if (cudaFree(0) != cudaSuccess) { /* make the primary context current */
        snprintf(guard_err, sizeof guard_err, "no CUDA context");
        return -1;
    }
    if (entry("cuMemAddressReserve", (void **)&drv.reserve) || entry("cuMemAddressFree", (void **)&drv.free_va) ||
        entry("cuMemCreate", (void **)&drv.create) || entry("cuMemRelease", (void **)&drv.release) ||
        entry("cuMemMap", (void **)&drv.map) || entry("cuMemUnmap", (void **)&drv.unmap) ||
        entry("cuMemSetAccess", (void **)&drv.set_access) ||
        entry("cuMemGetAllocationGranularity", (void **)&drv.granularity))
        return -1;
    prop_for(&prop, device);
    r = drv.granularity(&drv.gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS || drv.gran == 0) {
        snprintf(guard_err, sizeof guard_err, "cuMemGetAllocationGranularity: %d", (int)r);
        return -1;
    }
    drv.ready = 1;
    return 0;
}

size_t mlart_guard_granularity(void)
{
    return drv.gran;
}

int mlart_guard_alloc(mlart_guard_buf *b, size_t bytes, int device)
{
    CUmemAllocationProp prop;
    CUmemAccessDesc acc;
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h = 0;
    size_t mapped, reserved;
    CUresult r;
    memset(b, 0, sizeof *b);
    if (!drv.ready || bytes == 0) {
        snprintf(guard_err, sizeof guard_err, "guard_alloc: %s", bytes ? "not initialised" : "zero bytes");
        return -1;
    }
    mapped = (bytes + drv.gran - 1) / drv.gran * drv.gran;
    reserved = mapped + drv.gran; /* the granule after the mapping stays unmapped */
    prop_for(&prop, device);
    if ((r = drv.reserve(&va, reserved, drv.gran, 0, 0)) != CUDA_SUCCESS) {
        snprintf(guard_err, sizeof guard_err, "cuMemAddressReserve(%zu): %d", reserved, (int)r);
        return -1;
    }
    if ((r = drv.create(&h, mapped, &prop, 0)) != CUDA_SUCCESS) {
        snprintf(guard_err, sizeof guard_err, "cuMemCreate(%zu): %d", mapped, (int)r);
        drv.free_va(va, reserved);
        return -1;
    }
    if ((r = drv.map(va, mapped, 0, h, 0)) != CUDA_SUCCESS) {
        snprintf(guard_err, sizeof guard_err, "cuMemMap: %d", (int)r);
        drv.release(h);
        drv.free_va(va, reserved);
        return -1;
    }
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = device;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if ((r = drv.set_access(va, mapped, &acc, 1)) != CUDA_SUCCESS) {
        snprintf(guard_err, sizeof guard_err, "cuMemSetAccess: %d", (int)r);
        drv.unmap(va, mapped);
        drv.release(h);
        drv.free_va(va, reserved);
        return -1;
    }
    b->va = (unsigned long long)va;
    b->reserved = reserved;
    b->mapped = mapped;
    b->handle = (unsigned long long)h;
    b->bytes = bytes;
    b->ptr = (void *)(uintptr_t)(va + mapped - bytes);
    return 0;
}

void mlart_guard_free(mlart_guard_buf *b)
{
    if (!b || !b->va)
        return;
    drv.unmap((CUdeviceptr)b->va, b->mapped);
    drv.release((CUmemGenericAllocationHandle)b->handle);
    drv.free_va((CUdeviceptr)b->va, b->reserved);
    memset(b, 0, sizeof *b);
}
