/* common.c -- helpers shared by the subcommands (see cli.h). */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

k3_status k3_cli_open_model(k3_model **m, const char *dir, const char *quant, bool keep_mapped, k3_error *err) {
    return k3_cli_open_model_ex(m, dir, quant, keep_mapped, true, NULL, 0, 1, err);
}

k3_status k3_cli_open_model_stored(k3_model **m, const char *dir, const char *quant, bool keep_mapped, bool check,
                                   k3_model_info *stored, k3_error *err) {
    return k3_cli_open_model_ex(m, dir, quant, keep_mapped, check, stored, 0, 1, err);
}

k3_status k3_cli_open_model_ex(k3_model **m, const char *dir, const char *quant, bool keep_mapped, bool check,
                               k3_model_info *stored, int32_t ep_rank, int32_t ep_size, k3_error *err) {
    k3_quant_options q;
    k3_status s = k3_quant_parse(quant, &q, err);
    if (s) return s;
    if ((s = k3_model_open_ep(m, dir, ep_rank, ep_size, err))) return s;
    if (stored) k3_model_get_info(*m, stored);
    /* NaN/Inf in a weight: with 8-bit activations the logits can even stay
     * finite, so nothing downstream would notice */
    if (check && (s = k3_model_check_tensors(*m, NULL, err))) goto fail;
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

/* ---- strict numbers, threads, the default model ------------------------ */

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

int k3_cli_transfer_secret(const char *cmd, const char *file, char **out, size_t *n) {
    *out = NULL;
    *n = 0;
    char *buf = NULL;
    size_t len = 0;
    if (file) {
        FILE *f = fopen(file, "rb");
        if (!f) {
            fprintf(stderr, "k3 %s: --kv-transfer-secret-file %s: %s\n", cmd, file, strerror(errno));
            return -1;
        }
        buf = malloc(4097);
        len = buf ? fread(buf, 1, 4097, f) : 0;
        fclose(f);
        if (!buf || len > 4096) {
            fprintf(stderr, "k3 %s: --kv-transfer-secret-file %s: %s\n", cmd, file,
                    buf ? "over 4096 bytes" : "out of memory");
            free(buf);
            return -1;
        }
    } else {
        const char *env = getenv("K3_KV_TRANSFER_SECRET");
        if (!env || !*env) {
            fprintf(stderr,
                    "k3 %s: prefill and decode instances and their proxy share a transfer secret: give each the same "
                    "--kv-transfer-secret-file FILE or K3_KV_TRANSFER_SECRET (for example: head -c 32 /dev/urandom | "
                    "base64 > FILE)\n",
                    cmd);
            return -1;
        }
        len = strlen(env);
        buf = malloc(len + 1);
        if (!buf) return -1;
        memcpy(buf, env, len);
    }
    while (len && (buf[len - 1] == '\n' || buf[len - 1] == '\r')) len--;
    if (len < 16) {
        fprintf(stderr,
                "k3 %s: the kv transfer secret has %zu bytes: it needs at least 16 (for example 32 random "
                "bytes: head -c 32 /dev/urandom | base64)\n",
                cmd, len);
        memset(buf, 0, len);
        free(buf);
        return -1;
    }
    *out = buf;
    *n = len;
    return 0;
}

int k3_cli_long(const char *cmd, const char *opt, const char *s, long lo, long hi, long *out) {
    char *end = NULL;
    errno = 0;
    const long v = s && *s && !isspace((unsigned char)*s) ? strtol(s, &end, 10) : 0;
    if (!s || !end || end == s || *end || errno == ERANGE || v < lo || v > hi) {
        fprintf(stderr, "k3 %s: %s expects an integer from %ld to %ld, not '%s'\n", cmd, opt, lo, hi, s ? s : "");
        return -1;
    }
    *out = v;
    return 0;
}

int k3_cli_int(const char *cmd, const char *opt, const char *s, int lo, int hi, int *out) {
    long v;
    if (k3_cli_long(cmd, opt, s, lo, hi, &v)) return -1;
    *out = (int)v;
    return 0;
}

int k3_cli_u64(const char *cmd, const char *opt, const char *s, uint64_t *out) {
    char *end = NULL;
    errno = 0;
    /* strtoull accepts "-1" (as 2^64 - 1): only digits are taken */
    const unsigned long long v = s && isdigit((unsigned char)*s) ? strtoull(s, &end, 10) : 0;
    if (!s || !end || end == s || *end || errno == ERANGE) {
        fprintf(stderr, "k3 %s: %s expects an integer from 0 to %llu, not '%s'\n", cmd, opt,
                (unsigned long long)UINT64_MAX, s ? s : "");
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

int k3_cli_float(const char *cmd, const char *opt, const char *s, double lo, double hi, float *out) {
    char *end = NULL;
    errno = 0;
    const double v = s && *s && !isspace((unsigned char)*s) ? strtod(s, &end) : 0;
    if (!s || !end || end == s || *end || errno == ERANGE || !isfinite(v) || v < lo || v > hi) {
        fprintf(stderr, "k3 %s: %s expects a finite number from %g to %g, not '%s'\n", cmd, opt, lo, hi, s ? s : "");
        return -1;
    }
    *out = (float)v;
    return 0;
}

/* CPUs this process may run on (its affinity mask), else the online ones. */
static int logical_cpus(cpu_set_t *set) {
    CPU_ZERO(set);
    if (sched_getaffinity(0, sizeof *set, set) == 0 && CPU_COUNT(set) > 0) return CPU_COUNT(set);
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    CPU_ZERO(set);
    for (long i = 0; i < n && i < CPU_SETSIZE; i++) CPU_SET((int)i, set);
    return n < 1 ? 1 : (int)n;
}

static long read_sys_long(const char *fmt, int cpu) {
    char path[128];
    snprintf(path, sizeof path, fmt, cpu);
    FILE *f = fopen(path, "r");
    long v = -1;
    if (f) {
        if (fscanf(f, "%ld", &v) != 1) v = -1;
        fclose(f);
    }
    return v;
}

int k3_cli_all_cpus(void) {
    cpu_set_t set;
    const int n = logical_cpus(&set);
    return n > K3_CLI_MAX_THREADS ? K3_CLI_MAX_THREADS : n;
}

int k3_cli_physical_cores(void) {
    cpu_set_t set;
    const int n = logical_cpus(&set);
    /* distinct (package, core) pairs among the CPUs we may use: hardware
     * threads of one core share its execution units and its load ports, and
     * decode is bound by memory, so a second thread per core does not help */
    long seen[CPU_SETSIZE][2];
    int cores = 0;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &set)) continue;
        const long pkg = read_sys_long("/sys/devices/system/cpu/cpu%d/topology/physical_package_id", c);
        const long core = read_sys_long("/sys/devices/system/cpu/cpu%d/topology/core_id", c);
        if (pkg < 0 || core < 0) return n > K3_CLI_MAX_THREADS ? K3_CLI_MAX_THREADS : n; /* no topology */
        int k = 0;
        while (k < cores && !(seen[k][0] == pkg && seen[k][1] == core)) k++;
        if (k == cores) {
            seen[cores][0] = pkg;
            seen[cores][1] = core;
            cores++;
        }
    }
    if (cores < 1) cores = n;
    return cores > K3_CLI_MAX_THREADS ? K3_CLI_MAX_THREADS : cores;
}

