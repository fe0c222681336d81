/*
 * cmd_bench_serve.c -- `k3 bench serve --base-url URL ...`: load against any
 * OpenAI-compatible server, reported like `vllm bench serve`.
 *
 * Requests are streamed (stream_options.include_usage) through one libcurl
 * multi handle: at most --max-concurrency in flight, arrivals at
 * --request-rate as a Poisson process (exponential gaps; default: all at
 * once). Definitions (docs/serving-reference.md §6.3): TTFT = first chunk with text -
 * send; ITL = gaps between later chunks with text; E2EL = end - send;
 * TPOT = (E2EL - TTFT) / (output tokens - 1); output tokens from the usage
 * chunk (chunks counted when the server sends none); goodput = requests
 * meeting every --goodput SLO, per second. The random dataset decodes random
 * ordinary token ids with --tokenizer into text (a shared prefix of
 * --prefix-len ids first); input tokens are the server's prompt_tokens.
 * --disconnect-fraction F drops that share of the requests after their first
 * chunks (a soak of clients that go away): they are counted apart, neither
 * completed nor failed. --endpoint picks the API: completions, chat
 * (/v1/chat/completions), responses (/v1/responses: text and reasoning
 * deltas, usage from response.completed) or messages (Anthropic's
 * /v1/messages: content_block_delta, usage from message_start and
 * message_delta), so the surfaces can be timed against each other;
 * --no-thinking turns chat's and Responses' thinking off (Anthropic's is
 * off unless asked), so the three send one prompt: K3's thinking-effort
 * system message alone is ~150 tokens, which would otherwise be timed as
 * a difference between the APIs. A mixed workload: --long-input-len L
 * makes each request, with probability --long-fraction F, a prompt of L
 * tokens instead (long prompts arriving while others decode); the
 * inter-token latency of the short requests alone is reported beside the
 * whole (what a long prefill does to the decodes around it).
 */
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "common/buf.h"
#include "k3.h"

/* The API of --endpoint. */
typedef enum { EP_COMPLETIONS, EP_CHAT, EP_RESPONSES, EP_MESSAGES } endpoint_kind;
static endpoint_kind g_ep = EP_COMPLETIONS;

typedef struct req {
    int idx;
    char *body;
    CURL *h;
    struct curl_slist *hdr;
    k3_buf in;
    double t_send, t_first, t_last, t_end;
    double *itl;
    int n_itl, cap_itl, n_chunks;
    long prompt_tokens, completion_tokens;
    bool got_usage, done_marker, error, drop, dropped, is_long;
    int drop_after;
    char err[256];
} req;

static void itl_add(req *r, double v) {
    if (r->n_itl == r->cap_itl) {
        int cap = r->cap_itl ? r->cap_itl * 2 : 64;
        double *t = realloc(r->itl, (size_t)cap * sizeof *t);
        if (!t) return;
        r->itl = t;
        r->cap_itl = cap;
    }
    r->itl[r->n_itl++] = v;
}

static void got_text(req *r) {
    const double t = k3_now();
    if (r->t_first == 0) r->t_first = t;
    else itl_add(r, t - r->t_last);
    r->t_last = t;
    r->n_chunks++;
}

static bool nonempty(json_t *v) { return json_is_string(v) && json_string_length(v) > 0; }

/* A Responses event (its "type" says which). */
static void on_responses_event(req *r, json_t *j, const char *type) {
    if (strstr(type, ".delta") &&
        (!strcmp(type, "response.output_text.delta") || !strcmp(type, "response.reasoning_text.delta") ||
         !strcmp(type, "response.function_call_arguments.delta"))) {
        if (nonempty(json_object_get(j, "delta"))) got_text(r);
        return;
    }
    json_t *resp = json_object_get(j, "response");
    if (!strcmp(type, "response.failed")) {
        json_t *m = json_object_get(json_object_get(resp, "error"), "message");
        r->error = true;
        snprintf(r->err, sizeof r->err, "%s", json_is_string(m) ? json_string_value(m) : "response.failed");
        return;
    }
    if (strcmp(type, "response.completed") && strcmp(type, "response.incomplete")) return;
    r->done_marker = true;
    json_t *u = json_object_get(resp, "usage");
    if (json_is_object(u)) {
        r->got_usage = true;
        r->prompt_tokens = (long)json_integer_value(json_object_get(u, "input_tokens"));
        r->completion_tokens = (long)json_integer_value(json_object_get(u, "output_tokens"));
    }
}

/* An Anthropic Messages event: input_tokens there leave out the cached ones. */
static void on_messages_event(req *r, json_t *j, const char *type) {
    if (!strcmp(type, "content_block_delta")) {
        json_t *d = json_object_get(j, "delta");
        if (nonempty(json_object_get(d, "text")) || nonempty(json_object_get(d, "thinking")) ||
            nonempty(json_object_get(d, "partial_json")))
            got_text(r);
        return;
    }
    json_t *u = !strcmp(type, "message_start") ? json_object_get(json_object_get(j, "message"), "usage")
        : !strcmp(type, "message_delta")       ? json_object_get(j, "usage")
                                               : NULL;
    if (json_is_object(u)) {
        r->got_usage = true;
        json_t *in = json_object_get(u, "input_tokens"), *out = json_object_get(u, "output_tokens");
        if (json_is_integer(in))
            r->prompt_tokens =
                (long)(json_integer_value(in) + json_integer_value(json_object_get(u, "cache_read_input_tokens")));
        if (json_is_integer(out)) r->completion_tokens = (long)json_integer_value(out);
    }
    if (!strcmp(type, "message_stop")) r->done_marker = true;
}

