/*
 * safetensors.c -- parse, map and index safetensors files (see safetensors.h).
 *
 * Layout of a file: u64 little-endian header length H, H bytes of JSON
 * ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
 * {...}}), then the data area; offsets are relative to the data area.
 *
 * The set keeps tensors in one growing array and an open-addressing hash
 * table of indices (K3 has ~100k tensor names, so nothing is fixed-size).
 * k3_st_parse validates a whole file before it adds any of its tensors, so a
 * failed parse leaves the set as it was.
 */
#include "safetensors.h"
#include "../common/error.h"
#include "../common/json_guard.h"
#include "../common/file.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_MAX_HEADER ((uint64_t)100 << 20) /* 100 MB of JSON header */
#define ST_MAX_INDEX ((size_t)256 << 20)    /* model.safetensors.index.json */
#define ST_MAX_DEPTH 16

typedef struct st_file {
    char *path;   /* for messages */
    uint8_t *map; /* NULL for images handed to k3_st_parse */
    size_t size;
} st_file;

struct k3_st {
    k3_st_tensor *t; /* [n] */
    int64_t n, cap;
    int64_t *slot;   /* [n_slots] hash table: tensor index + 1, 0 = empty */
    int64_t n_slots; /* power of two, kept >= 2 n */
    st_file *files;  /* [n_files] mapped shards (k3_st_open only) */
    int32_t n_files;
};

bool k3_st_maps(const k3_st *st, const void *p) {
    const uint8_t *b = p;
    for (int32_t i = 0; i < st->n_files; i++)
        if (st->files[i].map && b >= st->files[i].map && b < st->files[i].map + st->files[i].size) return true;
    return false;
}

/* ---- dtypes ------------------------------------------------------------- */

static const struct {
    const char *name;
    size_t size;
} dtypes[K3_DTYPE_COUNT] = {
    [K3_DTYPE_F32] = {"F32", 4},   [K3_DTYPE_F16] = {"F16", 2}, [K3_DTYPE_BF16] = {"BF16", 2},
    [K3_DTYPE_U8] = {"U8", 1},     [K3_DTYPE_I8] = {"I8", 1},   [K3_DTYPE_I32] = {"I32", 4},
    [K3_DTYPE_I64] = {"I64", 8},   [K3_DTYPE_F64] = {"F64", 8}, [K3_DTYPE_F8_E4M3] = {"F8_E4M3", 1},
    [K3_DTYPE_BOOL] = {"BOOL", 1},
};

const char *k3_dtype_name(k3_dtype t) { return (unsigned)t < K3_DTYPE_COUNT ? dtypes[t].name : "?"; }

size_t k3_dtype_size(k3_dtype t) { return (unsigned)t < K3_DTYPE_COUNT ? dtypes[t].size : 0; }

static int dtype_parse(const char *s) {
    for (int i = 0; i < K3_DTYPE_COUNT; i++)
        if (!strcmp(s, dtypes[i].name)) return i;
    return -1;
}

/* ---- the name index ----------------------------------------------------- */

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* Slot of name: where it is, or the empty slot where it would go. */
static int64_t find_slot(const k3_st *st, const char *name) {
    uint64_t mask = (uint64_t)st->n_slots - 1;
    for (uint64_t i = hash_str(name) & mask;; i = (i + 1) & mask) {
        int64_t v = st->slot[i];
        if (v == 0 || !strcmp(st->t[v - 1].name, name)) return (int64_t)i;
    }
}

/* Makes room for `more` tensors in the array and the table. */
static k3_status reserve(k3_st *st, int64_t more, k3_error *err) {
    int64_t need = st->n + more;
    if (need > st->cap) {
        int64_t cap = st->cap ? st->cap : 64;
        while (cap < need) cap *= 2;
        k3_st_tensor *t = realloc(st->t, (size_t)cap * sizeof *t);
        if (!t) return k3_err(err, K3_ERR_NOMEM, "out of memory indexing %lld tensors", (long long)need);
        st->t = t;
        st->cap = cap;
    }
    if (need * 2 > st->n_slots) {
        int64_t n_slots = st->n_slots ? st->n_slots : 128;
        while (need * 2 > n_slots) n_slots *= 2;
        int64_t *slot = calloc((size_t)n_slots, sizeof *slot);
        if (!slot) return k3_err(err, K3_ERR_NOMEM, "out of memory indexing %lld tensors", (long long)need);
        free(st->slot);
        st->slot = slot;
        st->n_slots = n_slots;
        for (int64_t i = 0; i < st->n; i++) st->slot[find_slot(st, st->t[i].name)] = i + 1;
    }
    return K3_OK;
}

