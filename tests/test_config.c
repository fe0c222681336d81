/*
 * test_config.c -- config.json parsing: the real K3 config, the tiny config of
 * docs/model.md §6.1 (with and without the DSA index fields), a flat config, a
 * Kimi-Linear config, and the errors for missing, unknown and bad fields.
 */
#include "test.h"
#include "common/error.h"
#include "model/config.h"

#include <stdlib.h>
#include <string.h>

/* The tiny config of docs/model.md §6.1. */
static const char *tiny_json =
    "{\n"
    "  \"architectures\": [\"KimiK3ForConditionalGeneration\"], \"model_type\": \"kimi_k3\",\n"
    "  \"bos_token_id\": 163584, \"eos_token_id\": 163586, \"pad_token_id\": 163839,\n"
    "  \"tie_word_embeddings\": false,\n"
    "  \"text_config\": {\n"
    "    \"model_type\": \"kimi_linear\", \"architectures\": [\"KimiLinearForCausalLM\"],\n"
    "    \"vocab_size\": 1024, \"hidden_size\": 256, \"num_hidden_layers\": 8,\n"
    "    \"num_attention_heads\": 4, \"num_key_value_heads\": 4,\n"
    "    \"q_lora_rank\": 64, \"kv_lora_rank\": 64,\n"
    "    \"qk_nope_head_dim\": 32, \"qk_rope_head_dim\": 16, \"v_head_dim\": 32,\n"
    "    \"mla_use_nope\": true, \"mla_use_output_gate\": true,\n"
    "    \"linear_attn_config\": {\n"
    "      \"num_heads\": 4, \"head_dim\": 32, \"short_conv_kernel_size\": 4,\n"
    "      \"gate_lower_bound\": -5.0, \"use_full_rank_gate\": true,\n"
    "      \"kda_layers\": [1, 2, 3, 5, 6, 7], \"full_attn_layers\": [4, 8]\n"
    "    },\n"
    "    \"attn_res_block_size\": 3,\n"
    "    \"first_k_dense_replace\": 1, \"moe_layer_freq\": 1, \"intermediate_size\": 512,\n"
    "    \"num_experts\": 16, \"num_experts_per_token\": 4, \"num_shared_experts\": 2,\n"
    "    \"moe_intermediate_size\": 64, \"routed_expert_hidden_size\": 128,\n"
    "    \"latent_moe_use_norm\": true, \"moe_router_activation_func\": \"sigmoid\",\n"
    "    \"moe_renormalize\": true, \"routed_scaling_factor\": 1.0,\n"
    "    \"use_grouped_topk\": true, \"num_expert_group\": 1, \"topk_group\": 1, "
    "\"topk_method\": \"noaux_tc\",\n"
    "    \"hidden_act\": \"situ\", \"activation_situ_beta\": 4.0, "
    "\"activation_situ_linear_beta\": 25.0,\n"
    "    \"rms_norm_eps\": 1e-05, \"max_position_embeddings\": 4096, "
    "\"num_nextn_predict_layers\": 0,\n"
    "    \"tie_word_embeddings\": false,\n"
    "    \"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": "
    "\"mxfp4-pack-quantized\",\n"
    "      \"config_groups\": {\"group_0\": {\"weights\": {\"num_bits\": 4, \"group_size\": 32, "
    "\"type\": \"float\"}}}}\n"
    "  }\n"
    "}\n";

/* A copy of s with the first occurrence of from replaced by to (caller frees). */
static char *subst(const char *s, const char *from, const char *to) {
    const char *at = strstr(s, from);
    if (!at) return NULL;
    size_t a = (size_t)(at - s), lf = strlen(from), lt = strlen(to), ls = strlen(s);
    char *r = malloc(ls - lf + lt + 1);
    memcpy(r, s, a);
    memcpy(r + a, to, lt);
    memcpy(r + a + lt, at + lf, ls - a - lf + 1);
    return r;
}

static k3_status parse(const char *json, k3_config *c, k3_error *e) {
    k3_err_clear(e);
    return k3_config_parse(c, json, strlen(json), "config.json", e);
}

