/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/tokenize.h"

#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "base/json.h"
#include "proxy/disagg.h"

int px_tokenize_body(px_endpoint ep, const char *body, size_t len, px_buf *out, uint64_t *key) {
    const char *member = ep == PX_EP_COMPLETIONS ? "prompt" : ep == PX_EP_CHAT ? "messages" : NULL;
    px_json_member m, model;
    if (!member || !px_json_find(body, len, member, &m)) return -1;
    /* A completion prompt of text only: ids need no tokenizer, and a batch
     * of prompts is not one prompt. Chat messages as they are. */
    if (ep == PX_EP_COMPLETIONS && m.type != PX_JSON_STRING) return -1;
    if (ep == PX_EP_CHAT && m.type != PX_JSON_ARRAY) return -1;
    int has_model = px_json_find(body, len, "model", &model) && model.type == PX_JSON_STRING;
    px_buf_appends(out, "{");
    if (has_model) {
        px_buf_appends(out, "\"model\":");
        px_buf_append(out, model.val, model.val_len);
        px_buf_appends(out, ",");
    }
    px_buf_printf(out, "\"%s\":", member);
    px_buf_append(out, m.val, m.val_len);
    px_buf_appends(out, "}");
    uint64_t h = px_hash64_seed(member, strlen(member), has_model ? 0 : 1);
    if (has_model) h = px_hash64_more(h, model.val, model.val_len);
    *key = px_hash64_more(h, m.val, m.val_len);
    return 0;
}

long px_tokenize_parse(const char *body, size_t len, size_t max, uint32_t **out) {
    *out = NULL;
    px_json_member m;
    if (!px_json_find(body, len, "tokens", &m) || m.type != PX_JSON_ARRAY) return -1;
    size_t n = px_token_list(m.val, m.val_len, max, out);
    if (!n) return -1;
    return (long)n;
}

typedef struct entry {
    uint64_t key;
    uint32_t *tok; /* owned; NULL: empty */
    size_t n;
} entry;

struct px_tokcache {
    entry *e; /* owned */
    size_t n;
    size_t max_tokens;
};

px_tokcache *px_tokcache_create(size_t entries, size_t max_tokens) {
    px_tokcache *c = px_xcalloc(1, sizeof *c);
    c->n = entries ? entries : 1;
    c->e = px_xcalloc(c->n, sizeof *c->e);
    c->max_tokens = max_tokens;
    return c;
}

void px_tokcache_destroy(px_tokcache *c) {
    if (!c) return;
    for (size_t i = 0; i < c->n; i++)
        free(c->e[i].tok);
    free(c->e);
    free(c);
}

/* Direct-mapped by the key's bits: a newer prompt replaces an older one in
 * its cell, so memory stays within entries * max_tokens * 4 bytes. */
long px_tokcache_get(px_tokcache *c, uint64_t key, uint32_t **out) {
    entry *e = &c->e[px_mix64(key) % c->n];
    if (!e->tok || e->key != key) return -1;
    *out = px_xmalloc(e->n * sizeof **out);
    memcpy(*out, e->tok, e->n * sizeof **out);
    return (long)e->n;
}

void px_tokcache_put(px_tokcache *c, uint64_t key, const uint32_t *tok, size_t n) {
    if (!n || n > c->max_tokens) return;
    entry *e = &c->e[px_mix64(key) % c->n];
    free(e->tok);
    e->tok = px_xmalloc(n * sizeof *tok);
    memcpy(e->tok, tok, n * sizeof *tok);
    e->n = n;
    e->key = key;
}

int px_tokenize_lookup(px_tokcache **c, size_t entries, px_endpoint ep, const char *body,
                       size_t len, px_buf *out, uint64_t *key, uint32_t **tok, size_t *ntok) {
    if (px_tokenize_body(ep, body, len, out, key) < 0) return -1;
    if (!*c) *c = px_tokcache_create(entries, 65536);
    long n = px_tokcache_get(*c, *key, tok);
    if (n <= 0) return 0;
    *ntok = (size_t)n;
    return 1;
}

px_tokresult px_tokenize_answer(px_tokcache *c, uint64_t key, int rc_ok, int timed_out, int status,
                                const px_buf *resp, uint32_t **tok, size_t *ntok) {
    long n = -1;
    if (rc_ok && status == 200)
        n = px_tokenize_parse(resp->data, resp->len, PX_TOKENIZE_MAX_TOKENS, tok);
    if (n <= 0) return timed_out ? PX_TOK_TIMEOUT : PX_TOK_ERROR;
    *ntok = (size_t)n;
    px_tokcache_put(c, key, *tok, *ntok);
    return PX_TOK_OK;
}
