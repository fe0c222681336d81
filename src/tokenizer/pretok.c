/*
 * pretok.c -- the split regexes (see pretok.h), compiled with PCRE2.
 *
 * tiktoken runs each pat_str through fancy-regex's find_iter: leftmost match,
 * alternatives tried in order, backtracking for `\s+(?!\S)`. PCRE2 is also a
 * backtracking, leftmost-first engine, so the same pattern gives the same
 * pieces once the character classes mean the same thing (see pretok.h).
 * Every pattern here matches at least one character at any position, so the
 * pieces cover the text with no gaps.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "pretok.h"

#include <pcre2.h>
#include <stdlib.h>

#include "common/error.h"

/* ---- pattern sources ---------------------------------------------------- */

/* Unicode White_Space, which is what `\s` means to the Rust regex crate. */
#define WS \
    "\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}" \
    "\\x{202F}\\x{205F}\\x{3000}"
#define SPACE "[" WS "]"
#define NON_SPACE "[^" WS "]"

/* Script=Han. PCRE2 10.40 made a bare script name mean Script_Extensions and
 * added the sc: prefix; before 10.40 the bare name already meant Script. */
#if PCRE2_MAJOR > 10 || (PCRE2_MAJOR == 10 && PCRE2_MINOR >= 40)
#define HAN "\\p{sc:Han}"
#else
#define HAN "\\p{Han}"
#endif

#define CONTRACTION "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
#define UPPER_O200K "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]"
#define LOWER_O200K "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]"
/* Kimi's [X&&[^\p{Han}]]: one character of X that is not Han. */
#define UPPER_KIMI "(?:(?!" HAN ")" UPPER_O200K ")"
#define LOWER_KIMI "(?:(?!" HAN ")" LOWER_O200K ")"
#define NOT_LN_CRLF "[^\\r\\n\\p{L}\\p{N}]"

/* The tail shared by all three: numbers, punctuation runs, newlines, spaces.
 * PUNCT_TAIL is what may follow a punctuation run ([\r\n]* or o200k's
 * [\r\n/]*). */
#define TAIL(PUNCT_TAIL) \
    "|\\p{N}{1,3}" \
    "| ?[^" WS "\\p{L}\\p{N}]+" PUNCT_TAIL "|" SPACE "*[\\r\\n]+" \
    "|" SPACE "+(?!" NON_SPACE ")" \
    "|" SPACE "+"

static const char PAT_O200K[] =
    NOT_LN_CRLF "?" UPPER_O200K "*" LOWER_O200K "+" CONTRACTION "?"
                "|" NOT_LN_CRLF "?" UPPER_O200K "+" LOWER_O200K "*" CONTRACTION "?" TAIL("[\\r\\n/]*");

static const char PAT_CL100K[] = CONTRACTION "|" NOT_LN_CRLF "?\\p{L}+" TAIL("[\\r\\n]*");

static const char PAT_KIMI[] = "[" HAN "]+"
                               "|" NOT_LN_CRLF "?" UPPER_KIMI "*" LOWER_KIMI "+" CONTRACTION "?"
                               "|" NOT_LN_CRLF "?" UPPER_KIMI "+" LOWER_KIMI "*" CONTRACTION "?" TAIL("[\\r\\n]*");

const char *k3_pretok_source(k3_pattern pattern) {
    switch (pattern) {
    case K3_PATTERN_KIMI: return PAT_KIMI;
    case K3_PATTERN_O200K: return PAT_O200K;
    case K3_PATTERN_CL100K: return PAT_CL100K;
    }
    return NULL;
}

/* ---- compile and split -------------------------------------------------- */

struct k3_pretok {
    pcre2_code *re;
};

k3_status k3_pretok_init(k3_pretok **out, k3_pattern pattern, k3_error *err) {
    *out = NULL;
    const char *src = k3_pretok_source(pattern);
    if (!src) return k3_err(err, K3_ERR_ARG, "unknown split pattern %d", (int)pattern);
    k3_pretok *p = calloc(1, sizeof *p);
    if (!p) return k3_err(err, K3_ERR_NOMEM, "out of memory compiling the split pattern");
    int code;
    PCRE2_SIZE at;
    p->re = pcre2_compile((PCRE2_SPTR)src, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &code, &at, NULL);
    if (!p->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        free(p);
        /* Our own pattern failing to compile means a PCRE2 without Unicode
         * support or too old for a property we use. */
        return k3_err(err, K3_ERR_UNSUPPORTED, "PCRE2 rejects the split pattern at %zu: %s", (size_t)at,
                      (const char *)msg);
    }
    /* JIT is an optimisation only: without it pcre2_match interprets. */
    (void)pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE);
    *out = p;
    return K3_OK;
}

void k3_pretok_free(k3_pretok *p) {
    if (!p) return;
    pcre2_code_free(p->re);
    free(p);
}

k3_status k3_pretok_split(const k3_pretok *p, const char *text, size_t len, k3_pretok_fn fn, void *ctx, k3_error *err) {
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(p->re, NULL);
    if (!md) return k3_err(err, K3_ERR_NOMEM, "out of memory splitting text");
    const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    k3_status st = K3_OK;
    size_t pos = 0;
    while (pos < len) {
        int rc = pcre2_match(p->re, (PCRE2_SPTR)text, len, pos, PCRE2_NO_UTF_CHECK, md, NULL);
        /* The JIT backtracks on a small fixed stack; a very long run of
         * letters can overflow it. The interpreter keeps its frames on the
         * heap, so that one piece is matched again without JIT. */
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
            rc = pcre2_match(p->re, (PCRE2_SPTR)text, len, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            st = k3_err(err, rc == PCRE2_ERROR_NOMEMORY ? K3_ERR_NOMEM : K3_ERR_RANGE,
                        "split regex failed at byte %zu: %s", pos, (const char *)msg);
            break;
        }
        size_t start = ov[0], end = ov[1];
        K3_ASSERT(end > start && start >= pos); /* no pattern matches empty */
        st = fn(ctx, text + start, end - start);
        if (st != K3_OK) break;
        pos = end;
    }
    pcre2_match_data_free(md);
    return st;
}

/* ---- UTF-8 -------------------------------------------------------------- */

bool k3_utf8_check(const char *s, size_t len, size_t *bad) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        unsigned c = u[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t n;
        unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
        if (c >= 0xC2 && c <= 0xDF) n = 2;
        else if (c >= 0xE0 && c <= 0xEF) {
            n = 3;
            if (c == 0xE0) lo = 0xA0; /* overlong */
            if (c == 0xED) hi = 0x9F; /* surrogates D800..DFFF */
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 4;
            if (c == 0xF0) lo = 0x90; /* overlong */
            if (c == 0xF4) hi = 0x8F; /* above U+10FFFF */
        } else {
            goto fail; /* continuation, C0/C1, F5..FF */
        }
        if (len - i < n) goto fail;
        if (u[i + 1] < lo || u[i + 1] > hi) goto fail;
        for (size_t k = 2; k < n; k++)
            if ((u[i + k] & 0xC0) != 0x80) goto fail;
        i += n;
    }
    return true;
fail:
    if (bad) *bad = i;
    return false;
}
