/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/rewrite.h"

#include <stdio.h>
#include <string.h>

#include "base/json.h"
#include "proxy/bodyidx.h"

/* Keys the prefill request must not carry from the client. */
static const char *const prefill_drop[] = {
    "kv_transfer_params",    "stream",     "stream_options",        "max_tokens",
    "max_completion_tokens", "min_tokens", "min_completion_tokens",
};

/* Members that hold an object in which an engine reads kv_transfer_params
 * too, so the proxy's keys are stripped inside them as well, at any depth
 * these names nest (SECURITY.md, "Where the proxy's keys are stripped"):
 * vLLM merges a request's vllm_xargs into its sampling parameters'
 * extra_args, which is where the KV connector reads kv_transfer_params
 * (vllm/entrypoints/openai/chat_completion/protocol.py, to_sampling_params),
 * and the token-in generate endpoint takes sampling_params, extra_args
 * included, as the client sent them (vllm/entrypoints/serve/disagg/serving.py,
 * serve_tokens). */
static const char *const nested_owned[] = {"vllm_xargs", "sampling_params", "extra_args"};
static const char *const owned_keys[] = {"kv_transfer_params"};
#define SAW_NESTED (1u << 31) /* a proxy-owned key was stripped inside a member */

static int is_nested_owned(const px_json_member *m) {
    if (m->type != PX_JSON_OBJECT) return 0;
    for (size_t i = 0; i < sizeof nested_owned / sizeof *nested_owned; i++)
        if (px_json_str_eq(m->key, m->key_len, nested_owned[i])) return 1;
    return 0;
}

/* The members of body[0..n): listed by its index (bodyidx.h) or a member
 * list when either was built from these bytes, else scanned. */
typedef struct {
    px_json_iter it;
    const px_body_span *list;
    const char *src;
    int i, n; /* the next listed member, how many; n -1: scanned */
} members;

static int members_init(members *c, const char *body, size_t n, const px_body_idx *x,
                        const px_member_list *l) {
    c->i = 0;
    c->src = body;
    if ((c->n = px_body_idx_count(x, body, n)) >= 0) {
        c->list = x->list;
        return 0;
    }
    if ((c->n = px_member_list_count(l, body, n)) >= 0) {
        c->list = l->s;
        return 0;
    }
    return px_json_iter_init(&c->it, body, n);
}

static int members_next(members *c, px_json_member *m) {
    if (c->n < 0) return px_json_iter_next(&c->it, m);
    if (c->i == c->n) return 0;
    px_body_span_get(&c->list[c->i++], c->src, m);
    return 1;
}

/* Copies the members of `body` not named in `drop` into `out` as "{m1,m2,...",
 * leaving the object open. Sets *saw for each dropped key seen (bit i), and
 * SAW_NESTED when a proxy-owned key was stripped inside a nested member. */
static int copy_listed(const char *body, size_t n, const px_body_idx *x, const px_member_list *l,
                       const char *const *drop, size_t ndrop, px_buf *out, unsigned *saw) {
    members it;
    px_json_member m;
    int r, first = 1;
    if (members_init(&it, body, n, x, l) < 0) return -1;
    px_buf_reserve(out, n + 256);
    px_buf_append(out, "{", 1);
    *saw = 0;
    while ((r = members_next(&it, &m)) == 1) {
        int dropped = 0;
        for (size_t i = 0; i < ndrop; i++) {
            if (px_json_str_eq(m.key, m.key_len, drop[i])) {
                *saw |= 1u << i;
                dropped = 1;
                break;
            }
        }
        if (dropped) continue;
        if (!first) px_buf_append(out, ",", 1);
        first = 0;
        /* Key, colon and value exactly as sent; only the whitespace around
         * the colon is normalised away. */
        px_buf_append(out, m.start, (size_t)(m.key + m.key_len + 1 - m.start));
        px_buf_append(out, ":", 1);
        if (!is_nested_owned(&m)) {
            px_buf_append(out, m.val, m.val_len);
            continue;
        }
        size_t at = out->len;
        unsigned inner;
        if (copy_listed(m.val, m.val_len, NULL, NULL, owned_keys, 1, out, &inner) < 0) return -1;
        if (!inner) { /* nothing stripped inside: the value's own bytes */
            out->len = at;
            px_buf_append(out, m.val, m.val_len);
            continue;
        }
        *saw |= SAW_NESTED;
        if (out->len - at > 1)
            out->data[out->len - 1] = '}'; /* replace the trailing comma */
        else
            px_buf_append(out, "}", 1);
    }
    if (r < 0) return -1;
    if (!first) px_buf_append(out, ",", 1);
    return 0;
}

