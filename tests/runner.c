/*
 * runner.c -- runs every registered test, or those whose name contains one of
 * the arguments. Exit status 1 if any failed. A test that cannot run here
 * (SKIP in test.h) is counted as skipped with its reason, never as passed.
 * Ends with `N passed, N failed, N skipped`.
 *   build/k3-test            all tests
 *   build/k3-test kda mla    tests whose names contain "kda" or "mla"
 *   build/k3-test --list     names only
 */
#include "test.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    const char *name;
    k3_test_fn fn;
    const char *file;
} test_entry;

static test_entry *tests; /* grows: no test is ever dropped */
static int n_tests, cap_tests;
static bool lost_tests; /* out of memory registering one: the run fails */
static int cur_failed;
static char cur_skip[256];

void k3_test_register(const char *name, k3_test_fn fn, const char *file) {
    if (n_tests == cap_tests) {
        const int cap = cap_tests ? cap_tests * 2 : 256;
        test_entry *t = realloc(tests, sizeof *t * (size_t)cap);
        if (!t) {
            lost_tests = true;
            return;
        }
        tests = t;
        cap_tests = cap;
    }
    tests[n_tests++] = (test_entry){name, fn, file};
}

void k3_test_skip(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cur_skip, sizeof cur_skip, fmt, ap);
    va_end(ap);
    if (!cur_skip[0]) snprintf(cur_skip, sizeof cur_skip, "(no reason given)");
}

void k3_test_fail(const char *file, int line, const char *fmt, ...) {
    if (cur_failed < 5) {
        va_list ap;
        va_start(ap, fmt);
        fprintf(stdout, "    %s:%d: ", file, line);
        vfprintf(stdout, fmt, ap);
        fputc('\n', stdout);
        va_end(ap);
    }
    cur_failed++;
}

int k3_test_failed(void) { return cur_failed; }

double k3_test_rel_l2(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    if (den < 1e-30) den = 1e-30;
    return sqrt(num / den);
}

double k3_test_max_abs(const float *a, const float *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= m)) m = d; /* NaN counts as the largest */
    }
    return m;
}

static int cmp_entry(const void *a, const void *b) {
    const test_entry *x = a, *y = b;
    int c = strcmp(x->file, y->file);
    return c ? c : strcmp(x->name, y->name);
}

int main(int argc, char **argv) {
    if (n_tests) qsort(tests, (size_t)n_tests, sizeof tests[0], cmp_entry);
    int passed = 0, failed = 0, skipped = 0;
    if (lost_tests) {
        printf("FAIL runner: out of memory registering the tests (some were not run)\n");
        failed++;
    }
    for (int i = 0; i < n_tests; i++) {
        int want = argc < 2;
        for (int a = 1; a < argc; a++) {
            if (!strcmp(argv[a], "--list")) {
                printf("%s\n", tests[i].name);
                want = 0;
                break;
            }
            if (strstr(tests[i].name, argv[a])) want = 1;
        }
        if (!want) continue;
        cur_failed = 0;
        cur_skip[0] = 0;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        tests[i].fn();
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
        if (cur_failed) {
            printf("FAIL %s (%d checks failed, %.0f ms)\n", tests[i].name, cur_failed, ms);
            failed++;
        } else if (cur_skip[0]) {
            printf("skip %s: %s\n", tests[i].name, cur_skip);
            skipped++;
        } else {
            printf("ok   %s (%.0f ms)\n", tests[i].name, ms);
            passed++;
        }
        fflush(stdout);
    }
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    free(tests);
    return failed ? 1 : 0;
}
