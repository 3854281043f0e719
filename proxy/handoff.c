/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/handoff.h"

#include "base/log.h"
#include "proxy/bodyidx.h"
#include "proxy/usage.h"

px_kvp_status px_handoff_serial(px_metrics *m, const char *lid, const char *prefill,
                                px_prefill_answer *a, px_buf *resp, int keep, px_buf *body,
                                const px_body_idx *x, px_buf *pbody, px_pf_cache *learn,
                                int usage_prefill, const char *transfer_id, px_buf *out,
                                char cached[24]) {
    if (!a->read) px_prefill_answer_read(a, resp->data, resp->len);
    a->read = 0;
    const char *kvp = a->kvp;
    size_t kvp_len = a->kvp_len;
    px_kvp_status ks = a->ks;
    if (ks == PX_KVP_BAD_RESPONSE) return ks;
    if (ks == PX_KVP_MISSING) {
        px_m_inc(&m->kvp_missing);
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"prefill answer has no kv_transfer_params; decode will recompute the "
               "prefill\" prefill=%s",
               lid, prefill);
        kvp = NULL;
    } else if (ks == PX_KVP_NO_REQUEST_ID) {
        px_m_inc(&m->rrid_missing);
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"kv_transfer_params lack remote_request_id; decode cannot release "
               "prefill's blocks\" prefill=%s",
               lid, prefill);
    }
    /* --dispatch concurrent learns the prefill's identity from its
     * answers. */
    if (kvp && learn) px_dispatch_learn(learn, prefill, kvp, kvp_len);
    px_buf_reset(out);
    px_rewrite_decode_xfer(body->data, body->len, x, &a->kvl, kvp, kvp_len, transfer_id, out);
    /* Prefill's cached_tokens, for --usage-from prefill (its usage member
     * was found in the same pass as kv_transfer_params). */
    if (resp->data && usage_prefill) px_usage_cached_tokens_in(&a->usage, cached);
    px_buf_cleanup(body);
    px_buf_cleanup(pbody);
    if (!keep) px_buf_cleanup(resp);
    return ks;
}

void px_handoff_prefill(px_endpoint ep, const px_buf *body, const px_body_idx *x,
                        const char *transfer_id, px_buf *out) {
    if (ep == PX_EP_RESPONSES)
        px_rewrite_prefill_responses(body->data, body->len, x, transfer_id, out);
    else if (ep == PX_EP_GENERATE)
        px_rewrite_prefill_generate(body->data, body->len, x, transfer_id, out);
    else
        px_rewrite_prefill(body->data, body->len, x, transfer_id, out);
}

void px_handoff_alone(const px_buf *body, const px_body_idx *x, px_buf *out) {
    px_buf_reset(out);
    px_rewrite_decode(body->data, body->len, x, NULL, 0, out);
}

int px_handoff_concurrent(const px_pf_identity *pf, const char *transfer_id, const px_buf *body,
                          px_buf *pbody, px_buf *dbody, char id[PX_DISPATCH_ID_LEN]) {
    char tok[33];
    if (px_dispatch_mint(id, tok) < 0) return -1;
    px_buf kvp, b;
    px_buf_init(&kvp);
    px_buf_init(&b);
    px_dispatch_prefill_kvp(id, tok, transfer_id, &kvp);
    px_rewrite_decode(pbody->data, pbody->len, NULL, kvp.data, kvp.len, &b);
    px_buf_cleanup(pbody);
    *pbody = b;
    px_buf_reset(&kvp);
    px_dispatch_decode_kvp(pf, id, tok, transfer_id, &kvp);
    px_buf_reset(dbody);
    px_rewrite_decode(body->data, body->len, NULL, kvp.data, kvp.len, dbody);
    px_buf_cleanup(&kvp);
    return 0;
}

void px_handoff_learn(px_pf_cache *ids, const char *prefill, const px_buf *resp, int usage_prefill,
                      char cached[24]) {
    const char *kvp = NULL;
    size_t kl = 0;
    char err[128];
    px_json_member usage;
    px_kvp_status ks = px_extract_prefill_answer(resp->data ? resp->data : "", resp->len, &kvp,
                                                 &kl, &usage, err, sizeof err);
    if ((ks == PX_KVP_OK || ks == PX_KVP_NO_REQUEST_ID) && kvp)
        px_dispatch_learn(ids, prefill, kvp, kl);
    /* (An answer that is no valid object is searched on its own, as
     * before: only the found members of a valid one are trusted.) */
    if (resp->data && !cached[0] && usage_prefill) {
        if (ks != PX_KVP_BAD_RESPONSE)
            px_usage_cached_tokens_in(&usage, cached);
        else
            px_usage_cached_tokens(resp->data, resp->len, cached);
    }
}

int px_handoff_forwarded(px_buf *b) {
    px_buf clean;
    px_buf_init(&clean);
    int st = px_rewrite_forwarded(b->data ? b->data : "", b->len, &clean);
    if (st > 0) {
        px_buf t = *b;
        *b = clean;
        clean = t;
    }
    px_buf_cleanup(&clean);
    return st;
}
