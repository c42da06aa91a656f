/* Guard-page allocations on the GPU for read-exact tests.
 *
 * mlart_guard_alloc maps exactly round_up(bytes, granularity) bytes of device
 * memory through the CUDA virtual-memory API, reserves one more granule of
 * address space after it that stays unmapped, and returns a pointer placed so
 * that [ptr, ptr + bytes) ends exactly at the end of the mapped memory: any
 * access past the last byte faults (illegal address), so a kernel that reads
 * even one byte beyond an operand's span kills its context.
 *
 * The driver entry points come from cudaGetDriverEntryPointByVersion: nothing
 * links libcuda, so the test binaries still load on a machine without a
 * driver (and skip). */
#ifndef MLART_TESTS_GPU_GUARD_ALLOC_H
#define MLART_TESTS_GPU_GUARD_ALLOC_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlart_guard_buf {
    void *ptr;                  /* operand start; ptr + bytes == end of the mapping */
    size_t bytes;               /* requested size */
    unsigned long long va;      /* reserved range start */
    size_t reserved;            /* mapped + one unmapped granule */
    size_t mapped;              /* bytes mapped at va */
    unsigned long long handle;  /* physical allocation */
} mlart_guard_buf;

/* Resolve the driver entry points (once) and the granularity for `device`.
 * Returns 0, or -1 with the reason in mlart_guard_error(). */
int mlart_guard_init(int device);
/* Minimum mapping granularity on the device (after init). */
size_t mlart_guard_granularity(void);
/* Map a guarded range of `bytes` (> 0) on `device`.  0 or -1. */
int mlart_guard_alloc(mlart_guard_buf *b, size_t bytes, int device);
/* Unmap and release; accepts a zeroed or already freed buffer. */
void mlart_guard_free(mlart_guard_buf *b);
/* Reason of the last failure. */
const char *mlart_guard_error(void);

#ifdef __cplusplus
}
#endif
#endif /* MLART_TESTS_GPU_GUARD_ALLOC_H */
