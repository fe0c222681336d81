/*
 * identity.c -- k3_model_identity (k3.h): a 64-bit name of a checkpoint for
 * the instances that hand caches to one another (src/pd): FNV-1a over its
 * config.json and every safetensors header (names, dtypes, shapes,
 * offsets), so two instances agree exactly when they load the same files.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/file.h"
#include "model/model.h"
#include "model/safetensors.h"

uint64_t k3_model_identity(const k3_model *m) {
    uint64_t h = 1469598103934665603ull;
    char path[4096], *text = NULL;
    size_t len = 0;
    snprintf(path, sizeof path, "%s/config.json", m->dir ? m->dir : ".");
    if (!k3_file_read(path, (size_t)64 << 20, "config", &text, &len, NULL))
        for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)text[i]) * 1099511628211ull;
    free(text);
    h = k3_st_header_hash(m->st, h);
    return h ? h : 1;
}
