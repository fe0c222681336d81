/*
 * config.c -- config.json -> k3_config (see config.h).
 *
 * The text model's fields live in `text_config` (Hugging Face multimodal
 * layout) or, for a flat config, at the root. Sizes are required: a missing
 * size is a K3_ERR_FORMAT naming the field. Switches that only select a
 * variant (gate form, output gate, router, ...) default to the values of the
 * family's reference code: K3 (root model_type "kimi_k3", or AttnRes fields
 * present) takes the released K3 values of docs/model.md §2; Kimi-Linear
 * takes the defaults of its configuration_kimi.py.
 *
 * Every key of text_config must be on the allow-list below. A key that is not
 * could change the math, so it is refused (K3_ERR_UNSUPPORTED) rather than
 * guessed at. Known keys whose values k3 cannot honour (rope_scaling,
 * attention_bias, a non-NoPE MLA, other quantizations) are refused too.
 *
 * Hostile input: the file is capped at 1 MB and the JSON nesting at 32 levels
 * before jansson sees it; duplicate keys are rejected.
 */
#include "config.h"
#include "common/error.h"
#include "../common/json_guard.h"
#include "../common/file.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CONFIG_MAX_BYTES (1 << 20)
#define CONFIG_MAX_DEPTH 32

/* ---- allow-lists ------------------------------------------------------- */

/* Keys of text_config (or of a flat root) that k3 reads or knows to be inert. */
static const char *const text_keys[] = {
    /* identity and bookkeeping */
    "architectures",
    "model_type",
    "auto_map",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "_name_or_path",
    "_attn_implementation",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    /* sizes */
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "max_position_embeddings",
    "model_max_length",
    "rms_norm_eps",
    "tie_word_embeddings",
    /* MLA */
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "mla_use_nope",
    "mla_use_output_gate",
    "rope_theta",
    "rope_scaling",
    "attention_bias",
    /* transformers 5.x: written into every config it saves; checked below
     * (only {"rope_theta", "rope_type": "default"}, inert for NoPE) */
    "rope_parameters",
    /* KDA */
    "linear_attn_config",
    /* AttnRes */
    "attn_res_block_size",
    /* FFN / MoE */
    "first_k_dense_replace",
    "moe_layer_freq",
    "intermediate_size",
    "num_experts",
    "num_experts_per_token",
    "num_shared_experts",
    "moe_intermediate_size",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "moe_router_activation_func",
    "moe_renormalize",
    "routed_scaling_factor",
    "use_grouped_topk",
    "num_expert_group",
    "topk_group",
    "topk_method",
    "hidden_act",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "num_nextn_predict_layers",
    "quantization_config",
    /* transformers' KimiLinearConfig: duplicates of the fields above, checked
     * against them (layer_types, mlp_layer_types, linear_*, qk_head_dim) or inert */
    "layer_types",
    "mlp_layer_types",
    "linear_num_heads",
    "linear_head_dim",
    "linear_conv_kernel_dim",
    "qk_head_dim",
    "pretraining_tp",
    "output_router_logits",
    /* DSA lightning indexer */
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "index_layers",
    /* PretrainedConfig.to_dict() boilerplate: generation and training knobs */
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "use_return_dict",
    "torchscript",
    "use_bfloat16",
    "tf_legacy_loss",
    "pruned_heads",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "is_decoder",
    "add_cross_attention",
    "cross_attention_hidden_size",
    "tie_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "finetuning_task",
    "tokenizer_class",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
    "task_specific_params",
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "output_scores",
    "return_dict_in_generate",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "keys_to_ignore_at_inference",
};

/* Root keys of the multimodal wrapper, allowed too in a flat config. */
static const char *const root_keys[] = {
    "text_config",       "vision_config",     "media_placeholder_token_id",
    "image_placeholder", "video_placeholder", "ignore_index",
};

static const char *const linear_keys[] = {
    "num_heads",          "head_dim",   "short_conv_kernel_size", "gate_lower_bound",
    "use_full_rank_gate", "kda_layers", "full_attn_layers",       "allow_neg_eigval",
};

static bool in_list(const char *key, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(key, list[i])) return true;
    return false;
}
#define IN_LIST(k, l) in_list((k), (l), sizeof(l) / sizeof((l)[0]))

/* ---- hostile-input guard ------------------------------------------------ */


/* ---- typed getters ------------------------------------------------------ */

/* The parse context: messages read "<src>: field 'x' in <where> ...". */
typedef struct parser {
    const char *src;   /* file name for messages */
    const char *where; /* "text_config", "text_config.linear_attn_config", ... */
    k3_error *err;
} parser;

