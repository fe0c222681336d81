/*
 * cmd_serve.c -- `k3 serve -m DIR`: the OpenAI-compatible HTTP server
 * (src/server) on the batching engine. Prints the mode and the address at
 * start, one log line every 5 s while busy (like vLLM's), and drains on
 * SIGINT / SIGTERM: new requests are refused, those running finish within
 * --shutdown-timeout, the rest get an error ending, then it exits 0 (1 when
 * the engine failed).
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "k3.h"

/* Signals so far, and whether one came from the parent under mpirun
 * (mpirun ending the job: it sends SIGKILL a second later). */
static volatile sig_atomic_t g_signals, g_from_parent;

static void on_signal(int sig, siginfo_t *si, void *uc) {
    (void)sig;
    (void)uc;
    g_signals = g_signals + 1;
    if (si && si->si_pid > 1 && si->si_pid == getppid()) g_from_parent = 1;
}

static double mono_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void nap_ms(long ms) {
    struct timespec nap = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&nap, NULL);
}

/* Waits up to wait_s (or a further signal) for the requests in flight to be
 * answered; how many are left. */
static int wait_in_flight(k3_server *srv, double wait_s, int signals) {
    const double end = mono_now() + wait_s;
    while (k3_server_in_flight(srv) > 0 && mono_now() < end && g_signals <= signals) nap_ms(20);
    return k3_server_in_flight(srv);
}

