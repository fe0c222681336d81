/* fuzz_chat.c -- libFuzzer harness for the K3 chat encoder
 * (k3_chat_encode) on the tiny model's tokenizer. The input is split at NUL
 * bytes into fields taken three at a time as (role, content, reasoning) of
 * up to 8 messages; the first byte's bits choose add_generation_prompt and
 * thinking. The ids must decode back to text holding every content. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "k3.h"

static k3_tokenizer *tiny;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    k3_error err = {0};
    if (!tiny && k3_tokenizer_open(&tiny, "tests/models/tiny", &err) != K3_OK) abort();
    if (size < 1) return 0;
    const bool gen = data[0] & 1, think = data[0] & 2;
    char *s = malloc(size);
    if (!s) return 0;
    memcpy(s, data + 1, size - 1);
    s[size - 1] = 0;
    const char *field[24];
    int nf = 0;
    for (char *p = s; nf < 24;) {
        field[nf++] = p;
        char *z = memchr(p, 0, (size_t)(s + size - p));
        if (!z || z + 1 >= s + size) break;
        p = z + 1;
    }
    k3_chat_msg msgs[8];
    size_t nm = 0;
    for (int i = 0; i + 1 < nf && nm < 8; i += 3)
        msgs[nm++] = (k3_chat_msg){field[i], field[i + 1], i + 2 < nf && field[i + 2][0] ? field[i + 2] : NULL};
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (k3_chat_encode(tiny, msgs, nm, gen, think, &ids, &n_ids, &err) == K3_OK) {
        char *text = NULL;
        size_t len = 0;
        if (k3_tokenizer_decode(tiny, ids, n_ids, &text, &len, &err) != K3_OK) abort();
        for (size_t i = 0; i < nm; i++)
            if (msgs[i].content[0] && !strstr(text, msgs[i].content)) abort();
        free(text);
        free(ids);
    }
    free(s);
    return 0;
}