/* Parses tiny_json with one substitution; returns the status. */
static k3_status parse_sub(const char *from, const char *to, k3_config *c, k3_error *e) {
    char *j = subst(tiny_json, from, to);
    if (!j) {
        snprintf(e->msg, sizeof e->msg, "test bug: '%s' not in the tiny config", from);
        return (k3_status)-1;
    }
    k3_status s = parse(j, c, e);
    free(j);
    return s;
}

#define EXPECT_ERR(status_, needle, from, to) \
    do { \
        k3_config c_; \
        k3_error e_; \
        k3_status s_ = parse_sub(from, to, &c_, &e_); \
        CHECKF(s_ == (status_), "status %d (%s), want %d", (int)s_, e_.msg, (int)(status_)); \
        CHECKF(strstr(e_.msg, needle), "message '%s' lacks '%s'", e_.msg, needle); \
    } while (0)

/* ---- the real K3 config ------------------------------------------------- */

K3_TEST(config_real_k3) {
    char kda[512] = "", full[256] = "";
    size_t nk = 0, nf = 0;
    for (int l = 1; l <= 93; l++) {
        bool is_full = l % 4 == 0 || l == 93;
        char *b = is_full ? full : kda;
        size_t *n = is_full ? &nf : &nk;
        *n += (size_t)snprintf(b + *n, (is_full ? sizeof full : sizeof kda) - *n, "%s%d", *n ? ", " : "", l);
    }
    static char json[8192];
    snprintf(json, sizeof json,
             "{\"architectures\": [\"KimiK3ForConditionalGeneration\"],"
             " \"model_type\": \"kimi_k3\", \"auto_map\": {\"AutoConfig\": "
             "\"configuration_kimi_k3.KimiK3Config\"},"
             " \"bos_token_id\": 163584, \"eos_token_id\": 163586, \"pad_token_id\": 163839,"
             " \"media_placeholder_token_id\": 163605,"
             " \"image_placeholder\": \"<|kimi_image_placeholder|>\","
             " \"tie_word_embeddings\": false, \"dtype\": \"bfloat16\","
             " \"transformers_version\": \"4.57.1\","
             " \"vision_config\": {\"patch_size\": 14, \"vt_num_hidden_layers\": 27,"
             "   \"vt_hidden_size\": 1024, \"mm_projector_type\": \"patchmergerv2\"},"
             " \"text_config\": {"
             "  \"model_type\": \"kimi_linear\", \"architectures\": [\"KimiLinearForCausalLM\"],"
             "  \"vocab_size\": 163840, \"hidden_size\": 7168, \"num_hidden_layers\": 93,"
             "  \"num_attention_heads\": 96, \"num_key_value_heads\": 96,"
             "  \"q_lora_rank\": 1536, \"kv_lora_rank\": 512,"
             "  \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64, \"v_head_dim\": 128,"
             "  \"mla_use_nope\": true, \"mla_use_output_gate\": true,"
             "  \"linear_attn_config\": {\"num_heads\": 96, \"head_dim\": 128,"
             "    \"short_conv_kernel_size\": 4, \"gate_lower_bound\": -5.0,"
             "    \"use_full_rank_gate\": true, \"kda_layers\": [%s], \"full_attn_layers\": [%s]},"
             "  \"attn_res_block_size\": 12, \"first_k_dense_replace\": 1, \"moe_layer_freq\": 1,"
             "  \"intermediate_size\": 33792, \"num_experts\": 896, \"num_experts_per_token\": 16,"
             "  \"num_shared_experts\": 2, \"moe_intermediate_size\": 3072,"
             "  \"routed_expert_hidden_size\": 3584, \"latent_moe_use_norm\": true,"
             "  \"moe_router_activation_func\": \"sigmoid\", \"moe_renormalize\": true,"
             "  \"routed_scaling_factor\": 1.0, \"use_grouped_topk\": true,"
             "  \"num_expert_group\": 1, \"topk_group\": 1, \"topk_method\": \"noaux_tc\","
             "  \"hidden_act\": \"situ\", \"activation_situ_beta\": 4.0,"
             "  \"activation_situ_linear_beta\": 25.0, \"rms_norm_eps\": 1e-05,"
             "  \"max_position_embeddings\": 1048576, \"num_nextn_predict_layers\": 0,"
             "  \"tie_word_embeddings\": false, \"use_cache\": true, \"dtype\": \"bfloat16\","
             "  \"quantization_config\": {\"quant_method\": \"compressed-tensors\","
             "    \"format\": \"mxfp4-pack-quantized\", \"config_groups\": {\"group_0\": {"
             "      \"weights\": {\"num_bits\": 4, \"group_size\": 32, \"strategy\": \"group\","
             "        \"type\": \"float\", \"scale_dtype\": \"uint8\"},"
             "      \"input_activations\": null, \"targets\": [\"Linear\"]}},"
             "    \"ignore\": [\"re:.*self_attn.*\", \"re:.*shared_experts.*\", \"lm_head\"]}"
             " }}",
             kda, full);
    k3_config c;
    k3_error e;
    k3_status s = parse(json, &c, &e);
    REQUIREF(s == K3_OK, "%s", e.msg);
    CHECK(c.is_k3);
    CHECK(!strcmp(c.model_type, "kimi_k3"));
    CHECK(c.vocab_size == 163840 && c.hidden_size == 7168 && c.n_layers == 93);
    CHECK(c.n_heads == 96 && c.q_lora_rank == 1536 && c.kv_lora_rank == 512);
    CHECK(c.qk_nope_dim == 128 && c.qk_rope_dim == 64 && c.v_head_dim == 128);
    CHECK(c.mla_use_output_gate);
    CHECK(c.kda_heads == 96 && c.kda_head_dim == 128 && c.conv_size == 4);
    CHECK(c.kda_has_lower_bound && c.kda_lower_bound == -5.0f);
    CHECK(c.kda_full_rank_gate && c.kda_gate_rank == 0);
    CHECK(c.attn_res_block_size == 12);
    CHECK(c.first_k_dense == 1 && c.moe_layer_freq == 1 && c.intermediate_size == 33792);
    CHECK(c.n_experts == 896 && c.n_experts_per_tok == 16 && c.n_shared_experts == 2);
    CHECK(c.moe_intermediate == 3072 && c.expert_dim == 3584 && c.latent_moe);
    CHECK(c.latent_moe_norm && c.router_sigmoid && c.moe_renormalize);
    CHECK(c.routed_scaling == 1.0f && c.n_expert_groups == 1 && c.topk_groups == 1);
    CHECK(c.experts_mxfp4);
    CHECK(c.act == K3_ACT_SITU && c.situ_beta == 4.0f && c.situ_linear_beta == 25.0f);
    CHECK(fabsf(c.rms_eps - 1e-5f) < 1e-12f);
    CHECK(c.max_positions == 1048576 && !c.tie_word_embeddings);
    CHECK(c.bos_id == 163584 && c.eos_id == 163586 && c.pad_id == 163839);
    CHECK(c.index_n_heads == 0);

    int n_kda = 0, n_mla = 0, n_bank = 0, n_moe = 0;
    for (int i = 0; i < 93; i++) {
        n_kda += c.layer_kind[i] == K3_LAYER_KDA;
        n_mla += c.layer_kind[i] == K3_LAYER_MLA;
        n_moe += c.layer_moe[i];
        bool want_mla = i % 4 == 3 || i == 92;
        CHECKF(c.layer_kind[i] == (want_mla ? K3_LAYER_MLA : K3_LAYER_KDA), "layer %d", i);
        if (k3_config_is_bank_layer(&c, i)) {
            n_bank++;
            CHECKF(i % 12 == 0 && c.layer_kind[i] == K3_LAYER_KDA, "bank layer %d", i);
        }
    }
    CHECK(n_kda == 69 && n_mla == 24);
    CHECK(c.layer_kind[91] == K3_LAYER_MLA && c.layer_kind[92] == K3_LAYER_MLA);
    CHECK(c.layer_kind[0] == K3_LAYER_KDA && c.layer_kind[3] == K3_LAYER_MLA);
    CHECK(n_bank == 8 && k3_config_is_bank_layer(&c, 84) && !k3_config_is_bank_layer(&c, 90));
    CHECK(n_moe == 92 && !c.layer_moe[0] && c.layer_moe[1] && c.layer_moe[92]);
}

