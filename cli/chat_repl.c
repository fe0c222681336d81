/*
 * chat_repl.c -- `k3 run --chat` with no prompt (or `-i`): a conversation on
 * the terminal, and the renderer of the K3 chat format's assistant turns.
 *
 * The conversation lives in one context: each turn prefills only the new
 * user message (and, on the first turn, the --system message) after what is
 * already there, then generates the reply. A reply that ends with
 * <|end_of_msg|> has it fed back; one cut off by -n is closed with the tags
 * the format needs, so the next turn starts on a message boundary. Each turn
 * reports on stderr `[turn T: prefilled N new tokens, context P/M tokens]`.
 * One line of input is one user message; EOF, /exit or /quit ends it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "k3.h"

void k3_cli_chat_render_init(k3_cli_chat_view *c, const k3_tokenizer *tok, bool think, FILE *out) {
    memset(c, 0, sizeof *c);
    c->out = out;
    c->open = tok ? k3_tokenizer_special(tok, "<|open|>") : -1;
    c->close = tok ? k3_tokenizer_special(tok, "<|close|>") : -1;
    c->sep = tok ? k3_tokenizer_special(tok, "<|sep|>") : -1;
    /* the generation prompt opened the block already */
    snprintf(c->block, sizeof c->block, "%s", think ? "think" : "response");
    if (think) fputs("[think] ", out);
}

void k3_cli_chat_render(k3_cli_chat_view *c, int32_t id, const char *piece, size_t len) {
    if (id == c->open || id == c->close) {
        c->in_tag = 1;
        c->closing = id == c->close;
        c->tag[0] = 0;
        return;
    }
    if (id == c->sep) {
        if (c->in_tag && !strncmp(c->tag, "think", 5)) fputs(c->closing ? " [/think]\n" : "[think] ", c->out);
        if (c->in_tag) {
            /* the block we are in: NAME after <|open|>NAME<|sep|>, none after a close */
            if (c->closing) c->block[0] = 0;
            else snprintf(c->block, sizeof c->block, "%.*s", (int)strcspn(c->tag, " "), c->tag);
        }
        c->in_tag = 0;
        return;
    }
    if (!piece) return;
    if (c->in_tag) {
        const size_t have = strlen(c->tag);
        if (have + len < sizeof c->tag) {
            memcpy(c->tag + have, piece, len);
            c->tag[have + len] = 0;
        }
        return;
    }
    fwrite(piece, 1, len, c->out);
}

/* Appends ids to the conversation: a forward pass over them. */
static k3_status feed(k3_ctx *ctx, const int32_t *ids, size_t n, float *logits, k3_error *err) {
    k3_batch_seq b = {0, (int32_t)n, ids};
    return k3_ctx_forward(ctx, &b, 1, logits ? K3_LOGITS_LAST : K3_LOGITS_NONE, logits, err);
}

/* The text segment `s` encoded and pushed after control id `ctl` (-1: none). */
static k3_status push_tag(const k3_tokenizer *tok, int32_t ctl, const char *s, int32_t **v, size_t *n, size_t *cap,
                          k3_error *err) {
    int32_t *t = NULL;
    size_t nt = 0;
    if (s && k3_tokenizer_encode(tok, s, strlen(s), &t, &nt, err)) return err->status;
    const size_t need = *n + nt + 1;
    if (need > *cap) {
        int32_t *nv = realloc(*v, need * 2 * sizeof *nv);
        if (!nv) {
            free(t);
            return K3_ERR_NOMEM;
        }
        *v = nv;
        *cap = need * 2;
    }
    if (ctl >= 0) (*v)[(*n)++] = ctl;
    if (nt) memcpy(*v + *n, t, nt * sizeof *t);
    *n += nt;
    free(t);
    return K3_OK;
}

/* The ids that close a reply cut off inside block `block` ("" = between
 * blocks): <|close|>BLOCK<|sep|> <|close|>message<|sep|> <|end_of_msg|>. */
static k3_status closing_ids(const k3_tokenizer *tok, const k3_cli_chat_view *cr, int32_t eom, int32_t **v, size_t *n,
                             k3_error *err) {
    size_t cap = 0;
    *v = NULL;
    *n = 0;
    k3_status s = K3_OK;
    /* cut inside a tag: end the tag first; an opening one opens that block */
    const char *blk = cr->in_tag ? (cr->closing ? "" : cr->tag) : cr->block;
    if (cr->in_tag) s = push_tag(tok, cr->sep, NULL, v, n, &cap, err);
    if (!s && blk[0]) {
        s = push_tag(tok, cr->close, blk, v, n, &cap, err);
        if (!s) s = push_tag(tok, cr->sep, NULL, v, n, &cap, err);
    }
    if (!s) s = push_tag(tok, cr->close, "message", v, n, &cap, err);
    if (!s) s = push_tag(tok, cr->sep, NULL, v, n, &cap, err);
    if (!s) s = push_tag(tok, eom, NULL, v, n, &cap, err);
    return s;
}

/* Reads one line (without its newline) of at most max bytes; NULL at EOF. */
static char *read_line(FILE *in, size_t max, bool *too_long) {
    char *line = NULL;
    size_t cap = 0;
    *too_long = false;
    const ssize_t n = getline(&line, &cap, in);
    if (n < 0) {
        free(line);
        return NULL;
    }
    if ((size_t)n > max) *too_long = true;
    if (n > 0 && line[n - 1] == '\n') line[n - 1] = 0;
    if (n > 1 && line[n - 2] == '\r') line[n - 2] = 0;
    return line;
}

