/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim's POST /tokenize, in vLLM's request and response shape: the
 * token ids its completion endpoints count and cache for the same prompt. */
#include <stdlib.h>

#include "base/http.h"
#include "base/util.h"
#include "sim/engine_int.h"

void sim_handle_tokenize(sim_engine *e, px_conn *c, const px_http_head *h, px_buf *body) {
    char msg[256], xrid[129];
    px_http_request_id(h, xrid);
    uint32_t *tok = NULL;
    size_t n = 0;
    int status =
        sim_parse_tokenize(body->data, body->len, e->cfg->model, &tok, &n, msg, sizeof msg);
    if (status) {
        px_conn_reply_error(c, status, xrid, NULL, msg);
        return;
    }
    px_buf b;
    px_buf_init(&b);
    px_buf_printf(&b, "{\"count\":%zu,\"max_model_len\":%llu,\"tokens\":[", n,
                  (unsigned long long)(e->cfg->num_blocks * e->cfg->block_tokens));
    for (size_t i = 0; i < n; i++)
        px_buf_printf(&b, i ? ",%u" : "%u", tok[i]);
    px_buf_appends(&b, "],\"token_strs\":null}");
    px_conn_reply(c, 200, "application/json", xrid, NULL, b.data, b.len);
    px_buf_cleanup(&b);
    free(tok);
}
