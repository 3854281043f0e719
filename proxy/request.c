/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/request.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/event_struct.h> /* free_ev is embedded */

#include "base/list.h"
#include "base/log.h"
#include "proxy/admission.h"
#include "proxy/concurrent.h"
#include "proxy/disagg.h"
#include "proxy/handoff.h"
#include "proxy/intake.h"
#include "proxy/leg.h"
#include "proxy/predict.h"
#include "proxy/release.h"
#include "proxy/reply.h"
#include "proxy/reqlog.h"

/* ---------- the states and their transitions ---------- */

typedef enum {
    RS_INTAKE,        /* checked (intake.h), not admitted yet */
    RS_ADMIT,         /* waits in the admission queue: on arrival, or an engine's queue was full */
    RS_TOKENIZE,      /* the tokenize leg asks an engine for the prompt's exact tokens */
    RS_PREFILL,       /* the prefill leg runs (serial dispatch) */
    RS_RETRY_WAIT,    /* the prefill leg waits out its backoff before another attempt */
    RS_DECODE,        /* the decode leg runs; under concurrent dispatch the prefill leg beside it */
    RS_HOLD,          /* decode's answer is held: is it a failed KV load? (kvhold.h) */
    RS_STREAM,        /* decode's answer goes to the client */
    RS_AWAIT_PREFILL, /* answered in full; the concurrent prefill leg is let end */
    RS_RELEASING,     /* the client left while prefill may hold blocks for it */
    RS_DONE,          /* finished (req_finish): waits for its free on the next loop turn */
    RS_COUNT
} req_state;

#define TO(s) (1u << RS_##s)

/* The machine in one table: each state's name (logs, the access line),
 * the phase a client leaving it is counted in, and the states it may go
 * to. Any state goes to DONE through req_finish, the one exit. */
static const struct {
    const char *name;
    px_phase phase;
    unsigned next;
} states[RS_COUNT] = {
    [RS_INTAKE] = {"intake", PX_PHASE_PREFILL, TO(ADMIT) | TO(TOKENIZE) | TO(PREFILL) | TO(DECODE)},
    [RS_ADMIT] = {"admit", PX_PHASE_PREFILL, TO(TOKENIZE) | TO(PREFILL) | TO(DECODE)},
    [RS_TOKENIZE] = {"tokenize", PX_PHASE_PREFILL, TO(PREFILL) | TO(DECODE)},
    [RS_PREFILL] = {"prefill", PX_PHASE_PREFILL,
                    TO(RETRY_WAIT) | TO(ADMIT) | TO(DECODE) | TO(RELEASING)},
    [RS_RETRY_WAIT] = {"retry_wait", PX_PHASE_PREFILL, TO(PREFILL) | TO(DECODE)},
    [RS_DECODE] = {"decode", PX_PHASE_DECODE,
                   TO(DECODE) | TO(HOLD) | TO(STREAM) | TO(ADMIT) | TO(RELEASING)},
    [RS_HOLD] = {"hold", PX_PHASE_DECODE, TO(DECODE) | TO(STREAM) | TO(RELEASING)},
    [RS_STREAM] = {"stream", PX_PHASE_STREAM, TO(AWAIT_PREFILL)},
    [RS_AWAIT_PREFILL] = {"await_prefill", PX_PHASE_STREAM, 0},
    [RS_RELEASING] = {"releasing", PX_PHASE_PREFILL, 0},
    [RS_DONE] = {"done", PX_PHASE_PREFILL, 0},
};

struct px_req {
    px_req *prev, *next; /* in w->reqs */
    px_wctx *w;          /* borrowed: the worker this request runs on */
    px_ctx *ctx;         /* borrowed */
    px_gen *g;           /* owned reference: the configuration this request runs on */
    req_state state;
    px_endpoint ep;
    px_reqlog log;        /* its record: id, trace, times, how it was served (reqlog.h) */
    px_intake in;         /* what the client sent, checked: pool, session, prompt (intake.h) */
    px_buf body;          /* owned: the client's body (until decode's is built from it) */
    char *target;         /* owned: path and query sent to decode; NULL: the endpoint's path */
    px_leg *tok;          /* owned: the call to an engine's /tokenize (leg.h); NULL: none */
    px_leg pre;           /* the prefill leg */
    px_prefill_answer pa; /* prefill's answer, read once (prefill_done or the handoff) */
    px_leg dec;           /* the decode leg */
    px_reply reply;       /* its one answer to the client (reply.h) */
    px_release rel;       /* what lets prefill's blocks go when the client left (release.h) */
    px_conc conc;         /* the prefill leg beside decode's, concurrent dispatch (concurrent.h) */
    px_disagg dis;        /* its hash owned: conditional disaggregation's estimate */
    int disagg;           /* decode's body carries prefill's kv_transfer_params */
    char transfer_id[PX_DISPATCH_XFER_LEN]; /* minted for both legs (dispatch.h) */
    px_adm_req adm;       /* admission control: its queue entry, pool slot, tenant */
    px_lat_req lat;       /* routing and admission by predicted latency (predict.h) */
    int counted;          /* holds one of the server's in-flight slots */
    int64_t held;         /* bytes of its buffers counted in the server's memory budget */
    struct event free_ev; /* frees the request on the loop turn after it finished */
};