/* The value of key, NULL when absent or JSON null. */
static json_t *get(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return json_is_null(v) ? NULL : v;
}

static k3_status missing(const parser *p, const char *key) {
    return k3_err(p->err, K3_ERR_FORMAT, "%s: missing required field '%s' in %s", p->src, key, p->where);
}

static k3_status bad_type(const parser *p, const char *key, const char *want) {
    return k3_err(p->err, K3_ERR_FORMAT, "%s: field '%s' in %s must be %s", p->src, key, p->where, want);
}

/* An integer in [lo, hi]. required: absence is an error; else *out = def. */
static k3_status get_int(const parser *p, json_t *obj, const char *key, bool required, int64_t def, int64_t lo,
                         int64_t hi, int64_t *out) {
    json_t *v = get(obj, key);
    if (!v) {
        if (required) return missing(p, key);
        *out = def;
        return K3_OK;
    }
    if (!json_is_integer(v)) return bad_type(p, key, "an integer");
    int64_t x = (int64_t)json_integer_value(v);
    if (x < lo || x > hi)
        return k3_err(p->err, K3_ERR_FORMAT, "%s: field '%s' in %s = %lld is out of range [%lld, %lld]", p->src, key,
                      p->where, (long long)x, (long long)lo, (long long)hi);
    *out = x;
    return K3_OK;
}

static k3_status get_i32(const parser *p, json_t *obj, const char *key, bool required, int64_t def, int64_t lo,
                         int64_t hi, int32_t *out) {
    int64_t x;
    k3_status s = get_int(p, obj, key, required, def, lo, hi, &x);
    if (s == K3_OK) *out = (int32_t)x;
    return s;
}

static k3_status get_num(const parser *p, json_t *obj, const char *key, double def, double *out) {
    json_t *v = get(obj, key);
    if (!v) {
        *out = def;
        return K3_OK;
    }
    if (!json_is_number(v)) return bad_type(p, key, "a number");
    *out = json_number_value(v);
    if (!isfinite(*out)) return bad_type(p, key, "a finite number");
    return K3_OK;
}

static k3_status get_bool(const parser *p, json_t *obj, const char *key, bool def, bool *out) {
    json_t *v = get(obj, key);
    if (!v) {
        *out = def;
        return K3_OK;
    }
    if (!json_is_boolean(v)) return bad_type(p, key, "true or false");
    *out = json_is_true(v);
    return K3_OK;
}

/* A string or NULL when absent (def). */
static k3_status get_str(const parser *p, json_t *obj, const char *key, const char *def, const char **out) {
    json_t *v = get(obj, key);
    if (!v) {
        *out = def;
        return K3_OK;
    }
    if (!json_is_string(v)) return bad_type(p, key, "a string");
    *out = json_string_value(v);
    return K3_OK;
}

/* A token id: an integer, or a list whose first entry is used (HF allows a
 * list of eos ids). -1 when absent. */
static k3_status get_token_id(const parser *p, json_t *obj, const char *key, int32_t *out) {
    json_t *v = get(obj, key);
    if (!v) return K3_OK; /* keep the fallback already in *out */
    if (json_is_array(v)) v = json_array_get(v, 0);
    if (!v || !json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
        return bad_type(p, key, "a non-negative token id");
    *out = (int32_t)json_integer_value(v);
    return K3_OK;
}

/* ---- pieces ------------------------------------------------------------- */

/* Reads a 1-based layer list into flags[0..n): each id in 1..n, no repeats. */
static k3_status parse_layer_list(const parser *p, json_t *obj, const char *key, int32_t n_layers, bool *flags) {
    json_t *arr = get(obj, key);
    if (!arr) return missing(p, key);
    if (!json_is_array(arr)) return bad_type(p, key, "a list of 1-based layer numbers");
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v) {
        if (!json_is_integer(v)) return bad_type(p, key, "a list of 1-based layer numbers");
        json_int_t id = json_integer_value(v);
        if (id < 1 || id > n_layers)
            return k3_err(p->err, K3_ERR_FORMAT, "%s: %s.%s: layer %lld is out of range 1..%d (1-based)", p->src,
                          p->where, key, (long long)id, n_layers);
        if (flags[id - 1])
            return k3_err(p->err, K3_ERR_FORMAT, "%s: %s.%s: layer %lld is listed twice", p->src, p->where, key,
                          (long long)id);
        flags[id - 1] = true;
    }
    return K3_OK;
}

