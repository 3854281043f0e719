/* SPDX-License-Identifier: Apache-2.0 */
#include "sim/kvsim.h"

#include "base/hash.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

size_t kvsim_tokenize(const char *text, size_t len, uint32_t **ids, size_t n) {
    size_t cap = n + len / 2 + 4;
    uint32_t *v = realloc(*ids, cap * sizeof *v);
    if (!v) abort();
    size_t i = 0;
    while (i < len) {
        unsigned char c = (unsigned char)text[i];
        if (isspace(c)) {
            i++;
            continue;
        }
        size_t s = i;
        if (isalnum(c) || c >= 0x80) {
            while (i < len && (isalnum((unsigned char)text[i]) || (unsigned char)text[i] >= 0x80))
                i++;
        } else {
            i++;
        }
        if (n == cap) {
            cap *= 2;
            v = realloc(v, cap * sizeof *v);
            if (!v) abort();
        }
        v[n++] = (uint32_t)(px_hash64_seed(text + s, i - s, 0) % 32000) + 1;
    }
    *ids = v;
    return n;
}

void kvsim_prefix_hashes(uint64_t model_hash, const uint32_t *ids, size_t ntok, size_t block_tokens,
                         uint64_t *out, size_t nblocks) {
    uint64_t h = px_hash64_seed(ids, 0, model_hash);
    size_t done = 0;
    for (size_t b = 0; b < nblocks; b++) {
        size_t end = (b + 1) * block_tokens;
        if (end > ntok) end = ntok;
        h = px_hash64_more(h, ids + done, (end - done) * sizeof *ids);
        done = end;
        out[b] = h;
    }
}

void kvsim_fill_block(uint64_t prefix_hash, uint32_t layer, uint32_t kv, void *out, size_t len) {
    uint64_t x = px_mix64(prefix_hash ^ ((uint64_t)layer << 32) ^ ((uint64_t)kv << 62));
    unsigned char *p = out;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        x += 0x9e3779b97f4a7c15ull;
        uint64_t w = px_mix64(x);
        memcpy(p + i, &w, 8);
    }
    if (i < len) {
        x += 0x9e3779b97f4a7c15ull;
        uint64_t w = px_mix64(x);
        memcpy(p + i, &w, len - i);
    }
}

static const char *const words[] = {
    "the",   "a",      "KV",      "cache",   "moves",  "from",    "prefill", "to",        "decode",
    "and",   "tokens", "flow",    "over",    "UCX",    "blocks",  "are",     "read",      "once",
    "then",  "freed",  "by",      "request", "id",     "quickly", "while",   "streams",   "keep",
    "going", "with",   "no",      "copies",  "left",   "behind",  "in",      "memory",    "engine",
    "proxy", "sends",  "answers", "back",    "byte",   "for",     "every",   "client",    "waits",
    "less",  "than",   "before",  "model",   "layers", "heads",   "of",      "attention", "runs",
    "fast",  "on",     "GPUs",    "or",      "CPUs",   "alike",   "today",   "."};

size_t kvsim_word(uint64_t prompt_hash, uint64_t seed, size_t i, char *out) {
    uint64_t x = px_mix64(prompt_hash ^ px_mix64(seed + 0x1234) ^ px_mix64((uint64_t)i + 1));
    const char *w = words[x % (sizeof words / sizeof *words)];
    size_t n = strlen(w);
    out[0] = ' ';
    memcpy(out + 1, w, n);
    out[n + 1] = '\0';
    return n + 1;
}