/* Bottom-up: each section uses those above it; the legs' callback tables
 * stand after the transitions they lead to. */

/* The one place a request changes state. */
static void set_state(px_req *r, req_state st) {
    if (st != RS_DONE && !(states[r->state].next & 1u << st))
        PX_LOG(PX_LOG_ERROR, "req=%s msg=\"state change outside the table\" from=%s to=%s",
               r->log.lid, states[r->state].name, states[st].name);
    PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"state\" from=%s to=%s", r->log.lid, states[r->state].name,
           states[st].name);
    r->state = st;
}

/* Brings the memory budget's count of this request's bodies up to date. */
static void account(px_req *r) {
    int64_t now = (int64_t)(r->body.len + r->pre.body.len + r->dec.body.len + r->pre.resp.len +
                            px_reply_held(&r->reply));
    px_budget_add(&r->ctx->shared, now - r->held);
    r->held = now;
}

static void account_cb(void *arg) {
    account(arg);
}

/* ---------- DONE: the one exit ---------- */

/* Releases all r owns; r has finished (req_finish), so nothing calls back. */
static void req_free(px_req *r) {
    PX_LIST_UNLINK(r->w->reqs, r);
    r->w->nreqs--;
    if (event_initialized(&r->free_ev)) event_del(&r->free_ev);
    if (r->tok) px_leg_cleanup(r->tok);
    free(r->tok);
    px_leg_cleanup(&r->pre);
    px_leg_cleanup(&r->dec);
    px_intake_cleanup(&r->in);
    px_gen_release(r->g);
    px_budget_add(&r->ctx->shared, -r->held);
    px_buf_cleanup(&r->body);
    px_reply_cleanup(&r->reply);
    free(r->target);
    free(r->dis.hash);
    px_spare_put(&r->w->spare_reqs, r);
}

static void on_free(evutil_socket_t fd, short what, void *arg) {
    req_free(arg);
}

/* The one exit (pgbouncer's disconnect_client). With `msg`, the failure is
 * logged and, when the client has been sent nothing yet, answered in
 * OpenAI error JSON (`extra`: more header lines, or NULL); a client still
 * attached otherwise has its stream cut (callers that answered themselves
 * let the client go first). Then the metrics, the access line (with the
 * state it ended in) and the spans, once; then everything that could call
 * back is let go (the legs stopped, their backends handed back), and r is
 * freed on the next loop turn: the caller may be inside one of r's
 * callbacks. */
static void req_finish(px_req *r, int status, px_req_outcome outcome, const char *extra,
                       const char *msg) {
    if (r->state == RS_DONE) return;
    if (msg) {
        char qmsg[1100];
        PX_LOG(status >= 500 ? PX_LOG_WARN : PX_LOG_INFO, "req=%s msg=%s status=%d state=%s",
               r->log.lid, px_log_value(msg, qmsg, sizeof qmsg), status, states[r->state].name);
    }
    px_reply_fail(&r->reply, status, extra, msg);
    if (r->in.ps) px_reqlog_latency(&r->log, &r->lat, r->ctx, r->in.ps->name, status, r->disagg);
    px_reqlog_finish(&r->log, &r->w->metrics, status, outcome, states[r->state].name,
                     r->body.len ? &r->body : &r->dec.body);
    set_state(r, RS_DONE);
    if (r->tok) px_leg_stop(r->tok, PX_OUT_CANCELLED);
    px_leg_stop(&r->pre, PX_OUT_CANCELLED);
    px_leg_stop(&r->dec, PX_OUT_CANCELLED);
    if (r->counted) atomic_fetch_sub(&r->ctx->inflight, 1);
    r->counted = 0;
    px_adm_leave(r->w, &r->adm);
    event_assign(&r->free_ev, r->w->base, -1, 0, on_free, r);
    event_active(&r->free_ev, EV_TIMEOUT, 0);
}

/* Ends a request that failed: logs the message and answers it (req_finish). */
static void req_fail(px_req *r, int status, const char *extra, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    req_finish(r, status, r->state == RS_STREAM ? PX_RO_STREAM_FAILED : PX_RO_ERROR, extra, msg);
}

/* Every path on which the client is gone and nothing is left to do for it. */
static void req_abandon(void *arg) {
    req_finish(arg, 499, PX_RO_CLIENT_DISCONNECTED, NULL, NULL);
}

/* Fails r with what its leg l says of a failed answer (leg.h). */
static void leg_fail(px_req *r, const px_leg *l, px_up_result rc, const char *why) {
    char msg[512];
    int status = px_leg_error(l, rc, why, msg, sizeof msg);
    req_fail(r, status, NULL, "%s", msg);
}

/* ---------- ADMIT: back in the queue when an engine's is full ---------- */

/* An engine refused the request with 429/503 (its own queue is full):
 * back in the admission queue, to go to `go` when dispatched again.
 * Returns 1 when it waits, 0 when it cannot (the caller answers). */