/* quantization_config: only compressed-tensors MXFP4 (routed experts). */
static k3_status parse_quant(const parser *p, json_t *q, k3_config *cfg) {
    if (!json_is_object(q)) return bad_type(p, "quantization_config", "an object");
    const char *method = NULL;
    parser pq = *p;
    pq.where = "quantization_config";
    K3_TRY(get_str(&pq, q, "quant_method", NULL, &method));
    if (!method) return missing(&pq, "quant_method");
    if (strcmp(method, "compressed-tensors") != 0)
        return k3_err(p->err, K3_ERR_UNSUPPORTED,
                      "%s: quantization method '%s' is not supported (only "
                      "compressed-tensors mxfp4-pack-quantized)",
                      p->src, method);
    const char *format = NULL;
    K3_TRY(get_str(&pq, q, "format", NULL, &format));
    if (format && !strcmp(format, "mxfp4-pack-quantized")) {
        cfg->experts_mxfp4 = true;
        return K3_OK;
    }
    if (format)
        return k3_err(p->err, K3_ERR_UNSUPPORTED,
                      "%s: compressed-tensors format '%s' is not supported (only "
                      "mxfp4-pack-quantized)",
                      p->src, format);
    /* No format: accept only groups that describe MXFP4 weights (4-bit
     * float, group 32) and no quantized activations. */
    json_t *groups = get(q, "config_groups");
    bool ok = json_is_object(groups) && json_object_size(groups) > 0;
    const char *key;
    json_t *g;
    if (ok) {
        json_object_foreach(groups, key, g) {
            json_t *w = get(g, "weights");
            json_t *bits = w ? get(w, "num_bits") : NULL;
            json_t *type = w ? get(w, "type") : NULL;
            json_t *gs = w ? get(w, "group_size") : NULL;
            json_t *act = json_is_object(g) ? get(g, "input_activations") : NULL;
            json_t *gf = json_is_object(g) ? get(g, "format") : NULL;
            if (gf && (!json_is_string(gf) || strcmp(json_string_value(gf), "mxfp4-pack-quantized"))) ok = false;
            if (!json_is_integer(bits) || json_integer_value(bits) != 4 || !json_is_string(type) ||
                strcmp(json_string_value(type), "float") || !json_is_integer(gs) || json_integer_value(gs) != 32 || act)
                ok = false;
        }
    }
    if (!ok)
        return k3_err(p->err, K3_ERR_UNSUPPORTED,
                      "%s: compressed-tensors config_groups other than MXFP4 (4-bit "
                      "float weights, group size 32, no quantized activations) are not "
                      "supported",
                      p->src);
    cfg->experts_mxfp4 = true;
    return K3_OK;
}

/* rope_parameters, as transformers 5.x writes it into every config it saves:
 * {"rope_theta": T, "rope_type": "default"}. k3's MLA is NoPE, so plain RoPE
 * with any theta changes nothing; a scaled type (yarn, linear, dynamic,
 * llama3, ...) or any other field would, and is refused. */
static k3_status check_rope_parameters(const parser *p, json_t *tc) {
    json_t *rp = get(tc, "rope_parameters");
    if (!rp) return K3_OK;
    if (!json_is_object(rp)) return bad_type(p, "rope_parameters", "an object");
    const char *key;
    json_t *v;
    json_object_foreach(rp, key, v) {
        if (!strcmp(key, "rope_theta")) {
            if (!json_is_number(v)) return bad_type(p, "rope_parameters.rope_theta", "a number");
        } else if (!strcmp(key, "rope_type")) {
            if (!json_is_string(v) || strcmp(json_string_value(v), "default"))
                return k3_err(p->err, K3_ERR_UNSUPPORTED,
                              "%s: rope_parameters.rope_type is not \"default\": scaled RoPE "
                              "is not supported (k3 runs NoPE MLA only)",
                              p->src);
        } else {
            return k3_err(p->err, K3_ERR_UNSUPPORTED,
                          "%s: rope_parameters.%s is not supported (k3 runs NoPE MLA only; "
                          "only rope_theta and rope_type \"default\" are accepted)",
                          p->src, key);
        }
    }
    return K3_OK;
}

