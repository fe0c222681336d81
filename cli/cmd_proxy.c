/*
 * cmd_proxy.c -- `k3 serve --role proxy --prefill URL[,URL...] --decode
 * URL[,URL...]`: the one OpenAI endpoint in front of prefill and decode
 * instances (k3_proxy of k3.h, src/pd/proxy.c). No model: it only routes.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "k3.h"

static volatile sig_atomic_t g_quit;

static void on_signal(int sig) {
    (void)sig;
    g_quit = 1;
}

static int usage(FILE *f) {
    fprintf(f,
            "usage: k3 serve --role proxy --prefill URL[,URL...] --decode URL[,URL...] [options]\n"
            "  --prefill URLS     prefill instances (k3 serve --role prefill), http://HOST:PORT, comma-separated\n"
            "  --decode URLS      decode instances (k3 serve --role decode)\n"
            "  --host ADDR        address to bind (default 127.0.0.1)\n"
            "  --port N           port (default 8000; 0 = any free port)\n"
            "  --api-key KEY      require Authorization: Bearer KEY (or set K3_API_KEY); passed on to the instances\n"
            "  --timeout S        a backend silent this long fails the request (default 600)\n"
            "  --max-body-bytes N largest request body (default 4194304)\n"
            "  --max-connections N connections at once (default 1024)\n"
            "Each generation request goes to the least loaded prefill instance (one token, kept for a decode\n"
            "instance), then with its kv_transfer_params to the least loaded decode instance, whose answer or\n"
            "stream the client gets. Other routes go to a decode instance. docs/pd.md.\n");
    return f == stdout ? 0 : 2;
}

/* Splits a comma-separated list in place into out (at most cap). */
static int split(char *s, const char **out, int cap) {
    int n = 0;
    for (char *t = strtok(s, ","); t && n < cap; t = strtok(NULL, ",")) out[n++] = t;
    return n;
}

int k3_cmd_serve_proxy(int argc, char **argv) {
    const char *host = "127.0.0.1", *api_key = NULL;
    char *pre = NULL, *dec = NULL;
    long port = 8000, max_body = 0, max_conn = 0;
    float timeout = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < argc;
#define ARG(s) (!strcmp(a, s) && has)
        if (ARG("--role")) i++;
        else if (ARG("--prefill")) pre = argv[++i];
        else if (ARG("--decode")) dec = argv[++i];
        else if (ARG("--host")) host = argv[++i];
        else if (ARG("--api-key")) api_key = argv[++i];
        else if (ARG("--port")) {
            if (k3_cli_long("serve", "--port", argv[++i], 0, 65535, &port)) return 2;
        } else if (ARG("--max-body-bytes")) {
            if (k3_cli_long("serve", "--max-body-bytes", argv[++i], 1, 1L << 34, &max_body)) return 2;
        } else if (ARG("--max-connections")) {
            if (k3_cli_long("serve", "--max-connections", argv[++i], 1, 65536, &max_conn)) return 2;
        } else if (ARG("--timeout")) {
            if (k3_cli_float("serve", "--timeout", argv[++i], 0.001, 86400.0, &timeout)) return 2;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            return usage(stdout);
        } else {
            fprintf(stderr, "k3 serve --role proxy: unknown option or missing value: %s\n", a);
            return usage(stderr);
        }
#undef ARG
    }
    if (!pre || !dec) {
        fprintf(stderr, "k3 serve --role proxy: --prefill and --decode are required\n");
        return usage(stderr);
    }
    if (!api_key) api_key = getenv("K3_API_KEY");
    const char *pu[32], *du[32];
    const int np = split(pre, pu, 32), nd = split(dec, du, 32);
    k3_proxy_options o = {.host = host,
                          .port = (int)port,
                          .prefill = pu,
                          .n_prefill = np,
                          .decode = du,
                          .n_decode = nd,
                          .api_key = api_key,
                          .timeout_s = timeout,
                          .max_body_bytes = (size_t)max_body,
                          .max_connections = (int)max_conn};
    k3_error err = {0};
    k3_proxy *p = NULL;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (k3_proxy_start(&p, &o, &err)) {
        fprintf(stderr, "k3 serve --role proxy: %s\n", err.msg);
        return 1;
    }
    fprintf(stderr, "k3 serve: role proxy, %d prefill and %d decode instances\n", np, nd);
    const bool v6 = strchr(host, ':') != NULL;
    fprintf(stderr, "k3 serve: listening on http://%s%s%s:%d%s\n", v6 ? "[" : "", host, v6 ? "]" : "", k3_proxy_port(p),
            api_key && *api_key ? " (API key required)" : "");
    while (!g_quit) {
        struct timespec nap = {0, 200 * 1000000L};
        nanosleep(&nap, NULL);
    }
    fprintf(stderr, "k3 serve: shutting down\n");
    k3_proxy_stop(p);
    return 0;
}