static int requeue(px_req *r, void (*go)(void *)) {
    r->adm.go = go;
    set_state(r, RS_ADMIT);
    if (px_adm_requeue(r->w, &r->adm) == 0) {
        PX_LOG(PX_LOG_INFO, "req=%s msg=\"an engine's queue is full: waiting again\"", r->log.lid);
        return 1;
    }
    return 0;
}

/* ---------- DECODE, HOLD, STREAM ---------- */

/* Sends the decode request to r->dec's backend. Returns -1 when it could
 * not start (r has ended). */
static int send_decode(void *arg) {
    px_req *r = arg;
    /* This decode will hold the prompt's prefix in its cache. */
    if (r->dis.hash && r->w->pindex)
        px_pindex_add(r->w->pindex, r->dec.b->key_hash, r->dis.hash, r->dis.nhash);
    /* A GET (or a DELETE) without a body is sent without one. */
    const char *m = r->log.method;
    int bodyless = r->ep == PX_EP_MODELS ||
                   (r->dec.body.len == 0 && (!strcmp(m, "GET") || !strcmp(m, "DELETE")));
    if (px_leg_send(&r->dec, m, r->target ? r->target : px_endpoints[r->ep].path,
                    bodyless ? NULL : &r->dec.body, &r->dec.hdrs, 0) < 0) {
        req_fail(r, 502, NULL, "decode %s: cannot start the request", r->dec.name);
        return -1;
    }
    px_leg_touch(&r->dec);
    return 0;
}

/* Sends the decode body (built by the caller) or, for /v1/models, a GET
 * to the decode conditional disaggregation chose before prefill, else to
 * one picked now. */
static void start_decode(void *arg) {
    px_req *r = arg;
    size_t n = 0;
    if (!r->dec.b && !px_leg_pick(&r->dec, px_intake_pick(&r->in, r->dec.pool, (px_pick){0}), &n)) {
        req_fail(r, 503, "Retry-After: 1\r\n", "no healthy decode backend (%zu configured%s)", n,
                 px_pool_unusable_why(r->dec.pool));
        return;
    }
    set_state(r, RS_DECODE);
    send_decode(r);
}

/* The held answer is not a failed KV load: it goes to the client as it
 * came. */
static void release_hold(px_req *r) {
    set_state(r, RS_STREAM);
    px_reply_release(&r->reply, r->dec.status, r->dec.ctype, r->disagg);
    account(r);
}

static void decode_head(void *arg, int status, const char *ctype) {
    px_req *r = arg;
    if (px_adm_can_requeue(&r->adm, status)) {
        r->dec.busy = 1; /* decode_done puts it back in the queue */
        return;
    }
    px_reqlog_answer(&r->log, &r->w->metrics, &r->dec, ctype);
    px_adm_first_byte(&r->adm);
    /* Only an answer that could be a failed KV load is held, and only
     * while a retry without the KV is still possible. */
    if (r->disagg && r->ctx->cfg->fallback_decode_only &&
        px_kvhold_wanted(&r->reply.hold, status, r->log.streamed)) {
        px_kvhold_start(&r->reply.hold, r->log.streamed);
        set_state(r, RS_HOLD);
        return;
    }
    set_state(r, RS_STREAM);
    px_reply_start(&r->reply, status, ctype, r->log.streamed, r->disagg);
}

static int decode_data(void *arg, const char *p, size_t n) {
    px_req *r = arg;
    if (!r->reply.conn) return -1;
    if (r->dec.busy) return 0; /* a refusal nobody reads */
    if (r->reply.hold.active) {
        int k = px_kvhold_feed(&r->reply.hold, p, n);
        account(r);
        if (k < 0) return 0;
        if (k > 0) return -1; /* ends the transfer: decode_done retries */
        release_hold(r);
        return 0;
    }
    int usage = r->reply.usage.active;
    int k = px_reply_pass(&r->reply, p, n);
    if (usage) account(r);
    return k;
}

/* Decode failed to load prefill's KV: the request goes once more to a
 * decode, without kv_transfer_params, so it computes the prompt itself.
 * Nothing has reached the client yet. */
static void retry_without_kv(px_req *r) {
    px_handoff_forwarded(&r->dec.body);
    px_kvhold_retry(&r->reply.hold);
    r->disagg = 0;
    if (r->log.disp == PX_DISP_CONCURRENT) px_conc_distrust(&r->conc);
    r->dec.status = 0;
    r->log.t_first = 0;
    px_reqlog_fell_back(&r->log, &r->w->metrics, PX_FB_KV_LOAD);
    account(r);
    PX_LOG(PX_LOG_WARN,
           "req=%s msg=\"decode failed to load prefill's KV: retrying once without "
           "kv_transfer_params\" decode=%s",
           r->log.lid, r->dec.name);
    start_decode(r);
}

/* Decode answered in full while prefill's leg still runs: the client has
 * its answer, prefill is let end (px_conc_await). The access line is
 * written at that end (conc_over). */
static void await_prefill(px_req *r) {
    set_state(r, RS_AWAIT_PREFILL);
    px_conc_await(&r->conc);
}

