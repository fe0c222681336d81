/*
 * test.h -- the test harness: K3_TEST(name) { ... } registers a test at
 * start-up (a constructor), so a test file needs no entry in a shared table.
 * CHECK records file:line and keeps going; REQUIRE returns from the test;
 * SKIP("why", ...) ends a test that cannot run here (no such CPU feature, a
 * checkpoint not built), which is then counted as skipped, never as passed.
 * The runner (runner.c) prints `ok name` / `FAIL name (file:line: expr)` /
 * `skip name: why` and ends with the plain line `N passed, N failed, N skipped`.
 */
#ifndef K3_TESTS_TEST_H
#define K3_TESTS_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>

typedef void (*k3_test_fn)(void);
void k3_test_register(const char *name, k3_test_fn fn, const char *file);
void k3_test_fail(const char *file, int line, const char *fmt, ...);
int k3_test_failed(void);
void k3_test_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define K3_TEST(name) \
    static void test_##name(void); \
    __attribute__((constructor)) static void register_##name(void) { k3_test_register(#name, test_##name, __FILE__); } \
    static void test_##name(void)

#define CHECK(x) \
    do { \
        if (!(x)) k3_test_fail(__FILE__, __LINE__, "%s", #x); \
    } while (0)
#define CHECKF(x, ...) \
    do { \
        if (!(x)) k3_test_fail(__FILE__, __LINE__, __VA_ARGS__); \
    } while (0)
#define REQUIRE(x) \
    do { \
        if (!(x)) { \
            k3_test_fail(__FILE__, __LINE__, "%s", #x); \
            return; \
        } \
    } while (0)
#define REQUIREF(x, ...) \
    do { \
        if (!(x)) { \
            k3_test_fail(__FILE__, __LINE__, __VA_ARGS__); \
            return; \
        } \
    } while (0)

#define SKIP(...) \
    do { \
        k3_test_skip(__VA_ARGS__); \
        return; \
    } while (0)

/* Relative L2 distance ||a-b|| / max(||b||, tiny). */
double k3_test_rel_l2(const float *a, const float *b, int64_t n);
double k3_test_max_abs(const float *a, const float *b, int64_t n);
/* Tests open data files by paths relative to the repository root, where
 * `make test` runs them. */

#endif /* K3_TESTS_TEST_H */
