/*
 * parser.c -- the parser core over a compiled grammar: interned frames and
 * the closure, which the token tables (walk.c) and the matcher (matcher.c)
 * both run.
 *
 * A parser state is a set of configurations (node, stack): the node of the
 * rule being read and the stack of rules below it, as an index into
 * interned frames (ret, parent), so equal stacks are equal indices and a
 * set dedups by the pair. The closure of a set predicts (a reference
 * pushes a frame and enters the referenced rule) and completes (a final
 * node pops a frame and continues in the rule below), keeping only the
 * configurations that can read a byte or a special token; running out of
 * stack means the root rule is complete. Left recursion, refused when the
 * grammar is compiled, is what would make this loop.
 */
#include <stdlib.h>
#include <string.h>

#include "grammar/parser.h"

/* ---- frames ------------------------------------------------------------------- */

void k3g_frames_free(k3g_frames *f) {
    free(f->v);
    free(f->slot);
    *f = (k3g_frames){0};
}

static uint32_t frame_hash(int32_t ret, int32_t parent) {
    uint64_t h = ((uint64_t)(uint32_t)ret << 32 | (uint32_t)parent) * 0x9e3779b97f4a7c15u;
    return (uint32_t)(h >> 32);
}

static bool frames_rehash(k3g_frames *f, uint32_t ns) {
    int32_t *slot = malloc((size_t)ns * sizeof *slot);
    if (!slot) return false;
    for (uint32_t i = 0; i < ns; i++) slot[i] = -1;
    for (int32_t k = 0; k < f->n; k++) {
        uint32_t i = frame_hash(f->v[k].ret, f->v[k].parent) & (ns - 1);
        while (slot[i] >= 0) i = (i + 1) & (ns - 1);
        slot[i] = k;
    }
    free(f->slot);
    f->slot = slot;
    f->mask = ns - 1;
    return true;
}

int32_t k3g_frames_get(k3g_frames *f, int32_t ret, int32_t parent) {
    if (!f->slot || (uint32_t)f->n * 2 + 2 >= f->mask) {
        uint32_t ns = f->slot ? (f->mask + 1) : 256;
        while ((uint32_t)f->n * 4 + 4 >= ns) ns *= 2;
        if (!frames_rehash(f, ns)) return -1;
    }
    uint32_t i = frame_hash(ret, parent) & f->mask;
    for (;; i = (i + 1) & f->mask) {
        int32_t k = f->slot[i];
        if (k < 0 || k >= f->n) break; /* empty, or a frame dropped by a rollback */
        if (f->v[k].ret == ret && f->v[k].parent == parent) return k;
    }
    if (!k3g_grow(&f->v, &f->cap, (size_t)f->n + 1, sizeof *f->v)) return -1;
    f->v[f->n] = (k3g_frame){ret, parent};
    f->slot[i] = f->n;
    return f->n++;
}

bool k3g_frames_copy(k3g_frames *dst, const k3g_frames *src) {
    *dst = (k3g_frames){0};
    if (src->n) {
        dst->v = malloc((size_t)src->n * sizeof *dst->v);
        if (!dst->v) return false;
        memcpy(dst->v, src->v, (size_t)src->n * sizeof *dst->v);
        dst->cap = (size_t)src->n;
        dst->n = src->n;
    }
    return true; /* the hash is rebuilt on first use */
}

/* ---- closure -------------------------------------------------------------------- */

bool k3g_cfgv_push(k3g_cfgv *v, k3g_cfg c) {
    if (v->n == v->cap && !k3g_grow(&v->v, &v->cap, v->n + 1, sizeof *v->v)) return false;
    v->v[v->n++] = c;
    return true;
}

void k3g_cscratch_free(k3g_cscratch *s) {
    free(s->key);
    free(s->gen);
    free(s->work.v);
    free(s->fm_ret);
    free(s->fm_frame);
    free(s->fm_gen);
    *s = (k3g_cscratch){0};
}

/* Marks (node, stack) visited in the current generation; false when it was
 * already. *oom on allocation failure. */
