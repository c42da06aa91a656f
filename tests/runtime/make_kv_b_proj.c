/* Writes a small .safetensors checkpoint holding kv_b_proj of layers 0 and 1
 * for the tiny-cpu geometry (4 heads, P=128, V=128, L=512, bf16), so that
 * mlart-decode --weights can be run end to end.  With a head number K, layer
 * 0's heads K.. are NaN: a rank that reads them is refused, which shows
 * which heads each rank reads.  Usage: make_kv_b_proj FILE [K] */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops/numerics.h"

enum { H = 4, P = 128, V = 128, L = 512, ROWS = H * (P + V) };

int main(int argc, char **argv)
{
    static uint16_t w[ROWS * L];
    const size_t bytes = sizeof w;
    char header[512];
    uint64_t n, s = 12345;
    long nan_from = H;
    FILE *f;
    if (argc == 3) {
        char *end;
        nan_from = strtol(argv[2], &end, 10);
        if (*end || end == argv[2] || nan_from < 0 || nan_from > H)
            nan_from = -1;
    }
    if ((argc != 2 && argc != 3) || nan_from < 0) {
        fprintf(stderr, "usage: make_kv_b_proj FILE [first NaN head of layer 0, 0..%d]\n", H);
        return 2;
    }
    n = (uint64_t)snprintf(header, sizeof header,
                           "{\"__metadata__\":{\"format\":\"pt\"},"
                           "\"model.layers.0.self_attn.kv_b_proj.weight\":{\"dtype\":\"BF16\","
                           "\"shape\":[%d,%d],\"data_offsets\":[0,%zu]},"
                           "\"model.layers.1.self_attn.kv_b_proj.weight\":{\"dtype\":\"BF16\","
                           "\"shape\":[%d,%d],\"data_offsets\":[%zu,%zu]}}",
                           ROWS, L, bytes, ROWS, L, bytes, 2 * bytes);
    f = fopen(argv[1], "wb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    for (int i = 0; i < 8; i++) {
        unsigned char b = (unsigned char)(n >> (8 * i));
        fputc(b, f);
    }
    fwrite(header, 1, (size_t)n, f);
    for (int layer = 0; layer < 2; layer++) {
        for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull; /* LCG */
            w[i] = mlart_f32_to_bf16(0.3f * ((float)(s >> 40) / 8388608.0f - 1.0f));
            if (layer == 0 && (long)(i / ((size_t)(P + V) * L)) >= nan_from)
                w[i] = 0x7fc0; /* bf16 NaN */
        }
        fwrite(w, 1, bytes, f);
    }
    if (fclose(f) != 0) {
        perror(argv[1]);
        return 1;
    }
    printf("wrote %s: kv_b_proj [%d, %d] bf16 for layers 0 and 1\n", argv[1], ROWS, L);
    return 0;
}
