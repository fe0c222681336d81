/*
 * json_guard.h -- a cap on hostile JSON before it reaches the parser: jansson
 * recurses per nesting level, so config.json, safetensors headers and index
 * files are checked for depth first.
 */
#ifndef K3_COMMON_JSON_GUARD_H
#define K3_COMMON_JSON_GUARD_H

#include <stdbool.h>
#include <stddef.h>

/* True when the JSON text nests deeper than max (strings are skipped). */
bool k3_json_too_deep(const char *s, size_t len, int max);

#endif /* K3_COMMON_JSON_GUARD_H */
