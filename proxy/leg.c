/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/leg.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/event.h>

#include "base/json.h"
#include "base/log.h"
#include "proxy/dp.h"
#include "proxy/trace.h"

enum { TIMER_NONE = 0, TIMER_RETRY, TIMER_GRACE, TIMER_IDLE };

/* Largest prefill answer kept; a prefill answers one token, so anything near
 * this is a broken engine, not a big request. */
#define PREFILL_MAX_ANSWER (8 * 1024 * 1024)

static const px_upstream_cbs leg_up_cbs;
static void on_timer(evutil_socket_t fd, short what, void *arg);

/* Copies the string s into out (cap bytes), cut to fit: the names and
 * types a leg keeps, without printf's cost on every request. */
static void copy(char *out, size_t cap, const char *s) {
    size_t n = strlen(s);
    if (n >= cap) n = cap - 1;
    memcpy(out, s, n);
    out[n] = '\0';
}

void px_leg_init(px_leg *l, px_leg_role role, px_wctx *w, const px_leg_cbs *cbs, void *owner,
                 const char *lid) {
    l->lid = lid;
    l->role = role;
    l->w = w;
    l->cbs = cbs;
    l->owner = owner;
    l->rank = -1;
    px_buf_init(&l->hdrs);
    px_buf_init(&l->body);
    px_buf_init(&l->resp);
    if (role != PX_LEG_TOKENIZE) px_trace_span_new(l->span);
    if (role == PX_LEG_PREFILL) l->max_resp = PREFILL_MAX_ANSWER;
    if (role == PX_LEG_DECODE) l->idle_s = w->ctx->cfg->decode_idle_timeout;
}

void px_leg_cleanup(px_leg *l) {
    px_leg_stop(l, PX_OUT_CANCELLED);
    if (l->timer) event_free(l->timer);
    l->timer = NULL;
    px_buf_cleanup(&l->hdrs);
    px_buf_cleanup(&l->body);
    px_buf_cleanup(&l->resp);
}

const char *px_leg_role_name(px_leg_role role) {
    return role == PX_LEG_TOKENIZE ? "tokenize" : role == PX_LEG_PREFILL ? "prefill" : "decode";
}

/* The rank table of the leg's role (a tokenize call is counted as
 * decode's, as it always was). */
static px_dp_role dp_role(const px_leg *l) {
    return l->role == PX_LEG_PREFILL ? PX_DP_PREFILL : PX_DP_DECODE;
}

/* The attempt ended: its data-parallel rank is free again (the backend is
 * held until after this). */
static void dp_end(px_leg *l) {
    if (l->rank < 0) return;
    if (l->b) px_dp_done(l->w->ctx->reg->dp, dp_role(l), l->b->name, l->rank);
    l->rank = -1;
}

static void timer_stop(px_leg *l) {
    if (l->timer) evtimer_del(l->timer);
    l->timer_kind = TIMER_NONE;
}

static void timer_arm(px_leg *l, int kind, uint64_t us) {
    if (!l->timer) l->timer = evtimer_new(l->w->base, on_timer, l);
    l->timer_kind = kind;
    struct timeval tv = {(time_t)(us / 1000000), (suseconds_t)(us % 1000000)};
    evtimer_add(l->timer, &tv);
}

/* ---------- choosing the backend ---------- */

px_backend *px_leg_pick(px_leg *l, px_pick k, size_t *nmembers) {
    size_t cached = 0;
    k.exclude = l->tried;
    k.nexclude = l->ntried;
    k.cached = &cached;
    l->b = px_pool_pick(l->pool, &k, nmembers);
    if (l->b) l->charge = (long)(k.ntok - cached);
    return l->b;
}

void px_leg_take(px_leg *l, px_backend *b) {
    px_backend_take(b);
    l->b = b;
    l->named = 1;
}

px_backend *px_leg_pick_any(px_leg *l, px_pool *pool, uint64_t key) {
    size_t nm;
    px_backend **m = px_pool_members(pool, &nm);
    for (size_t j = 0; j < nm && !l->b; j++) {
        px_backend *b = m[(key + j) % nm];
        if (atomic_load(&b->healthy) && !atomic_load(&b->drained)) {
            l->b = b;
            atomic_fetch_add(&b->refs, 1);
        }
    }
    for (size_t j = 0; j < nm; j++)
        px_backend_release(m[j]);
    free(m);
    return l->b;
}