/* One SSE event's data. */
static void on_event(req *r, const char *data, size_t len) {
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        r->done_marker = true;
        return;
    }
    json_t *j = json_loadb(data, len, 0, NULL);
    if (!j) {
        r->error = true;
        snprintf(r->err, sizeof r->err, "a stream event is not JSON");
        return;
    }
    json_t *e = json_object_get(j, "error");
    if (e && !json_is_null(e)) {
        r->error = true;
        json_t *m = json_object_get(e, "message");
        snprintf(r->err, sizeof r->err, "%s", json_is_string(m) ? json_string_value(m) : "error event");
    }
    const char *type = json_string_value(json_object_get(j, "type"));
    if (g_ep == EP_RESPONSES || g_ep == EP_MESSAGES) {
        if (type && g_ep == EP_RESPONSES) on_responses_event(r, j, type);
        else if (type) on_messages_event(r, j, type);
        json_decref(j);
        return;
    }
    json_t *u = json_object_get(j, "usage");
    if (json_is_object(u)) {
        r->got_usage = true;
        r->prompt_tokens = (long)json_integer_value(json_object_get(u, "prompt_tokens"));
        r->completion_tokens = (long)json_integer_value(json_object_get(u, "completion_tokens"));
    }
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    if (ch) {
        json_t *d = json_object_get(ch, "delta");
        const char *keys[] = {"text", "content", "reasoning_content", "reasoning"};
        bool has = false;
        for (int k = 0; k < 4; k++) {
            json_t *v = k == 0 ? json_object_get(ch, "text") : d ? json_object_get(d, keys[k]) : NULL;
            if (json_is_string(v) && json_string_length(v) > 0) has = true;
        }
        if (d && json_array_size(json_object_get(d, "tool_calls"))) has = true;
        if (has) got_text(r);
    }
    json_decref(j);
}

static size_t on_data(char *ptr, size_t size, size_t nmemb, void *ud) {
    req *r = ud;
    const size_t n = size * nmemb;
    k3_buf_add(&r->in, ptr, n);
    if (r->in.oom) return 0;
    /* events end with a blank line; lines start with "data:" */
    for (;;) {
        char *end = strstr(r->in.p, "\n\n");
        size_t skip = 2;
        char *crlf = strstr(r->in.p, "\r\n\r\n");
        if (crlf && (!end || crlf < end)) end = crlf, skip = 4;
        if (!end) break;
        *end = 0;
        for (char *line = r->in.p; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            if (!strncmp(line, "data:", 5)) {
                const char *d = line + 5;
                while (*d == ' ') d++;
                size_t l = strlen(d);
                while (l && (d[l - 1] == '\r')) l--;
                on_event(r, d, l);
            }
            line = nl ? nl + 1 : NULL;
        }
        const size_t used = (size_t)(end - r->in.p) + skip;
        memmove(r->in.p, r->in.p + used, r->in.len - used + 1);
        r->in.len -= used;
    }
    if (r->drop && r->n_chunks >= r->drop_after) {
        r->dropped = true;
        return 0; /* abort the transfer: the client goes away */
    }
    return n;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define MAX_PCT 8
static double g_pct[MAX_PCT] = {99};
static int g_n_pct = 1;

typedef struct {
    double mean, median, std, pct[MAX_PCT];
} dist;

/* percentile p of sorted v[0..n), interpolated between order statistics as numpy.percentile */
static double pct_of(const double *v, size_t n, double p) {
    const double pos = p / 100.0 * (double)(n - 1);
    const size_t lo = (size_t)pos;
    return lo + 1 < n ? v[lo] + (pos - (double)lo) * (v[lo + 1] - v[lo]) : v[lo];
}

static dist dist_of(double *v, size_t n) {
    dist d;
    memset(&d, 0, sizeof d);
    if (!n) return d;
    qsort(v, n, sizeof *v, cmp_d);
    double s = 0;
    for (size_t i = 0; i < n; i++) s += v[i];
    d.mean = s / (double)n;
    double q = 0;
    for (size_t i = 0; i < n; i++) q += (v[i] - d.mean) * (v[i] - d.mean);
    d.std = sqrt(q / (double)n);
    d.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    for (int k = 0; k < g_n_pct; k++) d.pct[k] = pct_of(v, n, g_pct[k]);
    return d;
}

static uint64_t rng_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t x = *s;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    return x ^ (x >> 33);
}

static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) / 9007199254740992.0; }

/* vLLM's custom dataset: one JSON object per line with a "prompt" string;
 * their prompts in order, or NULL (said why). */
static json_t *load_custom(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "k3 bench serve: --dataset-path %s: cannot open it\n", path);
        return NULL;
    }
    json_t *all = json_array();
    char *line = NULL;
    size_t cap = 0;
    long no = 0;
    while (getline(&line, &cap, f) > 0) {
        no++;
        if (line[0] == '\n') continue;
        json_error_t je;
        json_t *o = json_loads(line, 0, &je);
        json_t *p = json_object_get(o, "prompt");
        if (!json_is_string(p)) {
            fprintf(stderr, "k3 bench serve: %s line %ld: not a JSON object with a \"prompt\" string\n", path, no);
            json_decref(o);
            json_decref(all);
            all = NULL;
            break;
        }
        json_array_append(all, p);
        json_decref(o);
    }
    free(line);
    fclose(f);
    if (all && !json_array_size(all)) {
        fprintf(stderr, "k3 bench serve: %s holds no prompt\n", path);
        json_decref(all);
        all = NULL;
    }
    return all;
}

