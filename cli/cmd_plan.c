/*
 * cmd_plan.c -- `k3 plan --config CONFIG.json --dcp D --ep E`: a deployment
 * sized on paper from a config alone (k3_plan_compute; no weights read).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static int usage_plan_to(FILE *out, int rc) {
    fprintf(out,
            "usage: k3 plan --config CONFIG.json [options]\n"
            "  --dcp D             decode context parallel ranks (default 1)\n"
            "  --ep E              expert parallel ranks (default 1)\n"
            "  --context L         tokens of one sequence (default 1048576)\n"
            "  --kv-cache c8|f32   cache format (default c8)\n"
            "  --quant MODE        none | w8a8 | w8a8-mxfp8 (+w4a8 changes nothing here) (default w8a8)\n"
            "  --topk K            DSA top-k for the exchange (default: the config's)\n"
            "the full-size configs: docs/configs/kimi-k3.json, docs/configs/kimi-k3.1-pro-dsa.json\n");
    return rc;
}

static int usage_plan(void) { return usage_plan_to(stderr, 2); }

static const char *gb(double b, char *buf, size_t n) {
    if (b >= 1e12) snprintf(buf, n, "%.2f TB", b / 1e12);
    else if (b >= 1e9) snprintf(buf, n, "%.2f GB", b / 1e9);
    else if (b >= 1e6) snprintf(buf, n, "%.2f MB", b / 1e6);
    else if (b >= 1e3) snprintf(buf, n, "%.2f KB", b / 1e3);
    else snprintf(buf, n, "%.0f B", b);
    return buf;
}

int k3_cmd_plan(int argc, char **argv) {
    const char *cfg = NULL, *quant = "w8a8";
    k3_plan_options o = {.dcp = 1, .ep = 1, .context = 1 << 20, .kv_cache = K3_KV_C8};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const int has = i + 1 < argc;
        char *end = NULL;
        if (!strcmp(a, "--config") && has) cfg = argv[++i];
        else if (!strcmp(a, "--dcp") && has) o.dcp = (int32_t)strtol(argv[++i], &end, 10);
        else if (!strcmp(a, "--ep") && has) o.ep = (int32_t)strtol(argv[++i], &end, 10);
        else if (!strcmp(a, "--context") && has) o.context = strtoll(argv[++i], &end, 10);
        else if (!strcmp(a, "--topk") && has) o.index_topk = (int32_t)strtol(argv[++i], &end, 10);
        else if (!strcmp(a, "--quant") && has) quant = argv[++i];
        else if (!strcmp(a, "--kv-cache") && has) {
            if (k3_cli_parse_kv(argv[++i], &o.kv_cache)) {
                fprintf(stderr, "k3 plan: --kv-cache must be f32 or c8, not '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) return usage_plan_to(stdout, 0);
        else {
            fprintf(stderr, "k3 plan: unknown option or missing value: %s\n", a);
            return usage_plan();
        }
        if (end && *end) {
            fprintf(stderr, "k3 plan: %s needs an integer, not '%s'\n", a, argv[i]);
            return 2;
        }
    }
    if (!cfg) {
        fprintf(stderr, "k3 plan: no --config given\n");
        return usage_plan();
    }
    if (o.dcp < 1 || o.ep < 1 || o.context < 1 || o.index_topk < 0) {
        fprintf(stderr, "k3 plan: --dcp, --ep and --context must be positive\n");
        return 2;
    }
    k3_error err = {0};
    if (k3_quant_parse(quant, &o.quant, &err)) {
        fprintf(stderr, "k3 plan: %s\n", err.msg);
        return 2;
    }
    k3_plan p;
    if (k3_plan_compute(cfg, &o, &p, &err)) {
        fprintf(stderr, "k3 plan: %s\n", err.msg);
        return 1;
    }
    char b1[32], b2[32], b3[32], b4[32];
    printf("config %s: %d KDA, %d MLA, %d DSA layers, %d MoE layers\n", cfg, p.n_kda, p.n_mla, p.n_dsa, p.n_moe);
    printf("plan: DCP %d x EP %d, context %lld tokens, cache %s, linears %s\n", o.dcp, o.ep, (long long)o.context,
           o.kv_cache == K3_KV_C8 ? "c8" : "f32", quant);
    printf("weights:            %s (%lld B), of which routed experts %s\n", gb((double)p.weight_bytes, b1, sizeof b1),
           (long long)p.weight_bytes, gb((double)p.expert_bytes, b2, sizeof b2));
    printf("cache per token:    %lld B (all MLA/DSA layers)\n", (long long)p.cache_bytes_per_token);
    printf("cache per sequence: %s at %lld tokens; %s per 1M-token sequence\n",
           gb((double)p.cache_bytes_per_seq, b1, sizeof b1), (long long)o.context,
           gb((double)p.cache_bytes_per_1m, b2, sizeof b2));
    printf("KDA state:          %s per sequence (replicated on every rank)\n",
           gb((double)p.state_bytes_per_seq, b1, sizeof b1));
    printf("per rank:           weights %s + cache %s (1/%d of the sequence) + KDA state %s = %s\n",
           gb((double)p.weight_bytes_per_rank, b1, sizeof b1), gb((double)p.cache_bytes_per_rank, b2, sizeof b2), o.dcp,
           gb((double)p.state_bytes_per_seq, b3, sizeof b3), gb((double)p.mem_bytes_per_rank, b4, sizeof b4));
    printf("per decoded token, cross-rank (one sequence):\n");
    printf("  topk_exchange     all-gather %lld B received per rank = %d DSA layers x (D-1) x k x 8; "
           "butterfly %lld B = %d x log2(D) x k x 8\n",
           (long long)p.topk_allgather_bytes, p.n_dsa, (long long)p.topk_butterfly_bytes, p.n_dsa);
    printf("  lse_merge         %lld B received per rank (per MLA/DSA layer: (D-1) x H/D heads x (kv_lora+1) partials"
           " + (D-1) x H/D merged heads x kv_lora, fp32)\n",
           (long long)p.lse_bytes);
    printf("  ep_dispatch       %lld B over the EP group (the fp32 latent to each remote owner, expected)\n",
           (long long)p.ep_dispatch_bytes);
    printf("  ep_combine        %lld B over the EP group (remote results back + the combined row to E-1 ranks)\n",
           (long long)p.ep_combine_bytes);
    printf("  ep per rank       a row's source rank (all of a one-sequence batch: rank 0) receives %lld B and sends "
           "%lld B;"
           " in a batch of %d rows or more each rank moves about 1/%d of the group's bytes: %lld B\n",
           (long long)p.ep_source_recv_bytes, (long long)p.ep_source_sent_bytes, o.ep, o.ep,
           (long long)((p.ep_dispatch_bytes + p.ep_combine_bytes) / o.ep));
    printf("  collectives       %d per decoded step with the all-gather top-k exchange, %d with the butterfly:"
           " each waits for its group, so a step takes at least that many one-way link latencies\n",
           p.collectives_allgather, p.collectives_butterfly);
    /* prefill -> decode (src/pd): bytes on the wire are payload; each 1 MiB unit adds a 96-byte header */
    const double link[2] = {100e9 / 8, 400e9 / 8};
    printf("prefill -> decode, one prompt of %lld tokens:\n", (long long)o.context);
    printf("  moves             %s = %lld tokens x %lld B + one KDA state of %s\n",
           gb((double)p.pd_bytes_per_seq, b1, sizeof b1), (long long)o.context, (long long)p.cache_bytes_per_token,
           gb((double)p.state_bytes_per_seq, b2, sizeof b2));
    printf("  over one link     %.3f s at 100 Gb/s, %.3f s at 400 Gb/s\n", (double)p.pd_bytes_per_seq / link[0],
           (double)p.pd_bytes_per_seq / link[1]);
    printf("  to %d decode ranks %s each (its 1/%d of the rows + the state), each on its own link: %.3f s at 100 Gb/s, "
           "%.3f s at 400 Gb/s\n",
           o.dcp, gb((double)p.pd_bytes_per_rank, b3, sizeof b3), o.dcp, (double)p.pd_bytes_per_rank / link[0],
           (double)p.pd_bytes_per_rank / link[1]);
    /* speculative decoding (docs/spec.md) */
    printf("speculative decoding, one sequence at batch 1:\n");
    printf("  KDA rollback      per verify position %s re-applying the recurrence (pre-conv rows, each head's k, "
           "v, gate, beta), %s keeping each position's state; at k = 4: %s / %s\n",
           gb((double)p.spec_reapply_bytes_per_pos, b1, sizeof b1),
           gb((double)p.spec_states_bytes_per_pos, b2, sizeof b2),
           gb(5.0 * (double)p.spec_reapply_bytes_per_pos, b3, sizeof b3),
           gb(5.0 * (double)p.spec_states_bytes_per_pos, b4, sizeof b4));
    printf("  bytes read        a decode step %s; a verify pass of 1 + k positions (routing independent, an upper "
           "bound):",
           gb((double)p.decode_read_bytes, b1, sizeof b1));
    for (int k = 1; k <= 8; k *= 2)
        printf(" k = %d %s (%.2fx)%s", k, gb((double)p.verify_read_bytes[k + 1], b2, sizeof b2),
               (double)p.verify_read_bytes[k + 1] / (double)p.decode_read_bytes, k < 8 ? "," : "\n");
    return 0;
}