/* ---- the tiny config, with and without DSA -------------------------------- */

K3_TEST(config_tiny) {
    k3_config c;
    k3_error e;
    REQUIREF(parse(tiny_json, &c, &e) == K3_OK, "%s", e.msg);
    CHECK(c.is_k3 && c.n_layers == 8 && c.hidden_size == 256 && c.vocab_size == 1024);
    static const uint8_t kinds[8] = {0, 0, 0, 1, 0, 0, 0, 1};
    for (int i = 0; i < 8; i++) CHECKF(c.layer_kind[i] == kinds[i], "layer %d", i);
    CHECK(k3_config_is_bank_layer(&c, 0) && k3_config_is_bank_layer(&c, 3) && k3_config_is_bank_layer(&c, 6) &&
          !k3_config_is_bank_layer(&c, 7));
    CHECK(c.experts_mxfp4 && c.expert_dim == 128 && c.moe_intermediate == 64);
    CHECK(c.max_positions == 4096 && c.index_n_heads == 0);
}

K3_TEST(config_tiny_dsa) {
    k3_config c;
    k3_error e;
    k3_status s = parse_sub("\"attn_res_block_size\": 3,",
                            "\"attn_res_block_size\": 3, \"index_n_heads\": 2, "
                            "\"index_head_dim\": 32, \"index_topk\": 8,",
                            &c, &e);
    REQUIREF(s == K3_OK, "%s", e.msg);
    CHECK(c.index_n_heads == 2 && c.index_head_dim == 32 && c.index_topk == 8);
    CHECK(c.layer_kind[3] == K3_LAYER_DSA && c.layer_kind[7] == K3_LAYER_DSA);
    CHECK(c.layer_kind[0] == K3_LAYER_KDA);

    /* index_layers restricts the indexer to some full-attention layers. */
    s = parse_sub("\"attn_res_block_size\": 3,",
                  "\"attn_res_block_size\": 3, \"index_n_heads\": 2, \"index_head_dim\": 32, "
                  "\"index_topk\": 8, \"index_layers\": [8],",
                  &c, &e);
    REQUIREF(s == K3_OK, "%s", e.msg);
    CHECK(c.layer_kind[3] == K3_LAYER_MLA && c.layer_kind[7] == K3_LAYER_DSA);

    /* ... and only those. */
    EXPECT_ERR(K3_ERR_FORMAT, "index_layers", "\"attn_res_block_size\": 3,",
               "\"attn_res_block_size\": 3, \"index_n_heads\": 2, \"index_head_dim\": 32, "
               "\"index_topk\": 8, \"index_layers\": [2],");
    /* Partial index fields. */
    EXPECT_ERR(K3_ERR_FORMAT, "index_topk", "\"attn_res_block_size\": 3,",
               "\"attn_res_block_size\": 3, \"index_n_heads\": 2, \"index_head_dim\": 32,");
}