static size_t to_buf(char *p, size_t size, size_t n, void *ud);

/* The speculative decoding counters of GET base/metrics (vLLM's names):
 * drafts, draft tokens, accepted; false when the server has none. */
static bool spec_counters(const char *base, const char *key, double out[3]) {
    CURL *h = curl_easy_init();
    if (!h) return false;
    char url[2100], auth[1100];
    snprintf(url, sizeof url, "%.2047s/metrics", base);
    struct curl_slist *hdr = NULL;
    if (key && *key) {
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", key);
        hdr = curl_slist_append(hdr, auth);
    }
    k3_buf b = {0};
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, 30L);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, to_buf);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
    const bool got = curl_easy_perform(h) == CURLE_OK;
    curl_slist_free_all(hdr);
    curl_easy_cleanup(h);
    static const char *names[3] = {"vllm:spec_decode_num_drafts_total{", "vllm:spec_decode_num_draft_tokens_total{",
                                   "vllm:spec_decode_num_accepted_tokens_total{"};
    int found = 0;
    for (int k = 0; got && b.p && k < 3; k++) {
        const char *at = strstr(b.p, names[k]);
        const char *sp = at ? strchr(at, '}') : NULL;
        if (sp && sscanf(sp + 1, "%lf", &out[k]) == 1) found++;
    }
    k3_buf_free(&b);
    return found == 3;
}

/* The usage on stdout (exit 0) for --help, on stderr (exit 2) after a bad option. */
static int usage_bs(FILE *f) {
    fprintf(f,
            "usage: k3 bench serve --base-url URL [options]\n"
            "  --model M                  model name (default: the first of GET /v1/models)\n"
            "  --endpoint completions|chat|responses|messages  the API (default completions; chat:\n"
            "                             /v1/chat/completions, responses: /v1/responses, messages:\n"
            "                             Anthropic's /v1/messages)\n"
            "  --dataset-name random|custom  random text (default), or vLLM's custom dataset: a JSON\n"
            "                             object per line with a \"prompt\" (--dataset-path FILE), taken in\n"
            "                             order (again from the top for more --num-prompts)\n"
            "  --tokenizer DIR            tokenizer for the random text (default %s)\n"
            "  --random-input-len I       prompt tokens (default 1024)\n"
            "  --random-output-len O      output tokens (default 128)\n"
            "  --random-range-ratio R     lengths uniform in [x(1-R), x(1+R)] (default 0)\n"
            "  --prefix-len P             a shared prefix of P tokens before every prompt\n"
            "  --long-input-len L         a mixed workload: a share of the prompts have L tokens instead\n"
            "  --long-fraction F          that share (default 0.25 with --long-input-len)\n"
            "  --num-prompts N            requests (default 100)\n"
            "  --max-concurrency C        requests in flight at most (default: no limit)\n"
            "  --request-rate R           requests/s, Poisson arrivals (default inf)\n"
            "  --ignore-eos               generate all O tokens\n"
            "  --no-thinking              chat and responses ask for no thinking (reasoning effort none), as\n"
            "                             messages does by default, so the three send the same prompt\n"
            "  --response-format JSON     completions and chat: send this response_format with every\n"
            "                             request (a JSON object, or @FILE), e.g. a json_schema\n"
            "  --goodput ttft:MS tpot:MS e2el:MS   SLOs for goodput\n"
            "  --disconnect-fraction F    drop this share of the streams after their first chunks\n"
            "  --metric-percentiles 50,90,99  percentiles to report (default 99)\n"
            "  --seed N                   dataset seed (default 0)\n"
            "  --api-key KEY              Bearer key (default: $OPENAI_API_KEY or $K3_API_KEY)\n"
            "  --timeout S                per-request limit in seconds (default 600)\n"
            "  --json                     print one JSON object instead of the table\n",
            K3_DEFAULT_MODEL);
    return f == stdout ? 0 : 2;
}

static size_t to_buf(char *p, size_t size, size_t n, void *ud) {
    k3_buf *b = ud;
    k3_buf_add(b, p, size * n);
    return b->oom ? 0 : size * n;
}

/* GET base/v1/models -> the first id (caller frees), or NULL with why. */
static char *first_model(const char *base, const char *key, char *why, size_t why_len) {
    CURL *h = curl_easy_init();
    if (!h) return NULL;
    char url[2100], auth[1100];
    snprintf(url, sizeof url, "%.2047s/v1/models", base);
    struct curl_slist *hdr = NULL;
    if (key && *key) {
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", key);
        hdr = curl_slist_append(hdr, auth);
    }
    k3_buf b = {0};
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(h, CURLOPT_TIMEOUT, 30L);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, to_buf);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &b);
    const CURLcode cc = curl_easy_perform(h);
    long code = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    curl_slist_free_all(hdr);
    curl_easy_cleanup(h);
    char *id = NULL;
    if (cc != CURLE_OK) snprintf(why, why_len, "GET %.300s: %s", url, curl_easy_strerror(cc));
    else if (code != 200) snprintf(why, why_len, "GET %.300s: HTTP %ld: %.150s", url, code, b.p ? b.p : "");
    else {
        json_t *j = b.p ? json_loads(b.p, 0, NULL) : NULL;
        json_t *v = json_object_get(json_array_get(json_object_get(j, "data"), 0), "id");
        if (json_is_string(v)) id = strdup(json_string_value(v));
        else snprintf(why, why_len, "GET %.300s: no model in the answer", url);
        json_decref(j);
    }
    k3_buf_free(&b);
    return id;
}

