/* Writes a small .safetensors checkpoint holding kv_b_proj of layers 0 and 1
 * for the tiny-cpu geometry (4 heads, P=128, V=128, L=512, bf16), so that
 * mlart-decode --weights can be run end to end.  Usage: make_kv_b_proj FILE */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ops/numerics.h"

enum { H = 4, P = 128, V = 128, L = 512, ROWS = H * (P + V) };

int main(int argc, char **argv)
{
    static uint16_t w[ROWS * L];
    const size_t bytes = sizeof w;
    char header[512];
    uint64_t n, s = 12345;
    FILE *f;
    if (argc != 2) {
        fprintf(stderr, "usage: make_kv_b_proj FILE\n");
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