int k3_cli_chat_repl(const k3_cli_repl *r) {
    k3_error err = {0};
    k3_pool *pool = NULL;
    k3_ctx *ctx = NULL;
    k3_sampler *smp = NULL;
    float *logits = NULL;
    int32_t *ids = NULL;
    int rc = 1;
    const bool tty = isatty(STDIN_FILENO) && isatty(STDOUT_FILENO);
    k3_model_info info;
    k3_model_get_info(r->model, &info);
    int64_t n_ctx = r->n_ctx > 0 ? r->n_ctx : 4096;
    if (n_ctx > info.max_positions) n_ctx = info.max_positions;
    const int32_t eom = k3_tokenizer_special(r->tok, "<|end_of_msg|>");
    if (eom < 0) {
        fprintf(stderr, "k3 run: the tokenizer has no <|end_of_msg|> token, so it cannot hold a conversation\n");
        return 1;
    }

    if (k3_pool_init(&pool, r->threads, &err)) goto fail;
    k3_ctx_options co = {.max_seqs = 1, .cache_tokens = n_ctx, .pool = pool, .kv_cache = r->kv};
    if (k3_ctx_init(&ctx, r->model, &co, &err)) goto fail;
    if (k3_sampler_init(&smp, r->sampling, (int32_t)info.vocab_size, &err)) goto fail;
    if (!(logits = malloc(sizeof(float) * (size_t)info.vocab_size))) {
        fprintf(stderr, "k3 run: out of memory for logits\n");
        goto out;
    }
    if (tty)
        fprintf(stderr, "k3 chat: %lld-token context; one line per message, /exit or Ctrl-D to end\n",
                (long long)n_ctx);

    for (int turn = 1;; turn++) {
        if (tty) {
            fputs("> ", stdout);
            fflush(stdout);
        }
        bool too_long;
        char *line = read_line(stdin, (size_t)1 << 20, &too_long);
        if (!line) break;
        if (too_long) {
            fprintf(stderr, "k3 run: a message is over 1 MB; send a shorter one\n");
            free(line);
            goto out;
        }
        if (!strcmp(line, "/exit") || !strcmp(line, "/quit")) {
            free(line);
            break;
        }
        if (!line[strspn(line, " \t")]) {
            free(line);
            turn--;
            continue;
        }
        k3_chat_msg msgs[2];
        size_t nm = 0;
        if (turn == 1 && r->system) msgs[nm++] = (k3_chat_msg){"system", r->system, NULL};
        msgs[nm++] = (k3_chat_msg){"user", line, NULL};
        size_t n_ids = 0;
        const k3_status es = k3_chat_encode(r->tok, msgs, nm, true, r->think, &ids, &n_ids, &err);
        free(line);
        if (es) goto fail;
        const int64_t pos = k3_ctx_seq_pos(ctx, 0);
        if (pos + (int64_t)n_ids + 1 > n_ctx) {
            fprintf(stderr,
                    "k3 run: the conversation is full: %lld of %lld tokens used and this message needs %zu more; "
                    "start again with a larger --ctx\n",
                    (long long)pos, (long long)n_ctx, n_ids);
            goto out;
        }
        if (feed(ctx, ids, n_ids, logits, &err)) goto fail;
        for (size_t i = 0; i < n_ids; i++) k3_sampler_accept(smp, ids[i]);
        fprintf(stderr, "[turn %d: prefilled %zu new tokens, context %lld/%lld tokens]\n", turn, n_ids,
                (long long)k3_ctx_seq_pos(ctx, 0), (long long)n_ctx);
        free(ids);
        ids = NULL;

        k3_cli_chat_view cr;
        k3_cli_chat_render_init(&cr, r->tok, r->think, stdout);
        bool ended = false;
        int n_done = 0;
        for (; n_done < r->n_gen; n_done++) {
            /* room for this token and the closing tags */
            if (k3_ctx_seq_pos(ctx, 0) + 8 >= n_ctx) break;
            const int32_t id = k3_sampler_sample(smp, logits);
            if (id < 0) {
                fprintf(stderr,
                        "\nk3 run: the logits are not finite (NaN or +Inf): the weights are damaged; "
                        "`k3 info -m DIR` names the tensor\n");
                goto out;
            }
            if (k3_tokenizer_is_eos(r->tok, id)) {
                if (feed(ctx, &eom, 1, NULL, &err)) goto fail;
                k3_sampler_accept(smp, eom);
                ended = true;
                break;
            }
            k3_sampler_accept(smp, id);
            size_t len;
            const char *piece = k3_tokenizer_token(r->tok, id, &len);
            k3_cli_chat_render(&cr, id, piece, len);
            fflush(stdout);
            if (feed(ctx, &id, 1, logits, &err)) goto fail;
        }
        if (!ended) {
            size_t nc;
            if (closing_ids(r->tok, &cr, eom, &ids, &nc, &err)) goto fail;
            if (k3_ctx_seq_pos(ctx, 0) + (int64_t)nc > n_ctx) {
                fprintf(stderr, "\nk3 run: the conversation is full (%lld tokens); start again with a larger --ctx\n",
                        (long long)n_ctx);
                goto out;
            }
            if (feed(ctx, ids, nc, NULL, &err)) goto fail;
            for (size_t i = 0; i < nc; i++) k3_sampler_accept(smp, ids[i]);
            free(ids);
            ids = NULL;
        }
        fputc('\n', stdout);
        fflush(stdout);
        fprintf(stderr, "[turn %d: %d tokens generated%s]\n", turn, n_done, ended ? "" : " (cut off by -n)");
    }
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "k3 run: %s\n", err.msg[0] ? err.msg : k3_status_str(err.status));
out:
    free(ids);
    free(logits);
    k3_sampler_free(smp);
    k3_ctx_free(ctx);
    k3_pool_free(pool);
    return rc;
}
