/* common.c -- helpers shared by the subcommands (see cli.h). */
#include <string.h>

#include "cli.h"

k3_status k3_cli_open_model(k3_model **m, const char *dir, const char *quant, k3_error *err) {
    k3_quant_options q;
    k3_status s = k3_quant_parse(quant, &q, err);
    if (s) return s;
    if ((s = k3_model_open(m, dir, err))) return s;
    if ((s = k3_model_quantize(*m, &q, err))) {
        k3_model_close(*m);
        *m = NULL;
    }
    return s;
}

int k3_cli_parse_kv(const char *s, k3_kv_type *out) {
    if (!strcmp(s, "f32")) *out = K3_KV_F32;
    else if (!strcmp(s, "c8")) *out = K3_KV_C8;
    else return -1;
    return 0;
}
