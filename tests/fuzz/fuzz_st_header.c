/* libFuzzer harness: the safetensors header parser on arbitrary bytes (the
 * header of a checkpoint is untrusted input).  The first 8 input bytes give
 * the size of the data region the header must fit; the rest is the header
 * text.  Every entry the parser accepts must lie inside that region and,
 * where its dtype is known, hold exactly its shape's bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    mlart_st_header h;
    uint64_t data_bytes = 0;
    if (size < 8)
        return 0;
    memcpy(&data_bytes, data, 8);
    data_bytes &= (1ull << 40) - 1;
    memset(&h, 0, sizeof h);
    if (mlart_st_header_parse((const char *)data + 8, size - 8, data_bytes, &h) == 0) {
        for (size_t i = 0; i < h.count; i++) {
            const mlart_st_entry *e = &h.entries[i];
            if (e->begin > e->end || e->end > data_bytes)
                abort();
            if (e->elem_size && (uint64_t)e->numel * e->elem_size != e->end - e->begin)
                abort();
            if (mlart_st_header_find(&h, e->name) == NULL)
                abort();
        }
        mlart_st_header_free(&h);
    }
    return 0;
}