static const char *file_name(const k3_st *st, int32_t file) {
    return file >= 0 && file < st->n_files ? st->files[file].path : "(memory)";
}

/* ---- parsing one file --------------------------------------------------- */


/* A non-negative JSON integer. */
static bool get_u64(json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

typedef struct span {
    uint64_t begin, end;
    const char *name;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Validates one tensor entry into *t (name not yet copied). */
static k3_status parse_entry(const char *path, const char *name, json_t *e, const uint8_t *data, uint64_t data_size,
                             size_t file_size, k3_st_tensor *t, span *sp, k3_error *err) {
    if (!json_is_object(e)) return k3_err(err, K3_ERR_FORMAT, "%s: tensor '%s': entry is not an object", path, name);
    json_t *dt = json_object_get(e, "dtype");
    json_t *shape = json_object_get(e, "shape");
    json_t *offs = json_object_get(e, "data_offsets");
    if (!json_is_string(dt) || !json_is_array(shape) || !json_is_array(offs))
        return k3_err(err, K3_ERR_FORMAT,
                      "%s: tensor '%s': needs a string 'dtype', a list 'shape' and a "
                      "list 'data_offsets'",
                      path, name);
    int d = dtype_parse(json_string_value(dt));
    if (d < 0)
        return k3_err(err, K3_ERR_UNSUPPORTED, "%s: tensor '%s' has unknown dtype '%s'", path, name,
                      json_string_value(dt));
    t->dtype = (k3_dtype)d;

    size_t nd = json_array_size(shape);
    if (nd > K3_ST_MAX_DIMS)
        return k3_err(err, K3_ERR_FORMAT, "%s: tensor '%s' has %zu dimensions (max %d)", path, name, nd,
                      K3_ST_MAX_DIMS);
    t->ndim = (int32_t)nd;
    /* numel * size must not overflow: every factor is checked against the
     * data size, which bounds the product of the non-zero factors. */
    uint64_t numel = 1;
    bool zero = false;
    for (size_t i = 0; i < nd; i++) {
        uint64_t dim;
        if (!get_u64(json_array_get(shape, i), &dim))
            return k3_err(err, K3_ERR_FORMAT, "%s: tensor '%s': shape entry %zu is not a non-negative integer", path,
                          name, i);
        t->shape[i] = (int64_t)dim;
        if (dim == 0) zero = true;
        else if (!zero && numel > UINT64_MAX / 16 / dim) numel = UINT64_MAX / 16;
        else if (!zero) numel *= dim;
    }
    if (zero) numel = 0;

    uint64_t begin, end;
    if (json_array_size(offs) != 2 || !get_u64(json_array_get(offs, 0), &begin) ||
        !get_u64(json_array_get(offs, 1), &end))
        return k3_err(err, K3_ERR_FORMAT, "%s: tensor '%s': data_offsets must be two non-negative integers", path,
                      name);
    if (begin > end)
        return k3_err(err, K3_ERR_FORMAT, "%s: tensor '%s' data_offsets [%llu,%llu] end before they begin", path, name,
                      (unsigned long long)begin, (unsigned long long)end);
    if (end > data_size)
        return k3_err(err, K3_ERR_FORMAT,
                      "%s: tensor '%s' data_offsets [%llu,%llu] run past the end of the file "
                      "(size %llu)",
                      path, name, (unsigned long long)begin, (unsigned long long)end, (unsigned long long)file_size);
    uint64_t want = numel * dtypes[d].size; /* numel <= UINT64_MAX/16: no overflow */
    if (end - begin != want)
        return k3_err(err, K3_ERR_FORMAT, "%s: tensor '%s' holds %llu bytes, but %s x shape needs %llu", path, name,
                      (unsigned long long)(end - begin), dtypes[d].name, (unsigned long long)want);
    /* elements are read in place as uint16_t/float/...: their address must be
     * a multiple of their size (writers pad the header to 8 bytes) */
    if (want && (uintptr_t)(data + begin) % dtypes[d].size)
        return k3_err(err, K3_ERR_FORMAT,
                      "%s: tensor '%s' (%s, data offset %llu) is not aligned to its %zu-byte "
                      "elements (the header is not padded to a multiple of 8 bytes): rewrite the "
                      "file with a padded header",
                      path, name, dtypes[d].name, (unsigned long long)begin, (size_t)dtypes[d].size);
    t->data = data + begin;
    t->nbytes = (size_t)want;
    *sp = (span){begin, end, name};
    return K3_OK;
}

k3_status k3_st_parse(k3_st *st, const uint8_t *buf, size_t size, int32_t file, const char *path, k3_error *err) {
    if (!path) path = file_name(st, file);
    if (size < 8) return k3_err(err, K3_ERR_FORMAT, "%s: %zu bytes is too small for a safetensors file", path, size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | buf[i];
    if (hlen > size - 8)
        return k3_err(err, K3_ERR_FORMAT, "%s: header length %llu runs past the end of the file (size %zu)", path,
                      (unsigned long long)hlen, size);
    if (hlen > ST_MAX_HEADER)
        return k3_err(err, K3_ERR_FORMAT, "%s: header length %llu is over the 100 MB limit", path,
                      (unsigned long long)hlen);
    const char *text = (const char *)buf + 8;
    if (k3_json_too_deep(text, (size_t)hlen, ST_MAX_DEPTH))
        return k3_err(err, K3_ERR_FORMAT, "%s: header JSON nests too deep", path);
    json_error_t je;
    json_t *root = json_loadb(text, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root) return k3_err(err, K3_ERR_FORMAT, "%s: invalid header JSON at column %d: %s", path, je.column, je.text);
    const uint8_t *data = buf + 8 + hlen;
    uint64_t data_size = size - 8 - hlen;

    k3_status s = K3_OK;
    size_t cap = json_object_size(root);
    k3_st_tensor *tmp = NULL;
    span *spans = NULL;
    size_t n = 0;
    if (!json_is_object(root)) {
        s = k3_err(err, K3_ERR_FORMAT, "%s: header is not a JSON object", path);
        goto done;
    }
    tmp = calloc(cap ? cap : 1, sizeof *tmp);
    spans = calloc(cap ? cap : 1, sizeof *spans);
    if (!tmp || !spans) {
        s = k3_err(err, K3_ERR_NOMEM, "%s: out of memory for %zu tensors", path, cap);
        goto done;
    }
    const char *name;
    json_t *e;
    json_object_foreach(root, name, e) {
        if (!strcmp(name, "__metadata__")) continue;
        s = parse_entry(path, name, e, data, data_size, size, &tmp[n], &spans[n], err);
        if (s != K3_OK) goto done;
        tmp[n].name = (char *)name; /* borrowed from the JSON until the commit */
        tmp[n].file = file;
        n++;
    }
    /* Overlaps: sort by offset, each tensor must start at or after the end
     * of the one before (empty tensors overlap nothing). */
    qsort(spans, n, sizeof *spans, cmp_span);
    size_t prev = SIZE_MAX;
    for (size_t c = 0; c < n; c++) {
        if (spans[c].begin == spans[c].end) continue;
        if (prev != SIZE_MAX && spans[c].begin < spans[prev].end) {
            s = k3_err(err, K3_ERR_FORMAT, "%s: tensors '%s' [%llu,%llu] and '%s' [%llu,%llu] overlap", path,
                       spans[prev].name, (unsigned long long)spans[prev].begin, (unsigned long long)spans[prev].end,
                       spans[c].name, (unsigned long long)spans[c].begin, (unsigned long long)spans[c].end);
            goto done;
        }
        prev = c;
    }
    /* Names already in the set (from another shard). */
    s = reserve(st, (int64_t)n, err);
    if (s != K3_OK) goto done;
    for (size_t i = 0; i < n; i++) {
        int64_t v = st->slot[find_slot(st, tmp[i].name)];
        if (v) {
            s = k3_err(err, K3_ERR_FORMAT, "%s: tensor '%s' is also in %s", path, tmp[i].name,
                       file_name(st, st->t[v - 1].file));
            goto done;
        }
    }
    /* Commit: own the names, append, index. */
    for (size_t i = 0; i < n; i++) {
        char *own = strdup(tmp[i].name);
        if (!own) {
            s = k3_err(err, K3_ERR_NOMEM, "%s: out of memory", path);
            goto done; /* the tensors appended so far stay valid */
        }
        tmp[i].name = own;
        st->t[st->n] = tmp[i];
        st->slot[find_slot(st, own)] = st->n + 1;
        st->n++;
    }
done:
    free(tmp);
    free(spans);
    json_decref(root);
    return s;
}

/* ---- the set ------------------------------------------------------------ */

k3_status k3_st_init(k3_st **out, k3_error *err) {
    *out = calloc(1, sizeof **out);
    if (!*out) return k3_err(err, K3_ERR_NOMEM, "out of memory");
    return K3_OK;
}

uint64_t k3_st_header_hash(const k3_st *st, uint64_t h) {
    for (int32_t i = 0; i < st->n_files; i++) {
        const st_file *f = &st->files[i];
        if (!f->map || f->size < 8) continue;
        uint64_t hl = 0;
        memcpy(&hl, f->map, 8);
        const size_t n = hl <= f->size - 8 ? (size_t)hl + 8 : 8;
        for (size_t k = 0; k < n; k++) h = (h ^ f->map[k]) * 1099511628211ull;
    }
    return h;
}

void k3_st_close(k3_st *st) {
    if (!st) return;
    for (int64_t i = 0; i < st->n; i++) free(st->t[i].name);
    for (int32_t i = 0; i < st->n_files; i++) {
        if (st->files[i].map) munmap(st->files[i].map, st->files[i].size);
        free(st->files[i].path);
    }
    free(st->files);
    free(st->t);
    free(st->slot);
    free(st);
}

const k3_st_tensor *k3_st_get(const k3_st *st, const char *name) {
    if (!st || st->n == 0) return NULL;
    int64_t v = st->slot[find_slot(st, name)];
    return v ? &st->t[v - 1] : NULL;
}

int64_t k3_st_count(const k3_st *st) { return st ? st->n : 0; }

const k3_st_tensor *k3_st_at(const k3_st *st, int64_t i) { return st && i >= 0 && i < st->n ? &st->t[i] : NULL; }

int64_t k3_st_bytes(const k3_st *st, const char *prefix) {
    size_t len = prefix ? strlen(prefix) : 0;
    int64_t sum = 0;
    for (int64_t i = 0; st && i < st->n; i++)
        if (!len || !strncmp(st->t[i].name, prefix, len)) sum += (int64_t)st->t[i].nbytes;
    return sum;
}

/* ---- opening a directory ------------------------------------------------ */

/* Maps path read-only and parses it as file number st->n_files. */
static k3_status open_file(k3_st *st, const char *path, k3_error *err) {
    int fd;
    k3_status os = k3_file_open_regular(path, &fd, err); /* a FIFO must not block */
    if (os != K3_OK) return os;
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return k3_err(err, K3_ERR_IO, "cannot stat %s: %s", path, strerror(e));
    }
    size_t size = (size_t)sb.st_size;
    if (size < 8) {
        close(fd);
        return k3_err(err, K3_ERR_FORMAT, "%s: %zu bytes is too small for a safetensors file", path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return k3_err(err, K3_ERR_IO, "cannot map %s: %s", path, strerror(e));
    /* A header not padded to 8 bytes leaves the data section misaligned in
     * the mapping, and tensors are read in place as uint16_t/float: such a
     * file is copied into anonymous memory at an offset that realigns it. */
    uint8_t *image = map;
    size_t map_size = size;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | ((const uint8_t *)map)[i];
    if (hlen <= size - 8 && (8 + hlen) % 8) {
        const size_t pad = (size_t)(8 - (8 + hlen) % 8);
        void *anon = mmap(NULL, size + 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (anon == MAP_FAILED) {
            munmap(map, size);
            return k3_err(err, K3_ERR_NOMEM, "%s: out of memory realigning an unpadded header", path);
        }
        memcpy((uint8_t *)anon + pad, map, size);
        munmap(map, size);
        map = anon;
        map_size = size + 8;
        image = (uint8_t *)anon + pad;
    }

    st_file *files = realloc(st->files, (size_t)(st->n_files + 1) * sizeof *files);
    char *p = strdup(path);
    if (!files || !p) {
        if (files) st->files = files;
        free(p);
        munmap(map, map_size);
        return k3_err(err, K3_ERR_NOMEM, "out of memory");
    }
    st->files = files;
    int32_t idx = st->n_files++;
    st->files[idx] = (st_file){p, map, map_size};
    return k3_st_parse(st, image, size, idx, p, err);
}

/* Reads a whole (small) file into a NUL-terminated buffer. */
static k3_status read_small(const char *path, size_t max, char **out, size_t *len, k3_error *err) {
    return k3_file_read(path, max, "a safetensors index", out, len, err);
}

/* A shard name must stay inside the directory. */
static bool shard_name_ok(const char *s) {
    if (!*s || s[0] == '/') return false;
    for (const char *p = s; *p; p++)
        if (p[0] == '.' && p[1] == '.' && (p == s || p[-1] == '/') && (!p[2] || p[2] == '/')) return false;
    return true;
}

static k3_status open_index(k3_st *st, const char *dir, const char *ipath, k3_error *err) {
    char *text = NULL;
    size_t len = 0;
    k3_status s = read_small(ipath, ST_MAX_INDEX, &text, &len, err);
    if (s != K3_OK) return s;
    json_error_t je;
    json_t *root = NULL;
    if (k3_json_too_deep(text, len, ST_MAX_DEPTH)) s = k3_err(err, K3_ERR_FORMAT, "%s: JSON nests too deep", ipath);
    else if (!(root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je)))
        s = k3_err(err, K3_ERR_FORMAT, "%s: invalid JSON at line %d: %s", ipath, je.line, je.text);
    free(text);
    if (s != K3_OK) return s;
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm)) {
        json_decref(root);
        return k3_err(err, K3_ERR_FORMAT, "%s: no 'weight_map' object", ipath);
    }
    /* Open each shard once, in order of first mention. The shard names are
     * few (about 100), so a linear search over opened ones is fine. */
    const char *name;
    json_t *v;
    char path[4096];
    const char **shards = NULL;
    int32_t n_shards = 0;
    json_object_foreach(wm, name, v) {
        if (!json_is_string(v) || !shard_name_ok(json_string_value(v))) {
            s = k3_err(err, K3_ERR_FORMAT, "%s: tensor '%s' maps to a bad shard name", ipath, name);
            break;
        }
        const char *shard = json_string_value(v);
        int32_t k = 0;
        while (k < n_shards && strcmp(shards[k], shard)) k++;
        if (k < n_shards) continue;
        const char **ns = realloc(shards, (size_t)(n_shards + 1) * sizeof *ns);
        if (!ns) {
            s = k3_err(err, K3_ERR_NOMEM, "out of memory");
            break;
        }
        shards = ns;
        shards[n_shards++] = shard;
        if (snprintf(path, sizeof path, "%s/%s", dir, shard) >= (int)sizeof path) {
            s = k3_err(err, K3_ERR_ARG, "path too long: %s/%s", dir, shard);
            break;
        }
        s = open_file(st, path, err);
        if (s != K3_OK) break;
    }
    /* Every tensor the index names must be in the shard it names. */
    if (s == K3_OK) {
        json_object_foreach(wm, name, v) {
            const char *shard = json_string_value(v);
            const k3_st_tensor *t = k3_st_get(st, name);
            int32_t k = 0;
            while (k < n_shards && strcmp(shards[k], shard)) k++;
            if (!t || t->file != k) {
                s = k3_err(err, K3_ERR_FORMAT,
                           "%s names tensor '%s' in shard %s, but that shard does not "
                           "contain it",
                           ipath, name, shard);
                break;
            }
        }
    }
    free(shards);
    json_decref(root);
    return s;
}

k3_status k3_st_open(k3_st **out, const char *dir, k3_error *err) {
    *out = NULL;
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return k3_err(err, K3_ERR_IO, "cannot open checkpoint directory %s: %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return k3_err(err, K3_ERR_IO, "%s is not a directory", dir);
    k3_st *st;
    k3_status s = k3_st_init(&st, err);
    if (s != K3_OK) return s;
    char path[4096];
    if (snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir) >= (int)sizeof path) {
        k3_st_close(st);
        return k3_err(err, K3_ERR_ARG, "checkpoint path too long: %s", dir);
    }
    if (access(path, F_OK) == 0) {
        s = open_index(st, dir, path, err);
    } else {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        s = open_file(st, path, err);
    }
    if (s != K3_OK) {
        k3_st_close(st);
        return s;
    }
    *out = st;
    return K3_OK;
}