static void decode_done(void *arg, px_up_result rc, const char *why, int connected) {
    px_req *r = arg;
    px_leg *d = &r->dec;
    px_outcome o = r->reply.hold.failed ? PX_OUT_SERVER_ERR : px_leg_outcome(d, rc);
    /* A full engine queue is saturation, not a failure (admission.h). */
    if (rc == PX_UP_OK && px_adm_engine_status(r->ctx, r->in.ps, d->b, d->status)) {
        o = PX_OUT_CLIENT_ERR;
        px_m_inc(&r->w->metrics.adm[PX_ADM_M_ENGINE_FULL]);
    }
    px_leg_done(d, o);
    if (d->busy) {
        /* Nothing reached the client: decode is asked again later with the
         * same body (a refused request never read prefill's blocks). */
        d->busy = 0;
        int st = d->status;
        d->status = 0;
        if (d->ntried) d->ntried--; /* not a failed attempt */
        if (rc == PX_UP_OK && requeue(r, start_decode)) return;
        req_fail(r, st ? st : 503, "Retry-After: 1\r\n",
                 "decode %s answered %d (its queue is full) and the request could not wait "
                 "again (admission queue full)",
                 d->name, st);
        return;
    }
    px_kvhold *hold = &r->reply.hold;
    if (hold->active) {
        if (px_kvhold_end(hold, rc == PX_UP_OK) > 0) {
            retry_without_kv(r);
            return;
        }
        /* Not a failed load: the held answer goes out as it came (cut
         * like decode's when decode's was cut). */
        if (rc == PX_UP_OK || hold->held.len)
            release_hold(r);
        else
            hold->active = 0;
    }
    int usage = r->reply.usage.active;
    px_reply_end(&r->reply, rc == PX_UP_OK);
    if (usage) account(r);
    if (rc == PX_UP_OK) {
        if (r->pre.up) /* concurrent: prefill's leg is let end */
            await_prefill(r);
        else
            req_finish(r, d->status, PX_RO_OK, NULL, NULL);
        return;
    }
    if (r->state == RS_STREAM) {
        req_fail(r, d->status, NULL, "decode %s failed mid-stream after %zu bytes: %s", d->name,
                 r->log.bytes_out, why);
        return;
    }
    if (px_leg_resend(d, connected, why))
        start_decode(r);
    else
        leg_fail(r, d, rc, why);
}

/* A decode idle past --decode-idle-timeout with the client there. */
static void decode_idle(void *arg) {
    px_req *r = arg;
    char msg[512];
    int status = px_leg_idle_error(&r->dec, r->reply.paused, r->log.bytes_out, msg, sizeof msg);
    req_fail(r, status, NULL, "%s", msg);
}

static const px_leg_cbs decode_cbs = {decode_head, decode_data, decode_done, .idle = decode_idle};

/* Sends the client's request to decode alone (no kv_transfer_params:
 * decode computes the prefill itself). */
static void decode_only(px_req *r) {
    px_handoff_alone(&r->body, &r->in.bx, &r->dec.body);
    r->disagg = 0;
    account(r);
    start_decode(r);
}

/* --fallback-decode-only: prefill could not serve the request. */
static void fall_back(px_req *r, px_fallback why) {
    px_reqlog_fell_back(&r->log, &r->w->metrics, why);
    decode_only(r);
}

/* ---------- PREFILL ---------- */

/* Takes the prefill of the next attempt into r->pre. Returns -1 when there
 * is none: r went on to decode alone or ended. */
static int pick_prefill(px_req *r) {
    size_t n = 0;
    if (r->in.hb) { /* sidecar: the prefill the header named */
        px_leg_take(&r->pre, r->in.hb);
    } else if (!r->in.no_prefill) {
        px_pick k = {.key = r->in.key, .key_len = r->in.key_len};
        px_leg_pick(&r->pre, px_intake_pick(&r->in, r->pre.pool, k), &n);
    }
    if (r->pre.b) return 0;
    if (r->in.no_prefill) {
        PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"no x-prefiller-host-port: decode alone\"", r->log.lid);
        decode_only(r);
    } else if (r->ctx->cfg->fallback_decode_only) {
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"no healthy prefill: sending the request to decode alone\" "
               "prefill_backends=%zu",
               r->log.lid, n);
        fall_back(r, PX_FB_NO_PREFILL);
    } else {
        req_fail(r, 503, "Retry-After: 1\r\n", "no healthy prefill backend (%zu configured%s)", n,
                 px_pool_unusable_why(r->pre.pool));
    }
    return -1;
}

/* Sends the prefill body to r->pre's backend. Returns -1 when r has ended. */
static int send_prefill(px_req *r) {
    set_state(r, RS_PREFILL);
    r->pa.read = 0;
    int rc = px_leg_send(&r->pre, "POST", px_endpoints[r->ep].path, &r->pre.body, &r->pre.hdrs, 0);
    if (rc == PX_LEG_PAST)
        req_fail(r, 504, NULL, "prefill did not answer within --prefill-timeout %gs",
                 r->ctx->cfg->prefill_timeout);
    else if (rc < 0)
        req_fail(r, 502, NULL, "prefill %s: cannot start the request", r->pre.name);
    return rc < 0 ? -1 : 0;
}

