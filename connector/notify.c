/* SPDX-License-Identifier: Apache-2.0 */
/* Notifications: the consumer tells the producer "<remote_request_id>:<tp>"
 * with the publication's token (an active message on the endpoint the data
 * used, after the data landed); the producer releases the request's blocks
 * once the expected number of consumers has notified (heterogeneous TP).
 * A notification for a publication that ended (released or expired) is
 * recognised by its token among the last KVC_NOTIFY_GONE that ended and
 * raises one KVC_EV_UNKNOWN_NOTIFY.  Anything else (an id never published
 * or forgotten, a wrong token) is never acted on: counted (KVC_STAT_DENIED)
 * and logged, at most ten lines a second, with no event and no memory kept,
 * so a flood of them costs the producer nothing that grows. */
#include "connector/kvc_int.h"

#include <string.h>

enum { KVC_AM_NOTIFY = 23 };

/* Longest part of a request id a log line shows. */
#define LOG_ID_MAX 128

void kvc_notify_handle(kvc_agent_t *a, const uint8_t *p, size_t len) {
    kvc_span_t id;
    uint32_t tp;
    const uint8_t *token;
    if (kvc_wire_parse_notify(p, len, &token, &id, &tp) != KVC_OK) {
        a->stats[KVC_STAT_UNKNOWN_NOTIFY]++;
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN, "notify: malformed notification (%zu bytes) ignored", len);
        return;
    }
    kvc_pub_t *pub = kvc_pubtab_find(&a->pubs, (const char *)id.p, id.len);
    int shown = id.len > LOG_ID_MAX ? LOG_ID_MAX : (int)id.len;
    if (!pub) {
        a->stats[KVC_STAT_UNKNOWN_NOTIFY]++;
        kvc_gone_t *g = kvc_token_recall(a, id, token);
        if (!g) {
            a->stats[KVC_STAT_DENIED]++;
            if (kvc_log_ratelimit(a, KVC_RL_DENIED))
                KVC_LOG(a, KVC_LOG_WARN,
                        "notify: unknown request id req=%.*s%s without a token of this producer, "
                        "refused",
                        shown, (const char *)id.p, shown < (int)id.len ? "..." : "");
            return;
        }
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN,
                    "notify: late notification for req=%.*s%s (released or expired)", shown,
                    (const char *)id.p, shown < (int)id.len ? "..." : "");
        if (g->used) return;
        g->used = true;
        char *rid = kvc_strndup((const char *)id.p, id.len);
        if (rid)
            kvc_event_push(a, KVC_EV_UNKNOWN_NOTIFY, KVC_ERR_NOT_FOUND, 0, 0, rid, NULL, 0, 0,
                           "notification for a released or expired request id");
        kvc_free(rid);
        return;
    }
    if (!kvc_mac_equal(token, pub->token, KVC_TOKEN_LEN)) {
        a->stats[KVC_STAT_DENIED]++;
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN, "notify: wrong token for req=%.*s%s, ignored", shown, pub->id,
                    shown < (int)id.len ? "..." : "");
        return;
    }
    if (pub->consumers == 0) {
        /* Consumers with a larger TP each read a slice: wait for all. */
        uint32_t ratio = tp > a->tp_size ? tp / a->tp_size : 1;
        pub->consumers = ratio ? ratio : 1;
    }
    if (++pub->notified < pub->consumers) {
        KVC_LOG(a, KVC_LOG_DEBUG, "notify: req=%s %u of %u consumers", pub->id, pub->notified,
                pub->consumers);
        return;
    }
    a->stats[KVC_STAT_RELEASED]++;
    KVC_LOG(a, KVC_LOG_DEBUG, "notify: released req=%s blocks=%zu consumer_tp=%u consumers=%u",
            pub->id, pub->n, tp, pub->consumers);
    /* RELEASED goes out once no push or confirmed read uses the blocks. */
    kvc_pub_release(a, pub, KVC_EV_RELEASED, KVC_OK, NULL);
}

static ucs_status_t notify_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                              const ucp_am_recv_param_t *param) {
    kvc_agent_t *a = arg;
    if (a->destroying) return UCS_OK;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        /* Refused (the sender's request fails): a notification is small. */
        a->stats[KVC_STAT_DENIED]++;
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN, "notify: oversized notification (%zu bytes) refused", len);
        return UCS_ERR_MESSAGE_TRUNCATED;
    }
    kvc_notify_handle(a, data, len);
    return UCS_OK;
}

kvc_status_t kvc_notify_register_am(kvc_agent_t *a) {
    return kvc_set_am_handler(a, KVC_AM_NOTIFY, notify_cb);
}

kvc_status_t kvc_notify_send(kvc_agent_t *a, ucp_ep_h ep, const kvc_buf_t *msg,
                             ucp_send_nbx_callback_t cb, void *arg, void **req) {
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = cb;
    rp.user_data = arg;
    rp.flags = UCP_AM_SEND_FLAG_EAGER;
    if (msg->len > KVC_WIRE_MAX_NOTIFY) return KVC_ERR_INVALID_PARAM;
    *req = ucp_am_send_nbx(ep, KVC_AM_NOTIFY, NULL, 0, msg->p, msg->len, &rp);
    return KVC_OK;
}