/* ---------- an attempt ---------- */

int px_leg_send(px_leg *l, const char *method, const char *path, const px_buf *body,
                const px_buf *hdrs, double total) {
    px_backend *b = l->b;
    const px_config *cfg = l->w->ctx->cfg;
    copy(l->name, sizeof l->name, b->name);
    l->https = (unsigned char)b->https;
    if (!l->t_start) l->t_start = px_now_ns();
    if (l->ntried < PX_LEG_MAX_TRIES) l->tried[l->ntried++] = b;
    if (l->deadline) {
        uint64_t now = px_now_ns();
        if (now + 1000000 >= l->deadline) return PX_LEG_PAST;
        total = (double)(l->deadline - now) / 1e9;
    }
    /* A data-parallel backend: the rank with the fewest requests in flight. */
    px_dp_role role = dp_role(l);
    int64_t dp =
        px_dp_size(l->w->ctx->reg->dp, b->src,
                   (int)(role == PX_DP_PREFILL ? cfg->prefill_dp_size : cfg->decode_dp_size));
    px_buf hd;
    px_buf_init(&hd);
    if (dp > 1) {
        dp_end(l);
        int rank = px_dp_take(l->w->ctx->reg->dp, role, b->name, (int)dp);
        if (rank >= 0) {
            l->rank = rank;
            if (hdrs) px_buf_append(&hd, hdrs->data, hdrs->len);
            px_buf_printf(&hd, "X-data-parallel-rank: %d\r\n", rank);
            hdrs = &hd;
        }
    }
    px_upstream_req q = {
        .backend = b,
        .method = method,
        .path = path,
        .body = body ? body->data : NULL,
        .len = body ? body->len : 0,
        .headers = hdrs,
        .connect_timeout = cfg->connect_timeout,
        .total_timeout = total,
        .ca_file = cfg->upstream_ca,
        .insecure = cfg->upstream_insecure,
        .track_upload = body && l->role == PX_LEG_DECODE,
        .request_id = l->rid,
    };
    l->up = px_upstream_start(l->w->up, &q, &leg_up_cbs, l);
    px_buf_cleanup(&hd);
    if (!l->up) dp_end(l);
    return l->up ? 0 : -1;
}

void px_leg_answered(px_leg *l, uint64_t t0) {
    l->t_end = px_now_ns();
    px_hist_observe(&l->w->metrics.prefill, (double)(l->t_end - t0) / 1e9);
}

void px_leg_uncharge(px_leg *l) {
    px_backend_charge(l->b, -l->charge);
    l->charge = 0;
}

void px_leg_done(px_leg *l, px_outcome o) {
    px_backend *b = l->b;
    if (!b) return;
    l->b = NULL;
    if (l->role == PX_LEG_TOKENIZE) {
        px_backend_release(b);
        return;
    }
    px_backend_charge(b, -l->charge);
    l->charge = 0;
    /* A request's attempts on the same backend (retries with one instance
     * configured) are one failure toward --unhealthy-after, not one each. */
    for (size_t i = 0; i + 1 < l->ntried; i++)
        if (l->tried[i] == b) {
            px_backend_done_repeat(l->pool, b, o);
            return;
        }
    px_backend_done(l->pool, b, o);
}

void px_leg_stop(px_leg *l, px_outcome o) {
    if (!l->up && !l->b && l->rank < 0 && l->timer_kind == TIMER_NONE) return; /* idle */
    px_upstream_cancel(l->up);
    l->up = NULL;
    dp_end(l);
    timer_stop(l);
    px_leg_done(l, o);
}

/* ---------- the transfer's callbacks ---------- */

static void up_headers(void *arg, int status, const char *ctype) {
    px_leg *l = arg;
    l->status = status;
    copy(l->ctype, sizeof l->ctype, ctype ? ctype : "application/json");
    px_leg_touch(l);
    if (l->cbs->head) l->cbs->head(l->owner, status, ctype);
}

int px_leg_keep(px_leg *l, const char *p, size_t n) {
    if (l->resp.len + n > l->max_resp) {
        l->too_big = 1;
        return -1;
    }
    px_buf_append(&l->resp, p, n);
    return 0;
}