/* A prefill attempt (the first, one after the backoff, or after the
 * admission queue again). */
static void start_prefill(void *arg) {
    if (pick_prefill(arg) == 0) send_prefill(arg);
}

static int prefill_data(void *arg, const char *p, size_t n) {
    px_req *r = arg;
    if (px_leg_keep(&r->pre, p, n) < 0) return -1;
    account(r); /* held memory, counted as it arrives */
    return 0;
}

/* A prefill attempt ended: its answer is counted, its backend handed back.
 * Returns how the attempt went. */
static px_outcome prefill_ended(px_req *r, px_up_result rc) {
    account(r); /* the prefill's answer */
    /* A full engine queue is not a failure. */
    px_outcome o = r->pre.busy ? PX_OUT_CLIENT_ERR : px_leg_outcome(&r->pre, rc);
    px_leg_done(&r->pre, o);
    return o;
}

/* Prefill answered 4xx: the client's fault. Its status goes back with the
 * engine's words as they are (a configured prefill: the operator's
 * engine), or, from a prefill a sidecar's header named (`named`), the
 * status with the engine's message. */
static void prefill_rejected(px_req *r, int named) {
    px_leg *p = &r->pre;
    if (named) {
        char msg[512];
        px_leg_rejection(p, msg, sizeof msg);
        req_finish(r, p->status, PX_RO_PREFILL_REJECTED, NULL, msg);
        return;
    }
    px_reply_body(&r->reply, p->status, p->ctype, p->resp.data, p->resp.len);
    req_finish(r, p->status, PX_RO_PREFILL_REJECTED, NULL, NULL);
}

/* Decode's body (handoff.h): what prefill's answer held (bad: r->pa.err). */
static px_kvp_status decode_body(px_req *r) {
    px_kvp_status ks = px_handoff_serial(
        &r->w->metrics, r->log.lid, r->pre.name, &r->pa, &r->pre.resp, px_reqlog_traced(), &r->body,
        &r->in.bx, &r->pre.body,
        r->in.ps->dispatch == PX_DISPATCH_CONCURRENT ? r->ctx->reg->identities : NULL,
        !strcmp(r->ctx->cfg->usage_from, "prefill"), r->transfer_id, &r->dec.body, r->reply.cached);
    if (ks == PX_KVP_BAD_RESPONSE) return ks;
    r->disagg = ks != PX_KVP_MISSING;
    px_intake_body_gone(&r->in);
    account(r);
    return ks;
}

static void proceed_to_decode(px_req *r) {
    if (decode_body(r) == PX_KVP_BAD_RESPONSE) {
        req_fail(r, 502, NULL, "prefill %s returned an invalid answer: %s", r->pre.name,
                 r->pa.err);
        return;
    }
    start_decode(r);
}

static void prefill_done(void *arg, px_up_result rc, const char *why, int connected) {
    px_req *r = arg;
    px_leg *p = &r->pre;
    const px_config *cfg = r->ctx->cfg;
    /* Another request's answer (an engine's late extra one): never its
     * kv_transfer_params to decode; it ends as a broken answer (retried). */
    if (rc == PX_UP_OK && p->status >= 200 && p->status < 300)
        px_prefill_answer_read(&r->pa, p->resp.data, p->resp.len);
    if (r->pa.read && px_leg_answer_foreign(p, &r->pa.rid, r->log.id)) {
        rc = PX_UP_RESET;
        why = "the answer names another request (remote_request_id)";
    }
    /* A full engine queue (admission.h) while the request may wait again:
     * the backend backs off, not counted as failed, and the request goes
     * back in the queue. Without a queue or time left, as before: a 503
     * is retried elsewhere, a 429 passed on. */
    p->busy = rc == PX_UP_OK && p->b && !r->in.hb && px_adm_can_requeue(&r->adm, p->status) &&
              px_adm_engine_status(r->ctx, r->in.ps, p->b, p->status);
    px_outcome o = prefill_ended(r, rc);
    if (p->busy) {
        p->busy = 0;
        px_m_inc(&r->w->metrics.adm[PX_ADM_M_ENGINE_FULL]);
        px_buf_reset(&p->resp);
        p->status = 0;
        if (p->ntried) p->ntried--; /* not a failed attempt */
        if (requeue(r, start_prefill)) return;
        req_fail(r, 503, "Retry-After: 1\r\n",
                 "prefill %s's queue is full and the admission queue has no room", p->name);
        return;
    }
    /* Refused, reset or 5xx: another prefill, after a jittered pause. */
    if (px_leg_retry(p, o, cfg->prefill_retries, rc, why)) {
        set_state(r, RS_RETRY_WAIT);
        return;
    }
    px_leg_answered(&r->pre, r->log.t0);
    /* Retries spent on a prefill that failed (5xx, refused, reset): with
     * --fallback-decode-only decode computes the prefill itself. Never
     * after a 4xx (the client's error, returned below as it is), nor after
     * a timeout (the prefill may still be working). */
    int failed_5xx = rc == PX_UP_OK && p->status >= 500 && p->status < 600;
    int failed_conn = rc == PX_UP_CONNECT || rc == PX_UP_RESET;
    if ((failed_5xx || failed_conn) && !p->too_big && cfg->fallback_decode_only) {
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"prefill failed: sending the request to decode alone\" prefill=%s "
               "status=%d error=\"%s\"",
               r->log.lid, p->name, p->status, rc ? why : "");
        px_buf_reset(&p->resp);
        account(r);
        fall_back(r, failed_5xx ? PX_FB_PREFILL_5XX : PX_FB_PREFILL_CONN);
        return;
    }
    if (rc == PX_UP_OK && p->status >= 400 && p->status < 500) {
        PX_LOG(PX_LOG_INFO, "req=%s msg=\"prefill rejected the request\" prefill=%s status=%d",
               r->log.lid, p->name, p->status);
        prefill_rejected(r, r->in.hb != NULL);
        return;
    }
    if (rc != PX_UP_OK || p->status < 200 || p->status >= 300) {
        leg_fail(r, p, rc, why);
        return;
    }
    proceed_to_decode(r);
}