/* Random ordinary token ids decoded to text (invalid UTF-8 dropped). */
static char *random_text(const k3_tokenizer *tok, const int32_t *prefix, int n_prefix, int n, uint64_t *rng) {
    int32_t n_ord = k3_tokenizer_n_vocab(tok);
    while (n_ord > 0 && k3_tokenizer_is_special(tok, n_ord - 1)) n_ord--;
    int32_t *ids = malloc(sizeof *ids * (size_t)(n_prefix + n + 1));
    if (!ids) return NULL;
    memcpy(ids, prefix, sizeof *ids * (size_t)n_prefix);
    for (int i = 0; i < n; i++) ids[n_prefix + i] = (int32_t)(rng_next(rng) % (uint64_t)(n_ord > 0 ? n_ord : 1));
    char *text = NULL;
    size_t len = 0;
    k3_status st = k3_tokenizer_decode(tok, ids, (size_t)(n_prefix + n), &text, &len, NULL);
    free(ids);
    if (st) return NULL;
    /* keep valid UTF-8 only, so the JSON string is valid */
    json_t *j = json_stringn(text, len);
    size_t k = 0;
    if (!j) {
        for (size_t i = 0; i < len;) {
            const unsigned char c = (unsigned char)text[i];
            size_t l = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
            json_t *one = l && i + l <= len ? json_stringn(text + i, l) : NULL;
            if (!one) {
                i++;
                continue;
            }
            json_decref(one);
            if (c == 0) {
                i++;
                continue;
            }
            memmove(text + k, text + i, l);
            k += l;
            i += l;
        }
        text[k] = 0;
    }
    json_decref(j);
    return text;
}

static long slo_parse(const char *s, const char *key) {
    const size_t kl = strlen(key);
    if (strncmp(s, key, kl) || s[kl] != ':') return -1;
    char *end;
    const double v = strtod(s + kl + 1, &end);
    return *end || v <= 0 ? -2 : (long)(v * 1000.0); /* microseconds */
}

#define CMD "bench serve"

/* a finite number option into a double, through the CLI's strict float parser */
static int dbl(const char *opt, const char *v, double lo, double hi, double *out) {
    float f;
    if (k3_cli_float(CMD, opt, v, lo, hi, &f)) return -1;
    *out = f;
    return 0;
}

int k3_cmd_bench_serve(int argc, char **argv) {
    const char *base = NULL, *model = NULL, *endpoint = "completions", *tok_dir = K3_DEFAULT_MODEL;
    const char *key = getenv("OPENAI_API_KEY");
    if (!key) key = getenv("K3_API_KEY");
    long in_len = 1024, out_len = 128, n_prompts = 100, conc = 0, prefix_len = 0, timeout = 600, long_len = 0;
    double range = 0, rate = INFINITY, drop_frac = 0, long_frac = 0.25;
    double slo_ttft = 0, slo_tpot = 0, slo_e2el = 0; /* ms; 0 = none */
    bool ignore_eos = false, json_out = false, goodput = false, no_thinking = false;
    uint64_t seed = 0;
    const char *rf_arg = NULL, *dataset = "random", *dataset_path = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < argc;
#define ARG(s) (!strcmp(a, s) && has)
/* a number option: strictly parsed (cli/common.c), or exit 2 with a message naming it */
#define NUM(call) \
    do { \
        if (call) return 2; \
    } while (0)
        if (ARG("--base-url")) base = argv[++i];
        else if (ARG("--model")) model = argv[++i];
        else if (ARG("--endpoint")) endpoint = argv[++i];
        else if (ARG("--dataset") || ARG("--dataset-name")) {
            dataset = argv[++i];
            if (strcmp(dataset, "random") && strcmp(dataset, "custom")) {
                fprintf(stderr, "k3 bench serve: --dataset-name must be random or custom, not '%s'\n", dataset);
                return 2;
            }
        } else if (ARG("--dataset-path")) dataset_path = argv[++i];
        else if (ARG("--tokenizer")) tok_dir = argv[++i];
        else if (ARG("--random-input-len")) NUM(k3_cli_long(CMD, a, argv[++i], 1, 1L << 30, &in_len));
        else if (ARG("--random-output-len")) NUM(k3_cli_long(CMD, a, argv[++i], 1, 1L << 30, &out_len));
        else if (ARG("--random-range-ratio")) NUM(dbl(a, argv[++i], 0, 1, &range));
        else if (ARG("--prefix-len") || ARG("--random-prefix-len"))
            NUM(k3_cli_long(CMD, a, argv[++i], 0, 1L << 30, &prefix_len));
        else if (ARG("--long-input-len")) NUM(k3_cli_long(CMD, a, argv[++i], 1, 1L << 30, &long_len));
        else if (ARG("--long-fraction")) NUM(dbl(a, argv[++i], 0, 1, &long_frac));
        else if (ARG("--num-prompts")) NUM(k3_cli_long(CMD, a, argv[++i], 1, 1L << 30, &n_prompts));
        else if (ARG("--max-concurrency")) NUM(k3_cli_long(CMD, a, argv[++i], 0, 1L << 20, &conc));
        else if (ARG("--request-rate")) {
            if (strcmp(argv[++i], "inf")) NUM(dbl(a, argv[i], 1e-9, 1e9, &rate));
            else rate = INFINITY;
        } else if (ARG("--disconnect-fraction")) NUM(dbl(a, argv[++i], 0, 1, &drop_frac));
        else if (ARG("--seed")) NUM(k3_cli_u64(CMD, a, argv[++i], &seed));
        else if (ARG("--api-key")) key = argv[++i];
        else if (ARG("--response-format")) rf_arg = argv[++i];
        else if (ARG("--timeout")) NUM(k3_cli_long(CMD, a, argv[++i], 1, 1L << 30, &timeout));
        else if (ARG("--metric-percentiles")) {
            char *p = argv[++i];
            g_n_pct = 0;
            while (*p && g_n_pct < MAX_PCT) {
                char *end;
                const double v = strtod(p, &end);
                if (end == p || v < 0 || v > 100) {
                    fprintf(stderr, "k3 bench serve: --metric-percentiles takes numbers in [0, 100], like 50,90,99\n");
                    return 2;
                }
                g_pct[g_n_pct++] = v;
                p = *end == ',' ? end + 1 : end;
                if (*end && *end != ',') return usage_bs(stderr);
            }
            if (!g_n_pct) return usage_bs(stderr);
        } else if (!strcmp(a, "--ignore-eos")) ignore_eos = true;
        else if (!strcmp(a, "--no-thinking")) no_thinking = true;
        else if (!strcmp(a, "--json")) json_out = true;
        else if (ARG("--goodput")) {
            goodput = true;
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2)) {
                const char *g = argv[++i];
                long v;
                if ((v = slo_parse(g, "ttft")) >= 0) slo_ttft = v / 1000.0;
                else if ((v = slo_parse(g, "tpot")) >= 0) slo_tpot = v / 1000.0;
                else if ((v = slo_parse(g, "e2el")) >= 0) slo_e2el = v / 1000.0;
                else {
                    fprintf(stderr, "k3 bench serve: --goodput takes ttft:MS tpot:MS e2el:MS, not '%s'\n", g);
                    return 2;
                }
            }
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage_bs(stdout);
        else {
            fprintf(stderr, "k3 bench serve: unknown option or missing value: %s\n", a);
            return usage_bs(stderr);
        }
