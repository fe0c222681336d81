/* json_guard.c -- see json_guard.h. */
#include "json_guard.h"

bool k3_json_too_deep(const char *s, size_t len, int max) {
    int depth = 0;
    bool in_str = false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\') i++;
            else if (c == '"') in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '{' || c == '[') {
            if (++depth > max) return true;
        } else if (c == '}' || c == ']') {
            depth--;
        }
    }
    return false;
}
