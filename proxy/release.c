/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/release.h"

#include "base/log.h"

/* How long a prefill whose client left gets to answer before it is told
 * (pre_grace: its write side shut, its answer still read for
 * PX_LEG_ANSWER_GRACE_US); one that has started answering is let finish
 * (so decode can release its blocks), but not for longer than the answer
 * grace, so a prefill stalled mid-answer is cut too. */
#define PREFILL_GRACE_US 50000

static const px_leg_cbs pre_cbs, dec_cbs;

void px_release_init(px_release *rl, const px_release_ops *ops, void *owner, px_leg *pre,
                     px_leg *dec, px_intake *in) {
    *rl = (px_release){ops, owner, pre, dec, in, 0};
}

static void over(void *arg) {
    px_release *rl = arg;
    rl->ops->over(rl->owner);
}

/* Decode has the request and its kv_transfer_params; it drops the request
 * now that the client left, and tells prefill to free the blocks. */
static void released(px_release *rl) {
    px_m_inc(&rl->dec->w->metrics.stranded_released);
    PX_LOG(PX_LOG_INFO,
           "req=%s msg=\"client left after prefill: decode was given the request and "
           "aborted so prefill frees its blocks\" decode=%s",
           rl->dec->lid, rl->dec->name);
    over(rl);
}

static void start(px_release *rl) {
    px_leg *d = rl->dec;
    size_t n;
    if (!d->b && !px_leg_pick(d, px_intake_pick(rl->in, d->pool, (px_pick){0}), &n)) {
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"client left after prefill and no decode can take "
               "the request: prefill's blocks stay until they expire\"",
               d->lid);
        over(rl);
        return;
    }
    px_release_decode(rl);
    if (rl->ops->send(rl->owner) < 0) return;
    /* The body only has to reach decode (it may have already: our client
     * writes at once, and a nearby decode acknowledges fast). */
    if (px_leg_abort_after_upload(d)) released(rl);
}

/* Decode's answer is nobody's: its first byte ends the transfer. */
static int dec_data(void *arg, const char *p, size_t n) {
    return -1;
}

static void dec_done(void *arg, px_up_result rc, const char *why, int connected) {
    px_release *rl = arg;
    if (connected) {
        released(rl);
        return;
    }
    px_leg_done(rl->dec, px_leg_outcome(rl->dec, rc));
    if (px_leg_resend(rl->dec, connected, why))
        start(rl);
    else
        over(rl);
}

static int pre_data(void *arg, const char *p, size_t n) {
    px_release *rl = arg;
    if (px_leg_keep(rl->pre, p, n) < 0) return -1;
    rl->ops->account(rl->owner); /* held memory, counted as it arrives */
    return 0;
}

/* Prefill answered: without kv_transfer_params in its answer there is
 * nothing to release. */
static void pre_done(void *arg, px_up_result rc, const char *why, int connected) {
    px_release *rl = arg;
    px_leg *p = rl->pre;
    rl->ops->account(rl->owner);
    px_leg_done(p, px_leg_outcome(p, rc));
    if (rc == PX_UP_OK && p->status >= 200 && p->status < 300 && rl->ops->handoff(rl->owner))
        start(rl);
    else
        over(rl);
}

/* Prefill did not answer in its grace. It may still have published: an
 * engine publishes just before its answer leaves, and the answer may be on
 * its way (a loaded proxy, a slow network). Cutting the connection then
 * strands the blocks until they expire. So the prefill is told the client
 * left (its connection's write side shut: an engine aborts a request whose
 * client closed, and one that has not published never will) and its
 * answer is still read for PX_LEG_ANSWER_GRACE_US: one that comes is
 * released through decode. Where that cannot be done (https), it is cut. */
static void pre_grace(void *arg) {
    px_release *rl = arg;
    if (!rl->half_closed && rl->pre->up && px_upstream_half_close(rl->pre->up) == 0) {
        rl->half_closed = 1;
        px_leg_grace(rl->pre, PX_LEG_ANSWER_GRACE_US);
        return;
    }
    over(rl);
}

static const px_leg_cbs pre_cbs = {.data = pre_data, .done = pre_done, .grace = pre_grace};
static const px_leg_cbs dec_cbs = {.data = dec_data, .done = dec_done, .idle = over};

void px_release_prefill(px_release *rl) {
    rl->pre->cbs = &pre_cbs;
    rl->pre->owner = rl;
    px_leg_grace(rl->pre, px_leg_answering(rl->pre) ? PX_LEG_ANSWER_GRACE_US : PREFILL_GRACE_US);
}

void px_release_decode(px_release *rl) {
    rl->dec->cbs = &dec_cbs;
    rl->dec->owner = rl;
}
