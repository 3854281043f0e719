/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/disagg.h"

#include <stdlib.h>
#include <stdint.h>

#include "base/hash.h"
#include "base/json.h"
#include "proxy/rewrite.h"

/* ---------- the decision ---------- */

/* The member holding the prompt. */
px_bkey px_disagg_prompt_key(px_endpoint ep) {
    return ep == PX_EP_COMPLETIONS  ? PX_BK_PROMPT
           : ep == PX_EP_RESPONSES ? PX_BK_INPUT
           : ep == PX_EP_GENERATE  ? PX_BK_TOKEN_IDS
                                   : PX_BK_MESSAGES;
}

static const char *prompt_member(px_endpoint ep) {
    return px_bkey_name(px_disagg_prompt_key(ep));
}

/* Tokens of a prompt given as token ids ([1,2,3]): exact. -1 when the
 * value is anything else (text, a batch of prompts). */
static long token_ids(const char *v, size_t n) {
    size_t i = 1;
    if (!n || v[0] != '[') return -1;
    while (i < n && (v[i] == ' ' || v[i] == '\n' || v[i] == '\t' || v[i] == '\r'))
        i++;
    if (i >= n || !(v[i] == '-' || (v[i] >= '0' && v[i] <= '9'))) return -1;
    long k = 1;
    for (; i < n; i++) {
        if (v[i] == '[' || v[i] == '{' || v[i] == '"') return -1;
        k += v[i] == ',';
    }
    return k;
}

/* The prompt's length in tokens: exact for token ids, else estimated from
 * its bytes. */
static double prompt_tokens(const px_config *cfg, px_endpoint ep, const char *body, size_t len,
                            const char *p, size_t n) {
    double bpt = cfg->disagg_bytes_per_token;
    long ids = ep == PX_EP_COMPLETIONS || ep == PX_EP_GENERATE ? token_ids(p, n) : -1;
    double total = ids >= 0 ? (double)ids : (double)n / bpt;
    /* Anthropic's system prompt is a member of its own. */
    px_json_member sys;
    if ((ep == PX_EP_MESSAGES && px_json_find(body, len, "system", &sys)) ||
        (ep == PX_EP_RESPONSES && px_json_find(body, len, "instructions", &sys)))
        total += (double)sys.val_len / bpt;
    /* What else the engine renders into the prompt: tools, documents, a
     * chat template, embeddings. */
    total += (double)px_rewrite_rendered_bytes(body, len) / bpt;
    return total;
}

/* How many of the prompt's `total` tokens the decode holds, by the share
 * of its bytes the prefix index lists for it. An index that knows tokens
 * (the engines' KV events) answers this exactly instead. */
static double cached_tokens(px_pindex *index, const uint64_t *decode_key, const char *p, size_t n,
                            double total, px_disagg *out) {
    if (n < PX_PINDEX_BLOCK_BYTES || !index) return 0;
    size_t max = n / PX_PINDEX_BLOCK_BYTES;
    if (max > PX_PINDEX_MAX_BLOCKS) max = PX_PINDEX_MAX_BLOCKS;
    out->hash = px_xmalloc(max * sizeof *out->hash);
    out->nhash = px_pindex_hashes(p, n, out->hash, max);
    if (!decode_key) return 0;
    size_t matched = px_pindex_match(index, *decode_key, out->hash, out->nhash);
    return total * (double)(matched * PX_PINDEX_BLOCK_BYTES) / (double)n;
}

long px_disagg_estimate(const px_config *cfg, px_endpoint ep, const char *body, size_t len) {
    px_json_member m;
    const char *p = "";
    size_t n = 0;
    if (px_json_find(body, len, prompt_member(ep), &m)) {
        p = m.val;
        n = m.val_len;
    }
    return (long)(prompt_tokens(cfg, ep, body, len, p, n) + 0.5);
}