static const px_leg_cbs prefill_cbs = {
    .data = prefill_data, .done = prefill_done, .retry = start_prefill};

/* ---------- concurrent dispatch: the prefill leg beside decode's ---------- */

/* The prefill leg ended after decode answered in full (AWAIT_PREFILL). */
static void conc_over(void *arg) {
    px_req *r = arg;
    req_finish(r, r->dec.status, PX_RO_OK, NULL, NULL);
}

static void conc_rejected(void *arg) {
    prefill_rejected(arg, 0); /* as serial */
}

/* Prefill failed while decode waited for its KV: with
 * --fallback-decode-only decode alone, else an OpenAI error. */
static void conc_failed(void *arg, px_up_result rc, const char *why) {
    px_req *r = arg;
    if (r->ctx->cfg->fallback_decode_only)
        fall_back(r, PX_FB_CONC_PREFILL);
    else
        leg_fail(r, &r->pre, rc, why);
}

/* What the concurrent prefill leg (concurrent.h) tells the request. */
static const px_conc_ops conc_ops = {account_cb, conc_over, conc_rejected, conc_failed};

/* --dispatch concurrent: both legs sent now when px_conc_dispatch says so,
 * else prefill serial. Decode's leg goes on as any decode (its answer
 * streamed, its failed KV load retried). */
static void dispatch_concurrent(px_req *r) {
    if (pick_prefill(r) < 0) return;
    px_dispatch_kind k = px_conc_dispatch(&r->conc, r->in.ps->dispatch, r->transfer_id, &r->body);
    px_reqlog_dispatched(&r->log, &r->w->metrics, k);
    if (k != PX_DISP_CONCURRENT) {
        send_prefill(r);
        return;
    }
    r->disagg = 1;
    if (send_prefill(r) < 0) return;
    r->pre.beside = 1;
    start_decode(r);
}

/* ---------- RELEASING: the client left, prefill's blocks are let go ---------- */

static int handoff(void *arg) {
    px_kvp_status ks = decode_body(arg);
    return ks == PX_KVP_OK || ks == PX_KVP_NO_REQUEST_ID;
}

/* What the release (release.h) asks of the request. */
static const px_release_ops release_ops = {account_cb, handoff, send_decode, req_abandon};

/* ---------- the client ---------- */

static void client_gone(void *arg) {
    px_req *r = arg;
    r->reply.conn = NULL;
    px_m_inc(&r->w->metrics.disconnects[states[r->state].phase]);
    /* Concurrent: prefill's leg is cut at once (an engine drops a prefill
     * whose client left; one that published already is read by decode's
     * registration); decode's is let receive its whole request, as below,
     * so that a publication is met and released. */
    if (r->pre.up && r->state != RS_PREFILL) px_leg_stop(&r->pre, PX_OUT_CANCELLED);
    if (r->state == RS_PREFILL && r->pre.up) {
        set_state(r, RS_RELEASING);
        px_release_prefill(&r->rel);
    } else if ((r->state == RS_DECODE || r->state == RS_HOLD) && r->dec.up && r->disagg &&
               !px_leg_abort_after_upload(&r->dec)) {
        set_state(r, RS_RELEASING);
        px_release_decode(&r->rel);
    } else {
        req_abandon(r);
    }
}

static void client_drained(void *arg) {
    px_req *r = arg;
    if (r->reply.paused && r->dec.up) {
        r->reply.paused = 0;
        px_leg_touch(&r->dec);
        px_leg_resume(&r->dec);
    }
}

static const px_exchange_cbs client_cbs = {client_gone, client_drained};

/* ---------- TOKENIZE, and the decision: prefill, or decode alone ---------- */

/* Routes a P/D request once its tokens are known (or are not to be). */
static void route_pd(px_req *r);

/* Routing and admission by predicted latency (predict.h): 1 when r was
 * refused, waits in the queue, or went to decode alone on the plan. */
static int lat_ready(void *arg) {
    return px_lat_req_ready(&((px_req *)arg)->lat);
}

static void adm_reroute(void *arg) {
    px_req *r = arg;
    r->adm.ready = NULL;
    route_pd(r);
}

