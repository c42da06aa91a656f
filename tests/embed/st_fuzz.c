/* libFuzzer target for the safetensors header parser.  Input: the data-region
 * size in decimal, a newline, then the header text (so seeds are plain text:
 * see st_fuzz_corpus/). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint64_t dbytes = 0;
    size_t i = 0;
    mlart_st_header h;
    char *text;
    while (i < size && i < 20 && data[i] >= '0' && data[i] <= '9')
        dbytes = dbytes * 10 + (uint64_t)(data[i++] - '0');
    if (i < size && data[i] == '\n')
        i++;
    text = malloc(size - i ? size - i : 1); /* exact copy: an overrun is caught */
    if (!text)
        return 0;
    memcpy(text, data + i, size - i);
    if (mlart_st_header_parse(text, size - i, dbytes, &h) == 0) {
        for (size_t k = 0; k < h.count; k++) {
            const mlart_st_entry *e = &h.entries[k];
            if (mlart_st_header_find(&h, e->name) != e || e->begin > e->end || e->end > dbytes)
                abort();
            /* a known dtype holds exactly its shape's bytes */
            if (e->elem_size && (uint64_t)e->numel * e->elem_size != e->end - e->begin)
                abort();
        }
        mlart_st_header_free(&h);
    }
    free(text);
    return 0;
}