/* linear_attn_config: KDA sizes, gate form and the 1-based layer lists. */
static k3_status parse_linear(const parser *p, json_t *la, k3_config *cfg) {
    parser pl = *p;
    char where[96];
    snprintf(where, sizeof where, "%s.linear_attn_config", p->where);
    pl.where = where;
    if (!json_is_object(la)) return bad_type(p, "linear_attn_config", "an object");
    const char *key;
    json_t *v;
    json_object_foreach(la, key, v) {
        if (!IN_LIST(key, linear_keys))
            return k3_err(p->err, K3_ERR_UNSUPPORTED, "%s: unknown field '%s' in %s", p->src, key, where);
    }
    bool neg = false;
    K3_TRY(get_bool(&pl, la, "allow_neg_eigval", false, &neg));
    if (neg)
        return k3_err(p->err, K3_ERR_UNSUPPORTED, "%s: %s.allow_neg_eigval = true is not supported", p->src, where);

    int n = cfg->n_layers;
    bool kda[K3_MAX_LAYERS] = {0}, full[K3_MAX_LAYERS] = {0};
    K3_TRY(parse_layer_list(&pl, la, "kda_layers", n, kda));
    if (get(la, "full_attn_layers")) {
        K3_TRY(parse_layer_list(&pl, la, "full_attn_layers", n, full));
    } else {
        for (int i = 0; i < n; i++) full[i] = !kda[i]; /* the complement */
    }
    int n_kda = 0;
    for (int i = 0; i < n; i++) {
        if (kda[i] && full[i])
            return k3_err(p->err, K3_ERR_FORMAT, "%s: layer %d is in both kda_layers and full_attn_layers of %s",
                          p->src, i + 1, where);
        if (!kda[i] && !full[i])
            return k3_err(p->err, K3_ERR_FORMAT, "%s: layer %d is in neither kda_layers nor full_attn_layers of %s",
                          p->src, i + 1, where);
        cfg->layer_kind[i] = kda[i] ? K3_LAYER_KDA : K3_LAYER_MLA;
        n_kda += kda[i];
    }
    if (n_kda == 0) return K3_OK; /* sizes unused */

    K3_TRY(get_i32(&pl, la, "num_heads", true, 0, 1, 1 << 16, &cfg->kda_heads));
    /* the scalar KDA recurrence keeps a value row on the stack (kda.c) */
    K3_TRY(get_i32(&pl, la, "head_dim", true, 0, 1, K3_MAX_KDA_HEAD_DIM, &cfg->kda_head_dim));
    K3_TRY(get_i32(&pl, la, "short_conv_kernel_size", true, 0, 1, 64, &cfg->conv_size));
    double lb;
    cfg->kda_has_lower_bound = get(la, "gate_lower_bound") != NULL;
    K3_TRY(get_num(&pl, la, "gate_lower_bound", 0.0, &lb));
    if (cfg->kda_has_lower_bound && !(lb < 0))
        return k3_err(p->err, K3_ERR_FORMAT, "%s: %s.gate_lower_bound = %g must be negative", p->src, where, lb);
    cfg->kda_lower_bound = (float)lb;
    K3_TRY(get_bool(&pl, la, "use_full_rank_gate", false, &cfg->kda_full_rank_gate));
    cfg->kda_gate_rank = cfg->kda_full_rank_gate ? 0 : cfg->kda_head_dim;
    return K3_OK;
}

/* transformers writes the layer map twice: layer_types ("linear_attention" /
 * "full_attention", 0-based) next to linear_attn_config, and flat linear_*
 * copies of its sizes. Refuse a config whose copies disagree. */
static k3_status check_layer_types(const parser *p, json_t *tc, const k3_config *cfg, json_t *la) {
    json_t *lt = get(tc, "layer_types");
    if (lt) {
        if (!json_is_array(lt) || (int)json_array_size(lt) != cfg->n_layers)
            return k3_err(p->err, K3_ERR_FORMAT, "%s: layer_types must list %d entries", p->src, cfg->n_layers);
        for (int i = 0; i < cfg->n_layers; i++) {
            const char *t = json_string_value(json_array_get(lt, (size_t)i));
            const bool lin = t && !strcmp(t, "linear_attention"), full = t && !strcmp(t, "full_attention");
            if (!lin && !full)
                return k3_err(p->err, K3_ERR_FORMAT,
                              "%s: layer_types[%d] must be \"linear_attention\" or \"full_attention\"", p->src, i);
            if (lin != (cfg->layer_kind[i] == K3_LAYER_KDA))
                return k3_err(p->err, K3_ERR_FORMAT, "%s: layer_types[%d] = \"%s\" disagrees with linear_attn_config",
                              p->src, i, t);
        }
    }
    const struct {
        const char *key;
        int32_t want;
    } dup[] = {
        {"linear_num_heads", cfg->kda_heads},
        {"linear_head_dim", cfg->kda_head_dim},
        {"linear_conv_kernel_dim", cfg->conv_size},
    };
    for (size_t i = 0; la && i < sizeof dup / sizeof dup[0]; i++) {
        json_t *v = get(tc, dup[i].key);
        if (v && (!json_is_integer(v) || json_integer_value(v) != dup[i].want))
            return k3_err(p->err, K3_ERR_FORMAT, "%s: %s disagrees with linear_attn_config (%d)", p->src, dup[i].key,
                          dup[i].want);
    }
    return K3_OK;
}