/* ---- flat and Kimi-Linear configs ---------------------------------------- */

K3_TEST(config_flat) {
    const char *json = "{\"model_type\": \"kimi_k3\", \"vocab_size\": 512, \"hidden_size\": 64,"
                       " \"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"q_lora_rank\": null,"
                       " \"kv_lora_rank\": 32, \"qk_nope_head_dim\": 16, \"qk_rope_head_dim\": 8,"
                       " \"v_head_dim\": 16, \"linear_attn_config\": {\"num_heads\": 2, \"head_dim\": 16,"
                       " \"short_conv_kernel_size\": 4, \"kda_layers\": [1], \"full_attn_layers\": [2]},"
                       " \"intermediate_size\": 128, \"num_experts\": 4, \"num_experts_per_token\": 2,"
                       " \"moe_intermediate_size\": 32, \"eos_token_id\": [7, 8], \"bos_token_id\": 1}";
    k3_config c;
    k3_error e;
    REQUIREF(parse(json, &c, &e) == K3_OK, "%s", e.msg);
    /* Root model_type kimi_k3: K3 defaults for what is absent; SiTU's are
     * the official _get_situ_activation_params ones (beta 1, no linear part). */
    CHECK(c.is_k3 && c.attn_res_block_size == 12 && c.act == K3_ACT_SITU);
    CHECK(c.situ_beta == 1.0f && c.situ_linear_beta == 0.0f);
    CHECK(c.q_lora_rank == 0);
    CHECK(c.mla_use_output_gate && c.n_shared_experts == 2 && c.first_k_dense == 1);
    CHECK(!c.latent_moe && c.expert_dim == 64 && !c.latent_moe_norm);
    CHECK(!c.kda_has_lower_bound && !c.kda_full_rank_gate && c.kda_gate_rank == 16);
    CHECK(c.eos_id == 7 && c.bos_id == 1 && c.pad_id == -1);
    CHECK(c.layer_kind[0] == K3_LAYER_KDA && c.layer_kind[1] == K3_LAYER_MLA);
    CHECK(!c.layer_moe[0] && c.layer_moe[1]);
    CHECK(!c.experts_mxfp4);
}

