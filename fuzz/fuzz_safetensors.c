/* fuzz_safetensors.c -- libFuzzer harness: one safetensors file image through
 * the header parser (k3_st_parse), then every tensor it accepted is looked up
 * and its bytes read (they must lie inside the image). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    k3_st *st = NULL;
    k3_error err = {0};
    if (k3_st_init(&st, &err) != K3_OK) return 0;
    /* a copy at an 8-aligned address, as a mapping would be */
    uint8_t *img = malloc(size ? size : 1);
    if (!img) {
        k3_st_close(st);
        return 0;
    }
    memcpy(img, data, size);
    if (k3_st_parse(st, img, size, 0, "fuzz.safetensors", &err) == K3_OK) {
        volatile uint8_t sink = 0;
        for (int64_t i = 0; i < k3_st_count(st); i++) {
            const k3_st_tensor *t = k3_st_at(st, i);
            if (k3_st_get(st, t->name) != t) abort();
            if (t->nbytes && (t->data < img || t->data + t->nbytes > img + size)) abort();
            if (t->nbytes) sink ^= t->data[0] ^ t->data[t->nbytes - 1];
        }
        (void)sink;
    }
    k3_st_close(st);
    free(img);
    return 0;
}
