/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/bodyidx.h"

static const char *const names[PX_BK_N] = {
    [PX_BK_MODEL] = "model",
    [PX_BK_USER] = "user",
    [PX_BK_PROMPT] = "prompt",
    [PX_BK_MESSAGES] = "messages",
    [PX_BK_INPUT] = "input",
    [PX_BK_TOKEN_IDS] = "token_ids",
    [PX_BK_CACHE_SALT] = "cache_salt",
    [PX_BK_SAMPLING_PARAMS] = "sampling_params",
    [PX_BK_MAX_TOKENS] = "max_tokens",
    [PX_BK_MAX_COMPLETION_TOKENS] = "max_completion_tokens",
    [PX_BK_MAX_OUTPUT_TOKENS] = "max_output_tokens",
    [PX_BK_PRIORITY] = "priority",
};

const char *px_bkey_name(px_bkey k) {
    return names[k];
}

/* Finds keys as px_json_object_find does (the last of duplicates) and
 * lists every member while they fit. */
int px_body_idx_build(px_body_idx *x, const char *body, size_t n) {
    px_json_iter it;
    px_json_member m;
    int r = -1;
    const char *b = body ? body : "";
    x->src = body;
    x->len = n;
    x->nlist = n <= UINT32_MAX ? 0 : PX_BODY_IDX_LIST + 1;
    for (int k = 0; k < PX_BK_N; k++)
        x->m[k].val = NULL;
    if (px_json_iter_init(&it, b, n) == 0) {
        while ((r = px_json_iter_next(&it, &m)) == 1) {
            for (int k = 0; k < PX_BK_N; k++)
                if (px_json_str_eq(m.key, m.key_len, names[k])) {
                    x->m[k] = m;
                    break;
                }
            if (x->nlist < PX_BODY_IDX_LIST) px_body_span_set(&x->list[x->nlist], b, &m);
            if (x->nlist <= PX_BODY_IDX_LIST) x->nlist++;
        }
    }
    x->ok = r == 0 && px_json_iter_whole(&it);
    return x->ok ? 0 : -1;
}

int px_body_idx_count(const px_body_idx *x, const char *body, size_t n) {
    if (!x || !x->ok || x->src != body || x->len != n || x->nlist > PX_BODY_IDX_LIST) return -1;
    return (int)x->nlist;
}

void px_body_idx_member(const px_body_idx *x, unsigned i, px_json_member *m) {
    px_body_span_get(&x->list[i], x->src, m);
}

void px_body_span_set(px_body_span *s, const char *base, const px_json_member *m) {
    s->start = (uint32_t)(m->start - base);
    s->key = (uint32_t)(m->key - base);
    s->key_len = (uint32_t)m->key_len;
    s->val = (uint32_t)(m->val - base);
    s->val_len = (uint32_t)m->val_len;
    s->type = (uint32_t)m->type;
}

void px_body_span_get(const px_body_span *s, const char *base, px_json_member *m) {
    m->start = base + s->start;
    m->key = base + s->key;
    m->key_len = s->key_len;
    m->val = base + s->val;
    m->val_len = s->val_len;
    m->type = (px_json_type)s->type;
}

void px_member_list_start(px_member_list *l, const char *src, size_t len) {
    l->src = src;
    l->len = len;
    l->n = len <= UINT32_MAX ? 0 : PX_MEMBER_LIST + 1;
}

void px_member_list_add(px_member_list *l, const px_json_member *m) {
    if (l->n < PX_MEMBER_LIST) px_body_span_set(&l->s[l->n], l->src, m);
    if (l->n <= PX_MEMBER_LIST) l->n++;
}

int px_member_list_count(const px_member_list *l, const char *obj, size_t n) {
    if (!l || !obj || l->src != obj || l->len != n || l->n > PX_MEMBER_LIST) return -1;
    return (int)l->n;
}

int px_body_idx_get(const px_body_idx *x, px_bkey k, const char *body, size_t n,
                    px_json_member *m) {
    if (!x || !x->ok || x->src != body || x->len != n)
        return body && px_json_find(body, n, names[k], m);
    if (!x->m[k].val) return 0;
    *m = x->m[k];
    return 1;
}