K3_TEST(config_kimi_linear) {
    /* Shaped like Kimi-Linear-48B-A3B's config.json, scaled down. */
    const char *json = "{\"architectures\": [\"KimiLinearForCausalLM\"], \"auto_map\": {},"
                       " \"model_type\": \"kimi_linear\", \"bos_token_id\": 163584, \"eos_token_id\": 163586,"
                       " \"pad_token_id\": 163839, \"dtype\": \"bfloat16\", \"first_k_dense_replace\": 1,"
                       " \"head_dim\": 72, \"hidden_act\": \"silu\", \"hidden_size\": 256,"
                       " \"initializer_range\": 0.02, \"intermediate_size\": 512, \"kv_lora_rank\": 64,"
                       " \"linear_attn_config\": {\"full_attn_layers\": [4], \"head_dim\": 32,"
                       "   \"kda_layers\": [1, 2, 3], \"num_heads\": 4, \"short_conv_kernel_size\": 4},"
                       " \"mla_use_nope\": true, \"model_max_length\": 1048576, \"moe_intermediate_size\": 64,"
                       " \"moe_layer_freq\": 1, \"moe_renormalize\": true,"
                       " \"moe_router_activation_func\": \"sigmoid\", \"num_attention_heads\": 4,"
                       " \"num_expert_group\": 1, \"num_experts\": 8, \"num_experts_per_token\": 2,"
                       " \"num_hidden_layers\": 4, \"num_key_value_heads\": 4, \"num_nextn_predict_layers\": 0,"
                       " \"num_shared_experts\": 1, \"q_lora_rank\": null, \"qk_nope_head_dim\": 32,"
                       " \"qk_rope_head_dim\": 16, \"rms_norm_eps\": 1e-06, \"rope_scaling\": null,"
                       " \"rope_theta\": 10000.0, \"routed_scaling_factor\": 2.446,"
                       " \"tie_word_embeddings\": false, \"topk_group\": 1, \"transformers_version\": \"4.56.0\","
                       " \"use_cache\": true, \"use_grouped_topk\": true, \"v_head_dim\": 32,"
                       " \"vocab_size\": 1024}";
    k3_config c;
    k3_error e;
    REQUIREF(parse(json, &c, &e) == K3_OK, "%s", e.msg);
    CHECK(!c.is_k3 && !strcmp(c.model_type, "kimi_linear"));
    CHECK(c.attn_res_block_size == 0 && c.act == K3_ACT_SILU);
    CHECK(!c.latent_moe && c.expert_dim == 256 && !c.latent_moe_norm);
    CHECK(!c.kda_has_lower_bound && !c.kda_full_rank_gate && c.kda_gate_rank == 32);
    CHECK(!c.mla_use_output_gate && c.q_lora_rank == 0);
    CHECK(c.n_shared_experts == 1 && fabsf(c.routed_scaling - 2.446f) < 1e-6f);
    CHECK(c.max_positions == 1048576 && fabsf(c.rms_eps - 1e-6f) < 1e-12f);
    CHECK(!c.layer_moe[0] && c.layer_moe[1] && c.layer_moe[3]);
    CHECK(c.layer_kind[3] == K3_LAYER_MLA && c.layer_kind[2] == K3_LAYER_KDA);
    CHECK(!c.experts_mxfp4);
}

