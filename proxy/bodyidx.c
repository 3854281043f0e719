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

int px_body_idx_build(px_body_idx *x, const char *body, size_t n) {
    x->ok = px_json_object_find(body ? body : "", n, names, PX_BK_N, x->m) == 0;
    x->src = body;
    x->len = n;
    return x->ok ? 0 : -1;
}

int px_body_idx_get(const px_body_idx *x, px_bkey k, const char *body, size_t n,
                    px_json_member *m) {
    if (!x || !x->ok || x->src != body || x->len != n)
        return body && px_json_find(body, n, names[k], m);
    if (!x->m[k].val) return 0;
    *m = x->m[k];
    return 1;
}
