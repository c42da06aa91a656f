/* Internal: the .safetensors container.
 *
 * File layout: an 8-byte little-endian header length N, N bytes of JSON
 * header, then the data region.  The header maps tensor names to
 * {"dtype", "shape", "data_offsets": [begin, end]} with offsets relative to
 * the data region, plus an optional "__metadata__" object of strings.
 *
 * The parser is strict and never trusts the header: every offset is checked
 * against the data size and against dtype x shape, the tensors must tile the
 * data region exactly (no overlap, no hole, no trailing bytes), names are
 * unique, and reads go through mlart_st_read, which refuses anything outside
 * the tensor it is asked for.  A file that breaks any of this, or cannot be
 * read, is MLART_EIO with a message that names the byte offset or the
 * tensor; running out of memory is MLART_ENOMEM, and a read outside a
 * tensor (a caller's bug) MLART_EINTERNAL. */
#ifndef MLART_RUNTIME_SAFETENSORS_H
#define MLART_RUNTIME_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "mlart/mlart.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MLART_ST_MAX_DIMS 16
/* Same cap as the format's reference implementation (100 MB). */
#define MLART_ST_MAX_HEADER ((uint64_t)100000000)

typedef struct mlart_st_entry {
    char *name;             /* unescaped UTF-8, NUL-terminated, no embedded NUL */
    char dtype[16];         /* as written: "BF16", "F8_E4M3", "F32", ... */
    mlart_dtype mdtype;     /* MLART_DTYPE_INVALID when mlart has no such dtype */
    size_t elem_size;       /* 0 when the dtype is unknown to the parser */
    int ndim;
    int64_t shape[MLART_ST_MAX_DIMS];
    int64_t numel;
    uint64_t begin, end;    /* byte offsets into the data region, begin <= end */
} mlart_st_entry;

typedef struct mlart_st_header {
    mlart_st_entry *entries; /* sorted by name */
    size_t count;
    size_t metadata_count;   /* entries of "__metadata__" (not kept) */
} mlart_st_header;

/* Parse and validate header text [text, text+len) for a data region of
 * data_bytes bytes.  On success *out owns its memory (mlart_st_header_free). */
int mlart_st_header_parse(const char *text, size_t len, uint64_t data_bytes,
                          mlart_st_header *out);
void mlart_st_header_free(mlart_st_header *h);
/* Entry named `name`, or NULL. */
const mlart_st_entry *mlart_st_header_find(const mlart_st_header *h, const char *name);

typedef struct mlart_st_file {
    int fd;
    uint64_t file_bytes;
    uint64_t data_start;    /* 8 + header length */
    mlart_st_header header;
} mlart_st_file;

/* Open and validate a file; on failure nothing stays open. */
int mlart_st_open(const char *path, mlart_st_file *out);
void mlart_st_close(mlart_st_file *f);
/* Read bytes [off, off+len) of entry e's data into dst; refuses ranges
 * outside the entry and reports short reads (a file truncated after open). */
int mlart_st_read(const mlart_st_file *f, const mlart_st_entry *e, uint64_t off, uint64_t len,
                  void *dst);

#ifdef __cplusplus
}
#endif
#endif /* MLART_RUNTIME_SAFETENSORS_H */