static int up_data(void *arg, const char *p, size_t n) {
    px_leg *l = arg;
    px_leg_touch(l);
    return l->cbs->data ? l->cbs->data(l->owner, p, n) : px_leg_keep(l, p, n);
}

static void up_done(void *arg, px_up_result rc, const char *why, int connected) {
    px_leg *l = arg;
    l->up = NULL; /* freed by the upstream module when this returns */
    dp_end(l);
    timer_stop(l);
    l->cbs->done(l->owner, rc, why[0] ? why : px_up_result_str(rc), connected);
}

static const px_upstream_cbs leg_up_cbs = {up_headers, up_data, up_done};

int px_leg_header(px_leg *l, const char *name, char *out, size_t cap) {
    return px_upstream_header(l->up, name, out, cap);
}

int px_leg_answering(px_leg *l) {
    return px_upstream_answering(l->up);
}

int px_leg_abort_after_upload(px_leg *l) {
    return px_upstream_abort_after_upload(l->up);
}

void px_leg_resume(px_leg *l) {
    px_upstream_resume(l->up);
}

/* ---------- retries and timers ---------- */

px_outcome px_leg_outcome(const px_leg *l, px_up_result rc) {
    if (l->too_big) return PX_OUT_SERVER_ERR;
    switch (rc) {
    case PX_UP_OK:
        return l->status >= 500   ? PX_OUT_SERVER_ERR
               : l->status >= 400 ? PX_OUT_CLIENT_ERR
                                  : PX_OUT_OK;
    case PX_UP_CONNECT:
        return PX_OUT_CONNECT_ERR;
    case PX_UP_TIMEOUT:
        return PX_OUT_TIMEOUT;
    case PX_UP_ABORTED:
        return PX_OUT_CANCELLED;
    default:
        return PX_OUT_RESET;
    }
}

int px_leg_answer_foreign(px_leg *l, const px_json_member *rid, const char *id) {
    if (l->status < 200 || l->status >= 300 || !px_upstream_answer_foreign(l->b, rid, id))
        return 0;
    px_m_inc(&l->w->metrics.answers_foreign);
    PX_LOG(PX_LOG_WARN, "req=%s msg=\"prefill answered for another request: refused\" prefill=%s",
           l->lid, l->name);
    return 1;
}

int px_leg_retry(px_leg *l, px_outcome o, long long retries, px_up_result rc, const char *why) {
    int failed = o == PX_OUT_CONNECT_ERR || o == PX_OUT_RESET || o == PX_OUT_SERVER_ERR;
    if (!failed || l->too_big || (long long)l->ntried > retries || l->ntried >= PX_LEG_MAX_TRIES)
        return 0;
    size_t n = 0;
    if (!l->named) px_pool_counts(l->pool, &n, NULL);
    PX_LOG(PX_LOG_WARN,
           "req=%s msg=\"%s failed, retrying%s\" %s=%s attempt=%zu error=\"%s\" status=%d", l->lid,
           px_leg_role_name(l->role),
           n > 1 ? " on another instance" : " on the same instance (the only one)",
           px_leg_role_name(l->role), l->name, l->ntried, rc ? why : "", l->status);
    px_m_inc(&l->w->metrics.retries[l->role == PX_LEG_DECODE]);
    px_buf_reset(&l->resp);
    l->status = 0;
    px_leg_backoff(l);
    return 1;
}

int px_leg_resend(px_leg *l, int connected, const char *why) {
    size_t n;
    px_pool_counts(l->pool, &n, NULL);
    if (connected || l->ntried >= PX_LEG_MAX_TRIES || l->ntried >= n) return 0;
    PX_LOG(PX_LOG_WARN, "req=%s msg=\"%s unreachable, trying another\" %s=%s error=\"%s\"", l->lid,
           px_leg_role_name(l->role), px_leg_role_name(l->role), l->name, why);
    px_m_inc(&l->w->metrics.retries[l->role == PX_LEG_DECODE]);
    return 1;
}

void px_leg_backoff(px_leg *l) {
    size_t k = l->ntried ? l->ntried : 1;
    uint64_t base_us = 10000u << (k < 6 ? k - 1 : 5);
    timer_arm(l, TIMER_RETRY, base_us / 2 + px_rand64() % base_us);
}