static int copy_members(const char *body, size_t n, const px_body_idx *x, const char *const *drop,
                        size_t ndrop, px_buf *out, unsigned *saw) {
    return copy_listed(body, n, x, NULL, drop, ndrop, out, saw);
}

/* The proxy's kv_transfer_params member, then a comma. */
static void prefill_kvp(const char *transfer_id, px_buf *out) {
    px_buf_appends(out, "\"kv_transfer_params\":");
    if (transfer_id) {
        px_buf_append(out, PX_PREFILL_KV_PARAMS, sizeof PX_PREFILL_KV_PARAMS - 2);
        px_buf_appends(out, ",\"transfer_id\":\"");
        px_buf_appends(out, transfer_id);
        px_buf_appends(out, "\"}");
    } else {
        px_buf_appends(out, PX_PREFILL_KV_PARAMS);
    }
    px_buf_append(out, ",", 1);
}

int px_rewrite_prefill(const char *body, size_t n, const px_body_idx *x, const char *transfer_id,
                       px_buf *out) {
    unsigned saw;
    if (copy_members(body, n, x, prefill_drop, sizeof prefill_drop / sizeof *prefill_drop, out,
                     &saw) < 0)
        return -1;
    prefill_kvp(transfer_id, out);
    px_buf_appends(out, "\"stream\":false,\"max_tokens\":1");
    if (saw & (1u << 4)) px_buf_appends(out, ",\"max_completion_tokens\":1");
    px_buf_append(out, "}", 1);
    return 0;
}

/* vLLM's ResponsesRequest: the output limit is max_output_tokens; a
 * prefill must neither answer in the background nor keep its one-token
 * answer in its response store (the client's conversation lives where
 * decode stores it; previous_response_id goes to both untouched). */
static const char *const responses_drop[] = {"kv_transfer_params", "stream",     "stream_options",
                                             "max_output_tokens",  "background", "store"};

int px_rewrite_prefill_responses(const char *body, size_t n, const px_body_idx *x,
                                 const char *transfer_id, px_buf *out) {
    unsigned saw;
    if (copy_members(body, n, x, responses_drop, sizeof responses_drop / sizeof *responses_drop,
                     out, &saw) < 0)
        return -1;
    prefill_kvp(transfer_id, out);
    px_buf_appends(out, "\"stream\":false,\"max_output_tokens\":1,\"store\":false}");
    return 0;
}

/* vLLM's GenerateRequest (token-in /inference/v1/generate): the limits
 * are members of sampling_params. */
static const char *const generate_drop[] = {"kv_transfer_params", "stream", "stream_options",
                                            "sampling_params"};
static const char *const sampling_drop[] = {"max_tokens", "min_tokens"};

int px_rewrite_prefill_generate(const char *body, size_t n, const px_body_idx *x,
                                const char *transfer_id, px_buf *out) {
    unsigned saw;
    px_json_member sp;
    int has_sp =
        px_body_idx_get(x, PX_BK_SAMPLING_PARAMS, body, n, &sp) && sp.type == PX_JSON_OBJECT;
    if (copy_members(body, n, x, generate_drop, sizeof generate_drop / sizeof *generate_drop, out,
                     &saw) < 0)
        return -1;
    prefill_kvp(transfer_id, out);
    px_buf_appends(out, "\"stream\":false,\"sampling_params\":");
    if (has_sp) {
        if (copy_members(sp.val, sp.val_len, NULL, sampling_drop, 2, out, &saw) < 0) return -1;
    } else {
        px_buf_append(out, "{", 1);
    }
    px_buf_appends(out, "\"max_tokens\":1}}");
    return 0;
}

int px_rewrite_decode(const char *body, size_t n, const px_body_idx *x, const char *kvp,
                      size_t kvp_len, px_buf *out) {
    unsigned saw;
    size_t start = out->len;
    if (copy_members(body, n, x, prefill_drop, 1, out, &saw) < 0) return -1;
    if (kvp) {
        px_buf_appends(out, "\"kv_transfer_params\":");
        px_buf_append(out, kvp, kvp_len);
        px_buf_append(out, "}", 1);
    } else if (out->len - start > 1) {
        out->data[out->len - 1] = '}'; /* replace the trailing comma */
    } else {
        px_buf_append(out, "}", 1);
    }
    return 0;
}