/* ---- the parser --------------------------------------------------------- */

static k3_status parse_root(k3_config *cfg, json_t *root, const char *src, k3_error *err) {
    if (!json_is_object(root)) return k3_err(err, K3_ERR_FORMAT, "%s: the top level is not a JSON object", src);

    json_t *tc = get(root, "text_config");
    bool nested = tc != NULL;
    if (nested && !json_is_object(tc)) return k3_err(err, K3_ERR_FORMAT, "%s: text_config is not an object", src);
    if (!nested) tc = root;
    parser p = {src, nested ? "text_config" : "the config", err};
    parser pr = {src, "the config", err}; /* root-level fields */

    /* Unknown keys could change the math: refuse them. */
    const char *key;
    json_t *val;
    json_object_foreach(tc, key, val) {
        if (IN_LIST(key, text_keys)) continue;
        if (!nested && IN_LIST(key, root_keys)) continue;
        return k3_err(err, K3_ERR_UNSUPPORTED, "%s: unknown field '%s' in %s", src, key,
                      nested ? "text_config" : "the config");
    }

    /* Family. */
    const char *root_type = NULL, *text_type = NULL;
    K3_TRY(get_str(&pr, root, "model_type", NULL, &root_type));
    K3_TRY(get_str(&p, tc, "model_type", root_type, &text_type));
    if (!text_type) return missing(&p, "model_type");
    if (strcmp(text_type, "kimi_linear") && strcmp(text_type, "kimi_k3"))
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "%s: model_type '%s' is not supported "
                      "(kimi_k3 or kimi_linear)",
                      src, text_type);
    bool root_k3 = root_type && !strncmp(root_type, "kimi_k3", 7);
    cfg->is_k3 = root_k3 || !strcmp(text_type, "kimi_k3") || get(tc, "attn_res_block_size");
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", cfg->is_k3 ? "kimi_k3" : "kimi_linear");
    bool k3 = cfg->is_k3;

    /* Sizes. */
    const int64_t big = (int64_t)1 << 40;
    K3_TRY(get_int(&p, tc, "vocab_size", true, 0, 1, INT32_MAX, &cfg->vocab_size));
    K3_TRY(get_int(&p, tc, "hidden_size", true, 0, 1, 1 << 20, &cfg->hidden_size));
    K3_TRY(get_i32(&p, tc, "num_hidden_layers", true, 0, 1, K3_MAX_LAYERS, &cfg->n_layers));
    int64_t mml;
    K3_TRY(get_int(&p, tc, "model_max_length", false, 1048576, 1, big, &mml));
    K3_TRY(get_int(&p, tc, "max_position_embeddings", false, mml, 1, big, &cfg->max_positions));
    double eps;
    K3_TRY(get_num(&p, tc, "rms_norm_eps", 1e-5, &eps));
    if (!(eps > 0 && eps < 1)) return k3_err(err, K3_ERR_FORMAT, "%s: rms_norm_eps = %g must be in (0, 1)", src, eps);
    cfg->rms_eps = (float)eps;
    bool tie_root;
    K3_TRY(get_bool(&pr, root, "tie_word_embeddings", false, &tie_root));
    K3_TRY(get_bool(&p, tc, "tie_word_embeddings", tie_root, &cfg->tie_word_embeddings));

    /* Special ids: the root wins, text_config is the fallback. */
    cfg->bos_id = cfg->eos_id = cfg->pad_id = -1;
    K3_TRY(get_token_id(&p, tc, "bos_token_id", &cfg->bos_id));
    K3_TRY(get_token_id(&p, tc, "eos_token_id", &cfg->eos_id));
    K3_TRY(get_token_id(&p, tc, "pad_token_id", &cfg->pad_id));
    if (nested) {
        K3_TRY(get_token_id(&pr, root, "bos_token_id", &cfg->bos_id));
        K3_TRY(get_token_id(&pr, root, "eos_token_id", &cfg->eos_id));
        K3_TRY(get_token_id(&pr, root, "pad_token_id", &cfg->pad_id));
    }

    /* Layer kinds: KDA / MLA from linear_attn_config (absent = all MLA). */
    json_t *la = get(tc, "linear_attn_config");
    for (int i = 0; i < cfg->n_layers; i++) cfg->layer_kind[i] = K3_LAYER_MLA;
    if (la) K3_TRY(parse_linear(&p, la, cfg));
    K3_TRY(check_layer_types(&p, tc, cfg, la));
    int n_full = 0;
    for (int i = 0; i < cfg->n_layers; i++) n_full += cfg->layer_kind[i] != K3_LAYER_KDA;

    /* MLA. */
    if (n_full > 0) {
        bool nope;
        /* both families are NoPE; transformers' KimiLinear has no other mode */
        K3_TRY(get_bool(&p, tc, "mla_use_nope", true, &nope));
        if (!nope) return k3_err(err, K3_ERR_UNSUPPORTED, "%s: mla_use_nope is false: RoPE MLA not supported", src);
        K3_TRY(check_rope_parameters(&p, tc));
        json_t *rs = json_object_get(tc, "rope_scaling");
        if (rs && !json_is_null(rs))
            return k3_err(err, K3_ERR_UNSUPPORTED, "%s: rope_scaling is set, but k3 runs NoPE MLA only", src);
        bool bias;
        K3_TRY(get_bool(&p, tc, "attention_bias", false, &bias));
        if (bias) return k3_err(err, K3_ERR_UNSUPPORTED, "%s: attention_bias = true is not supported", src);
        /* per-head log-sum-exp rows live on the stack in forward.c: K3_MAX_HEADS */
        K3_TRY(get_i32(&p, tc, "num_attention_heads", true, 0, 1, K3_MAX_HEADS, &cfg->n_heads));
        K3_TRY(get_i32(&p, tc, "q_lora_rank", false, 0, 0, 1 << 20, &cfg->q_lora_rank));
        K3_TRY(get_i32(&p, tc, "kv_lora_rank", true, 0, 1, 1 << 20, &cfg->kv_lora_rank));
        K3_TRY(get_i32(&p, tc, "qk_nope_head_dim", true, 0, 1, 1 << 16, &cfg->qk_nope_dim));
        K3_TRY(get_i32(&p, tc, "qk_rope_head_dim", true, 0, 0, 1 << 16, &cfg->qk_rope_dim));
        K3_TRY(get_i32(&p, tc, "v_head_dim", true, 0, 1, 1 << 16, &cfg->v_head_dim));
        K3_TRY(get_bool(&p, tc, "mla_use_output_gate", k3, &cfg->mla_use_output_gate));
        json_t *qkh = get(tc, "qk_head_dim");
        if (qkh && (!json_is_integer(qkh) || json_integer_value(qkh) != cfg->qk_nope_dim + cfg->qk_rope_dim))
            return k3_err(err, K3_ERR_FORMAT, "%s: qk_head_dim must equal qk_nope_head_dim + qk_rope_head_dim (%d)",
                          src, cfg->qk_nope_dim + cfg->qk_rope_dim);
    }

    /* DSA: the index_* fields turn full-attention layers into DSA layers. */
    bool has_idx =
        get(tc, "index_n_heads") || get(tc, "index_head_dim") || get(tc, "index_topk") || get(tc, "index_layers");
    if (has_idx) {
        K3_TRY(get_i32(&p, tc, "index_n_heads", true, 0, 1, 1 << 16, &cfg->index_n_heads));
        K3_TRY(get_i32(&p, tc, "index_head_dim", true, 0, 1, 1 << 16, &cfg->index_head_dim));
        K3_TRY(get_i32(&p, tc, "index_topk", true, 0, 1, INT32_MAX, &cfg->index_topk));
        if (n_full > 0 && cfg->q_lora_rank == 0)
            return k3_err(err, K3_ERR_UNSUPPORTED, "%s: a DSA indexer needs q_lora_rank > 0 (it reads the q latent)",
                          src);
        bool sel[K3_MAX_LAYERS] = {0};
        if (get(tc, "index_layers")) {
            K3_TRY(parse_layer_list(&p, tc, "index_layers", cfg->n_layers, sel));
            for (int i = 0; i < cfg->n_layers; i++)
                if (sel[i] && cfg->layer_kind[i] != K3_LAYER_MLA)
                    return k3_err(err, K3_ERR_FORMAT,
                                  "%s: index_layers names layer %d, which is not a "
                                  "full-attention layer",
                                  src, i + 1);
        } else {
            for (int i = 0; i < cfg->n_layers; i++) sel[i] = cfg->layer_kind[i] == K3_LAYER_MLA;
        }
        for (int i = 0; i < cfg->n_layers; i++)
            if (sel[i]) cfg->layer_kind[i] = K3_LAYER_DSA;
    }

    /* AttnRes. */
    K3_TRY(
        get_i32(&p, tc, "attn_res_block_size", false, root_k3 ? 12 : 0, 1, K3_MAX_LAYERS, &cfg->attn_res_block_size));

    /* Activation. */
    const char *act;
    K3_TRY(get_str(&p, tc, "hidden_act", k3 ? "situ" : "silu", &act));
    if (!strcmp(act, "situ")) cfg->act = K3_ACT_SITU;
    else if (!strcmp(act, "silu")) cfg->act = K3_ACT_SILU;
    else
        return k3_err(err, K3_ERR_UNSUPPORTED,
                      "%s: hidden_act '%s' is not supported "
                      "(situ or silu)",
                      src, act);
    if (cfg->act == K3_ACT_SITU) {
        /* Official _get_situ_activation_params: beta = config beta or 1.0
         * (absent, null and 0 all give 1.0); linear beta absent or null = no
         * linear part (plain u, 0 here), for both families. */
        double b1, b2;
        K3_TRY(get_num(&p, tc, "activation_situ_beta", 1.0, &b1));
        if (b1 == 0) b1 = 1.0;
        K3_TRY(get_num(&p, tc, "activation_situ_linear_beta", 0.0, &b2));
        if (!(b1 > 0) || b2 < 0)
            return k3_err(err, K3_ERR_FORMAT,
                          "%s: activation_situ_beta (%g) must be > 0 and "
                          "activation_situ_linear_beta (%g) >= 0",
                          src, b1, b2);
        cfg->situ_beta = (float)b1;
        cfg->situ_linear_beta = (float)b2;
    }

    /* Quantization: text_config first, then the root. */
    json_t *q = get(tc, "quantization_config");
    if (!q && nested) q = get(root, "quantization_config");
    if (q) K3_TRY(parse_quant(&p, q, cfg));

    /* FFN and MoE. */
    K3_TRY(get_i32(&p, tc, "num_experts", false, 0, 0, 1 << 20, &cfg->n_experts));
    K3_TRY(get_i32(&p, tc, "first_k_dense_replace", false, 1, 0, cfg->n_layers, &cfg->first_k_dense));
    K3_TRY(get_i32(&p, tc, "moe_layer_freq", false, 1, 1, K3_MAX_LAYERS, &cfg->moe_layer_freq));
    int n_dense = 0, n_moe = 0;
    json_t *mlt = get(tc, "mlp_layer_types"); /* transformers: wins when present */
    if (mlt && (!json_is_array(mlt) || (int)json_array_size(mlt) != cfg->n_layers))
        return k3_err(err, K3_ERR_FORMAT, "%s: mlp_layer_types must list %d entries", src, cfg->n_layers);
    for (int i = 0; i < cfg->n_layers; i++) {
        if (mlt) {
            const char *t = json_string_value(json_array_get(mlt, (size_t)i));
            if (!t || (strcmp(t, "dense") && strcmp(t, "sparse")))
                return k3_err(err, K3_ERR_FORMAT, "%s: mlp_layer_types[%d] must be \"dense\" or \"sparse\"", src, i);
            cfg->layer_moe[i] = !strcmp(t, "sparse");
            if (cfg->layer_moe[i] && cfg->n_experts == 0)
                return k3_err(err, K3_ERR_FORMAT, "%s: mlp_layer_types[%d] is sparse but num_experts is 0", src, i);
        } else cfg->layer_moe[i] = cfg->n_experts > 0 && i >= cfg->first_k_dense && i % cfg->moe_layer_freq == 0;
        n_moe += cfg->layer_moe[i];
        n_dense += !cfg->layer_moe[i];
    }
    if (n_dense > 0) K3_TRY(get_int(&p, tc, "intermediate_size", true, 0, 1, big, &cfg->intermediate_size));
    if (n_moe > 0) {
        int E = cfg->n_experts;
        K3_TRY(get_i32(&p, tc, "num_experts_per_token", true, 0, 1, E, &cfg->n_experts_per_tok));
        K3_TRY(get_i32(&p, tc, "num_shared_experts", false, k3 ? 2 : 1, 0, 1024, &cfg->n_shared_experts));
        K3_TRY(get_int(&p, tc, "moe_intermediate_size", true, 0, 1, big, &cfg->moe_intermediate));
        cfg->latent_moe = get(tc, "routed_expert_hidden_size") != NULL;
        K3_TRY(get_int(&p, tc, "routed_expert_hidden_size", false, cfg->hidden_size, 1, big, &cfg->expert_dim));
        K3_TRY(get_bool(&p, tc, "latent_moe_use_norm", k3, &cfg->latent_moe_norm));
        if (!cfg->latent_moe) cfg->latent_moe_norm = false;
        const char *router;
        K3_TRY(get_str(&p, tc, "moe_router_activation_func", "sigmoid", &router));
        if (!strcmp(router, "sigmoid")) cfg->router_sigmoid = true;
        else if (!strcmp(router, "softmax")) cfg->router_sigmoid = false;
        else
            return k3_err(err, K3_ERR_UNSUPPORTED, "%s: moe_router_activation_func '%s' is not supported", src, router);
        const char *topk_method;
        K3_TRY(get_str(&p, tc, "topk_method", "noaux_tc", &topk_method));
        if (strcmp(topk_method, "noaux_tc") && strcmp(topk_method, "greedy"))
            return k3_err(err, K3_ERR_UNSUPPORTED, "%s: topk_method '%s' is not supported", src, topk_method);
        K3_TRY(get_bool(&p, tc, "moe_renormalize", true, &cfg->moe_renormalize));
        double scale;
        /* defaults as in each family's config class (KimiLinear: 2.446) */
        K3_TRY(get_num(&p, tc, "routed_scaling_factor", k3 ? 1.0 : 2.446, &scale));
        if (!(scale > 0)) return k3_err(err, K3_ERR_FORMAT, "%s: routed_scaling_factor = %g must be > 0", src, scale);
        cfg->routed_scaling = (float)scale;
        /* the router ranks groups in fixed arrays (moe.c): at most K3_MOE_MAX_GROUPS */
        K3_TRY(get_i32(&p, tc, "num_expert_group", false, 1, 1, E < K3_MOE_MAX_GROUPS ? E : K3_MOE_MAX_GROUPS,
                       &cfg->n_expert_groups));
        K3_TRY(get_i32(&p, tc, "topk_group", false, 1, 1, cfg->n_expert_groups, &cfg->topk_groups));
        if (E % cfg->n_expert_groups)
            return k3_err(err, K3_ERR_FORMAT, "%s: num_experts (%d) is not a multiple of num_expert_group (%d)", src, E,
                          cfg->n_expert_groups);
        if (cfg->n_expert_groups > cfg->topk_groups &&
            (int64_t)cfg->topk_groups * (E / cfg->n_expert_groups) < cfg->n_experts_per_tok)
            return k3_err(err, K3_ERR_FORMAT, "%s: topk_group %d x %d experts per group < num_experts_per_token %d",
                          src, cfg->topk_groups, E / cfg->n_expert_groups, cfg->n_experts_per_tok);
        if (cfg->experts_mxfp4 && (cfg->expert_dim % 32 || cfg->moe_intermediate % 32))
            return k3_err(err, K3_ERR_FORMAT,
                          "%s: MXFP4 experts need widths that are multiples of 32, got "
                          "expert input %lld and moe_intermediate_size %lld",
                          src, (long long)cfg->expert_dim, (long long)cfg->moe_intermediate);
    }
    return K3_OK;
}

