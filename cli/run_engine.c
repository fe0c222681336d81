/*
 * run_engine.c -- k3 run's generation through the serving engine, for
 * --speculative (k3_cli_run_engine): one request, its tokens streamed as
 * the steps give them (a step gives several when drafts are accepted), the
 * closing line with the acceptance. --speculative off takes the same path
 * without drafts, so the two compare the same computation.
 */
#include <stdio.h>
#include <string.h>

#include "cli.h"

int k3_cli_run_engine(const k3_cli_run_engine_args *a) {
    k3_engine_options eo = {.max_num_seqs = 1,
                            .max_model_len = a->ctx_tokens,
                            .cache_tokens = a->ctx_tokens,
                            .kv_cache = a->kv,
                            .pool = a->pool,
                            .no_prefix_cache = true};
    int32_t eos[K3_MAX_EOS_IDS];
    eo.n_eos_ids = k3_tokenizer_eos_ids(a->tok, eos);
    eo.eos_ids = eos;
    k3_model *draft = NULL;
    if (k3_cli_spec_apply("run", a->spec, a->quant, &eo, &draft)) return 1;
    k3_engine *e = NULL;
    k3_error err = {0};
    int rc = 1;
    if (k3_engine_open(&e, a->m, &eo, &err)) {
        fprintf(stderr, "k3 run: %s\n", err.msg);
        k3_model_close(draft);
        return 1;
    }
    k3_request_params p = {.prompt = a->ids,
                           .n_prompt = (int64_t)a->n_ids,
                           .sampling = a->so,
                           .max_tokens = a->n_gen,
                           .logprobs = -1,
                           .prompt_logprobs = -1};
    uint64_t id = 0;
    const double t0 = k3_now();
    double t_first = 0;
    int n_out = 0;
    const char *why = "";
    k3_cli_chat_view cr;
    if (a->chat) k3_cli_chat_render_init(&cr, a->tok, a->think, stdout);
    if (k3_engine_submit(e, &p, &id, &err)) {
        fprintf(stderr, "k3 run: %s\n", err.msg);
        goto out;
    }
    bool done = false;
    while (!done) {
        k3_step_result sr;
        if (k3_engine_step(e, &sr, &err)) {
            fprintf(stderr, "\nk3 run: %s\n", err.msg);
            goto out;
        }
        for (int32_t i = 0; i < sr.n_outputs; i++) {
            const k3_req_output *o = &sr.outputs[i];
            for (int32_t t = 0; t < o->n_new; t++) {
                const int32_t tk = o->tokens[t];
                if (k3_tokenizer_is_eos(a->tok, tk)) continue; /* not printed, not counted (as k3 run does) */
                if (!n_out++) t_first = k3_now();
                size_t len;
                const char *piece = k3_tokenizer_token(a->tok, tk, &len);
                if (a->chat) k3_cli_chat_render(&cr, tk, piece, len);
                else if (piece && !k3_tokenizer_is_special(a->tok, tk)) fwrite(piece, 1, len, stdout);
            }
            fflush(stdout);
            if (o->events & K3_EV_FINISHED) {
                done = true;
                if (o->finish == K3_FINISH_ERROR) {
                    fprintf(stderr, "\nk3 run: %s\n", o->error ? o->error : "the request failed");
                    goto out;
                }
                if (o->finish == K3_FINISH_STOP) why = " (end of message)";
            }
        }
    }
    const double t_end = k3_now();
    printf("\n");
    fflush(stdout);
    k3_engine_stats st;
    k3_engine_get_stats(e, &st);
    const double dec = t_first > 0 ? t_end - t_first : 0;
    fprintf(stderr, "prompt %zu tokens, prefill %.1f tok/s, decode %d tokens at %.1f tok/s%s (quant %s, kv %s)\n",
            a->n_ids, (double)a->n_ids / ((t_first > 0 ? t_first : t_end) - t0), n_out,
            n_out > 1 && dec > 0 ? (n_out - 1) / dec : 0.0, why, a->quant, a->kv == K3_KV_C8 ? "c8" : "f32");
    fprintf(stderr,
            "speculative %s: %lld verify passes with %lld draft tokens, %lld accepted (%.0f%%), mean "
            "acceptance length %.2f\n",
            a->spec->method ? a->spec->method : "draft_model", (long long)st.spec_drafts,
            (long long)st.spec_draft_tokens, (long long)st.spec_accepted_tokens,
            st.spec_draft_tokens ? 100.0 * (double)st.spec_accepted_tokens / (double)st.spec_draft_tokens : 0.0,
            st.spec_drafts ? 1.0 + (double)st.spec_accepted_tokens / (double)st.spec_drafts : 1.0);
    rc = 0;
out:
    k3_engine_close(e);
    k3_model_close(draft);
    return rc;
}