int px_rewrite_decode_xfer(const char *body, size_t n, const px_body_idx *x,
                           const px_member_list *kl, const char *kvp, size_t kvp_len,
                           const char *transfer_id, px_buf *out) {
    static const char *const own[] = {"transfer_id"};
    unsigned saw;
    if (!transfer_id || !kvp) return px_rewrite_decode(body, n, x, kvp, kvp_len, out);
    /* Prefill's members as they came, its own transfer_id left out, written
     * straight into out (no copy of kvp: this runs on every request). */
    size_t start = out->len;
    /* One allocation for the whole body: each copy_members reserves its
     * input's size and 256 bytes more. */
    px_buf_reserve(out, n + kvp_len + 512);
    if (copy_members(body, n, x, prefill_drop, 1, out, &saw) < 0) return -1;
    px_buf_appends(out, "\"kv_transfer_params\":");
    if (copy_listed(kvp, kvp_len, NULL, kl, own, 1, out, &saw) < 0) { /* kvp is no object */
        out->len = start;
        return px_rewrite_decode(body, n, x, kvp, kvp_len, out);
    }
    px_buf_appends(out, "\"transfer_id\":\"");
    px_buf_appends(out, transfer_id);
    px_buf_appends(out, "\"}}");
    return 0;
}

int px_rewrite_cache_salt(const char *body, size_t n, const px_body_idx *x, const char *salt,
                          px_buf *out) {
    static const char *const salt_key[] = {"cache_salt"};
    unsigned saw;
    if (copy_members(body, n, x, salt_key, 1, out, &saw) < 0) return -1;
    px_buf_appends(out, "\"cache_salt\":");
    px_buf_append_json_str(out, salt, strlen(salt));
    px_buf_append(out, "}", 1);
    return 0;
}

int px_rewrite_include_usage(const char *body, size_t n, px_buf *out) {
    static const char *const so_key[] = {"stream_options"};
    static const char *const usage_keys[] = {"include_usage", "continuous_usage_stats"};
    px_json_member st, so, iu;
    if (!px_json_find(body, n, "stream", &st) || st.type != PX_JSON_TRUE) return 0;
    int has_so = px_json_find(body, n, "stream_options", &so) && so.type == PX_JSON_OBJECT;
    if (has_so && px_json_find(so.val, so.val_len, "include_usage", &iu) &&
        iu.type == PX_JSON_TRUE)
        return 0; /* asked for: it is the client's */
    unsigned saw;
    if (copy_members(body, n, NULL, so_key, 1, out, &saw) < 0) return -1;
    px_buf_appends(out, "\"stream_options\":");
    if (has_so) {
        /* continuous_usage_stats goes too: without include_usage it did
         * nothing, with it every chunk would carry usage. */
        if (copy_members(so.val, so.val_len, NULL, usage_keys, 2, out, &saw) < 0) return -1;
    } else {
        px_buf_append(out, "{", 1);
    }
    px_buf_appends(out, "\"include_usage\":true}}");
    return 1;
}

int px_body_foreign_encoding(const char *body, size_t n) {
    const unsigned char *b = (const unsigned char *)body;
    if (n >= 3 && b[0] == 0xEF && b[1] == 0xBB && b[2] == 0xBF) return 1; /* UTF-8 BOM */
    if (n >= 2 && ((b[0] == 0xFE && b[1] == 0xFF) || (b[0] == 0xFF && b[1] == 0xFE)))
        return 1; /* UTF-16 BOM (and UTF-32 little-endian's) */
    return n >= 2 && (!b[0] || !b[1]); /* UTF-16/32 without BOM, UTF-32 BE's BOM */
}

int px_rewrite_forwarded(const char *body, size_t n, px_buf *out) {
    if (px_body_foreign_encoding(body, n)) return -2;
    size_t i = 0;
    while (i < n && (body[i] == ' ' || body[i] == '\t' || body[i] == '\r' || body[i] == '\n'))
        i++;
    if (i == n || body[i] != '{') return 0;
    char err[8];
    if (px_json_validate(body, n, err, sizeof err) != PX_JSON_OBJECT) return -1;
    unsigned saw;
    size_t start = out->len;
    if (copy_members(body, n, NULL, prefill_drop, 1, out, &saw) < 0) return -1;
    if (!saw) {
        out->len = start;
        return 0;
    }
    if (out->len - start > 1)
        out->data[out->len - 1] = '}'; /* replace the trailing comma */
    else
        px_buf_append(out, "}", 1);
    return 1;
}