static bool visit(k3g_cscratch *s, uint64_t key, size_t *count, bool *oom) {
    if (!s->key || *count * 2 + 2 >= (size_t)s->mask) {
        uint32_t ns = s->key ? (s->mask + 1) * 2 : 64;
        uint64_t *k = malloc((size_t)ns * sizeof *k);
        uint32_t *g = calloc(ns, sizeof *g);
        if (!k || !g) {
            free(k);
            free(g);
            *oom = true;
            return false;
        }
        /* carry the current generation's keys over */
        for (uint32_t i = 0; s->key && i <= s->mask; i++) {
            if (s->gen[i] != s->cur) continue;
            uint64_t h = s->key[i] * 0x9e3779b97f4a7c15u;
            uint32_t j = (uint32_t)(h >> 40) & (ns - 1);
            while (g[j] == 1) j = (j + 1) & (ns - 1);
            k[j] = s->key[i];
            g[j] = 1;
        }
        free(s->key);
        free(s->gen);
        s->key = k;
        s->gen = g;
        s->mask = ns - 1;
        s->cur = 1;
    }
    uint64_t h = key * 0x9e3779b97f4a7c15u;
    uint32_t j = (uint32_t)(h >> 40) & s->mask;
    for (; s->gen[j] == s->cur; j = (j + 1) & s->mask)
        if (s->key[j] == key) return false;
    s->key[j] = key;
    s->gen[j] = s->cur;
    (*count)++;
    return true;
}

static void new_generation(k3g_cscratch *s) {
    if (!s->key) return;
    if (++s->cur == 0) {
        memset(s->gen, 0, ((size_t)s->mask + 1) * sizeof *s->gen);
        s->cur = 1;
    }
}

bool k3g_closure(const k3_grammar *g, k3g_frames *fr, k3g_cscratch *cs, const k3g_cfg *seeds, size_t n_seeds,
                 k3g_cfgv *out, bool *bottom) {
    if (n_seeds == 1) {
        /* the common case: a node that reads and neither references nor ends */
        const k3g_node *nd = &g->nodes[seeds[0].node];
        if (!nd->nr && !nd->final) return (nd->nb || nd->ns) ? k3g_cfgv_push(out, seeds[0]) : true;
    }
    new_generation(cs);
    size_t count = 0;
    bool oom = false;
    k3g_cfgv *w = &cs->work;
    w->n = 0;
    for (size_t i = 0; i < n_seeds; i++)
        if (!k3g_cfgv_push(w, seeds[i])) return false;
    while (w->n) {
        k3g_cfg c = w->v[--w->n];
        uint64_t key = (uint64_t)(uint32_t)c.node << 32 | (uint32_t)c.stack;
        if (!visit(cs, key, &count, &oom)) {
            if (oom) return false;
            continue;
        }
        if (cs->budget > 0 && --cs->budget == 0) {
            cs->over = true;
            return false;
        }
        const k3g_node *nd = &g->nodes[c.node];
        if ((nd->nb || nd->ns) && !k3g_cfgv_push(out, c)) return false;
        for (uint32_t j = 0; j < nd->nr; j++) {
            const k3g_redge *e = &g->redges[nd->r0 + j];
            int32_t f = k3g_frames_get(fr, (int32_t)e->to, c.stack);
            if (f < 0 || !k3g_cfgv_push(w, (k3g_cfg){g->rule_start[e->rule], f})) return false;
        }
        if (nd->final) {
            if (c.stack < 0) {
                *bottom = true;
            } else {
                k3g_frame F = fr->v[c.stack];
                if (!k3g_cfgv_push(w, (k3g_cfg){F.ret, F.parent})) return false;
            }
        }
    }
    return true;
}

bool k3g_scan_byte(const k3_grammar *g, k3g_frames *fr, k3g_cscratch *cs, const k3g_cfg *in, size_t n_in, unsigned c,
                   k3g_cfgv *out, bool *bottom) {
    /* the seeds go through out's tail, then the closure replaces them */
    size_t base = out->n;
    for (size_t i = 0; i < n_in; i++) {
        int32_t t = k3g_step(g, in[i].node, c);
        if (t >= 0 && !k3g_cfgv_push(out, (k3g_cfg){t, in[i].stack})) return false;
    }
    size_t ns = out->n - base;
    if (ns == 0) return true;
    k3g_cfg small[16], *seeds = small;
    if (ns > 16 && !(seeds = malloc(ns * sizeof *seeds))) return false;
    memcpy(seeds, out->v + base, ns * sizeof *seeds);
    out->n = base;
    bool ok = k3g_closure(g, fr, cs, seeds, ns, out, bottom);
    if (seeds != small) free(seeds);
    return ok;
}

