/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/concurrent.h"

#include <string.h>

#include "base/log.h"
#include "proxy/handoff.h"

static const px_leg_cbs pre_cbs;

void px_conc_init(px_conc *c, const px_conc_ops *ops, void *owner, px_leg *pre, px_leg *dec,
                  const px_reqlog *log, char *cached) {
    *c = (px_conc){ops, owner, pre, dec, log, cached, 0};
}

px_dispatch_kind px_conc_dispatch(px_conc *c, px_dispatch_mode mode, const char *transfer_id,
                                  const px_buf *body) {
    px_leg *p = c->pre;
    px_wctx *w = p->w;
    char id[PX_DISPATCH_ID_LEN];
    px_pf_identity pf;
    int known = px_dispatch_get(w->ctx->reg->identities, p->b->name, &pf);
    px_dispatch_kind k = px_dispatch_decide(mode, known ? &pf : NULL);
    if (k == PX_DISP_CONCURRENT &&
        px_handoff_concurrent(&pf, transfer_id, body, &p->body, &c->dec->body, id) < 0)
        k = PX_DISP_NO_IDENTITY;
    if (k != PX_DISP_CONCURRENT) {
        PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"sent serial\" prefill=%s reason=%s", p->lid, p->b->name,
               px_dispatch_kind_reason(k));
        return k;
    }
    c->ops->account(c->owner);
    PX_LOG(PX_LOG_DEBUG,
           "req=%s msg=\"concurrent dispatch\" prefill=%s remote_request_id=%s transfer_id=%s",
           p->lid, p->b->name, id, transfer_id);
    p->cbs = &pre_cbs;
    p->owner = c;
    return k;
}

void px_conc_await(px_conc *c) {
    c->awaiting = 1;
    c->pre->beside = 0;
    px_leg_grace(c->pre, PX_LEG_ANSWER_GRACE_US);
}

void px_conc_distrust(px_conc *c) {
    c->pre->beside = 0;
    px_dispatch_forget(c->pre->w->ctx->reg->identities, c->pre->name);
}

static int pre_data(void *arg, const char *p, size_t n) {
    px_conc *c = arg;
    if (px_leg_keep(c->pre, p, n) < 0) return -1;
    c->ops->account(c->owner); /* held memory, counted as it arrives */
    return 0;
}

/* The prefill leg ended. A good answer refreshes the identity cache. A
 * failure while decode still waits for the KV (no answer head from it
 * yet, so nothing reached the client) cancels decode's leg, then: a 4xx
 * goes to the client as prefill said it; else the owner sends the request
 * to decode alone or fails it. No other prefill is tried: decode's params
 * name this one. Once decode has answered, it had its KV (or computed
 * it): prefill's late failure changes nothing. */
static void pre_done(void *arg, px_up_result rc, const char *why, int connected) {
    px_conc *c = arg;
    px_leg *p = c->pre;
    const px_config *cfg = p->w->ctx->cfg;
    c->ops->account(c->owner); /* the prefill's answer */
    px_leg_done(p, px_leg_outcome(p, rc));
    px_leg_answered(p, c->log->t0);
    if (rc == PX_UP_OK && p->status >= 200 && p->status < 300 && !p->too_big) {
        px_handoff_learn(p->w->ctx->reg->identities, p->name, &p->resp,
                         !strcmp(cfg->usage_from, "prefill"), c->cached);
        if (!px_reqlog_traced()) px_buf_cleanup(&p->resp);
        c->ops->account(c->owner);
        if (c->awaiting) c->ops->over(c->owner);
        return;
    }
    if (c->awaiting) {
        px_buf_reset(&p->resp);
        c->ops->over(c->owner);
        return;
    }
    if (!p->beside || c->log->t_first) {
        px_buf_reset(&p->resp);
        c->ops->account(c->owner);
        PX_LOG(PX_LOG_INFO,
               "req=%s msg=\"prefill leg failed after decode answered: decode's answer stands\" "
               "prefill=%s status=%d error=\"%s\"",
               p->lid, p->name, p->status, rc ? why : "");
        return;
    }
    PX_LOG(PX_LOG_WARN,
           "req=%s msg=\"prefill failed while decode waited for its KV: decode's leg cancelled\" "
           "prefill=%s decode=%s status=%d error=\"%s\"",
           p->lid, p->name, c->dec->name, p->status, rc ? why : "");
    px_leg_stop(c->dec, PX_OUT_CANCELLED);
    p->beside = 0;
    if (rc == PX_UP_OK && p->status >= 400 && p->status < 500 && !p->too_big) {
        c->ops->rejected(c->owner); /* as serial */
        return;
    }
    px_buf_reset(&p->resp);
    c->ops->account(c->owner);
    c->ops->failed(c->owner, rc, why);
}

/* The grace after decode's answer passed. */
static void pre_grace(void *arg) {
    px_conc *c = arg;
    c->ops->over(c->owner);
}

static const px_leg_cbs pre_cbs = {.data = pre_data, .done = pre_done, .grace = pre_grace};