size_t px_rewrite_rendered_bytes(const char *body, size_t n) {
    static const char *const rendered[] = {"tools", "functions", "documents", "chat_template",
                                           "prompt_embeds"};
    px_json_iter it;
    px_json_member m;
    size_t total = 0;
    if (px_json_iter_init(&it, body, n) < 0) return 0;
    while (px_json_iter_next(&it, &m) == 1)
        for (size_t i = 0; i < sizeof rendered / sizeof *rendered; i++)
            if (px_json_str_eq(m.key, m.key_len, rendered[i])) {
                if (m.type != PX_JSON_NULL) total += m.val_len;
                break;
            }
    return total;
}

/* kv_transfer_params' last remote_request_id into *rid (val NULL: none),
 * its members into *l when l is given; -1 when kvp is no object. */
static int kvp_read(const char *kvp, size_t n, px_json_member *rid, px_member_list *l) {
    px_json_iter it;
    px_json_member m;
    int r;
    rid->val = NULL;
    if (px_json_iter_init(&it, kvp, n) < 0) return -1; /* l lists nothing */
    if (l) px_member_list_start(l, kvp, n);
    while ((r = px_json_iter_next(&it, &m)) == 1) {
        if (l) px_member_list_add(l, &m);
        if (px_json_str_eq(m.key, m.key_len, "remote_request_id")) *rid = m;
    }
    if (r < 0) {
        rid->val = NULL;
        if (l) l->n = PX_MEMBER_LIST + 1;
        return -1;
    }
    return 0;
}

/* px_extract_prefill_answer that also gives remote_request_id (rid->val
 * NULL when the answer has none) and, l given, lists kv_transfer_params'
 * members. */
static px_kvp_status extract(const char *resp, size_t n, const char **kvp, size_t *kvp_len,
                             px_json_member *usage, px_json_member *rid, px_member_list *l,
                             char *err, size_t errlen) {
    static const char *const keys[] = {"kv_transfer_params", "usage"};
    px_json_member found[2];
    rid->val = NULL;
    if (l) px_member_list_start(l, NULL, 0);
    /* One pass validates the answer and finds both members (it runs on
     * every request); only a bad answer is scanned again, for the reason. */
    if (px_json_object_find(resp, n, keys, 2, found) < 0) {
        if (err && errlen) err[0] = '\0';
        px_json_validate(resp, n, err, errlen);
        if (err && errlen && !err[0]) snprintf(err, errlen, "not a JSON object");
        return PX_KVP_BAD_RESPONSE;
    }
    if (usage) *usage = found[1];
    const px_json_member *m = &found[0];
    if (!m->val || m->type != PX_JSON_OBJECT) return PX_KVP_MISSING;
    *kvp = m->val;
    *kvp_len = m->val_len;
    if (kvp_read(m->val, m->val_len, rid, l) < 0 || !rid->val) return PX_KVP_NO_REQUEST_ID;
    if (rid->type != PX_JSON_STRING || rid->val_len <= 2) return PX_KVP_NO_REQUEST_ID;
    return PX_KVP_OK;
}

px_kvp_status px_extract_prefill_answer(const char *resp, size_t n, const char **kvp,
                                        size_t *kvp_len, px_json_member *usage, char *err,
                                        size_t errlen) {
    px_json_member rid;
    return extract(resp, n, kvp, kvp_len, usage, &rid, NULL, err, errlen);
}

void px_prefill_answer_read(px_prefill_answer *a, const char *resp, size_t n) {
    a->kvp = NULL;
    a->kvp_len = 0;
    a->usage.val = NULL;
    a->ks = extract(resp ? resp : "", n, &a->kvp, &a->kvp_len, &a->usage, &a->rid, &a->kvl, a->err,
                    sizeof a->err);
    a->read = 1;
}

px_kvp_status px_extract_kv_params(const char *resp, size_t n, const char **kvp, size_t *kvp_len,
                                   char *err, size_t errlen) {
    return px_extract_prefill_answer(resp, n, kvp, kvp_len, NULL, err, errlen);
}