/* The usage on stdout (exit 0) for --help, on stderr (exit 2) after a bad option. */
static int usage_serve(FILE *f) {
    fprintf(f,
            "usage: k3 serve [-m DIR] [options]\n"
            "  --host ADDR                  address to bind (default 127.0.0.1)\n"
            "  --port N                     port (default 8000; 0 = any free port)\n"
            "  --api-key KEY                require Authorization: Bearer KEY or x-api-key: KEY on every route\n"
            "                               but /health, /ready, /metrics (or set K3_API_KEY; an empty key is "
            "refused)\n"
            "  --metrics-require-key        /metrics needs the key too (default: open, as vLLM's)\n"
            "  --allowed-origins LIST       CORS: origins a browser page may call from, comma-separated, or '*'\n"
            "                               (default: none but the server's own: a request with another Origin\n"
            "                               is refused 403, so a web page cannot drive a local model)\n"
            "  --allowed-methods LIST       CORS preflight methods (default \"GET, POST, OPTIONS\")\n"
            "  --allowed-headers LIST       CORS preflight headers (default '*': those the browser asks for)\n"
            "  --served-model-name NAME     the model name clients use (default: DIR)\n"
            "  --max-model-len N            prompt + output tokens per request\n"
            "  --max-num-seqs N             running requests at once (default 16)\n"
            "  --max-num-batched-tokens N   tokens per step (default 2048)\n"
            "  --max-step-cost N            while requests decode, a step costs at most N decode tokens,\n"
            "                               a prompt token priced by its position (default 0: off)\n"
            "  --max-waiting N              waiting requests before 503 (default 256)\n"
            "  --cache-tokens N             cache pool size in tokens (default: from the machine)\n"
            "  --block-size N               tokens per cache block (default 64; under --dcp D a multiple of\n"
            "                               D x --dcp-interleave, by default 64 rounded up to one)\n"
            "  --no-prefix-cache            turn prefix caching off\n"
            "  --snapshot-mb N              byte budget of the prefix cache's KDA snapshots (default: the engine's)\n"
            "  --quant MODE                 " K3_CLI_QUANT_MODES " (default %s)\n"
            "  --kv-cache f32|c8            cache format (default %s)\n"
            "  --mmap                       keep the weights in the file mapping\n"
            "  --threads N                  worker threads (default: the physical cores)\n"
            "  --isa NAME                   kernels: " K3_CLI_ISA_HELP "\n"
            "  --max-body-bytes N           largest request body, base64 images included (default 4194304)\n"
            "  --max-image-pixels N         largest image, width x height (default 67108864 = 8192 x 8192)\n"
            "  --max-request-image-pixels N a request's images' pixels together, read from their headers before\n"
            "                               any is decoded (default 268435456: four of the largest); images are\n"
            "                               decoded and encoded one at a time, one request at a time\n"
            "  --max-request-image-tokens N their prompt rows together, the vision tower's work (default:\n"
            "                               --max-model-len)\n"
            "  --vision-threads N           threads of the image encoder's own pool (default: --threads)\n"
            "  --timeout S                  drop a client idle this long (default 30)\n"
            "  --header-timeout S           a request line and headers must be in within S of the connection\n"
            "                               opening or of its previous answer, else 408 and closed (default 10)\n"
            "  --body-timeout S             a body must be in within S of its headers, else 408 (default 60)\n"
            "  --max-connections N          connections at once, one thread each (default 1024); one more takes\n"
            "                               the place of the connection that has waited longest for its request,\n"
            "                               or is answered 503 with Retry-After when every one is busy\n"
            "  --max-connections-per-ip N   connections at once from one address, the rest 503 (default 0: no cap)\n"
            "  --shutdown-timeout S         on SIGTERM / SIGINT: stop taking requests (503), let those running\n"
            "                               finish for up to S, then end the rest with an error event (streams)\n"
            "                               or a 503; a second signal cuts at once (default 5; 0 = end at once)\n"
            "  --step-timeout S             /health and /ready answer 503 while one engine step has run longer\n"
            "                               than S (default: --dist-timeout, 300)\n"
            "  --no-ui                      no chat page at / (by default / serves one that talks to\n"
            "                               /v1/chat/completions)\n"
            "  --kv-cache-dir DIR           the prefix cache's disk tier (docs/kvstore.md): cache blocks and KDA\n"
            "                               snapshots saved behind the engine into DIR, loaded back before a request\n"
            "                               is scheduled; it survives restarts and instances of a host share it\n"
            "  --kv-cache-disk-bytes N      its budget, an LRU over the directory (default 64G; K, M, G, T suffixes)\n"
            "  --kv-cache-fsync             fsync each file before publishing it (durable after a power loss)\n"
            "  --kv-cache-buffered          read and write through the page cache (default: O_DIRECT where the\n"
            "                               directory's filesystem does it)\n"
            "  --kv-cache-buffered-writes   write through the page cache (the device writes at writeback), read\n"
            "                               with O_DIRECT\n"
            "  --prefix-cache-per-key       the prefix cache (RAM and disk) is salted by the API key a request\n"
            "                               presents: one key never hits (nor times) another's prompts; a request's\n"
            "                               \"cache_salt\" (vLLM's field) salts it too\n"
            "  --kv-events-endpoint EP      publish vLLM's KV events (BlockStored / BlockRemoved / AllBlocksCleared,\n"
            "                               msgpack over ZeroMQ PUB: tcp://*:5557, ipc://PATH); the disk tier's carry\n"
            "                               medium DISK; --kv-events-replay-endpoint EP (a ROUTER for replays),\n"
            "                               --kv-events-topic T\n"
            "  --kv-cache-metrics           the sampled block residency histograms in /metrics (vLLM's\n"
            "                               vllm:kv_block_lifetime_seconds, _idle_before_evict_, _reuse_gap_)\n"
            "  --kv-cache-metrics-sample F  the fraction of blocks followed (default 0.01)\n"
            "  --ep E, --dcp D              under mpirun -np N: the routed experts split over E ranks, the\n"
            "                               cache sharded by token over D ranks (--dcp-interleave I,\n"
            "                               --dcp-topk-exchange allgather|butterfly); rank 0 serves HTTP and\n"
            "                               runs the engine, the others replay its forward passes\n"
            "  --dist-timeout S             a rank silent this long mid-pass fails the engine: every request\n"
            "                               gets the error, then the job ends (default 300)\n"
            "  --role prefill|decode|proxy  prefill and decode apart (docs/pd.md): a prefill instance keeps a\n"
            "                               finished prompt's cache for a decode instance to pull; a decode\n"
            "                               instance pulls it; `--role proxy --prefill URL[,URL...] --decode\n"
            "                               URL[,URL...]` is the one endpoint in front of them (k3 serve --role\n"
            "                               proxy --help); `--role router --backend URL[,URL...]` spreads\n"
            "                               requests over colocated instances by prefix affinity (k3 serve\n"
            "                               --role router --help; docs/kvstore.md)\n"
            "  --kv-transfer-port N         the transfer listener's port (prefill; default 0 = any free port); it\n"
            "                               binds on --host; --kv-transfer-advertise ADDR: the address decode\n"
            "                               instances are told (default: --host)\n"
            "  --kv-transfer-secret-file F  the deployment's transfer secret (every prefill and decode instance\n"
            "                               and the proxy: the same; or K3_KV_TRANSFER_SECRET): a pull proves it\n"
            "  --prefill-peers H:P[,...]    decode: prefill transfer ports whose kv_transfer_params are taken\n"
            "                               without the proxy's credential (vLLM's proxies)\n"
            "  --kv-hold-timeout S          a kept prompt nobody pulled is freed after S seconds (default 120)\n"
            "  --kv-transfer-timeout S      a transfer silent this long fails (default 30)\n"
            "  --kv-transport tcp|ucx       how the rows move (default tcp): ucx gets them one-sided from where\n"
            "                               they lie into the decode instance's blocks (libucx; the stream\n"
            "                               where either side lacks it); --kv-ucx-tls LIST: UCX's transports\n"
            "                               (default UCX_TLS, else sm,self: one host; across hosts rc or dc\n"
            "                               on an RDMA NIC, or tcp: see docs/pd.md on what tcp exposes)\n"
            "  --kv-fault SPEC              tests only: flip:U | stall:U:MS | offer:forge |\n"
            "                               offer:replay (see docs/pd.md)\n"
            "speculative decoding (a request may ask for its own with \"speculative_config\": {\"method\",\n"
            "\"num_speculative_tokens\"}):\n" K3_CLI_SPEC_HELP,
            K3_DEFAULT_QUANT, K3_DEFAULT_KV);
    return f == stdout ? 0 : 2;
}

