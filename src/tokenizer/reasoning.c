/*
 * reasoning.c -- OpenAI's reasoning effort onto K3's thinking (reasoning.h).
 *
 * K3's chat format has a think switch and three effort levels (low, high,
 * max; encoding_k3.py refuses any other); OpenAI's scale has none plus five
 * levels. Each OpenAI level takes the K3 level of its place on the scale:
 * the two lowest the lowest, the two middle ones the middle, the top the
 * top. Without any effort the turn thinks at "max", which is what Moonshot's
 * apply_chat_template renders by default (thinking on, thinking_effort
 * "max"), so a request with no thinking fields gets the official prompt.
 */
#include "tokenizer/reasoning.h"

#include <string.h>

#include "common/error.h"

static const struct {
    const char *openai;
    bool thinking;
    const char *k3;
} levels[] = {
    {"none", false, NULL},  {"minimal", true, "low"}, {"low", true, "low"}, {"medium", true, "high"},
    {"high", true, "high"}, {"xhigh", true, "max"},   {"max", true, "max"},
};

k3_status k3_chat_reasoning_effort(const char *effort, bool *thinking, const char **thinking_effort, k3_error *err) {
    *thinking = true;
    *thinking_effort = "max";
    if (!effort) return K3_OK;
    for (size_t i = 0; i < sizeof levels / sizeof *levels; i++)
        if (!strcmp(effort, levels[i].openai)) {
            *thinking = levels[i].thinking;
            *thinking_effort = levels[i].k3;
            return K3_OK;
        }
    return k3_err(err, K3_ERR_ARG,
                  "reasoning effort \"%.32s\" is not none, minimal, low, medium, high or xhigh (or K3's max)", effort);
}