k3_status k3_config_parse(k3_config *cfg, const char *json, size_t len, const char *src, k3_error *err) {
    memset(cfg, 0, sizeof *cfg);
    if (!src) src = "config.json";
    if (len > CONFIG_MAX_BYTES) return k3_err(err, K3_ERR_FORMAT, "%s: %zu bytes is over the 1 MB limit", src, len);
    if (k3_json_too_deep(json, len, CONFIG_MAX_DEPTH))
        return k3_err(err, K3_ERR_FORMAT, "%s: JSON nests deeper than %d levels", src, CONFIG_MAX_DEPTH);
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return k3_err(err, K3_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", src, je.line, je.column,
                      je.text);
    k3_status s = parse_root(cfg, root, src, err);
    json_decref(root);
    if (s != K3_OK) memset(cfg, 0, sizeof *cfg);
    return s;
}

k3_status k3_config_load(k3_config *cfg, const char *dir, k3_error *err) {
    char path[4096];
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path)
        return k3_err(err, K3_ERR_ARG, "checkpoint path too long: %s", dir);
    /* a regular file (a FIFO must not block), of at most 1 MB */
    char *buf;
    size_t n;
    k3_status s = k3_file_read(path, CONFIG_MAX_BYTES, "config.json", &buf, &n, err);
    if (s != K3_OK) return s;
    s = k3_config_parse(cfg, buf, n, path, err);
    free(buf);
    return s;
}