/* ---- errors --------------------------------------------------------------- */

K3_TEST(config_missing_field) {
    EXPECT_ERR(K3_ERR_FORMAT, "'hidden_size'", "\"hidden_size\": 256,", "");
    EXPECT_ERR(K3_ERR_FORMAT, "'kv_lora_rank'", "\"kv_lora_rank\": 64,", "");
    EXPECT_ERR(K3_ERR_FORMAT, "'moe_intermediate_size'", "\"moe_intermediate_size\": 64,", "");
    EXPECT_ERR(K3_ERR_FORMAT, "'kda_layers'", "\"kda_layers\": [1, 2, 3, 5, 6, 7], ", "");
    EXPECT_ERR(K3_ERR_FORMAT, "'head_dim'", "\"head_dim\": 32,", "");
    /* A wrong type names the field too. */
    EXPECT_ERR(K3_ERR_FORMAT, "'vocab_size'", "\"vocab_size\": 1024", "\"vocab_size\": \"1024\"");
    EXPECT_ERR(K3_ERR_FORMAT, "'mla_use_nope'", "\"mla_use_nope\": true", "\"mla_use_nope\": 1");
}

K3_TEST(config_unknown_field) {
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "unknown field 'mla_rope_mode' in text_config", "\"mla_use_nope\": true,",
               "\"mla_use_nope\": true, \"mla_rope_mode\": 1,");
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "unknown field 'gate_upper_bound'", "\"gate_lower_bound\": -5.0,",
               "\"gate_lower_bound\": -5.0, \"gate_upper_bound\": 1,");
    /* Unknown root keys of a nested config belong to other parts (vision...). */
    k3_config c;
    k3_error e;
    CHECK(parse_sub("\"tie_word_embeddings\": false,", "\"tie_word_embeddings\": false, \"video_fps\": 2,", &c, &e) ==
          K3_OK);
}

K3_TEST(config_bad_layer_lists) {
    EXPECT_ERR(K3_ERR_FORMAT, "layer 9 is out of range", "\"full_attn_layers\": [4, 8]",
               "\"full_attn_layers\": [4, 8, 9]");
    EXPECT_ERR(K3_ERR_FORMAT, "layer 0 is out of range", "\"kda_layers\": [1,", "\"kda_layers\": [0, 1,");
    EXPECT_ERR(K3_ERR_FORMAT, "layer 4 is in both kda_layers and full_attn_layers", "\"kda_layers\": [1, 2, 3, 5,",
               "\"kda_layers\": [1, 2, 3, 4, 5,");
    EXPECT_ERR(K3_ERR_FORMAT, "layer 8 is in neither", "\"full_attn_layers\": [4, 8]", "\"full_attn_layers\": [4]");
    EXPECT_ERR(K3_ERR_FORMAT, "listed twice", "\"full_attn_layers\": [4, 8]", "\"full_attn_layers\": [4, 8, 8]");
    EXPECT_ERR(K3_ERR_FORMAT, "kda_layers", "\"kda_layers\": [1,", "\"kda_layers\": [\"1\",");
}

