/* common.c -- helpers shared by the subcommands (see cli.h). */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

k3_status k3_cli_open_model(k3_model **m, const char *dir, const char *quant, bool keep_mapped, k3_error *err) {
    k3_quant_options q;
    k3_status s = k3_quant_parse(quant, &q, err);
    if (s) return s;
    if ((s = k3_model_open(m, dir, err))) return s;
    if ((s = k3_model_quantize(*m, &q, err))) goto fail;
    if (!keep_mapped) {
        /* into RAM (huge pages) when that takes at most half of it */
        const long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        const int64_t half = pages > 0 && psz > 0 ? (int64_t)pages * psz / 2 : 0;
        int64_t copied;
        if (half > 0 && (s = k3_model_load_resident(*m, half, &copied, err))) goto fail;
    }
    return K3_OK;
fail:
    k3_model_close(*m);
    *m = NULL;
    return s;
}

int k3_cli_parse_kv(const char *s, k3_kv_type *out) {
    if (!strcmp(s, "f32")) *out = K3_KV_F32;
    else if (!strcmp(s, "c8")) *out = K3_KV_C8;
    else return -1;
    return 0;
}

int k3_cli_set_isa(const char *cmd, const char *name) {
    k3_error err = {0};
    if (k3_set_isa(name, &err) == K3_OK) return 0;
    fprintf(stderr, "k3 %s: --isa: %s\n", cmd, err.msg);
    return 2;
}
