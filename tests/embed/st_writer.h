/* Test helper: builds .safetensors bytes in memory, honestly or with lies.
 * Each tensor's header fields may be overridden independently of its data,
 * so tests can write headers that disagree with the bytes that follow. */
#ifndef MLART_TESTS_EMBED_ST_WRITER_H
#define MLART_TESTS_EMBED_ST_WRITER_H

#include <stddef.h>
#include <stdint.h>

typedef struct st_tensor {
    const char *name;      /* written as is between quotes (may hold escapes) */
    const char *dtype;     /* "BF16", "F8_E4M3", "F32", ... */
    int ndim;
    int64_t shape[4];
    const void *data;
    size_t bytes;
    int lie_offsets;       /* 1: write begin/end below instead of the true ones */
    uint64_t begin, end;
} st_tensor;

typedef struct st_buf {
    unsigned char *data;
    size_t len;
} st_buf;

/* Header JSON (with "__metadata__" when meta != 0, padded to 8 bytes), then
 * the tensors' data in order.  Returns 0 or -1 (out of memory). */
int st_build(const st_tensor *t, int n, int meta, st_buf *out);
/* Same header, any text: 8-byte length + text + data bytes. */
int st_build_raw(const char *header, size_t hlen, const void *data, size_t dlen, st_buf *out);
int st_write_file(const char *path, const void *data, size_t len);
void st_buf_free(st_buf *b);

/* Independent reference conversions for expectations. */
double st_ref_e4m3(uint8_t b);
/* Round-to-nearest-even of a double to bf16 bits by integer manipulation of
 * its IEEE bits (normal bf16 range only). */
uint16_t st_ref_bf16(double d);

#endif
