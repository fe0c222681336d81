/*
 * cmd_tokenize.c -- `k3 tokenize`: text on stdin to token ids on stdout, or
 * back with --decode.
 *
 *   k3 tokenize [-m DIR]                        the tokenizer of a model dir
 *   k3 tokenize --vocab FILE.tiktoken [--pattern o200k|cl100k|kimi]
 *   ... --decode                                ids (spaces, commas, newlines)
 *                                               on stdin, bytes on stdout
 *
 * Encoding prints the ids on one line, separated by spaces. Every error is
 * one line on stderr, `k3 tokenize: <message>`, and exit status 1.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "k3.h"

static const char usage[] = "usage: k3 tokenize [-m DIR | --vocab FILE.tiktoken [--pattern o200k|cl100k|kimi]]"
                            " [--decode]\n"
                            "  Reads UTF-8 text on stdin and prints its token ids; with --decode reads ids\n"
                            "  (separated by spaces, commas or newlines) and writes the bytes they stand for.\n"
                            "  -m DIR          model directory with tiktoken.model and tokenizer_config.json\n"
                            "                  (default " K3_DEFAULT_MODEL ")\n"
                            "  --vocab FILE    a bare .tiktoken rank file, no special tokens\n"
                            "  --pattern NAME  split pattern for --vocab (default kimi)\n"
                            "  The input is at most 64 MB.\n";

static int fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("k3 tokenize: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

static int encode(const k3_tokenizer *t, const char *text, size_t len) {
    int32_t *ids;
    size_t n;
    k3_error err = {0};
    if (k3_tokenizer_encode(t, text, len, &ids, &n, &err) != K3_OK) return fail("%s", err.msg);
    for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    putchar('\n');
    free(ids);
    return 0;
}

static int decode(const k3_tokenizer *t, const char *text) {
    size_t n = 0, cap = 256;
    int32_t *ids = malloc(cap * sizeof *ids);
    const char *p = text;
    int rc = 0;
    while (ids) {
        p += strspn(p, " \t\r\n,");
        if (!*p) break;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        size_t word = strcspn(p, " \t\r\n,");
        if (end != p + word || errno || v < INT32_MIN || v > INT32_MAX) {
            rc = fail("not a token id: \"%.*s\"", (int)(word < 40 ? word : 40), p);
            break;
        }
        if (n == cap) {
            int32_t *nv = realloc(ids, (cap *= 2) * sizeof *ids);
            if (!nv) free(ids);
            ids = nv;
            if (!ids) break;
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    if (!ids) return fail("out of memory");
    if (rc == 0) {
        char *out;
        size_t len;
        k3_error err = {0};
        if (k3_tokenizer_decode(t, ids, n, &out, &len, &err) != K3_OK) {
            rc = fail("%s", err.msg);
        } else {
            fwrite(out, 1, len, stdout);
            free(out);
        }
    }
    free(ids);
    return rc;
}

int k3_cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *vocab = NULL, *pattern = "kimi";
    bool do_decode = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_value = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(usage, stdout);
            return 0;
        } else if (!strcmp(a, "--decode")) {
            do_decode = true;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--vocab") || !strcmp(a, "--pattern")) {
            if (!has_value) return fail("%s needs a value", a);
            const char *v = argv[++i];
            if (!strcmp(a, "-m")) model = v;
            else if (!strcmp(a, "--vocab")) vocab = v;
            else pattern = v;
        } else {
            return fail("unknown argument \"%s\" (see k3 tokenize --help)", a);
        }
    }
    if (model && vocab) return fail("give -m or --vocab, not both");

    k3_tokenizer *t = NULL;
    k3_error err = {0};
    k3_status st;
    if (vocab) {
        k3_pattern pat;
        if (!strcmp(pattern, "o200k")) pat = K3_PATTERN_O200K;
        else if (!strcmp(pattern, "cl100k")) pat = K3_PATTERN_CL100K;
        else if (!strcmp(pattern, "kimi")) pat = K3_PATTERN_KIMI;
        else return fail("unknown pattern \"%s\" (o200k, cl100k or kimi)", pattern);
        st = k3_tokenizer_open_file(&t, vocab, pat, &err);
    } else {
        if (!(model = k3_cli_model_dir("tokenize", model ? model : K3_DEFAULT_MODEL))) return 1;
        st = k3_tokenizer_open(&t, model, &err);
    }
    if (st != K3_OK) return fail("%s", err.msg);

    size_t len;
    char *text = k3_cli_read_input("tokenize", "-", K3_CLI_MAX_INPUT, &len);
    int rc;
    if (!text) rc = 1;
    else rc = do_decode ? decode(t, text) : encode(t, text, len);
    free(text);
    k3_tokenizer_free(t);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        if (rc == 0) rc = fail("cannot write stdout: %s", strerror(errno));
    }
    return rc;
}
