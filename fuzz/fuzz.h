/*
 * fuzz.h -- the entry point every libFuzzer harness (fuzz/fuzz_*.c) defines:
 * one input of size bytes; returns 0. Declared here so the compiler checks
 * each definition against it (-Wmissing-prototypes).
 */
#ifndef K3_FUZZ_FUZZ_H
#define K3_FUZZ_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif /* K3_FUZZ_FUZZ_H */