void px_disagg_decide(const px_config *cfg, px_endpoint ep, const char *body, size_t len,
                      px_pindex *index, const uint64_t *decode_key, px_disagg *out) {
    *out = (px_disagg){.decision = PX_DEC_ALWAYS, .disagg = 1};
    if (cfg->disagg_min_tokens <= 0) return;
    px_json_member m;
    const char *p = "";
    size_t n = 0;
    if (px_json_find(body, len, prompt_member(ep), &m)) {
        p = m.val;
        n = m.val_len;
    }
    double total = prompt_tokens(cfg, ep, body, len, p, n);
    double cached = cached_tokens(index, decode_key, p, n, total, out);
    out->estimated = 1;
    out->tokens = (long)(total + 0.5);
    out->uncached = (long)(total - cached + 0.5);
    if (out->uncached >= cfg->disagg_min_tokens) {
        out->decision = PX_DEC_LONG_PROMPT;
        return;
    }
    out->disagg = 0;
    out->decision =
        out->tokens < cfg->disagg_min_tokens ? PX_DEC_SHORT_PROMPT : PX_DEC_CACHED_PREFIX;
}

size_t px_token_list(const char *v, size_t vn, size_t max, uint32_t **out) {
    *out = NULL;
    long n = token_ids(v, vn);
    if (n <= 0 || (size_t)n > max) return 0;
    uint32_t *t = px_xmalloc((size_t)n * sizeof *t);
    size_t k = 0;
    const char *p = v + 1, *end = v + vn;
    while (p < end && k < (size_t)n) {
        while (p < end && (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r' || *p == ','))
            p++;
        if (p >= end || *p == ']') break;
        unsigned long long x = 0;
        const char *d = p;
        while (p < end && *p >= '0' && *p <= '9' && x <= UINT32_MAX)
            x = x * 10 + (unsigned)(*p++ - '0');
        if (p == d || x > UINT32_MAX) break; /* a sign, a fraction, a huge id */
        t[k++] = (uint32_t)x;
        while (p < end && (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r'))
            p++;
        if (p < end && *p != ',' && *p != ']') {
            k = 0; /* "1.5", "1e3", "2x": not an id */
            break;
        }
    }
    if (k != (size_t)n) {
        free(t);
        return 0;
    }
    *out = t;
    return k;
}

int px_disagg_prompt(px_endpoint ep, const char *body, size_t len, px_json_member *m) {
    return px_json_find(body, len, prompt_member(ep), m);
}

size_t px_disagg_prompt_ids(px_endpoint ep, const px_json_member *m, size_t max, uint32_t **out) {
    *out = NULL;
    if (ep != PX_EP_COMPLETIONS) return 0;
    return px_token_list(m->val, m->val_len, max, out);
}

size_t px_disagg_token_ids(px_endpoint ep, const char *body, size_t len, size_t max,
                           uint32_t **out) {
    *out = NULL;
    px_json_member m;
    if (!px_disagg_prompt(ep, body, len, &m)) return 0;
    return px_disagg_prompt_ids(ep, &m, max, out);
}

void px_disagg_exact(const px_config *cfg, long tokens, long cached, px_disagg *out) {
    if (cfg->disagg_min_tokens <= 0) return;
    out->estimated = 1;
    out->tokens = tokens;
    out->uncached = tokens - cached;
    if (out->uncached >= cfg->disagg_min_tokens) {
        out->disagg = 1;
        out->decision = PX_DEC_LONG_PROMPT;
        return;
    }
    out->disagg = 0;
    out->decision = tokens < cfg->disagg_min_tokens ? PX_DEC_SHORT_PROMPT : PX_DEC_CACHED_PREFIX;
}

int px_disagg_key(px_endpoint ep, const char *body, size_t len, size_t max, const char **key,
                  size_t *key_len) {
    px_json_member m;
    if (!px_json_find(body, len, prompt_member(ep), &m)) return 0;
    *key = m.val;
    *key_len = m.val_len < max ? m.val_len : max;
    return 1;
}