/* A byte count with an optional K, M, G or T (powers of 1024). */
static long long parse_bytes(const char *s, int *bad) {
    char *end;
    errno = 0;
    const long long v = strtoll(s, &end, 10);
    int shift = 0;
    if (*end == 'K' || *end == 'k') shift = 10;
    else if (*end == 'M' || *end == 'm') shift = 20;
    else if (*end == 'G' || *end == 'g') shift = 30;
    else if (*end == 'T' || *end == 't') shift = 40;
    if (shift) end++;
    if (end == s || *end || errno || v <= 0 || v > (LLONG_MAX >> shift)) {
        *bad = 1;
        return 0;
    }
    return v << shift;
}

/* The disk tier's lines (a miss and why, a failed save, an eviction). */
static void disk_log(void *arg, const char *line) {
    (void)arg;
    fprintf(stderr, "k3 serve: %s\n", line);
}

static long parse_long(const char *s, int *bad) {
    char *end;
    errno = 0;
    const long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < 0) *bad = 1;
    return v;
}

/* FNV-1a over the mode: the prefix cache never mixes modes. */
static uint64_t salt_of(const char *quant, k3_kv_type kv) {
    uint64_t h = 1469598103934665603ull;
    for (const char *p = quant; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;
    return (h ^ (uint64_t)kv) * 1099511628211ull;
}

/* Ranks > 0 of `mpirun -np E k3 serve --ep E`: this rank's experts, then
 * rank 0's engine context replayed until rank 0 lets go. SIGINT / SIGTERM
 * (mpirun forwards them to every rank) are left to rank 0, which ends the
 * loop with its release. */
static int serve_worker(k3_cli_dist *cd, const char *dir, const char *quant, bool keep_mapped, int threads) {
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    k3_error err = {0};
    k3_model *m = NULL;
    k3_pool *pool = NULL;
    int rc = 1;
    k3_status ms = k3_cli_open_model_dist(&m, dir, quant, keep_mapped, false, cd, &err);
    if (k3_cli_dist_agree(cd, ms, &err, "serve")) goto out;
    k3_cli_dist_test_hooks(cd);
    if (k3_pool_init(&pool, threads, &err) || k3_exec_serve_pool(cd->d, m, pool, &err)) {
        fprintf(stderr, "k3 serve: rank %d: %s\n", cd->rank, err.msg);
        k3_dist_abort(cd->d, 1);
    }
    rc = 0;
out:
    k3_pool_free(pool);
    k3_model_close(m);
    k3_cli_dist_end(cd);
    return k3_cli_dist_exit(cd, rc);
}

int k3_cmd_serve(int argc, char **argv) {
    const char *dir = K3_DEFAULT_MODEL, *host = "127.0.0.1", *api_key = NULL, *name = NULL;
    const char *quant = K3_DEFAULT_QUANT, *kv_name = K3_DEFAULT_KV;
    long port = 8000, max_len = 0, max_seqs = 0, max_batched = 0, max_step_cost = 0, max_waiting = 256,
         cache_tokens = 0, block = 0;
    long max_body = 0, timeout = 0, snapshot_mb = 0, max_conn = 1024, max_image_px = 0, vthreads = 0;
    long header_timeout = 10, body_timeout = 60, max_conn_ip = 0, shutdown_timeout = 5, step_timeout = 0;
    long test_fail_step = 0, test_fail_request = 0, max_req_px = 0, max_req_tok = 0;
    const char *origins = NULL, *cors_methods = NULL, *cors_headers = NULL;
    bool keep_mapped = false, no_prefix = false, kv_metrics = false, metrics_key = false, no_ui = false;
    float kv_sample = 0.01f;
    const char *role = NULL, *kv_adv = NULL, *kv_fault = NULL, *kv_secret_file = NULL, *peers = NULL, *kv_host = NULL;
    const char *kv_transport = NULL, *ucx_tls = NULL;
    long kv_port = 0;
    float kv_hold_timeout = 0, kv_timeout = 0;
    const char *kv_dir = NULL, *ev_endpoint = NULL, *ev_replay = NULL, *ev_topic = NULL;
    long long kv_disk_bytes = 0;
    bool kv_fsync = false, kv_buffered = false, kv_buffered_writes = false, per_key = false;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--role") && (!strcmp(argv[i + 1], "proxy") || !strcmp(argv[i + 1], "router")))
            return k3_cmd_serve_proxy(argc, argv);
    long threads = k3_cli_default_threads();
    int bad = 0;
    k3_cli_dist cd;
    k3_cli_spec spec = {0};
    if (k3_cli_dist_args(&argc, argv, &cd, "serve")) return 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < argc;
        const int sa = k3_cli_spec_arg("serve", argc, argv, &i, &spec);
        if (sa < 0) return 2;
        if (sa) continue;
#define ARG(s) (!strcmp(a, s) && has)
        if (ARG("-m")) dir = argv[++i];
        else if (ARG("--host")) host = argv[++i];
        else if (ARG("--port")) port = parse_long(argv[++i], &bad);
        else if (ARG("--api-key")) api_key = argv[++i];
        else if (ARG("--served-model-name")) name = argv[++i];
        else if (ARG("--max-model-len")) max_len = parse_long(argv[++i], &bad);
        else if (ARG("--max-num-seqs")) max_seqs = parse_long(argv[++i], &bad);
        else if (ARG("--max-num-batched-tokens")) max_batched = parse_long(argv[++i], &bad);
        else if (ARG("--max-step-cost")) max_step_cost = parse_long(argv[++i], &bad);
        else if (ARG("--max-waiting")) max_waiting = parse_long(argv[++i], &bad);
        else if (ARG("--cache-tokens")) cache_tokens = parse_long(argv[++i], &bad);
        else if (ARG("--block-size")) block = parse_long(argv[++i], &bad);
        else if (ARG("--snapshot-mb")) snapshot_mb = parse_long(argv[++i], &bad);
        else if (ARG("--quant")) quant = argv[++i];
        else if (ARG("--kv-cache")) kv_name = argv[++i];
        else if (ARG("--threads")) threads = parse_long(argv[++i], &bad);
        else if (ARG("--isa")) {
            if (k3_cli_set_isa("serve", argv[++i])) return 2;
        } else if (ARG("--max-body-bytes")) max_body = parse_long(argv[++i], &bad);
        else if (ARG("--timeout")) timeout = parse_long(argv[++i], &bad);
        else if (ARG("--max-image-pixels")) max_image_px = parse_long(argv[++i], &bad);
        else if (ARG("--max-request-image-pixels")) max_req_px = parse_long(argv[++i], &bad);
        else if (ARG("--max-request-image-tokens")) max_req_tok = parse_long(argv[++i], &bad);
        else if (ARG("--vision-threads")) vthreads = parse_long(argv[++i], &bad);
        else if (ARG("--max-connections")) max_conn = parse_long(argv[++i], &bad);
        else if (ARG("--role")) role = argv[++i];
        else if (ARG("--kv-transfer-port")) kv_port = parse_long(argv[++i], &bad);
        else if (ARG("--kv-transfer-secret-file")) kv_secret_file = argv[++i];
        else if (ARG("--kv-transfer-host")) kv_host = argv[++i];
        else if (ARG("--prefill-peers")) peers = argv[++i];
        else if (ARG("--kv-transfer-advertise")) kv_adv = argv[++i];
        else if (ARG("--kv-fault")) kv_fault = argv[++i];
        else if (ARG("--kv-transport")) kv_transport = argv[++i];
        else if (ARG("--kv-ucx-tls")) ucx_tls = argv[++i];
        else if (ARG("--kv-cache-dir")) kv_dir = argv[++i];
        else if (ARG("--kv-cache-disk-bytes")) kv_disk_bytes = parse_bytes(argv[++i], &bad);
        else if (!strcmp(a, "--kv-cache-fsync")) kv_fsync = true;
        else if (!strcmp(a, "--kv-cache-buffered")) kv_buffered = true;
        else if (!strcmp(a, "--kv-cache-buffered-writes")) kv_buffered_writes = true;
        else if (!strcmp(a, "--prefix-cache-per-key")) per_key = true;
        else if (ARG("--kv-events-endpoint")) ev_endpoint = argv[++i];
        else if (ARG("--kv-events-replay-endpoint")) ev_replay = argv[++i];
        else if (ARG("--kv-events-topic")) ev_topic = argv[++i];
        else if (ARG("--kv-hold-timeout")) {
            if (k3_cli_float("serve", "--kv-hold-timeout", argv[++i], 0.001, 86400.0, &kv_hold_timeout)) return 2;
        } else if (ARG("--kv-transfer-timeout")) {
            if (k3_cli_float("serve", "--kv-transfer-timeout", argv[++i], 0.001, 86400.0, &kv_timeout)) return 2;
        } else if (ARG("--max-connections-per-ip")) max_conn_ip = parse_long(argv[++i], &bad);
        else if (ARG("--header-timeout")) header_timeout = parse_long(argv[++i], &bad);
        else if (ARG("--body-timeout")) body_timeout = parse_long(argv[++i], &bad);
        else if (ARG("--shutdown-timeout")) shutdown_timeout = parse_long(argv[++i], &bad);
        else if (ARG("--step-timeout")) step_timeout = parse_long(argv[++i], &bad);
        else if (ARG("--allowed-origins")) origins = argv[++i];
        else if (ARG("--allowed-methods")) cors_methods = argv[++i];
        else if (ARG("--allowed-headers")) cors_headers = argv[++i];
        else if (!strcmp(a, "--metrics-require-key")) metrics_key = true;
        /* tests only (not in --help): the engine fails at step N; engine request N fails alone */
        else if (ARG("--test-fail-step")) test_fail_step = parse_long(argv[++i], &bad);
        else if (ARG("--test-fail-request")) test_fail_request = parse_long(argv[++i], &bad);
        else if (!strcmp(a, "--mmap")) keep_mapped = true;
        else if (!strcmp(a, "--no-prefix-cache")) no_prefix = true;
        else if (!strcmp(a, "--no-ui")) no_ui = true;
        else if (!strcmp(a, "--kv-cache-metrics")) kv_metrics = true;
        else if (ARG("--kv-cache-metrics-sample")) {
            if (k3_cli_float("serve", "--kv-cache-metrics-sample", argv[++i], 0.0, 1.0, &kv_sample)) return 2;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage_serve(stdout);
        else {
            fprintf(stderr, "k3 serve: unknown option or missing value: %s\n", a);
            return usage_serve(stderr);
        }
#undef ARG
    }
    k3_kv_type kv;
    if (bad || port > 65535 || threads < 1 || max_seqs > 1 << 20 || max_batched > 1 << 24 || max_step_cost > 1 << 24 ||
        max_waiting > 1 << 20 || block > 4096 || snapshot_mb > 1 << 24 || max_conn > 65536 || timeout > 86400 ||
        vthreads > 64 || max_image_px > K3_IMAGE_MAX_PIXELS || max_req_px > ((long)1 << 40) ||
        max_req_tok > (1L << 30) || max_conn_ip > 65536 || header_timeout < 1 || header_timeout > 86400 ||
        body_timeout < 1 || body_timeout > 86400 || shutdown_timeout > 86400 || step_timeout > 1 << 24) {
        fprintf(stderr, "k3 serve: a numeric option is not a non-negative integer in range\n");
        return 2;
    }
    if (role && strcmp(role, "prefill") && strcmp(role, "decode")) {
        fprintf(stderr, "k3 serve: --role must be prefill, decode, proxy or router, not '%s'\n", role);
        return 2;
    }
    if (kv_dir && no_prefix) {
        fprintf(stderr, "k3 serve: --kv-cache-dir is a tier of the prefix cache: it needs prefix caching on\n");
        return 2;
    }
    if (kv_dir && !*kv_dir) {
        fprintf(stderr, "k3 serve: --kv-cache-dir is empty\n");
        return 2;
    }
    if ((ev_replay || ev_topic) && !ev_endpoint) {
        fprintf(stderr, "k3 serve: --kv-events-replay-endpoint and --kv-events-topic need --kv-events-endpoint\n");
        return 2;
    }
    if (kv_port > 65535) {
        fprintf(stderr, "k3 serve: --kv-transfer-port must be in 0..65535\n");
        return 2;
    }
    if (kv_host && strcmp(kv_host, host)) {
        fprintf(stderr,
                "k3 serve: the transfer port binds where the HTTP port binds: --kv-transfer-host %s differs "
                "from --host %s (--kv-transfer-advertise names the address decode instances are told)\n",
                kv_host, host);
        return 2;
    }
    if (k3_cli_parse_kv(kv_name, &kv)) {
        fprintf(stderr, "k3 serve: --kv-cache must be f32 or c8, not '%s'\n", kv_name);
        return 2;
    }
    if (!api_key) api_key = getenv("K3_API_KEY");
    if (api_key && !*api_key) {
        /* a launcher passing an unset variable must not leave the server open */
        fprintf(stderr,
                "k3 serve: the API key is empty (--api-key \"\" or K3_API_KEY=): give a key, or leave it out "
                "to serve without one\n");
        return 2;
    }
    if (!name) name = dir;
    char *secret = NULL;
    size_t secret_len = 0;
    if (role && k3_cli_transfer_secret("serve", kv_secret_file, &secret, &secret_len)) return 2;
    if (k3_cli_dist_start(&cd, "serve")) {
        free(secret);
        return k3_cli_dist_exit(&cd, 2);
    }
    if (cd.d && cd.rank != 0) {
        free(secret);
        return serve_worker(&cd, dir, quant, keep_mapped, (int)threads);
    }

    k3_error err = {0};
    k3_model *m = NULL;
    k3_tokenizer *tok = NULL;
    k3_pool *pool = NULL, *vpool = NULL;
    k3_vision *vis = NULL;
    k3_engine *eng = NULL;
    k3_server *srv = NULL;
    k3_pd *pd = NULL;
    k3_model *draft = NULL;
    k3_kv_events *events = NULL;
    int rc = 1;
    k3_status ms = k3_cli_open_model_dist(&m, dir, quant, keep_mapped, false, &cd, &err);
    if (cd.d) {
        if (k3_cli_dist_agree(&cd, ms, &err, "serve")) goto fail_quiet;
    } else if (ms) {
        goto fail;
    }
    if (k3_tokenizer_open(&tok, dir, &err) || k3_pool_init(&pool, (int)threads, &err)) goto fail;
    /* the vision tower, if the checkpoint has one, with --quant's mode (as
     * k3 run --image) and a pool of its own: HTTP threads encode images
     * while the engine thread steps on its pool; under mpirun rank 0 encodes
     * and the rows go to the other ranks with each batch */
    if (k3_vision_open(&vis, m, &err)) {
        if (err.status != K3_ERR_UNSUPPORTED || !strstr(err.msg, "no vision tower")) goto fail;
        vis = NULL;
        err = (k3_error){0};
    } else {
        k3_quant_options q = {0};
        if (k3_quant_parse(quant, &q, &err) || k3_vision_quantize(vis, &q, &err) ||
            k3_pool_init(&vpool, (int)(vthreads ? vthreads : threads), &err))
            goto fail;
    }
    int32_t eos[K3_MAX_EOS_IDS];
    const int32_t n_eos = k3_tokenizer_eos_ids(tok, eos);
    k3_engine_options eo = {.max_num_seqs = (int32_t)max_seqs,
                            .max_num_batched_tokens = (int32_t)max_batched,
                            .max_step_cost = (int32_t)max_step_cost,
                            .max_model_len = max_len,
                            .cache_tokens = cache_tokens,
                            .block_size = (int32_t)block,
                            .kv_cache = kv,
                            .no_prefix_cache = no_prefix,
                            .snapshot_bytes = (int64_t)snapshot_mb << 20,
                            .max_waiting = (int32_t)max_waiting,
                            .eos_ids = eos,
                            .n_eos_ids = n_eos,
                            .cache_salt = salt_of(quant, kv),
                            .hold_timeout_s = kv_hold_timeout,
                            .pool = pool,
                            .dist = cd.d,
                            .kv_cache_dir = kv_dir,
                            .kv_cache_disk_bytes = kv_disk_bytes,
                            .quant_name = quant,
                            .kv_cache_fsync = kv_fsync,
                            .kv_cache_buffered = kv_buffered,
                            .kv_cache_buffered_writes = kv_buffered_writes,
                            .log = disk_log};
    if (k3_cli_spec_apply("serve", &spec, quant, &eo, &draft)) goto fail_quiet;
    if (k3_engine_open(&eng, m, &eo, &err)) goto fail;
    if (kv_metrics && k3_engine_set_kv_metrics(eng, kv_sample, &err)) goto fail;
    if (ev_endpoint) {
        const k3_kv_events_options evo = {.endpoint = ev_endpoint, .replay_endpoint = ev_replay, .topic = ev_topic};
        if (k3_kv_events_open(&events, &evo, &err)) goto fail;
        k3_engine_set_kv_events(eng, events);
    }
    k3_engine_stats st;
    k3_engine_get_stats(eng, &st);
    if (role) {
        k3_pd_options po = {.engine = eng,
                            .host = host,
                            .port = strcmp(role, "prefill") ? -1 : (int)kv_port,
                            .advertise_host = kv_adv,
                            .model_id = k3_model_identity(m),
                            .quant = quant,
                            .kv_cache = kv,
                            .block_size = st.blocks_total ? (int32_t)(st.cache_tokens / st.blocks_total) : 0,
                            .timeout_s = kv_timeout,
                            .fault = kv_fault,
                            .secret = secret,
                            .secret_len = secret_len,
                            .prefill_peers = peers,
                            .kv_transport = kv_transport,
                            /* UCX's own default opens every transport, tcp too (a
                             * worker any host may reach): one host's unless told */
                            .ucx_tls = ucx_tls      ? ucx_tls
                                : getenv("UCX_TLS") ? getenv("UCX_TLS")
                                                    : "sm,self"};
        const k3_status ps = k3_pd_start(&pd, &po, &err);
        memset(secret, 0, secret_len);
        if (ps) goto fail;
    }
    k3_server_options so = {.host = host,
                            .port = (int)port,
                            .api_key = api_key,
                            .model_name = name,
                            .tok = tok,
                            .engine = eng,
                            .max_body_bytes = (size_t)max_body,
                            .timeout_s = (int)timeout,
                            .max_connections = (int)max_conn,
                            .version = "k3 0.1",
                            .vision = vis,
                            .vision_pool = vpool,
                            .max_image_pixels = max_image_px,
                            .max_request_image_pixels = max_req_px,
                            .max_request_image_tokens = max_req_tok,
                            .metrics_require_key = metrics_key,
                            .max_connections_per_ip = (int)max_conn_ip,
                            .header_timeout_s = (int)header_timeout,
                            .body_timeout_s = (int)body_timeout,
                            .step_timeout_s = step_timeout ? (double)step_timeout
                                : cd.opt.timeout_s > 0     ? cd.opt.timeout_s
                                                           : 300.0,
                            .allowed_origins = origins,
                            .allowed_methods = cors_methods,
                            .allowed_headers = cors_headers,
                            .test_fail_step = test_fail_step,
                            .test_fail_request = test_fail_request,
                            .no_ui = no_ui,
                            .pd = pd,
                            .prefix_cache_per_key = per_key,
                            .kv_events = events};
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (k3_server_start(&srv, &so, &err)) goto fail;
    fprintf(stderr,
            "k3 serve: model %s as \"%s\", quant %s, kv-cache %s, %ld threads, max_model_len %lld, "
            "max_num_seqs %d, cache %lld tokens in %lld blocks (%lld MB), prefix cache %s, images %s\n",
            dir, name, quant, kv_name, threads, (long long)st.max_model_len, st.max_num_seqs,
            (long long)st.cache_tokens, (long long)st.blocks_total, (long long)(k3_engine_cache_bytes(eng) >> 20),
            no_prefix ? "off" : "on", vis ? "on" : "off (text only)");
    if (!no_prefix)
        fprintf(stderr, "k3 serve: KDA snapshots of the prefix cache: up to %.1f MB, %lld states of %.1f KB (%s)\n",
                (double)st.snapshot_budget / (1 << 20),
                (long long)(st.state_bytes_per_seq ? st.snapshot_budget / st.state_bytes_per_seq : 0),
                (double)st.state_bytes_per_seq / 1024,
                snapshot_mb ? "--snapshot-mb"
                            : "one per 4 blocks of the pool and one per running request, within 1 GiB and an "
                              "eighth of free memory");
    if (cd.d)
        fprintf(stderr,
                "k3 serve: %d ranks, DCP %d (interleave %d), EP %d: cache %lld bytes per rank (block %d tokens, "
                "%d per rank)\n",
                k3_dist_size(cd.d), k3_dist_dcp_size(cd.d), k3_dist_interleave(cd.d), k3_dist_ep_size(cd.d),
                (long long)k3_engine_cache_bytes(eng), (int)(st.cache_tokens / st.blocks_total),
                (int)(st.cache_tokens / st.blocks_total / k3_dist_dcp_size(cd.d)));
    if (kv_dir)
        fprintf(stderr,
                "k3 serve: prefix cache disk tier in %s, budget %.1f GB (shared by the instances of this host; "
                "saves behind the engine, loads before scheduling)\n",
                kv_dir, (double)(kv_disk_bytes ? kv_disk_bytes : (long long)64 << 30) / 1e9);
    if (events)
        fprintf(stderr, "k3 serve: KV events on %s%s%s\n", ev_endpoint, ev_replay ? ", replays on " : "",
                ev_replay ? ev_replay : "");
    if (pd && k3_pd_port(pd) >= 0)
        fprintf(stderr,
                "k3 serve: role %s, kv transfer listening on %s%s%s:%d (the HTTP port's address; a pull proves the "
                "deployment's secret, each message has a MAC)\n",
                role, strchr(host, ':') ? "[" : "", host, strchr(host, ':') ? "]" : "", k3_pd_port(pd));
    else if (pd)
        fprintf(stderr,
                "k3 serve: role %s: prompts' caches are pulled from prefill instances named by the proxy (its "
                "credential)%s%s\n",
                role, peers ? " or by --prefill-peers " : "", peers ? peers : "");
    if (pd) {
        const char *tr = k3_pd_transport(pd);
        fprintf(stderr, "k3 serve: kv transport %s\n", tr);
        if (!strncmp(tr, "ucx", 3) && (strstr(tr, "tcp") || strstr(tr, "ud") || strstr(tr, "all")))
            fprintf(stderr,
                    "k3 serve: warning: UCX over tcp (or ud) emulates one-sided gets with messages its worker answers "
                    "for any peer that reaches it, at any address of this process: keep the transfer network closed "
                    "to all but the deployment (docs/pd.md)\n");
    }
    if (eo.speculative != K3_SPEC_OFF && eo.speculative != K3_SPEC_DEFAULT)
        fprintf(stderr, "k3 serve: speculative decoding: %s, up to %d draft tokens a step%s\n",
                eo.speculative == K3_SPEC_SUFFIX      ? "suffix"
                    : eo.speculative == K3_SPEC_NGRAM ? "ngram"
                                                      : "draft model",
                st.spec_k, spec.no_cost_model ? " (no cost model)" : ", as many as its cost model says pay");
    fprintf(stderr, "k3 serve: auth %s; CORS: %s; /metrics %s\n",
            api_key ? "on (Authorization: Bearer KEY or x-api-key: KEY)" : "off (no --api-key: every route is open)",
            origins && *origins ? origins : "the server's own origin only",
            api_key && metrics_key ? "needs the key" : "open");
    const bool v6 = strchr(host, ':') != NULL;
    fprintf(stderr, "k3 serve: listening on http://%s%s%s:%d%s\n", v6 ? "[" : "", host, v6 ? "]" : "",
            k3_server_port(srv), api_key ? " (API key required)" : "");
    if (!no_ui)
        fprintf(stderr, "k3 serve: chat page at http://%s%s%s:%d/\n", v6 ? "[" : "", host, v6 ? "]" : "",
                k3_server_port(srv));

    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    k3_engine_stats last = st;
    double t_last = t0.tv_sec + t0.tv_nsec * 1e-9;
    while (!g_signals) {
        nap_ms(100);
        if (k3_server_failed(srv, &err)) {
            /* every request in flight has had its error ending: let the
             * answers go out, refuse new ones meanwhile, then end the job */
            fprintf(stderr, "k3 serve: the engine failed: %s\n", err.msg);
            k3_server_drain(srv);
            wait_in_flight(srv, 2.0, 0);
            goto fail_quiet;
        }
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        const double now = t.tv_sec + t.tv_nsec * 1e-9;
        if (now - t_last < 5.0) continue;
        k3_engine_stats cur;
        k3_engine_get_stats(eng, &cur);
        const int64_t dp = cur.prompt_tokens - last.prompt_tokens, dg = cur.generation_tokens - last.generation_tokens;
        if (cur.n_running || cur.n_waiting || dp || dg) {
            const int64_t dq = cur.prefix_queries - last.prefix_queries, dh = cur.prefix_hits - last.prefix_hits;
            /* vLLM's wording, so the same greps work */
            fprintf(stderr,
                    "k3 serve: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
                    "Preemptions: %lld\n",
                    dp / (now - t_last), dg / (now - t_last), cur.n_running, cur.n_waiting, 100.0 * cur.cache_usage,
                    dq > 0 ? 100.0 * (double)dh / (double)dq : 0.0, (long long)cur.n_preemptions);
        }
        last = cur;
        t_last = now;
    }
    {
        /* the drain: no new requests; those running finish within
         * --shutdown-timeout, then the rest end with an error event or a 503.
         * Under mpirun a signal from mpirun itself (it ends the job, and
         * kills a second later) ends them at once. */
        const bool now = g_from_parent && cd.d;
        const double grace = now ? 0.0 : (double)shutdown_timeout;
        fprintf(stderr, "k3 serve: shutting down: %d requests in flight, %s\n", k3_server_in_flight(srv),
                now ? "mpirun ends the job: ending them now" : "new ones refused; a second signal cuts at once");
        k3_server_drain(srv);
        const int left = grace > 0 ? wait_in_flight(srv, grace, 1) : k3_server_in_flight(srv);
        if (left > 0) {
            k3_server_end(srv, "the server is shutting down");
            if (g_signals <= 1) wait_in_flight(srv, now ? 0.5 : 2.0, 1);
        }
        if (k3_server_failed(srv, &err)) {
            fprintf(stderr, "k3 serve: the engine failed: %s\n", err.msg);
            goto fail_quiet;
        }
        fprintf(stderr, "k3 serve: shut down (%d requests were ended by it)\n", left);
    }
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "k3 serve: %s\n", err.msg[0] ? err.msg : k3_status_str(err.status));
fail_quiet:
    rc = 1;
out:
    free(secret);
    k3_server_stop(srv);
    k3_pd_stop(pd);
    k3_engine_close(eng);
    k3_kv_events_close(events);
    k3_model_close(draft);
    k3_vision_close(vis);
    k3_pool_free(vpool);
    k3_pool_free(pool);
    k3_tokenizer_free(tok);
    k3_model_close(m);
    if (cd.d) {
        /* the other ranks wait in k3_exec_serve_pool: let them go, or end the job
         * when a rank died (a failed link stays failed) */
        k3_error rerr = {0};
        if (k3_exec_release(cd.d, &rerr)) {
            fprintf(stderr, "k3 serve: %s\n", rerr.msg);
            k3_dist_abort(cd.d, 1);
        }
        k3_cli_dist_end(&cd);
    }
    return rc;
}