/* ---- graph-structured stacks ---------------------------------------------------- */

void k3g_gss_free(k3g_gss *s) {
    free(s->f);
    free(s->e);
    *s = (k3g_gss){0};
}

bool k3g_gss_copy(k3g_gss *dst, const k3g_gss *src) {
    *dst = (k3g_gss){.gen = src->gen};
    if (src->nf && !(dst->f = malloc((size_t)src->nf * sizeof *dst->f))) return false;
    if (src->ne && !(dst->e = malloc((size_t)src->ne * sizeof *dst->e))) {
        k3g_gss_free(dst);
        return false;
    }
    if (src->nf) memcpy(dst->f, src->f, (size_t)src->nf * sizeof *dst->f);
    if (src->ne) memcpy(dst->e, src->e, (size_t)src->ne * sizeof *dst->e);
    dst->nf = src->nf;
    dst->capf = (size_t)src->nf;
    dst->ne = src->ne;
    dst->cape = (size_t)src->ne;
    return true;
}

bool k3g_gss_pop(const k3g_gss *s, int32_t f, k3g_cfgv *out) {
    for (int32_t k = s->f[f].edge; k >= 0; k = s->e[k].next)
        if (!k3g_cfgv_push(out, (k3g_cfg){s->f[f].ret, s->e[k].parent})) return false;
    return true;
}

/* The frame this closure (cs->fm_cur) pushed for return node ret, made when
 * new; -1 on allocation failure or past K3G_MAX_GSS (cs->over). */
static int32_t gss_frame(k3g_gss *s, k3g_cscratch *cs, int32_t ret) {
    if (!cs->fm_ret || cs->fm_n * 2 + 2 >= cs->fm_mask) {
        uint32_t ns = cs->fm_ret ? (cs->fm_mask + 1) * 2 : 64;
        int32_t *kr = malloc((size_t)ns * sizeof *kr), *kf = malloc((size_t)ns * sizeof *kf);
        uint32_t *kg = calloc(ns, sizeof *kg);
        if (!kr || !kf || !kg) {
            free(kr);
            free(kf);
            free(kg);
            return -1;
        }
        for (uint32_t i = 0; cs->fm_ret && i <= cs->fm_mask; i++) {
            if (cs->fm_gen[i] != cs->fm_cur) continue;
            uint32_t j = ((uint32_t)cs->fm_ret[i] * 0x9e3779b1u) & (ns - 1);
            while (kg[j] == 1) j = (j + 1) & (ns - 1);
            kr[j] = cs->fm_ret[i];
            kf[j] = cs->fm_frame[i];
            kg[j] = 1;
        }
        free(cs->fm_ret);
        free(cs->fm_frame);
        free(cs->fm_gen);
        cs->fm_ret = kr;
        cs->fm_frame = kf;
        cs->fm_gen = kg;
        cs->fm_mask = ns - 1;
        cs->fm_cur = 1;
    }
    uint32_t j = ((uint32_t)ret * 0x9e3779b1u) & cs->fm_mask;
    for (; cs->fm_gen[j] == cs->fm_cur; j = (j + 1) & cs->fm_mask)
        if (cs->fm_ret[j] == ret) return cs->fm_frame[j];
    if (s->nf >= K3G_MAX_GSS) {
        cs->over = true;
        return -1;
    }
    if (!k3g_grow(&s->f, &s->capf, (size_t)s->nf + 1, sizeof *s->f)) return -1;
    s->f[s->nf] = (k3g_gframe){ret, s->gen, -1, 0};
    cs->fm_ret[j] = ret;
    cs->fm_frame[j] = s->nf;
    cs->fm_gen[j] = cs->fm_cur;
    cs->fm_n++;
    return s->nf++;
}

/* Adds the edge f -> parent unless f has it; *added says whether it was new
 * (the edges looked at count against the budget). */
