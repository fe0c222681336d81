/*
 * cmd_proxy.c -- `k3 serve --role proxy --prefill URL[,URL...] --decode
 * URL[,URL...]`: the one OpenAI endpoint in front of prefill and decode
 * instances (k3_proxy of k3.h, src/pd/proxy.c); `k3 serve --role router
 * --backend URL[,URL...]`: the same endpoint in front of colocated
 * instances, each request whole to one by prefix affinity and load
 * (src/router). No model: it only routes.
 * It drains on SIGINT / SIGTERM as `k3 serve` does: new requests are
 * refused, those running finish within --shutdown-timeout, the rest get
 * their API's error ending; a second signal cuts at once.
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
    g_quit++;
}

static int usage(FILE *f) {
    fprintf(f,
            "usage: k3 serve --role proxy --prefill URL[,URL...] --decode URL[,URL...] [options]\n"
            "  --prefill URLS     prefill instances (k3 serve --role prefill), http://HOST:PORT, comma-separated\n"
            "  --decode URLS      decode instances (k3 serve --role decode)\n"
            "  --kv-transfer-secret-file F  the deployment's transfer secret, as the instances' (or\n"
            "                     K3_KV_TRANSFER_SECRET): the proxy's credential on kv_transfer_params\n"
            "  --host ADDR        address to bind (default 127.0.0.1)\n"
            "  --port N           port (default 8000; 0 = any free port)\n"
            "  --api-key KEY      require Authorization: Bearer KEY or x-api-key: KEY (or set K3_API_KEY);\n"
            "                     passed on to the instances; an empty key is refused\n"
            "  --metrics-require-key  /metrics needs the key too (open by default)\n"
            "  --timeout S        a backend silent this long fails the request (default 600)\n"
            "  --max-body-bytes N largest request body (default 4194304)\n"
            "  --max-connections N connections at once (default 1024); --max-connections-per-ip N (default\n"
            "                     no cap)\n"
            "  --header-timeout S the request line and headers must be in this long (default 10);\n"
            "                     --body-timeout S the body (default 60); --idle-timeout S an idle client\n"
            "                     (default 30)\n"
            "  --allowed-origins LIST, --allowed-methods LIST, --allowed-headers LIST  CORS, as k3 serve's\n"
            "  --shutdown-timeout S on SIGTERM / SIGINT: stop taking requests (503), let those running finish\n"
            "                     for S seconds, then end them (default 5)\n"
            "Each generation request goes to the least loaded prefill instance (one token, kept for a decode\n"
            "instance), then with its kv_transfer_params to the least loaded decode instance, whose answer or\n"
            "stream the client gets. Other routes go to a decode instance. /health answers 200 while a prefill\n"
            "and a decode instance answer theirs. docs/pd.md.\n"
            "\n"
            "usage: k3 serve --role router --backend URL[,URL...] [options]\n"
            "  --backend URLS     colocated instances (k3 serve), http://HOST:PORT, comma-separated or repeated\n"
            "  --policy P         cache_aware (default): the instance the longest prefix of the prompt's text\n"
            "                     was sent to, balanced by load; round_robin: in turn\n"
            "  --cache-threshold F  affinity wins when the match covers more than F of the prompt (default\n"
            "                     0.5); else the instance with the least cached takes a new prefix\n"
            "  --balance-abs N, --balance-rel F  out of balance when the busiest has more than N requests\n"
            "                     more than the idlest and more than F times as many (default 32, 1.5): the\n"
            "                     least loaded takes the request\n"
            "  --router-block-bytes N  bytes of the prompt's text per node of the router's tree (default 64)\n"
            "  and the options above (no transfer secret). A backend that fails 3 requests in a row or whose\n"
            "  /health does not answer is skipped (its tree forgotten) and used again when /health answers;\n"
            "  /health answers 200 while a backend does. docs/kvstore.md.\n");
    return f == stdout ? 0 : 2;
}

/* Splits a comma-separated list in place into out (at most cap). */
static int split(char *s, const char **out, int cap) {
    int n = 0;
    for (char *t = strtok(s, ","); t && n < cap; t = strtok(NULL, ",")) out[n++] = t;
    return n;
}

