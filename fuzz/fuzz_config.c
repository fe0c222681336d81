/* fuzz_config.c -- libFuzzer harness: config.json bytes through
 * k3_config_parse. An accepted config must hold the bounds the compute
 * code's fixed-size arrays rely on (config.h). */
#include <stdint.h>
#include <stdlib.h>

#include "fuzz.h"
#include "model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    k3_config c;
    k3_error err = {0};
    if (k3_config_parse(&c, (const char *)data, size, "fuzz/config.json", &err) == K3_OK) {
        if (c.n_layers < 1 || c.n_layers > K3_MAX_LAYERS) abort();
        if (c.n_expert_groups > K3_MOE_MAX_GROUPS || c.n_heads > K3_MAX_HEADS ||
            c.kda_head_dim > K3_MAX_KDA_HEAD_DIM)
            abort();
    }
    return 0;
}