K3_TEST(config_bad_values) {
    EXPECT_ERR(K3_ERR_FORMAT, "'num_experts_per_token'", "\"num_experts_per_token\": 4",
               "\"num_experts_per_token\": 17");
    EXPECT_ERR(K3_ERR_FORMAT, "'hidden_size'", "\"hidden_size\": 256", "\"hidden_size\": -256");
    EXPECT_ERR(K3_ERR_FORMAT, "'num_hidden_layers'", "\"num_hidden_layers\": 8", "\"num_hidden_layers\": 0");
    EXPECT_ERR(K3_ERR_FORMAT, "multiples of 32", "\"moe_intermediate_size\": 64", "\"moe_intermediate_size\": 48");
    EXPECT_ERR(K3_ERR_FORMAT, "num_expert_group", "\"num_expert_group\": 1", "\"num_expert_group\": 3");
    EXPECT_ERR(K3_ERR_FORMAT, "rms_norm_eps", "\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": 0");
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "RoPE MLA not supported", "\"mla_use_nope\": true", "\"mla_use_nope\": false");
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "hidden_act 'gelu'", "\"hidden_act\": \"situ\"", "\"hidden_act\": \"gelu\"");
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "rope_scaling", "\"mla_use_nope\": true,",
               "\"mla_use_nope\": true, \"rope_scaling\": {\"type\": \"yarn\"},");
    EXPECT_ERR(K3_ERR_FORMAT, "duplicate", "\"hidden_size\": 256,", "\"hidden_size\": 256, \"hidden_size\": 128,");
}

K3_TEST(config_quantization) {
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "'fp8'", "\"quant_method\": \"compressed-tensors\"", "\"quant_method\": \"fp8\"");
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "'pack-quantized'", "\"format\": \"mxfp4-pack-quantized\"",
               "\"format\": \"pack-quantized\"");
    /* Without a format, the weight group description decides. */
    k3_config c;
    k3_error e;
    REQUIREF(parse_sub("\"format\": \"mxfp4-pack-quantized\",", "", &c, &e) == K3_OK, "%s", e.msg);
    CHECK(c.experts_mxfp4);
    char *j = subst(tiny_json, "\"format\": \"mxfp4-pack-quantized\",", "");
    REQUIRE(j);
    char *j2 = subst(j, "\"type\": \"float\"", "\"type\": \"int\"");
    free(j);
    REQUIRE(j2);
    CHECK(parse(j2, &c, &e) == K3_ERR_UNSUPPORTED);
    free(j2);
    /* No quantization_config: float experts. */
    j = subst(tiny_json, "\"quantization_config\": {", "\"quantization_config\": null, \"auto_map\": {");
    REQUIRE(j);
    REQUIREF(parse(j, &c, &e) == K3_OK, "%s", e.msg);
    CHECK(!c.experts_mxfp4);
    free(j);
}

K3_TEST(config_hostile) {
    k3_config c;
    k3_error e;
    /* Deep nesting is refused before jansson recurses. */
    char deep[400];
    size_t n = 0;
    n += (size_t)snprintf(deep, sizeof deep, "{\"text_config\":");
    for (int i = 0; i < 100; i++) deep[n++] = '[';
    for (int i = 0; i < 100; i++) deep[n++] = ']';
    deep[n++] = '}';
    deep[n] = 0;
    CHECK(parse(deep, &c, &e) == K3_ERR_FORMAT && strstr(e.msg, "deeper"));
    /* Over 1 MB. */
    size_t big = (1 << 20) + 16;
    char *b = malloc(big + 1);
    REQUIRE(b);
    memset(b, ' ', big);
    b[0] = '{';
    b[big - 1] = '}';
    b[big] = 0;
    k3_err_clear(&e);
    CHECK(k3_config_parse(&c, b, big, "config.json", &e) == K3_ERR_FORMAT);
    CHECK(strstr(e.msg, "1 MB") != NULL);
    free(b);
    /* Not JSON, not an object, truncated. */
    CHECK(parse("{\"text_config\": {", &c, &e) == K3_ERR_FORMAT);
    CHECK(parse("[1, 2]", &c, &e) == K3_ERR_FORMAT);
    CHECK(parse("", &c, &e) == K3_ERR_FORMAT);
    /* Unsupported family. */
    CHECK(parse("{\"model_type\": \"deepseek_v3\"}", &c, &e) == K3_ERR_UNSUPPORTED);
    CHECK(strstr(e.msg, "deepseek_v3") != NULL);
}