void px_leg_grace(px_leg *l, long us) {
    timer_arm(l, TIMER_GRACE, (uint64_t)us);
}

void px_leg_touch(px_leg *l) {
    if (l->idle_s <= 0) return;
    l->idle_since_ns = px_now_ns();
    if (!l->timer) l->timer = evtimer_new(l->w->base, on_timer, l);
    if (!evtimer_pending(l->timer, NULL))
        timer_arm(l, TIMER_IDLE, (uint64_t)(l->idle_s * 1e9) / 1000);
}

/* The idle limit is our own timer, since curl's low-speed check averages
 * over several seconds. A byte only notes the time; the timer, armed
 * once, looks when it fires and waits out the rest if there was activity
 * meanwhile (no timer-heap work per read). */
static void on_timer(evutil_socket_t fd, short what, void *arg) {
    px_leg *l = arg;
    int kind = l->timer_kind;
    l->timer_kind = TIMER_NONE;
    if (kind == TIMER_RETRY) {
        l->cbs->retry(l->owner);
    } else if (kind == TIMER_GRACE) {
        l->cbs->grace(l->owner);
    } else if (kind == TIMER_IDLE) {
        uint64_t limit = (uint64_t)(l->idle_s * 1e9), idle = px_now_ns() - l->idle_since_ns;
        if (idle < limit) {
            timer_arm(l, TIMER_IDLE, (limit - idle) / 1000);
            return;
        }
        px_leg_stop(l, PX_OUT_TIMEOUT);
        l->cbs->idle(l->owner);
    }
}

/* ---------- what a failed answer tells the client ---------- */

int px_leg_error(const px_leg *l, px_up_result rc, const char *why, char *msg, size_t cap) {
    const char *role = px_leg_role_name(l->role);
    if (l->too_big) {
        snprintf(msg, cap, "%s %s answer exceeds %zu bytes", role, l->name, l->max_resp);
        return 502;
    }
    if (rc != PX_UP_OK) {
        snprintf(msg, cap, "%s %s: %s", role, l->name, why);
        return px_upstream_status_for(rc);
    }
    snprintf(msg, cap, "%s %s answered HTTP %d", role, l->name, l->status);
    /* 508: a loop through proxies, reported as one to the client. */
    return l->status == 508 ? 508 : 502;
}

int px_leg_idle_error(const px_leg *l, int client_paused, size_t bytes_out, char *msg, size_t cap) {
    double s = l->idle_s;
    if (client_paused)
        snprintf(msg, cap, "client read nothing for --decode-idle-timeout %gs", s);
    else if (!l->status)
        snprintf(msg, cap,
                 "%s %s sent no response head within %gs of the request (--decode-idle-timeout)",
                 px_leg_role_name(l->role), l->name, s);
    else
        snprintf(msg, cap,
                 "%s %s went idle mid-answer: no byte for %gs after %zu bytes "
                 "(--decode-idle-timeout)",
                 px_leg_role_name(l->role), l->name, s, bytes_out);
    return 504;
}

void px_leg_rejection(const px_leg *l, char *msg, size_t cap) {
    char em[320];
    px_engine_error_message(l->resp.data, l->resp.len, em, sizeof em);
    snprintf(msg, cap, "%s %s answered HTTP %d%s%s", px_leg_role_name(l->role), l->name, l->status,
             em[0] ? ": " : "", em);
}

void px_engine_error_message(const char *body, size_t n, char *out, size_t outlen) {
    out[0] = '\0';
    if (!body || !n) return;
    px_json_member m;
    const char *obj = body;
    size_t on = n;
    if (px_json_find(body, n, "error", &m) && m.type == PX_JSON_OBJECT) {
        obj = m.val;
        on = m.val_len;
    }
    if (!px_json_find(obj, on, "message", &m) || m.type != PX_JSON_STRING || m.val_len < 2) return;
    char *t = px_xmalloc(m.val_len);
    long len = px_json_str_decode(m.val + 1, m.val_len - 2, t, m.val_len);
    if (len > 0) {
        size_t k = (size_t)len < outlen - 1 ? (size_t)len : outlen - 1;
        while (k && k < (size_t)len && ((unsigned char)t[k] & 0xc0) == 0x80)
            k--;
        memcpy(out, t, k);
        out[k] = '\0';
    }
    free(t);
}