static bool gss_edge(k3g_gss *s, k3g_cscratch *cs, int32_t f, int32_t parent, bool *added) {
    *added = false;
    int64_t looked = 0;
    bool found = false;
    for (int32_t k = s->f[f].edge; k >= 0 && !found; k = s->e[k].next, looked++) found = s->e[k].parent == parent;
    if (cs->budget > 0) {
        if (cs->budget <= looked + 1) {
            cs->budget = 0;
            cs->over = true;
            return false;
        }
        cs->budget -= looked;
    }
    if (found) return true;
    if (s->ne >= K3G_MAX_GSS) {
        cs->over = true;
        return false;
    }
    if (!k3g_grow(&s->e, &s->cape, (size_t)s->ne + 1, sizeof *s->e)) return false;
    s->e[s->ne] = (k3g_gedge){parent, s->f[f].edge};
    s->f[f].edge = s->ne++;
    *added = true;
    return true;
}

bool k3g_gss_closure(const k3_grammar *g, k3g_gss *s, k3g_cscratch *cs, const k3g_cfg *seeds, size_t n_seeds,
                     k3g_cfgv *out, bool *bottom) {
    if (n_seeds == 1) {
        const k3g_node *nd = &g->nodes[seeds[0].node];
        if (!nd->nr && !nd->final) return (nd->nb || nd->ns) ? k3g_cfgv_push(out, seeds[0]) : true;
    }
    new_generation(cs);
    s->gen++;
    if (cs->fm_ret && ++cs->fm_cur == 0) {
        memset(cs->fm_gen, 0, ((size_t)cs->fm_mask + 1) * sizeof *cs->fm_gen);
        cs->fm_cur = 1;
    }
    cs->fm_n = 0;
    size_t count = 0;
    bool oom = false;
    k3g_cfgv *w = &cs->work;
    w->n = 0;
    for (size_t i = 0; i < n_seeds; i++)
        if (!k3g_cfgv_push(w, seeds[i])) return false;
    while (w->n) {
        k3g_cfg c = w->v[--w->n];
        /* every item counts, a repeat too: the budget bounds the time */
        if (cs->budget > 0 && --cs->budget == 0) {
            cs->over = true;
            return false;
        }
        uint64_t key = (uint64_t)(uint32_t)c.node << 32 | (uint32_t)c.stack;
        if (!visit(cs, key, &count, &oom)) {
            if (oom) return false;
            continue;
        }
        const k3g_node *nd = &g->nodes[c.node];
        if ((nd->nb || nd->ns) && !k3g_cfgv_push(out, c)) return false;
        for (uint32_t j = 0; j < nd->nr; j++) {
            const k3g_redge *e = &g->redges[nd->r0 + j];
            const int32_t f = gss_frame(s, cs, (int32_t)e->to);
            bool added;
            if (f < 0 || !gss_edge(s, cs, f, c.stack, &added)) return false;
            /* the rule above ended without reading here already: this stack continues too */
            if (added && s->f[f].popped == s->gen && !k3g_cfgv_push(w, (k3g_cfg){s->f[f].ret, c.stack})) return false;
            if (!k3g_cfgv_push(w, (k3g_cfg){g->rule_start[e->rule], f})) return false;
        }
        if (nd->final) {
            if (c.stack < 0) {
                *bottom = true;
            } else {
                if (s->f[c.stack].gen == s->gen) s->f[c.stack].popped = s->gen;
                if (!k3g_gss_pop(s, c.stack, w)) return false;
            }
        }
    }
    return true;
}

bool k3g_gss_scan_byte(const k3_grammar *g, k3g_gss *s, k3g_cscratch *cs, const k3g_cfg *in, size_t n_in, unsigned c,
                       k3g_cfgv *out, bool *bottom) {
    size_t base = out->n;
    for (size_t i = 0; i < n_in; i++) {
        int32_t t = k3g_step(g, in[i].node, c);
        if (t >= 0 && !k3g_cfgv_push(out, (k3g_cfg){t, in[i].stack})) return false;
    }
    size_t ns = out->n - base;
    if (ns == 0) return true;
    k3g_cfg small[16], *seeds = small;
    if (ns > 16 && !(seeds = malloc(ns * sizeof *seeds))) return false;
    memcpy(seeds, out->v + base, ns * sizeof *seeds);
    out->n = base;
    bool ok = k3g_gss_closure(g, s, cs, seeds, ns, out, bottom);
    if (seeds != small) free(seeds);
    return ok;
}