K3_TEST(config_load_missing) {
    k3_config c;
    k3_error e;
    k3_err_clear(&e);
    CHECK(k3_config_load(&c, "/nonexistent/k3-dir", &e) == K3_ERR_IO);
    CHECK(strstr(e.msg, "/nonexistent/k3-dir/config.json") != NULL);
}

/* ---- what the official config class and transformers 5.x save_pretrained
 * write ---------------------------------------------------------------------- */

K3_TEST(config_official_save_pretrained) {
    /* tests/models/official-tiny/config.json was written by the official
     * KimiK3Config through transformers 5.24 save_pretrained: it has
     * rope_parameters, rope_theta, head_dim, id2label, dtype null, ... */
    k3_config c;
    k3_error e = {0};
    REQUIREF(k3_config_load(&c, "tests/models/official-tiny", &e) == K3_OK, "%s", e.msg);
    CHECK(c.is_k3 && c.n_layers == 6 && c.situ_beta == 4.0f && c.situ_linear_beta == 25.0f);
}

K3_TEST(config_rope_parameters) {
    /* Inert for a NoPE model: accepted. */
    k3_config c;
    k3_error e;
    const char *from = "\"mla_use_nope\": true,";
    CHECKF(parse_sub(from,
                     "\"mla_use_nope\": true, \"rope_parameters\": {\"rope_theta\": "
                     "50000.0, \"rope_type\": \"default\"},",
                     &c, &e) == K3_OK,
           "%s", e.msg);
    CHECKF(parse_sub(from, "\"mla_use_nope\": true, \"rope_parameters\": null,", &c, &e) == K3_OK, "%s", e.msg);
    CHECKF(parse_sub(from, "\"mla_use_nope\": true, \"rope_parameters\": {\"rope_theta\": 1e6},", &c, &e) == K3_OK,
           "%s", e.msg);
    /* Would change the math of a RoPE model: refused. */
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "rope_type", from,
               "\"mla_use_nope\": true, \"rope_parameters\": {\"rope_theta\": 1e4, "
               "\"rope_type\": \"yarn\", \"factor\": 4.0},");
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "rope_parameters.factor", from,
               "\"mla_use_nope\": true, \"rope_parameters\": {\"factor\": 4.0, "
               "\"rope_type\": \"default\"},");
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "rope_parameters.partial_rotary_factor", from,
               "\"mla_use_nope\": true, \"rope_parameters\": {\"partial_rotary_factor\": 0.5},");
    EXPECT_ERR(K3_ERR_FORMAT, "rope_parameters", from, "\"mla_use_nope\": true, \"rope_parameters\": \"default\",");
    EXPECT_ERR(K3_ERR_UNSUPPORTED, "rope_scaling", from,
               "\"mla_use_nope\": true, \"rope_scaling\": {\"type\": \"yarn\"},");
}

K3_TEST(config_situ_defaults_official) {
    /* _get_situ_activation_params: beta = beta or 1.0, linear beta None =
     * no linear part; explicit values are kept. */
    k3_config c;
    k3_error e;
    const char *from = "\"activation_situ_beta\": 4.0, \"activation_situ_linear_beta\": 25.0,";
    REQUIREF(parse_sub(from, "", &c, &e) == K3_OK, "%s", e.msg);
    CHECK(c.situ_beta == 1.0f && c.situ_linear_beta == 0.0f);
    REQUIREF(parse_sub(from, "\"activation_situ_beta\": null, \"activation_situ_linear_beta\": null,", &c, &e) == K3_OK,
             "%s", e.msg);
    CHECK(c.situ_beta == 1.0f && c.situ_linear_beta == 0.0f);
    REQUIREF(parse_sub(from, "\"activation_situ_beta\": 0, \"activation_situ_linear_beta\": 3.0,", &c, &e) == K3_OK,
             "%s", e.msg);
    CHECK(c.situ_beta == 1.0f && c.situ_linear_beta == 3.0f);
    REQUIREF(parse_sub(from, "\"activation_situ_beta\": 2.5,", &c, &e) == K3_OK, "%s", e.msg);
    CHECK(c.situ_beta == 2.5f && c.situ_linear_beta == 0.0f);
}