#undef ARG
#undef NUM
    }
    static const char *eps[] = {"completions", "chat", "responses", "messages"};
    int ep = -1;
    for (int k = 0; k < 4; k++)
        if (!strcmp(endpoint, eps[k])) ep = k;
    if (ep < 0) {
        fprintf(stderr, "k3 bench serve: --endpoint takes completions, chat, responses or messages, not '%s'\n",
                endpoint);
        return 2;
    }
    g_ep = (endpoint_kind)ep;
    if (!base) return usage_bs(stderr);
    if (in_len < 1 || out_len < 1 || n_prompts < 1 || conc < 0 || prefix_len < 0 || range < 0 || range >= 1 ||
        !(rate > 0) || drop_frac < 0 || drop_frac > 1 || timeout < 1) {
        fprintf(stderr,
                "k3 bench serve: lengths, --num-prompts and --request-rate must be positive, "
                "--random-range-ratio in [0, 1), --disconnect-fraction in [0, 1]\n");
        return 2;
    }
    if (!conc || conc > n_prompts) conc = n_prompts;
    json_t *custom = NULL; /* the custom dataset's prompts */
    if (!strcmp(dataset, "custom")) {
        if (!dataset_path) {
            fprintf(stderr, "k3 bench serve: --dataset-name custom needs --dataset-path FILE\n");
            return 2;
        }
        if (!(custom = load_custom(dataset_path))) return 2;
    }
    json_t *rf = NULL;
    if (rf_arg) {
        json_error_t je;
        rf = rf_arg[0] == '@' ? json_load_file(rf_arg + 1, 0, &je) : json_loads(rf_arg, 0, &je);
        if (!json_is_object(rf)) {
            fprintf(stderr, "k3 bench serve: --response-format: not a JSON object (%s)\n", rf ? "" : je.text);
            json_decref(rf);
            return 2;
        }
    }
    char basebuf[2048];
    snprintf(basebuf, sizeof basebuf, "%s", base);
    size_t bl = strlen(basebuf);
    while (bl && basebuf[bl - 1] == '/') basebuf[--bl] = 0;
    if (bl > 3 && !strcmp(basebuf + bl - 3, "/v1")) basebuf[bl -= 3] = 0;
    base = basebuf;

    k3_error err = {0};
    k3_tokenizer *tok = NULL;
    if (k3_tokenizer_open(&tok, tok_dir, &err)) {
        fprintf(stderr, "k3 bench serve: --tokenizer %s: %s\n", tok_dir, err.msg);
        json_decref(rf);
        return 1;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);
    char why[512] = "";
    char *model_own = NULL;
    if (!model) {
        model_own = first_model(base, key, why, sizeof why);
        if (!model_own) {
            fprintf(stderr, "k3 bench serve: %s\n", why);
            k3_tokenizer_free(tok);
            curl_global_cleanup();
            json_decref(rf);
            return 1;
        }
        model = model_own;
    }
    /* the dataset */
    uint64_t rng = seed * 0x9E3779B97F4A7C15ull + 12345;
    int32_t *prefix = malloc(sizeof *prefix * (size_t)(prefix_len + 1));
    int32_t n_ord = k3_tokenizer_n_vocab(tok);
    while (n_ord > 0 && k3_tokenizer_is_special(tok, n_ord - 1)) n_ord--;
    for (long i = 0; prefix && i < prefix_len; i++) prefix[i] = (int32_t)(rng_next(&rng) % (uint64_t)n_ord);
    req *rs = calloc((size_t)n_prompts, sizeof *rs);
    double *arrive = calloc((size_t)n_prompts, sizeof *arrive);
    int rc = 1;
    if (!rs || !arrive || !prefix) {
        fprintf(stderr, "k3 bench serve: out of memory\n");
        goto out;
    }
    char url[2200], auth[1100], xkey[1100];
    static const char *paths[] = {"completions", "chat/completions", "responses", "messages"};
    snprintf(url, sizeof url, "%s/v1/%s", base, paths[g_ep]);
    snprintf(auth, sizeof auth, "Authorization: Bearer %s", key ? key : "");
    snprintf(xkey, sizeof xkey, "x-api-key: %s", key ? key : "");
    double t_arr = 0;
    for (long i = 0; i < n_prompts; i++) {
        req *r = &rs[i];
        r->idx = (int)i;
        r->is_long = long_len > 0 && rng_unit(&rng) < long_frac;
        const long base_len = r->is_long ? long_len : in_len;
        const long il = range > 0 ? (long)(base_len * (1 - range) + rng_unit(&rng) * 2 * range * base_len) : base_len;
        const long ol = range > 0 ? (long)(out_len * (1 - range) + rng_unit(&rng) * 2 * range * out_len) : out_len;
        char *text = custom ? strdup(json_string_value(json_array_get(custom, (size_t)i % json_array_size(custom))))
                            : random_text(tok, prefix, (int)prefix_len, (int)(il > 0 ? il : 1), &rng);
        if (!text) {
            fprintf(stderr, "k3 bench serve: cannot make the random prompts\n");
            goto out;
        }
        static const char *max_key[] = {"max_tokens", "max_completion_tokens", "max_output_tokens", "max_tokens"};
        json_t *b = json_pack("{s:s,s:I,s:f,s:b,s:b}", "model", model, max_key[g_ep], (json_int_t)(ol > 0 ? ol : 1),
                              "temperature", 0.0, "stream", 1, "ignore_eos", ignore_eos);
        /* the usage: OpenAI's chunk when asked for; Responses and Messages always send theirs */
        if (g_ep <= EP_CHAT) json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
        /* thinking off the way each API says it (Messages: off unless asked) */
        if (no_thinking && g_ep == EP_CHAT) json_object_set_new(b, "reasoning_effort", json_string("none"));
        if (no_thinking && g_ep == EP_RESPONSES)
            json_object_set_new(b, "reasoning", json_pack("{s:s}", "effort", "none"));
        if (rf && g_ep <= EP_CHAT) json_object_set(b, "response_format", rf);
        if (g_ep == EP_CHAT || g_ep == EP_MESSAGES)
            json_object_set_new(b, "messages", json_pack("[{s:s,s:s}]", "role", "user", "content", text));
        else json_object_set_new(b, g_ep == EP_RESPONSES ? "input" : "prompt", json_string(text));
        free(text);
        r->body = json_dumps(b, JSON_COMPACT);
        json_decref(b);
        r->drop = drop_frac > 0 && rng_unit(&rng) < drop_frac;
        r->drop_after = 1 + (int)(rng_next(&rng) % 4);
        if (!r->body) {
            fprintf(stderr, "k3 bench serve: out of memory\n");
            goto out;
        }
        if (isfinite(rate)) t_arr += -log(1.0 - rng_unit(&rng)) / rate;
        arrive[i] = t_arr;
    }

    double spec0[3] = {0}, spec1[3] = {0};
    const bool spec_on = spec_counters(base, key, spec0);
    CURLM *multi = curl_multi_init();
    long next = 0, in_flight = 0, finished = 0;
    const double t0 = k3_now();
    while (finished < n_prompts) {
        const double t = k3_now() - t0;
        while (next < n_prompts && in_flight < conc && arrive[next] <= t) {
            req *r = &rs[next++];
            r->h = curl_easy_init();
            r->hdr = curl_slist_append(NULL, "Content-Type: application/json");
            if (key && *key) r->hdr = curl_slist_append(r->hdr, auth);
            if (key && *key && g_ep == EP_MESSAGES) r->hdr = curl_slist_append(r->hdr, xkey);
            if (g_ep == EP_MESSAGES) r->hdr = curl_slist_append(r->hdr, "anthropic-version: 2023-06-01");
            curl_easy_setopt(r->h, CURLOPT_URL, url);
            curl_easy_setopt(r->h, CURLOPT_HTTPHEADER, r->hdr);
            curl_easy_setopt(r->h, CURLOPT_POSTFIELDS, r->body);
            curl_easy_setopt(r->h, CURLOPT_WRITEFUNCTION, on_data);
            curl_easy_setopt(r->h, CURLOPT_WRITEDATA, r);
            curl_easy_setopt(r->h, CURLOPT_PRIVATE, r);
            curl_easy_setopt(r->h, CURLOPT_NOSIGNAL, 1L);
            curl_easy_setopt(r->h, CURLOPT_TIMEOUT, timeout);
            r->t_send = k3_now();
            curl_multi_add_handle(multi, r->h);
            in_flight++;
        }
        int running = 0;
        curl_multi_perform(multi, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(multi, &left))) {
            if (msg->msg != CURLMSG_DONE) continue;
            req *r;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&r);
            r->t_end = k3_now();
            long code = 0;
            curl_easy_getinfo(msg->easy_handle, CURLINFO_RESPONSE_CODE, &code);
            if (!r->dropped) {
                if (msg->data.result != CURLE_OK) {
                    r->error = true;
                    snprintf(r->err, sizeof r->err, "%s", curl_easy_strerror(msg->data.result));
                } else if (code != 200) {
                    r->error = true;
                    snprintf(r->err, sizeof r->err, "HTTP %ld: %.200s", code, r->in.p ? r->in.p : "");
                } else if (!r->done_marker && !r->error) {
                    r->error = true;
                    snprintf(r->err, sizeof r->err, "the stream ended without %s",
                             g_ep == EP_RESPONSES      ? "response.completed"
                                 : g_ep == EP_MESSAGES ? "message_stop"
                                                       : "[DONE]");
                }
            }
            curl_multi_remove_handle(multi, r->h);
            curl_easy_cleanup(r->h);
            curl_slist_free_all(r->hdr);
            r->h = NULL;
            k3_buf_free(&r->in);
            in_flight--;
            finished++;
        }
        double wait_ms = 50;
        if (next < n_prompts && in_flight < conc) {
            const double dt = (arrive[next] - (k3_now() - t0)) * 1000.0;
            wait_ms = dt < 0 ? 0 : dt < wait_ms ? dt : wait_ms;
        }
        curl_multi_poll(multi, NULL, 0, (int)wait_ms, NULL);
    }
    const double dur = k3_now() - t0;
    curl_multi_cleanup(multi);

    /* the report */
    long ok = 0, failed = 0, dropped = 0, good = 0, in_tok = 0, out_tok = 0;
    double *ttft = calloc((size_t)n_prompts, sizeof *ttft), *tpot = calloc((size_t)n_prompts, sizeof *tpot),
           *e2el = calloc((size_t)n_prompts, sizeof *e2el);
    size_t n_itl = 0, n_tpot = 0;
    for (long i = 0; i < n_prompts; i++) n_itl += (size_t)rs[i].n_itl;
    double *itl = calloc(n_itl + 1, sizeof *itl), *itl_s = calloc(n_itl + 1, sizeof *itl_s);
    size_t n_itl_s = 0;
    long n_long = 0;
    if (!ttft || !tpot || !e2el || !itl || !itl_s) {
        fprintf(stderr, "k3 bench serve: out of memory\n");
        goto out;
    }
    n_itl = 0;
    const char *first_err = NULL;
    for (long i = 0; i < n_prompts; i++) {
        req *r = &rs[i];
        if (r->dropped) {
            dropped++;
            continue;
        }
        if (r->error) {
            failed++;
            if (!first_err) first_err = r->err;
            continue;
        }
        const long out = r->got_usage ? r->completion_tokens : r->n_chunks;
        in_tok += r->prompt_tokens;
        out_tok += out;
        const double tt = r->t_first > 0 ? r->t_first - r->t_send : r->t_end - r->t_send;
        const double e2 = r->t_end - r->t_send;
        ttft[ok] = tt * 1000;
        e2el[ok] = e2 * 1000;
        double tp = 0;
        if (out > 1) tpot[n_tpot++] = tp = (e2 - tt) / (double)(out - 1) * 1000;
        for (int k = 0; k < r->n_itl; k++) itl[n_itl++] = r->itl[k] * 1000;
        for (int k = 0; !r->is_long && k < r->n_itl; k++) itl_s[n_itl_s++] = r->itl[k] * 1000;
        n_long += r->is_long;
        ok++;
        if ((!slo_ttft || ttft[ok - 1] <= slo_ttft) && (!slo_tpot || tp <= slo_tpot) &&
            (!slo_e2el || e2el[ok - 1] <= slo_e2el))
            good++;
    }
    const dist dt = dist_of(ttft, (size_t)ok), dp = dist_of(tpot, n_tpot), di = dist_of(itl, n_itl),
               de = dist_of(e2el, (size_t)ok), ds_short = dist_of(itl_s, n_itl_s);
    /* speculative decoding over the run (vLLM bench serve's section): the counters' growth */
    const bool spec = spec_on && spec_counters(base, key, spec1) && spec1[0] > spec0[0];
    const double sp_drafts = spec1[0] - spec0[0], sp_tokens = spec1[1] - spec0[1], sp_acc = spec1[2] - spec0[2];
    if (json_out) {
        json_t *j = json_pack("{s:I,s:I,s:I,s:I,s:f,s:I,s:I,s:f,s:f,s:f}", "completed", (json_int_t)ok, "failed",
                              (json_int_t)failed, "disconnected", (json_int_t)dropped, "max_concurrency",
                              (json_int_t)conc, "duration", dur, "total_input_tokens", (json_int_t)in_tok,
                              "total_output_tokens", (json_int_t)out_tok, "request_throughput", ok / dur,
                              "output_throughput", out_tok / dur, "total_token_throughput", (in_tok + out_tok) / dur);
        if (goodput) json_object_set_new(j, "request_goodput", json_real(good / dur));
        if (spec) {
            json_object_set_new(j, "spec_decode_acceptance_rate", json_real(sp_tokens > 0 ? sp_acc / sp_tokens : 0));
            json_object_set_new(j, "spec_decode_acceptance_length", json_real(1 + sp_acc / sp_drafts));
            json_object_set_new(j, "spec_decode_num_drafts", json_integer((json_int_t)sp_drafts));
            json_object_set_new(j, "spec_decode_draft_tokens", json_integer((json_int_t)sp_tokens));
            json_object_set_new(j, "spec_decode_accepted_tokens", json_integer((json_int_t)sp_acc));
        }
        const char *names[4] = {"ttft", "tpot", "itl", "e2el"};
        const dist *ds[4] = {&dt, &dp, &di, &de};
        char k[64];
        for (int m = 0; m < 4; m++) {
            snprintf(k, sizeof k, "mean_%s_ms", names[m]);
            json_object_set_new(j, k, json_real(ds[m]->mean));
            snprintf(k, sizeof k, "median_%s_ms", names[m]);
            json_object_set_new(j, k, json_real(ds[m]->median));
            snprintf(k, sizeof k, "std_%s_ms", names[m]);
            json_object_set_new(j, k, json_real(ds[m]->std));
            for (int q = 0; q < g_n_pct; q++) {
                snprintf(k, sizeof k, "p%g_%s_ms", g_pct[q], names[m]);
                json_object_set_new(j, k, json_real(ds[m]->pct[q]));
            }
        }
        if (long_len > 0) { /* the mixed workload: the short requests' inter-token latency */
            json_object_set_new(j, "long_requests", json_integer(n_long));
            json_object_set_new(j, "long_input_len", json_integer(long_len));
            json_object_set_new(j, "mean_itl_short_ms", json_real(ds_short.mean));
            json_object_set_new(j, "median_itl_short_ms", json_real(ds_short.median));
            for (int q = 0; q < g_n_pct; q++) {
                snprintf(k, sizeof k, "p%g_itl_short_ms", g_pct[q]);
                json_object_set_new(j, k, json_real(ds_short.pct[q]));
            }
        }
        if (first_err) json_object_set_new(j, "first_error", json_string(first_err));
        char *t = json_dumps(j, JSON_COMPACT);
        json_decref(j);
        if (t) puts(t);
        free(t);
    } else {
        printf("============ Serving Benchmark Result ============\n");
        printf("%-40s %-10ld\n", "Successful requests:", ok);
        printf("%-40s %-10ld\n", "Failed requests:", failed);
        if (drop_frac > 0) printf("%-40s %-10ld\n", "Disconnected requests:", dropped);
        printf("%-40s %-10ld\n", "Maximum request concurrency:", conc);
        if (isfinite(rate)) printf("%-40s %-10.2f\n", "Request rate (req/s):", rate);
        printf("%-40s %-10.2f\n", "Benchmark duration (s):", dur);
        printf("%-40s %-10ld\n", "Total input tokens:", in_tok);
        printf("%-40s %-10ld\n", "Total generated tokens:", out_tok);
        printf("%-40s %-10.2f\n", "Request throughput (req/s):", ok / dur);
        if (goodput) printf("%-40s %-10.2f\n", "Request goodput (req/s):", good / dur);
        printf("%-40s %-10.2f\n", "Output token throughput (tok/s):", out_tok / dur);
        printf("%-40s %-10.2f\n", "Total Token throughput (tok/s):", (in_tok + out_tok) / dur);
        const char *titles[4] = {"Time to First Token", "Time per Output Token (excl. 1st token)",
                                 "Inter-token Latency", "End-to-end Latency"};
        const char *abbr[4] = {"TTFT", "TPOT", "ITL", "E2EL"};
        const dist *ds[4] = {&dt, &dp, &di, &de};
        for (int m = 0; m < 4; m++) {
            const int w = (int)strlen(titles[m]);
            const int l = (50 - w) / 2, rr = 50 - w - l;
            printf("%.*s%s%.*s\n", l, "--------------------------", titles[m], rr, "--------------------------");
            char k[64];
            snprintf(k, sizeof k, "Mean %s (ms):", abbr[m]);
            printf("%-40s %-10.2f\n", k, ds[m]->mean);
            snprintf(k, sizeof k, "Median %s (ms):", abbr[m]);
            printf("%-40s %-10.2f\n", k, ds[m]->median);
            for (int q = 0; q < g_n_pct; q++) {
                snprintf(k, sizeof k, "P%g %s (ms):", g_pct[q], abbr[m]);
                printf("%-40s %-10.2f\n", k, ds[m]->pct[q]);
            }
        }
        if (long_len > 0) {
            printf("-----Inter-token Latency (short requests)----------\n");
            printf("%-40s %-10ld\n", "Long requests:", n_long);
            printf("%-40s %-10.2f\n", "Mean ITL of the short (ms):", ds_short.mean);
            printf("%-40s %-10.2f\n", "Median ITL of the short (ms):", ds_short.median);
            for (int q = 0; q < g_n_pct; q++) {
                char k[64];
                snprintf(k, sizeof k, "P%g ITL of the short (ms):", g_pct[q]);
                printf("%-40s %-10.2f\n", k, ds_short.pct[q]);
            }
        }
        if (spec) {
            printf("---------------Speculative Decoding---------------\n");
            printf("%-40s %-10.2f\n", "Acceptance rate (%):", sp_tokens > 0 ? 100 * sp_acc / sp_tokens : 0);
            printf("%-40s %-10.2f\n", "Acceptance length:", 1 + sp_acc / sp_drafts);
            printf("%-40s %-10.0f\n", "Drafts:", sp_drafts);
            printf("%-40s %-10.0f\n", "Draft tokens:", sp_tokens);
            printf("%-40s %-10.0f\n", "Accepted tokens:", sp_acc);
        }
        printf("==================================================\n");
        if (first_err) fprintf(stderr, "k3 bench serve: first failure: %s\n", first_err);
    }
    rc = failed ? 1 : 0;
    free(ttft);
    free(tpot);
    free(e2el);
    free(itl);
    free(itl_s);
out:
    json_decref(custom);
    for (long i = 0; rs && i < n_prompts; i++) {
        free(rs[i].body);
        free(rs[i].itl);
    }
    free(rs);
    free(arrive);
    free(prefix);
    free(model_own);
    json_decref(rf);
    k3_tokenizer_free(tok);
    curl_global_cleanup();
    return rc;
}
