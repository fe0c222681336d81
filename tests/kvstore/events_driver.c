/*
 * events_driver.c -- an engine on tests/models/tiny publishing its KV
 * events (tests/kv_events.py decodes them with vLLM's field layout): a few
 * requests that share prefixes, hit the prefix cache and, the cache being
 * small, evict blocks (after "listening" it waits for a line on stdin, so
 * a subscriber can connect first); then one line of JSON with the engine's prefix-cache
 * state (the hashes it holds, the hit counters, the publisher's counts),
 * then "ready"; it closes when stdin gives a line.
 *   k3-kvev-driver ENDPOINT REPLAY_ENDPOINT [legacy]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "k3.h"
#include "kvevents/events.h"

static int run(k3_engine *e, const int32_t *prompt, int64_t n, k3_error *err) {
    k3_request_params q = {.prompt = prompt,
                           .n_prompt = n,
                           .max_tokens = 4,
                           .logprobs = -1,
                           .prompt_logprobs = -1,
                           .sampling = {.temperature = 0, .top_p = 1, .repeat_penalty = 1}};
    uint64_t id;
    if (k3_engine_submit(e, &q, &id, err)) return 1;
    while (k3_engine_has_work(e)) {
        k3_step_result r;
        if (k3_engine_step(e, &r, err)) return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: k3-kvev-driver ENDPOINT REPLAY_ENDPOINT [legacy]\n");
        return 2;
    }
    k3_error err = {0};
    k3_model *m = NULL;
    if (k3_model_open(&m, "tests/models/tiny", &err)) goto fail;
    const int32_t eos = 770;
    k3_engine_options o = {.max_num_seqs = 2,
                           .max_num_batched_tokens = 128,
                           .cache_tokens = 16 * 14,
                           .block_size = 16,
                           .kv_cache = K3_KV_F32,
                           .eos_ids = &eos,
                           .n_eos_ids = 1,
                           .cache_salt = 0x6b33};
    k3_engine *e = NULL;
    if (k3_engine_open(&e, m, &o, &err)) goto fail;
    k3_kv_events_options eo = {.endpoint = argv[1],
                               .replay_endpoint = argv[2],
                               .topic = "kv-events",
                               .legacy_array = argc > 3 && !strcmp(argv[3], "legacy")};
    k3_kv_events *ev = NULL;
    if (k3_kv_events_open(&ev, &eo, &err)) goto fail;
    k3_engine_set_kv_events(e, ev);
    char line[64];
    printf("listening\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) line[0] = 0;
    int32_t a[100], b[100], c[160];
    for (int i = 0; i < 100; i++) a[i] = b[i] = 10 + (i * 37) % 700;
    for (int i = 48; i < 100; i++) b[i] = 20 + (i * 53) % 700; /* shares 3 blocks with a */
    for (int i = 0; i < 160; i++) c[i] = 30 + (i * 71) % 700;
    if (run(e, a, 70, &err) || run(e, b, 90, &err) || run(e, a, 70, &err) || run(e, c, 150, &err) ||
        run(e, a, 60, &err) || run(e, b, 50, &err))
        goto fail;
    k3_kv_events_flush(ev);
    uint64_t hashes[64];
    const int64_t n = k3_engine_cached_hashes(e, hashes, 64);
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    k3_kv_events_stats es;
    k3_kv_events_get_stats(ev, &es);
    printf("{\"cached\": [");
    for (int64_t i = 0; i < n && i < 64; i++) printf("%s%" PRIu64, i ? ", " : "", hashes[i]);
    printf("], \"prefix_queries\": %" PRId64 ", \"prefix_hits\": %" PRId64 ", \"batches\": %" PRId64
           ", \"stored_blocks\": %" PRId64 ", \"removed_blocks\": %" PRId64 "}\nready\n",
           st.prefix_queries, st.prefix_hits, es.batches, es.stored_blocks, es.removed_blocks);
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) line[0] = 0;
    k3_engine_set_kv_events(e, NULL);
    k3_kv_events_close(ev);
    k3_engine_close(e);
    k3_model_close(m);
    return 0;
fail:
    fprintf(stderr, "k3-kvev-driver: %s\n", err.msg);
    return 1;
}