static void nap_ms(int ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* Waits up to s seconds (a second signal cuts it) for the requests in flight; what is left. */
static int wait_in_flight(k3_proxy *p, double s, int signals) {
    for (double t = 0; t < s && k3_proxy_in_flight(p) > 0 && g_quit <= signals; t += 0.05) nap_ms(50);
    return k3_proxy_in_flight(p);
}

int k3_cmd_serve_proxy(int argc, char **argv) {
    const char *host = "127.0.0.1", *api_key = NULL, *secret_file = NULL;
    const char *origins = NULL, *methods = NULL, *headers = NULL;
    char *pre = NULL, *dec = NULL, *role = NULL;
    const char *policy = "cache_aware";
    char bk[4096] = "";
    long block = 0, bal_abs = 0;
    float threshold = 0, bal_rel = 0;
    long port = 8000, max_body = 0, max_conn = 0, max_conn_ip = 0, header_t = 0, body_t = 0, idle_t = 0, grace = 5;
    bool metrics_key = false;
    float timeout = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < argc;
#define ARG(s) (!strcmp(a, s) && has)
        if (ARG("--role")) role = argv[++i];
        else if (ARG("--backend")) {
            const char *u = argv[++i];
            if (strlen(bk) + strlen(u) + 2 > sizeof bk) {
                fprintf(stderr, "k3 serve --role router: the --backend list is too long\n");
                return 2;
            }
            if (bk[0]) strcat(bk, ",");
            strcat(bk, u);
        } else if (ARG("--policy")) policy = argv[++i];
        else if (ARG("--router-block-bytes")) {
            if (k3_cli_long("serve", "--router-block-bytes", argv[++i], 1, 1 << 20, &block)) return 2;
        } else if (ARG("--balance-abs")) {
            if (k3_cli_long("serve", "--balance-abs", argv[++i], 1, 1 << 20, &bal_abs)) return 2;
        } else if (ARG("--cache-threshold")) {
            if (k3_cli_float("serve", "--cache-threshold", argv[++i], 0.001, 1.0, &threshold)) return 2;
        } else if (ARG("--balance-rel")) {
            if (k3_cli_float("serve", "--balance-rel", argv[++i], 1.0, 1e6, &bal_rel)) return 2;
        } else if (ARG("--prefill")) pre = argv[++i];
        else if (ARG("--decode")) dec = argv[++i];
        else if (ARG("--host")) host = argv[++i];
        else if (ARG("--api-key")) api_key = argv[++i];
        else if (ARG("--kv-transfer-secret-file")) secret_file = argv[++i];
        else if (ARG("--allowed-origins")) origins = argv[++i];
        else if (ARG("--allowed-methods")) methods = argv[++i];
        else if (ARG("--allowed-headers")) headers = argv[++i];
        else if (!strcmp(a, "--metrics-require-key")) metrics_key = true;
        else if (ARG("--port")) {
            if (k3_cli_long("serve", "--port", argv[++i], 0, 65535, &port)) return 2;
        } else if (ARG("--max-body-bytes")) {
            if (k3_cli_long("serve", "--max-body-bytes", argv[++i], 1, 1L << 34, &max_body)) return 2;
        } else if (ARG("--max-connections")) {
            if (k3_cli_long("serve", "--max-connections", argv[++i], 1, 65536, &max_conn)) return 2;
        } else if (ARG("--max-connections-per-ip")) {
            if (k3_cli_long("serve", "--max-connections-per-ip", argv[++i], 0, 65536, &max_conn_ip)) return 2;
        } else if (ARG("--header-timeout")) {
            if (k3_cli_long("serve", "--header-timeout", argv[++i], 1, 86400, &header_t)) return 2;
        } else if (ARG("--body-timeout")) {
            if (k3_cli_long("serve", "--body-timeout", argv[++i], 1, 86400, &body_t)) return 2;
        } else if (ARG("--idle-timeout")) {
            if (k3_cli_long("serve", "--idle-timeout", argv[++i], 1, 86400, &idle_t)) return 2;
        } else if (ARG("--shutdown-timeout")) {
            if (k3_cli_long("serve", "--shutdown-timeout", argv[++i], 0, 86400, &grace)) return 2;
        } else if (ARG("--timeout")) {
            if (k3_cli_float("serve", "--timeout", argv[++i], 0.001, 86400.0, &timeout)) return 2;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            return usage(stdout);
        } else {
            fprintf(stderr, "k3 serve --role %s: unknown option or missing value: %s\n", role ? role : "proxy", a);
            return usage(stderr);
        }
#undef ARG
    }
    const bool router = role && !strcmp(role, "router");
    const char *who = router ? "k3 serve --role router" : "k3 serve --role proxy";
    int pol = 0;
    if (router) {
        if (pre || dec) {
            fprintf(stderr, "%s: --prefill and --decode are the proxy's (--role proxy); a router takes --backend\n",
                    who);
            return usage(stderr);
        }
        if (!bk[0]) {
            fprintf(stderr, "%s: --backend is required\n", who);
            return usage(stderr);
        }
        if (!strcmp(policy, "round_robin")) pol = 1;
        else if (strcmp(policy, "cache_aware")) {
            fprintf(stderr, "%s: --policy must be cache_aware or round_robin, not '%s'\n", who, policy);
            return 2;
        }
    } else {
        if (bk[0]) {
            fprintf(stderr, "%s: --backend is the router's (--role router)\n", who);
            return usage(stderr);
        }
        if (!pre || !dec) {
            fprintf(stderr, "%s: --prefill and --decode are required\n", who);
            return usage(stderr);
        }
    }
    if (!api_key) api_key = getenv("K3_API_KEY");
    if (api_key && !*api_key) {
        /* a launcher passing an unset variable must not leave the proxy open */
        fprintf(stderr,
                "%s: the API key is empty (--api-key \"\" or K3_API_KEY=): give a key, or leave it out to serve "
                "without one\n",
                who);
        return 2;
    }
    char *secret = NULL;
    size_t secret_len = 0;
    if (!router && k3_cli_transfer_secret("serve --role proxy", secret_file, &secret, &secret_len)) return 2;
    const char *pu[32], *du[32], *bu[64];
    const int np = pre ? split(pre, pu, 32) : 0, nd = dec ? split(dec, du, 32) : 0, nb = split(bk, bu, 64);
    k3_proxy_options o = {.host = host,
                          .port = (int)port,
                          .prefill = pu,
                          .n_prefill = np,
                          .decode = du,
                          .n_decode = nd,
                          .api_key = api_key,
                          .metrics_require_key = metrics_key,
                          .timeout_s = timeout,
                          .max_body_bytes = (size_t)max_body,
                          .max_connections = (int)max_conn,
                          .max_connections_per_ip = (int)max_conn_ip,
                          .idle_timeout_s = (int)idle_t,
                          .header_timeout_s = (int)header_t,
                          .body_timeout_s = (int)body_t,
                          .allowed_origins = origins,
                          .allowed_methods = methods,
                          .allowed_headers = headers,
                          .secret = secret,
                          .secret_len = secret_len,
                          .backends = bu,
                          .n_backends = router ? nb : 0,
                          .router_policy = pol,
                          .router_block_bytes = (int)block,
                          .router_cache_threshold = threshold,
                          .router_balance_abs = (int)bal_abs,
                          .router_balance_rel = bal_rel};
    k3_error err = {0};
    k3_proxy *p = NULL;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    const k3_status st = k3_proxy_start(&p, &o, &err);
    if (secret) memset(secret, 0, secret_len);
    free(secret);
    if (st) {
        fprintf(stderr, "%s: %s\n", who, err.msg);
        return 1;
    }
    if (router) fprintf(stderr, "k3 serve: role router, %d backends, policy %s\n", nb, policy);
    else fprintf(stderr, "k3 serve: role proxy, %d prefill and %d decode instances\n", np, nd);
    fprintf(stderr, "k3 serve: auth %s; CORS: %s; /metrics %s\n",
            api_key ? "on (Authorization: Bearer KEY or x-api-key: KEY)" : "off (no --api-key: every route is open)",
            origins && *origins ? origins : "the proxy's own origin only",
            api_key && metrics_key ? "needs the key" : "open");
    const bool v6 = strchr(host, ':') != NULL;
    fprintf(stderr, "k3 serve: listening on http://%s%s%s:%d%s\n", v6 ? "[" : "", host, v6 ? "]" : "", k3_proxy_port(p),
            api_key ? " (API key required)" : "");
    while (!g_quit) nap_ms(100);
    fprintf(stderr, "k3 serve: shutting down: %d requests in flight, new ones refused; a second signal cuts at once\n",
            k3_proxy_in_flight(p));
    k3_proxy_drain(p);
    const int left = grace > 0 ? wait_in_flight(p, (double)grace, 1) : k3_proxy_in_flight(p);
    if (left > 0) {
        k3_proxy_end(p, "the server is shutting down");
        if (g_quit <= 1) wait_in_flight(p, 2.0, 1);
    }
    fprintf(stderr, "k3 serve: shut down (%d requests were ended by it)\n", left);
    k3_proxy_stop(p);
    return 0;
}