static int lat_route(px_req *r) {
    px_lat_verdict v =
        px_intake_lat_route(&r->in, &r->lat, r->adm.tenant, r->log.t0, r->adm.deadline_ns);
    if (v == PX_LATV_WAIT) {
        r->adm.ready = lat_ready;
        r->adm.it.cls = PX_ADM_CLASSES - 1; /* behind the requests that can meet theirs */
        if (requeue(r, adm_reroute)) return 1;
        r->adm.ready = NULL;
        v = px_lat_req_refuse(&r->lat); /* no room to wait */
    }
    if (v == PX_LATV_REFUSE) {
        char extra[40], msg[200];
        int status = px_lat_req_refusal(&r->lat, extra, sizeof extra, msg, sizeof msg);
        req_fail(r, status, extra, "%s", msg);
        return 1;
    }
    if (v != PX_LATV_LOCAL) return 0;
    px_reqlog_decided(&r->log, &r->w->metrics, PX_DEC_PREDICTED);
    decode_only(r);
    return 1;
}

static void route_pd(px_req *r) {
    px_intake_token_key(&r->in);
    /* sidecar: the header decides */
    if (!r->in.hb && !r->in.no_prefill && lat_route(r)) return;
    int disagg = px_intake_decide(&r->in, &r->dec, &r->dis);
    px_reqlog_decided(&r->log, &r->w->metrics, r->dis.decision);
    if (!disagg) {
        if (r->log.decision == PX_DEC_NO_PREFILL) {
            PX_LOG(PX_LOG_WARN,
                   "req=%s msg=\"no healthy prefill: sending the request to decode alone\"",
                   r->log.lid);
            fall_back(r, PX_FB_NO_PREFILL);
        } else {
            decode_only(r);
        }
        return;
    }
    if (px_dispatch_mint_transfer_id(r->transfer_id) < 0) {
        req_fail(r, 500, NULL, "cannot mint a transfer id: the random generator failed");
        return;
    }
    px_handoff_prefill(r->ep, &r->body, &r->in.bx, r->transfer_id, &r->pre.body);
    account(r);
    if (r->ctx->cfg->prefill_timeout > 0)
        r->pre.deadline = px_now_ns() + (uint64_t)(r->ctx->cfg->prefill_timeout * 1e9);
    if (r->in.ps->dispatch == PX_DISPATCH_CONCURRENT) {
        dispatch_concurrent(r);
        return;
    }
    px_reqlog_dispatched(&r->log, &r->w->metrics, PX_DISP_SERIAL);
    start_prefill(r);
}

static void tok_done(void *arg, px_up_result rc, const char *why, int connected) {
    px_req *r = arg;
    px_intake_tokens_done(&r->in, r->tok, rc, why, r->log.lid);
    if (r->state == RS_TOKENIZE) route_pd(r);
}

static const px_leg_cbs tokenize_cbs = {.done = tok_done};

/* Admitted: the prompt's key and, when wanted, its exact tokens. */
static void pd_go(void *arg) {
    px_req *r = arg;
    /* The tenant's cache_salt in place of the client's (tenant.h), and a
     * stream asked for its usage when the tenant's tokens count. */
    if (px_adm_body(&r->adm, r->ep == PX_EP_CHAT || r->ep == PX_EP_COMPLETIONS, &r->body))
        account(r);
    r->in.salt = px_adm_salt_key(&r->adm);
    px_buf body = {0}; /* the /tokenize request, when one is to be made */
    if (px_intake_tokens(&r->in, px_intake_prompt(&r->in), &body)) {
        r->tok = px_xcalloc(1, sizeof *r->tok);
        px_leg_init(r->tok, PX_LEG_TOKENIZE, r->w, &tokenize_cbs, r, r->log.lid);
        r->tok->body = body;
        if (px_intake_tokens_ask(&r->in, r->tok, &r->pre.hdrs)) {
            set_state(r, RS_TOKENIZE);
            return;
        }
    }
    route_pd(r);
}

/* ---------- INTAKE: the request arrives ---------- */

/* A request for `ep` on worker w, owning the client's body (moved out of
 * `body`), with its record, its legs and their header lines. */