int k3_cli_default_threads(void) {
    int n = k3_cli_physical_cores();
    /* under mpirun the ranks of one machine share its cores */
    const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (local && atoi(local) > 1) n /= atoi(local);
    return n < 1 ? 1 : n;
}

int k3_cli_threads(const char *cmd, const char *s, int *out) {
    int v;
    if (k3_cli_int(cmd, "--threads", s, 0, K3_CLI_MAX_THREADS, &v)) {
        fprintf(stderr, "k3 %s: (--threads 0 means every CPU this process may use)\n", cmd);
        return -1;
    }
    *out = v == 0 ? k3_cli_all_cpus() : v;
    return 0;
}

static bool is_model_dir(const char *dir) {
    char p[4400];
    struct stat st;
    const size_t n = strnlen(dir, 4300);
    memcpy(p, dir, n);
    memcpy(p + n, "/config.json", sizeof "/config.json");
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

const char *k3_cli_model_dir(const char *cmd, const char *dir) {
    if (dir && strcmp(dir, K3_DEFAULT_MODEL)) return dir; /* given with -m */
    /* the default: the working directory, then beside the binary (a build
     * tree: build/k3 -> models/k3-mini), then the install prefix
     * (bin/k3 -> share/k3/models/k3-mini) */
    static char found[4200];
    static char tried[3][4200];
    int n = 0;
    snprintf(tried[n++], sizeof tried[0], "%s", K3_DEFAULT_MODEL);
    char exe[4096];
    const ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len > 0) {
        exe[len] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            snprintf(tried[n++], sizeof tried[0], "%s/../%s", exe, K3_DEFAULT_MODEL);
            snprintf(tried[n++], sizeof tried[0], "%s/../share/k3/%s", exe, K3_DEFAULT_MODEL);
        }
    }
    for (int i = 0; i < n; i++)
        if (is_model_dir(tried[i])) {
            char *real = realpath(tried[i], NULL);
            const char *use = i == 0 || !real ? tried[i] : real;
            const size_t l = strnlen(use, sizeof found - 1);
            memcpy(found, use, l);
            found[l] = 0;
            free(real);
            return found;
        }
    fprintf(stderr, "k3 %s: no model given (-m DIR) and the default model was not found; looked in:\n", cmd);
    for (int i = 0; i < n; i++) fprintf(stderr, "  %s\n", tried[i]);
    fprintf(stderr, "(run from the repository, or `make install` to put it under PREFIX/share/k3)\n");
    return NULL;
}

char *k3_cli_read_input(const char *cmd, const char *path, size_t max, size_t *len) {
    const bool std_in = !strcmp(path, "-");
    FILE *f = std_in ? stdin : fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "k3 %s: cannot open %s: %s\n", cmd, path, strerror(errno));
        return NULL;
    }
    struct stat sb;
    if (!std_in && fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) {
        fprintf(stderr, "k3 %s: %s is a directory\n", cmd, path);
        fclose(f);
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    bool over = false;
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        if (cap > max) {
            over = true;
            break;
        }
        cap = cap > max / 2 ? max + 1 : cap * 2;
        char *nb = realloc(buf, cap + 1);
        if (!nb) free(buf);
        buf = nb;
    }
    const int bad = ferror(f);
    if (!std_in) fclose(f);
    const char *name = std_in ? "stdin" : path;
    if (!buf || bad || over || n > max) {
        if (!buf) fprintf(stderr, "k3 %s: out of memory reading %s\n", cmd, name);
        else if (bad) fprintf(stderr, "k3 %s: cannot read %s\n", cmd, name);
        else
            fprintf(stderr, "k3 %s: %s is larger than the %zu MB limit; give a smaller file or split it\n", cmd, name,
                    max >> 20);
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

int k3_cli_set_isa(const char *cmd, const char *name) {
    k3_error err = {0};
    if (k3_set_isa(name, &err) == K3_OK) return 0;
    fprintf(stderr, "k3 %s: --isa: %s\n", cmd, err.msg);
    return 2;
}