static px_req *req_new(px_wctx *w, px_conn *c, px_endpoint ep, const px_http_head *h,
                       px_buf *body) {
    px_req *r = px_spare_take(&w->spare_reqs, sizeof *r);
    r->w = w;
    PX_LIST_PUSH(w->reqs, r);
    w->nreqs++;
    r->ctx = w->ctx;
    r->g = px_ctx_gen(r->ctx);
    r->ep = ep;
    r->state = RS_INTAKE;
    r->body = *body;
    px_buf_init(body);
    px_intake_init(&r->in, w, r->g, ep, &r->body);
    px_leg_init(&r->pre, PX_LEG_PREFILL, w, &prefill_cbs, r, r->log.lid);
    px_leg_init(&r->dec, PX_LEG_DECODE, w, &decode_cbs, r, r->log.lid);
    r->pre.rid = r->dec.rid = r->log.id;
    r->pre.pool = &r->in.ps->prefill;
    r->dec.pool = &r->in.ps->decode;
    px_release_init(&r->rel, &release_ops, r, &r->pre, &r->dec, &r->in);
    px_conc_init(&r->conc, &conc_ops, r, &r->pre, &r->dec, &r->log, r->reply.cached);
    px_reqlog_start(&r->log, c, ep, h, &r->target);
    px_reqlog_sources(&r->log, &r->pre, &r->dec, &r->dis, &r->adm, r->ctx->cfg);
    r->log.lat = r->in.lat = &r->lat;
    px_reply_init(&r->reply, c, r->ctx, &r->adm, r->log.id, &r->log.bytes_out);
    r->reply.lat = &r->lat;
    const px_reqlog *lg = &r->log;
    /* Only the P/D endpoints ever reach a prefill. */
    if (!px_endpoint_passthrough(ep) && ep != PX_EP_MODELS)
        px_intake_headers(r->ctx, ep, h, lg->id, lg->trace_id, lg->trace_flags, lg->traced,
                          r->pre.span, &r->pre.hdrs);
    px_intake_headers(r->ctx, ep, h, lg->id, lg->trace_id, lg->trace_flags, lg->traced, r->dec.span,
                      &r->dec.hdrs);
    return r;
}

/* Intake refused the request: its own answer (404 model_not_found) or an
 * OpenAI error. */
static void refuse(px_req *r, px_verdict *v) {
    if (!v->body.len) {
        req_fail(r, v->status, v->extra, "%s", v->msg);
        return;
    }
    px_reply_body(&r->reply, v->status, "application/json", v->body.data, v->body.len);
    req_finish(r, v->status, PX_RO_MODEL_NOT_FOUND, NULL, NULL);
}

/* The client's bytes to a decode, with the keys the proxy owns taken out of
 * a JSON object body (kv_transfer_params: SECURITY.md). */
static void start_passthrough(px_req *r) {
    int fw = px_handoff_forwarded(&r->body);
    if (fw < 0) {
        req_fail(r, 400, NULL,
                 fw == -2 ? "request body must be UTF-8 JSON without a byte-order mark"
                          : "request body is not valid JSON");
        return;
    }
    r->dec.body = r->body;
    px_buf_init(&r->body);
    account(r);
    start_decode(r);
}

static void adm_expire(void *arg) {
    px_req *r = arg;
    r->lat.refused = r->lat.waited; /* it waited for its prediction in vain */
    req_fail(r, 503, "Retry-After: 1\r\n",
             "the request waited %.3f s in the admission queue for a saturated pool: its "
             "deadline passed (--queue-timeout, x-queue-timeout)",
             (double)r->adm.wait_ns / 1e9);
}

/* A P/D request: checked, counted in the memory budget, admitted. */
static void start_pd(px_req *r, const px_http_head *h) {
    px_verdict v = {0};
    int rc = px_intake_pd(&r->in, h, r->log.lid, &v);
    r->pre.pool = &r->in.ps->prefill;
    r->dec.pool = &r->in.ps->decode;
    if (rc == 0) account(r);
    if (rc < 0 || px_intake_room(&r->in, &r->held, &v) < 0) {
        refuse(r, &v);
        px_verdict_cleanup(&v);
        return;
    }
    /* The tenant's rate limits and the pool's saturation: on now, queued,
     * or refused. */
    int status = 0;
    char extra[768], msg[300];
    r->adm.it.owner = r;
    r->adm.go = pd_go;
    r->adm.expire = adm_expire;
    r->adm.peer = r->log.client;
    r->adm.cert = r->ctx->tcerts ? px_conn_client_cert(r->reply.conn) : NULL;
    r->adm.bx = &r->in.bx;
    px_lat_req_headers(&r->lat, r->ctx, h, r->body.data, r->body.len);
    px_adm_verdict av = px_adm_enter(r->w, &r->adm, r->in.ps, h, r->body.data, r->body.len, &status,
                                     extra, sizeof extra, msg, sizeof msg);
    if (av == PX_ADM_QUEUED) {
        PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"queued\" class=%d", r->log.lid, r->adm.it.cls);
        set_state(r, RS_ADMIT);
    } else if (av == PX_ADM_REFUSED) {
        req_fail(r, status, extra, "%s", msg);
    } else {
        pd_go(r);
    }
}

void px_req_start(px_wctx *w, px_conn *c, px_endpoint ep, const px_http_head *h, px_buf *body) {
    px_req *r = req_new(w, c, ep, h, body);
    px_verdict v = {0};
    if (px_intake_admit(&r->in, h, &r->counted, &v) < 0) {
        refuse(r, &v);
        return;
    }
    px_conn_bind(c, &client_cbs, r);
    if (ep == PX_EP_MODELS)
        start_decode(r);
    else if (px_endpoint_passthrough(ep))
        start_passthrough(r);
    else
        start_pd(r, h);
}

void px_req_free_all(px_wctx *w) {
    px_adm_worker_stop(w->adm);
    while (w->reqs) {
        px_req *r = w->reqs;
        /* Finished ones wait for a loop turn that will not come. */
        req_finish(r, 499, PX_RO_STOPPED, NULL, NULL);
        req_free(r);
    }
    px_intake_worker_cleanup(w);
}
