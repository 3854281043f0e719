#include "request.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "json.h"
#include "log.h"
#include "otlp.h"
#include "rewrite.h"

/* Largest prefill answer kept; a prefill answers one token, so anything near
 * this is a broken engine, not a big request. */
#define PREFILL_MAX_ANSWER (8 * 1024 * 1024)
#define MAX_TRIES 16
/* How long a prefill whose client left gets to answer before it is cut:
 * one that has not started answering has probably not published blocks
 * yet; one that has is let finish (so decode can release its blocks), but
 * not for longer than this, so a prefill stalled mid-answer is cut too. */
#define PREFILL_GRACE_US 50000
#define PREFILL_ANSWER_GRACE_US 2000000

typedef enum {
    RS_NEW,
    RS_PREFILL,
    RS_RETRY_WAIT,
    RS_DECODE,
    RS_STREAM,
    RS_RELEASING,
    RS_DONE,
    RS_CLOSING
} req_state;

static const char *const state_names[] = {"new",    "prefill",   "retry_wait", "decode",
                                          "stream", "releasing", "done",       "closing"};
static const char *const ep_paths[] = {"/v1/completions", "/v1/chat/completions", "/v1/models"};
static const px_metric_endpoint ep_metric[] = {PX_MEP_COMPLETIONS, PX_MEP_CHAT, PX_MEP_MODELS};

struct px_req {
    px_req *prev, *next; /* in w->reqs */
    px_worker *w;        /* borrowed: the worker this request runs on */
    px_server *s;        /* borrowed */
    px_gen *g;           /* owned reference: the configuration this request runs on */
    px_pset *ps;         /* borrowed from g: the pool of the request's model */
    px_backend *hb;      /* owned reference: the prefill named by the request's header */
    int no_prefill;      /* sidecar mode without the header: decode alone */
    px_conn *conn;       /* borrowed: NULL once the exchange ended or the client left */
    req_state state;
    px_endpoint ep;
    char id[129];
    char lid[300]; /* id as a logfmt value */
    char trace_id[33];
    char trace_flags[3];
    px_buf body;                    /* owned: the client's body */
    px_buf pbody;                   /* owned: the prefill request's body */
    px_buf dbody;                   /* owned: the decode request's body */
    px_buf presp;                   /* owned: the prefill's answer */
    px_buf hdrs_p;                  /* owned: header lines of the prefill request */
    px_buf hdrs_d;                  /* owned: header lines of the decode request */
    px_upstream *up;                /* owned: the transfer in flight */
    px_backend *pb;                 /* owned reference while a prefill is in flight */
    px_backend *db;                 /* owned reference while a decode is in flight */
    char pname[128], dname[128];    /* the backends' names, for logs after release */
    px_backend *tried_p[MAX_TRIES]; /* identity only, never dereferenced */
    size_t ntried_p;
    px_backend *tried_d[MAX_TRIES];
    size_t ntried_d;
    const char *key; /* borrowed from body: prefix_affinity's bytes */
    size_t key_len;
    struct event *retry_timer; /* owned */
    int pstatus;
    char pctype[128];
    int dstatus;
    int too_big;
    int paused;
    int counted; /* holds one of the server's in-flight slots */
    int released_via_decode;
    uint64_t t0, t_prefill, t_first;
    uint64_t prefill_deadline; /* --prefill-timeout covers every attempt; 0: none */
    struct event *idle_timer;  /* owned: --decode-idle-timeout */
    struct event *grace_timer; /* owned: a prefill whose client left may still answer */
    size_t bytes_out;
    int64_t held; /* bytes of the bodies above counted in the server's memory budget */

    /* Tracing (otlp.h): the client's span id ("" when the trace is new),
     * this request's spans, and when its first prefill and decode attempts
     * left. */
    char parent_span[17];
    char span_root[17], span_p[17], span_d[17];
    uint64_t t_pstart, t_dstart;
    int streamed; /* decode answered text/event-stream: 1, else 0 */
};

static void start_prefill(px_req *r);
static void start_decode(px_req *r);

/* Hands a backend back after an attempt. A request's attempts on the same
 * backend (retries with one instance configured) are one failure toward
 * --unhealthy-after, not one each. */
static void attempt_done(px_pool *p, px_backend *b, px_backend *const *tried, size_t ntried,
                         px_outcome o) {
    for (size_t i = 0; i + 1 < ntried; i++)
        if (tried[i] == b) {
            px_backend_done_repeat(p, b, o);
            return;
        }
    px_backend_done(p, b, o);
}

/* ---------- lifetime ---------- */

/* Brings the memory budget's count of this request's bodies up to date. */
static void account(px_req *r) {
    int64_t now = (int64_t)(r->body.len + r->pbody.len + r->dbody.len + r->presp.len);
    px_budget_add(&r->s->shared, now - r->held);
    r->held = now;
}

static void req_free(px_req *r) {
    if (r->prev)
        r->prev->next = r->next;
    else
        r->w->reqs = r->next;
    if (r->next) r->next->prev = r->prev;
    r->w->nreqs--;
    px_upstream_cancel(r->up);
    px_backend_done(&r->ps->prefill, r->pb, PX_OUT_CANCELLED);
    px_backend_done(&r->ps->decode, r->db, PX_OUT_CANCELLED);
    if (r->retry_timer) event_free(r->retry_timer);
    if (r->idle_timer) event_free(r->idle_timer);
    if (r->grace_timer) event_free(r->grace_timer);
    if (r->counted) atomic_fetch_sub(&r->s->inflight, 1);
    px_backend_release(r->hb);
    px_gen_release(r->g);
    px_budget_add(&r->s->shared, -r->held);
    px_buf_cleanup(&r->body);
    px_buf_cleanup(&r->pbody);
    px_buf_cleanup(&r->dbody);
    px_buf_cleanup(&r->presp);
    px_buf_cleanup(&r->hdrs_p);
    px_buf_cleanup(&r->hdrs_d);
    free(r);
}

/* The one place a request changes state. */
static void set_state(px_req *r, req_state st) {
    PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"state\" from=%s to=%s", r->lid, state_names[r->state],
           state_names[st]);
    r->state = st;
}

static double secs(uint64_t from, uint64_t to) {
    return from && to ? (double)(to - from) / 1e9 : -1;
}

/* The request's spans for trace export (otlp.h). */
static void submit_spans(px_req *r, int status, const char *outcome, uint64_t now) {
    px_otlp_req q = {.trace_id = r->trace_id,
                     .flags = r->trace_flags,
                     .parent_span = r->parent_span[0] ? r->parent_span : NULL,
                     .span_root = r->span_root,
                     .span_prefill = r->span_p,
                     .span_decode = r->span_d,
                     .method = r->ep == PX_EP_MODELS ? "GET" : "POST",
                     .route = ep_paths[r->ep],
                     .request_id = r->id,
                     .outcome = outcome,
                     .status = status,
                     .t_start = r->t0,
                     .t_end = now,
                     .prefill = r->pname[0] ? r->pname : NULL,
                     .prefill_status = r->pstatus,
                     .prefill_attempts = (int)r->ntried_p,
                     .t_prefill_start = r->t_pstart,
                     .t_prefill_end = r->t_prefill,
                     .decode = r->dname[0] ? r->dname : NULL,
                     .decode_status = r->dstatus,
                     .decode_attempts = (int)r->ntried_d,
                     .streamed = r->streamed,
                     .t_decode_start = r->t_dstart,
                     .presp = r->presp.data,
                     .presp_len = r->presp.len};
    px_otlp_submit(&q);
}

/* The access log line and the request metrics, once per request. */
static void finish_log(px_req *r, int status, const char *outcome) {
    uint64_t now = px_now_ns();
    px_metrics *m = &r->w->metrics;
    px_metrics_count(m, ep_metric[r->ep], status);
    px_hist_observe(&m->duration, secs(r->t0, now));
    if (r->t_first) px_hist_observe(&m->ttfb[r->streamed], secs(r->t0, r->t_first));
    px_access a = {.req = r->lid,
                   .endpoint = ep_paths[r->ep],
                   .prefill = r->pname[0] ? r->pname : NULL,
                   .decode = r->dname[0] ? r->dname : NULL,
                   .status = status,
                   .prefill_ms = r->t_prefill ? secs(r->t0, r->t_prefill) * 1e3 : -1.0,
                   .ttfb_ms = r->t_first ? secs(r->t0, r->t_first) * 1e3 : -1.0,
                   .total_ms = secs(r->t0, now) * 1e3,
                   .bytes_out = r->bytes_out,
                   .outcome = outcome,
                   .trace_id = r->trace_id};
    px_log_access(&a);
    if (px_otlp_enabled()) submit_spans(r, status, outcome, now);
}

/* Visible ASCII without quote or backslash, at most 128 bytes (README,
 * SECURITY.md): engines put it into their own ids and log lines. Anything
 * else is replaced by a UUIDv4. */
static int valid_request_id(const char *v, size_t n) {
    if (n == 0 || n > 128) return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)v[i];
        if (c <= 0x20 || c > 0x7e || c == '"' || c == '\\') return 0;
    }
    return 1;
}

void px_req_log_refused(const px_http_head *h, const char *endpoint, int status) {
    char lid[300] = "-";
    const px_http_header *xid = px_http_find(h, "x-request-id");
    if (xid && valid_request_id(xid->value, xid->value_len)) {
        char id[129];
        memcpy(id, xid->value, xid->value_len);
        id[xid->value_len] = '\0';
        px_log_value(id, lid, sizeof lid);
    }
    px_access a = {.req = lid,
                   .endpoint = endpoint,
                   .status = status,
                   .prefill_ms = -1,
                   .ttfb_ms = -1,
                   .outcome = "refused"};
    px_log_access(&a);
}

static void req_end(px_req *r, int status, const char *outcome) {
    finish_log(r, status, outcome);
    set_state(r, RS_DONE);
    req_free(r);
}

/* Ends a request that failed: logs, answers once in OpenAI error JSON when
 * nothing was sent yet (else cuts the stream), and frees it. */
static void req_fail(px_req *r, int status, const char *extra, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void req_fail(px_req *r, int status, const char *extra, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char qmsg[1100];
    PX_LOG(status >= 500 ? PX_LOG_WARN : PX_LOG_INFO, "req=%s msg=%s status=%d state=%s", r->lid,
           px_log_value(msg, qmsg, sizeof qmsg), status, state_names[r->state]);
    int streaming = r->state == RS_STREAM;
    if (r->conn) {
        if (streaming)
            px_conn_abort(r->conn);
        else
            px_conn_reply_error(r->conn, status, r->id, extra, msg);
        r->conn = NULL;
    }
    req_end(r, status, streaming ? "stream_failed" : "error");
}

static px_outcome outcome_of(px_up_result rc, int status) {
    switch (rc) {
    case PX_UP_OK:
        return status >= 500 ? PX_OUT_SERVER_ERR : status >= 400 ? PX_OUT_CLIENT_ERR : PX_OUT_OK;
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

/* ---------- headers and tracing ---------- */

static int lowhex(const char *s, size_t n, int nonzero) {
    int nz = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return 0;
        nz |= c != '0';
    }
    return !nonzero || nz;
}

int px_trace_parse(const char *tp, size_t n, char trace[33], char flags[3]) {
    /* version "-" trace-id "-" parent-id "-" flags (W3C Trace Context):
     * version 00 is exactly 55 characters; later versions may append
     * "-..." fields, which a version-00 reader ignores; ff is invalid. */
    if (!tp || n < 55 || tp[2] != '-' || tp[35] != '-' || tp[52] != '-') return 0;
    if (!lowhex(tp, 2, 0) || !memcmp(tp, "ff", 2)) return 0;
    if (!memcmp(tp, "00", 2) ? n != 55 : (n > 55 && tp[55] != '-')) return 0;
    if (!lowhex(tp + 3, 32, 1) || !lowhex(tp + 36, 16, 1) || !lowhex(tp + 53, 2, 0)) return 0;
    memcpy(trace, tp + 3, 32);
    trace[32] = '\0';
    memcpy(flags, tp + 53, 2);
    flags[2] = '\0';
    return 1;
}

void px_trace_new(char trace[33]) {
    static const char hex[] = "0123456789abcdef";
    uint64_t a = px_rand64() | 1, b = px_rand64();
    for (int i = 0; i < 16; i++) {
        trace[i] = hex[(a >> (60 - 4 * i)) & 15];
        trace[16 + i] = hex[(b >> (60 - 4 * i)) & 15];
    }
    trace[32] = '\0';
}

/* A new span id: 16 hex digits, never all zero. */
static void span_new(char sp[17]) {
    static const char hex[] = "0123456789abcdef";
    uint64_t span = px_rand64() | 1;
    for (int i = 0; i < 16; i++)
        sp[i] = hex[(span >> (60 - 4 * i)) & 15];
    sp[16] = '\0';
}

/* A child span of the request's trace: same trace id and flags, the span
 * of the upstream leg (prefill or decode) as parent id. */
static void trace_child(const char *trace, const char *span, const char *flags, char out[56]) {
    snprintf(out, 56, "00-%s-%s-%s", trace, span, flags);
}

/* The header lines both upstream requests carry ("Name: value\r\n" each);
 * Host and the body's framing are the transport's. */
static void headers_for(px_req *r, const px_http_head *h, int traced, const char *span, px_buf *l) {
    if (r->ep != PX_EP_MODELS) px_buf_appends(l, "Content-Type: application/json\r\n");
    px_buf_printf(l, "X-Request-Id: %s\r\n", r->id);
    const px_http_header *auth = px_http_find(h, "authorization");
    if (r->s->upstream_auth_forced || !auth) {
        if (r->s->upstream_auth) px_buf_printf(l, "%s\r\n", r->s->upstream_auth);
    } else {
        px_buf_printf(l, "Authorization: %.*s\r\n", (int)auth->value_len, auth->value);
    }
    char child[56];
    trace_child(r->trace_id, span, r->trace_flags, child);
    px_buf_printf(l, "traceparent: %s\r\n", child);
    /* tracestate belongs to the client's trace: dropped when that was
     * unusable and a new trace started. */
    const px_http_header *ts = traced ? px_http_find(h, "tracestate") : NULL;
    if (ts && ts->value_len <= 512)
        px_buf_printf(l, "tracestate: %.*s\r\n", (int)ts->value_len, ts->value);
}

static int start_upstream(px_req *r, px_backend *b, const char *path, const px_buf *body,
                          const px_buf *hdrs, const px_upstream_cbs *cbs, long total_ms,
                          long idle_s) {
    const px_config *cfg = r->s->cfg;
    px_upstream_opts o = {
        .connect_timeout_ms = (long)(cfg->connect_timeout * 1000),
        .total_timeout_ms = total_ms,
        .idle_timeout_s = idle_s,
        .ca_file = cfg->upstream_ca,
        .insecure = cfg->upstream_insecure,
        .track_upload = body && cbs != NULL && b == r->db,
    };
    r->up = px_upstream_start(r->w->up, b, body ? "POST" : "GET", path, body ? body->data : NULL,
                              body ? body->len : 0, hdrs, &o, cbs, r);
    return r->up ? 0 : -1;
}

/* ---------- decode ---------- */

/* --decode-idle-timeout: no byte from decode for that long ends the request.
 * Our own timer, re-armed on every byte, since curl's low-speed check
 * averages over several seconds. */
static void on_idle_timer(evutil_socket_t fd, short what, void *arg) {
    px_req *r = arg;
    px_upstream_cancel(r->up);
    r->up = NULL;
    px_backend_done(&r->ps->decode, r->db, PX_OUT_TIMEOUT);
    r->db = NULL;
    if (r->state == RS_RELEASING) {
        req_end(r, 499, "client_disconnected");
        return;
    }
    if (r->paused)
        req_fail(r, 504, NULL, "client read nothing for --decode-idle-timeout %gs",
                 r->s->cfg->decode_idle_timeout);
    else
        req_fail(r, 504, NULL, "decode %s sent nothing for --decode-idle-timeout %gs", r->dname,
                 r->s->cfg->decode_idle_timeout);
}

static void touch_idle(px_req *r) {
    double s = r->s->cfg->decode_idle_timeout;
    if (s <= 0) return;
    if (!r->idle_timer) r->idle_timer = evtimer_new(r->w->base, on_idle_timer, r);
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    evtimer_add(r->idle_timer, &tv);
}

static void decode_headers(void *arg, int status, const char *ctype) {
    px_req *r = arg;
    r->dstatus = status;
    touch_idle(r);
    if (r->state == RS_RELEASING) return;
    r->t_first = px_now_ns();
    r->streamed = ctype && !strncasecmp(ctype, "text/event-stream", 17);
    set_state(r, RS_STREAM);
    if (r->conn) px_conn_stream_start(r->conn, status, ctype, r->id, NULL);
}

static int decode_data(void *arg, const char *p, size_t n) {
    px_req *r = arg;
    if (!r->conn) return -1;
    touch_idle(r);
    if (px_conn_pending(r->conn) >= PX_CONN_HIGH_WATER) {
        /* Paused on the client: the same timeout now bounds how long the
         * client may leave its queue full, so a reader that stopped reading
         * does not hold a decode forever. */
        if (!r->paused) touch_idle(r);
        r->paused = 1;
        return 1;
    }
    px_conn_stream_write(r->conn, p, n);
    r->bytes_out += n;
    return 0;
}

/* Decode has the request and its kv_transfer_params; it drops the request
 * now that the client left, and tells prefill to free the blocks. Ends r. */
static void released_via_decode(px_req *r) {
    px_upstream_cancel(r->up); /* NULL once it ended */
    r->up = NULL;
    if (r->idle_timer) evtimer_del(r->idle_timer);
    px_backend_done(&r->ps->decode, r->db, PX_OUT_CANCELLED);
    r->db = NULL;
    px_m_inc(&r->w->metrics.stranded_released);
    PX_LOG(PX_LOG_INFO,
           "req=%s msg=\"client left after prefill: decode was given the request and "
           "aborted so prefill frees its blocks\" decode=%s",
           r->lid, r->dname);
    req_end(r, 499, "client_disconnected");
}

static void decode_done(void *arg, px_up_result rc, const char *errbuf, int connected) {
    px_req *r = arg;
    r->up = NULL; /* freed by the upstream module when this returns */
    if (r->idle_timer) evtimer_del(r->idle_timer);
    px_outcome o = outcome_of(rc, r->dstatus);
    const char *why = errbuf[0] ? errbuf : px_up_result_str(rc);
    if (r->state == RS_RELEASING && connected) {
        released_via_decode(r);
        return;
    }
    attempt_done(&r->ps->decode, r->db, r->tried_d, r->ntried_d, o);
    r->db = NULL;
    if (rc == PX_UP_OK) {
        if (r->conn) {
            px_conn_stream_end(r->conn);
            r->conn = NULL;
        }
        req_end(r, r->dstatus, "ok");
        return;
    }
    if (r->state == RS_STREAM) {
        req_fail(r, r->dstatus, NULL, "decode %s failed mid-stream after %zu bytes: %s", r->dname,
                 r->bytes_out, why);
        return;
    }
    /* Resend only what decode never saw: it may have read prefill's blocks
     * once the request reached it. */
    size_t ndecode;
    px_pool_counts(&r->ps->decode, &ndecode, NULL);
    if (!connected && r->ntried_d < MAX_TRIES && r->ntried_d < ndecode) {
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"decode unreachable, trying another\" decode=%s error=\"%s\"", r->lid,
               r->dname, why);
        px_m_inc(&r->w->metrics.retries[1]);
        start_decode(r);
        return;
    }
    if (r->state == RS_RELEASING) {
        req_end(r, 499, "client_disconnected");
        return;
    }
    req_fail(r, px_upstream_status_for(rc), NULL, "decode %s: %s", r->dname, why);
}

static const px_upstream_cbs decode_cbs = {decode_headers, decode_data, decode_done};

/* Picks a decode and sends it r->dbody (built by the caller) or, for
 * /v1/models, a GET. */
static void start_decode(px_req *r) {
    px_pick k = {.exclude = r->tried_d, .nexclude = r->ntried_d};
    size_t n;
    r->db = px_pool_pick(&r->ps->decode, &k, &n);
    if (!r->db) {
        if (r->state == RS_RELEASING) {
            PX_LOG(PX_LOG_WARN,
                   "req=%s msg=\"client left after prefill and no decode can take "
                   "the request: prefill's blocks stay until they expire\"",
                   r->lid);
            req_end(r, 499, "client_disconnected");
            return;
        }
        req_fail(r, 503, "Retry-After: 1\r\n", "no healthy decode backend (%zu configured%s)", n,
                 n ? ", all ejected" : "");
        return;
    }
    snprintf(r->dname, sizeof r->dname, "%s", r->db->name);
    if (!r->t_dstart) r->t_dstart = px_now_ns();
    if (r->ntried_d < MAX_TRIES) r->tried_d[r->ntried_d++] = r->db;
    if (r->state != RS_RELEASING) set_state(r, RS_DECODE);
    if (start_upstream(r, r->db, ep_paths[r->ep], r->ep == PX_EP_MODELS ? NULL : &r->dbody,
                       &r->hdrs_d, &decode_cbs, 0, 0) < 0) {
        req_fail(r, 502, NULL, "decode %s: cannot start the request", r->dname);
        return;
    }
    touch_idle(r);
    /* Releasing: the body only has to reach decode (it may have already:
     * our client writes at once, and a nearby decode acknowledges fast). */
    if (r->state == RS_RELEASING && px_upstream_abort_after_upload(r->up)) released_via_decode(r);
}

/* ---------- prefill ---------- */

static void prefill_headers(void *arg, int status, const char *ctype) {
    px_req *r = arg;
    r->pstatus = status;
    snprintf(r->pctype, sizeof r->pctype, "%s", ctype ? ctype : "application/json");
}

static int prefill_data(void *arg, const char *p, size_t n) {
    px_req *r = arg;
    if (r->presp.len + n > PREFILL_MAX_ANSWER) {
        r->too_big = 1;
        return -1;
    }
    px_buf_append(&r->presp, p, n);
    account(r); /* held memory, counted as it arrives */
    return 0;
}

static void proceed_to_decode(px_req *r) {
    const char *kvp = NULL;
    size_t kvp_len = 0;
    char err[128];
    px_kvp_status ks = px_extract_kv_params(r->presp.data ? r->presp.data : "", r->presp.len, &kvp,
                                            &kvp_len, err, sizeof err);
    if (ks == PX_KVP_BAD_RESPONSE) {
        if (r->state == RS_RELEASING) {
            req_end(r, 499, "client_disconnected");
            return;
        }
        req_fail(r, 502, NULL, "prefill %s returned an invalid answer: %s", r->pname, err);
        return;
    }
    if (ks == PX_KVP_MISSING) {
        px_m_inc(&r->w->metrics.kvp_missing);
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"prefill answer has no kv_transfer_params; decode will recompute the "
               "prefill\" prefill=%s",
               r->lid, r->pname);
        kvp = NULL;
        if (r->state == RS_RELEASING) { /* nothing to release */
            req_end(r, 499, "client_disconnected");
            return;
        }
    } else if (ks == PX_KVP_NO_REQUEST_ID) {
        px_m_inc(&r->w->metrics.rrid_missing);
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"kv_transfer_params lack remote_request_id; decode cannot release "
               "prefill's blocks\" prefill=%s",
               r->lid, r->pname);
    }
    px_buf_reset(&r->dbody);
    px_rewrite_decode(r->body.data, r->body.len, kvp, kvp_len, &r->dbody);
    /* From here on only the decode body is needed (retries resend it): one
     * copy of the request is held, not three. */
    px_buf_cleanup(&r->body);
    px_buf_cleanup(&r->pbody);
    /* Prefill's answer stays only for the trace (its remote_request_id and
     * usage go into the spans). */
    if (!px_otlp_enabled()) px_buf_cleanup(&r->presp);
    r->key = NULL;
    account(r);
    start_decode(r);
}

static void on_retry_timer(evutil_socket_t fd, short what, void *arg) {
    start_prefill(arg);
}

static void prefill_done(void *arg, px_up_result rc, const char *errbuf, int connected) {
    px_req *r = arg;
    r->up = NULL;
    account(r);                                      /* the prefill's answer */
    if (r->grace_timer) evtimer_del(r->grace_timer); /* it answered in time */
    px_outcome o = outcome_of(rc, r->pstatus);
    if (r->too_big) o = PX_OUT_SERVER_ERR;
    attempt_done(&r->ps->prefill, r->pb, r->tried_p, r->ntried_p, o);
    r->pb = NULL;
    const char *why = errbuf[0] ? errbuf : px_up_result_str(rc);

    if (r->state == RS_RELEASING) {
        if (rc == PX_UP_OK && r->pstatus >= 200 && r->pstatus < 300) {
            proceed_to_decode(r);
            return;
        }
        req_end(r, 499, "client_disconnected");
        return;
    }
    /* Refused, reset or 5xx: another prefill, after a jittered pause. */
    int retryable = o == PX_OUT_CONNECT_ERR || o == PX_OUT_RESET || o == PX_OUT_SERVER_ERR;
    if (retryable && !r->too_big && (int64_t)(r->ntried_p) <= r->s->cfg->prefill_retries &&
        r->ntried_p < MAX_TRIES) {
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"prefill failed, retrying on another instance\" prefill=%s attempt=%zu "
               "error=\"%s\" status=%d",
               r->lid, r->pname, r->ntried_p, rc ? why : "", r->pstatus);
        px_m_inc(&r->w->metrics.retries[0]);
        px_buf_reset(&r->presp);
        r->pstatus = 0;
        set_state(r, RS_RETRY_WAIT);
        uint64_t base_us = 10000u << (r->ntried_p < 6 ? r->ntried_p - 1 : 5);
        uint64_t us = base_us / 2 + px_rand64() % base_us;
        struct timeval tv = {(time_t)(us / 1000000), (suseconds_t)(us % 1000000)};
        if (!r->retry_timer) r->retry_timer = evtimer_new(r->w->base, on_retry_timer, r);
        evtimer_add(r->retry_timer, &tv);
        return;
    }
    r->t_prefill = px_now_ns();
    px_hist_observe(&r->w->metrics.prefill, secs(r->t0, r->t_prefill));
    if (rc != PX_UP_OK) {
        if (r->too_big)
            req_fail(r, 502, NULL, "prefill %s answer exceeds %d bytes", r->pname,
                     PREFILL_MAX_ANSWER);
        else
            req_fail(r, px_upstream_status_for(rc), NULL, "prefill %s: %s", r->pname, why);
        return;
    }
    if (r->pstatus >= 400 && r->pstatus < 500) {
        /* The client's fault: its status and the engine's words, as they are. */
        PX_LOG(PX_LOG_INFO, "req=%s msg=\"prefill rejected the request\" prefill=%s status=%d",
               r->lid, r->pname, r->pstatus);
        if (r->conn) {
            px_conn_reply(r->conn, r->pstatus, r->pctype, r->id, NULL, r->presp.data, r->presp.len);
            r->conn = NULL;
        }
        req_end(r, r->pstatus, "prefill_rejected");
        return;
    }
    if (r->pstatus < 200 || r->pstatus >= 300) {
        req_fail(r, 502, NULL, "prefill %s answered HTTP %d", r->pname, r->pstatus);
        return;
    }
    proceed_to_decode(r);
}

static const px_upstream_cbs prefill_cbs = {prefill_headers, prefill_data, prefill_done};

static void start_prefill(px_req *r) {
    px_pick k = {
        .key = r->key, .key_len = r->key_len, .exclude = r->tried_p, .nexclude = r->ntried_p};
    size_t n = 0;
    if (r->hb) { /* sidecar: the prefill the header named */
        r->pb = r->hb;
        atomic_fetch_add(&r->pb->refs, 1);
        atomic_fetch_add(&r->pb->inflight, 1);
    } else if (!r->no_prefill) {
        r->pb = px_pool_pick(&r->ps->prefill, &k, &n);
    }
    if (!r->pb) {
        if (r->s->cfg->fallback_decode_only || r->no_prefill) {
            if (r->no_prefill)
                PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"no x-prefiller-host-port: decode alone\"",
                       r->lid);
            else
                PX_LOG(PX_LOG_WARN,
                       "req=%s msg=\"no healthy prefill: sending the request to decode alone\" "
                       "prefill_backends=%zu",
                       r->lid, n);
            px_buf_reset(&r->dbody);
            px_rewrite_decode(r->body.data, r->body.len, NULL, 0, &r->dbody);
            account(r);
            start_decode(r);
            return;
        }
        req_fail(r, 503, "Retry-After: 1\r\n", "no healthy prefill backend (%zu configured%s)", n,
                 n ? ", all ejected" : "");
        return;
    }
    snprintf(r->pname, sizeof r->pname, "%s", r->pb->name);
    if (!r->t_pstart) r->t_pstart = px_now_ns();
    if (r->ntried_p < MAX_TRIES) r->tried_p[r->ntried_p++] = r->pb;
    set_state(r, RS_PREFILL);
    long ptimeout = 0;
    if (r->prefill_deadline) {
        uint64_t now = px_now_ns();
        if (now + 1000000 >= r->prefill_deadline) {
            px_backend_done(&r->ps->prefill, r->pb, PX_OUT_CANCELLED);
            r->pb = NULL;
            req_fail(r, 504, NULL, "prefill did not answer within --prefill-timeout %gs",
                     r->s->cfg->prefill_timeout);
            return;
        }
        ptimeout = (long)((r->prefill_deadline - now) / 1000000);
    }
    if (start_upstream(r, r->pb, ep_paths[r->ep], &r->pbody, &r->hdrs_p, &prefill_cbs, ptimeout,
                       0) < 0)
        req_fail(r, 502, NULL, "prefill %s: cannot start the request", r->pname);
}

/* ---------- the client ---------- */

/* The client left during prefill and prefill did not answer in its grace. */
static void on_grace_timer(evutil_socket_t fd, short what, void *arg) {
    px_req *r = arg;
    finish_log(r, 499, "client_disconnected");
    set_state(r, RS_CLOSING);
    req_free(r); /* cancels prefill, closing its connection */
}

static void client_gone(void *arg) {
    px_req *r = arg;
    r->conn = NULL;
    px_phase phase = r->state == RS_STREAM   ? PX_PHASE_STREAM
                     : r->state == RS_DECODE ? PX_PHASE_DECODE
                                             : PX_PHASE_PREFILL;
    px_m_inc(&r->w->metrics.disconnects[phase]);
    if (r->state == RS_PREFILL && r->up) {
        /* Prefill publishes its blocks just before its answer leaves: a
         * client leaving near that moment would strand them if we cut the
         * connection. So prefill gets a short grace (well inside the 100 ms
         * in which a cancelled upstream must close) to answer; an answer
         * goes on to the release through decode, silence is cut. */
        set_state(r, RS_RELEASING);
        long us = px_upstream_answering(r->up) ? PREFILL_ANSWER_GRACE_US : PREFILL_GRACE_US;
        if (!r->grace_timer) r->grace_timer = evtimer_new(r->w->base, on_grace_timer, r);
        struct timeval tv = {us / 1000000, us % 1000000};
        evtimer_add(r->grace_timer, &tv);
        return;
    }
    if (r->state == RS_DECODE && r->up && r->ep != PX_EP_MODELS &&
        !px_upstream_abort_after_upload(r->up)) {
        /* Decode has not received the request yet: let the body reach it,
         * then abort, so that decode tells prefill to free the blocks. */
        set_state(r, RS_RELEASING);
        return;
    }
    set_state(r, RS_CLOSING);
    finish_log(r, 499, "client_disconnected");
    req_free(r); /* cancels the transfer in flight, closing its connection */
}

static void client_drained(void *arg) {
    px_req *r = arg;
    if (r->paused && r->up) {
        r->paused = 0;
        touch_idle(r);
        px_upstream_resume(r->up);
    }
}

static const px_exchange_cbs client_cbs = {client_gone, client_drained};

/* The bytes prefix_affinity hashes: the start of the prompt, or of the
 * messages, as the client spelled them (identical requests, identical keys,
 * in every replica). */
static void find_key(px_req *r) {
    px_json_member m;
    const char *name = r->ep == PX_EP_CHAT ? "messages" : "prompt";
    if (!px_json_find(r->body.data, r->body.len, name, &m)) return;
    r->key = m.val;
    r->key_len =
        m.val_len < r->ps->prefill.cfg.prefix_bytes ? m.val_len : r->ps->prefill.cfg.prefix_bytes;
}

/* Named pools: the body's model chooses the pool; an unknown one gets
 * OpenAI's 404 model_not_found. Returns -1 when r has ended. */
static int choose_pool(px_req *r) {
    if (!r->g->named) return 0;
    px_json_member m;
    char model[512];
    long n = -1;
    if (px_json_find(r->body.data, r->body.len, "model", &m) && m.val_len >= 2 && m.val[0] == '"')
        n = px_json_str_decode(m.val + 1, m.val_len - 2, model, sizeof model);
    if (n < 0) {
        req_fail(r, 400, NULL, "the request names no model (a string \"model\" member)");
        return -1;
    }
    r->ps = px_gen_find(r->g, model, (size_t)n);
    if (r->ps) return 0;
    r->ps = &r->g->ps[0];
    px_buf b, msg;
    px_buf_init(&b);
    px_buf_init(&msg);
    px_buf_printf(&msg, "The model `%.*s` does not exist.", (int)(n > 200 ? 200 : n), model);
    px_buf_appends(&b, "{\"error\":{\"message\":");
    px_buf_append_json_str(&b, msg.data, msg.len);
    px_buf_appends(&b, ",\"type\":\"invalid_request_error\",\"param\":\"model\","
                       "\"code\":\"model_not_found\"}}");
    char q[600];
    PX_LOG(PX_LOG_INFO, "req=%s msg=\"unknown model\" model=%s status=404", r->lid,
           px_log_value(model, q, sizeof q));
    if (r->conn) px_conn_reply(r->conn, 404, "application/json", r->id, NULL, b.data, b.len);
    r->conn = NULL;
    px_buf_cleanup(&b);
    px_buf_cleanup(&msg);
    req_end(r, 404, "model_not_found");
    return -1;
}

/* --prefiller-from-header (llm-d's routing sidecar): x-prefiller-host-port
 * names the prefill, host:port; of several (header lines, or one line of
 * comma-separated values) the first counts; without it, decode alone. Its
 * host must be in --prefiller-allowlist, or the request is refused before
 * any backend sees it. Returns -1 when r has ended. */
static int sidecar_prefill(px_req *r, const px_http_head *h) {
    if (!r->s->cfg->prefiller_from_header) return 0;
    const px_http_header *x = px_http_find(h, "x-prefiller-host-port");
    const char *v = x ? x->value : "";
    size_t n = x ? x->value_len : 0;
    size_t l = 0;
    while (l < n && v[l] == ' ')
        v++, n--;
    while (l < n && v[l] != ',')
        l++;
    while (l && v[l - 1] == ' ')
        l--;
    if (!l) {
        r->no_prefill = 1;
        return 0;
    }
    char hp[300], host[260];
    int port = 0;
    char url[320];
    if (l >= sizeof hp) goto bad;
    memcpy(hp, v, l);
    hp[l] = '\0';
    snprintf(url, sizeof url, "http://%s", hp);
    int https;
    if (!strrchr(hp, ':') || (hp[0] == '[' && !strstr(hp, "]:")) ||
        px_url_split(url, host, sizeof host, &port, &https) < 0 || port < 1)
        goto bad;
    if (!px_host_allowed(&r->s->cfg->prefiller_allowlist, host)) {
        char q[700];
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"x-prefiller-host-port outside --prefiller-allowlist: refused\" "
               "target=%s",
               r->lid, px_log_value(hp, q, sizeof q));
        req_fail(r, 400, NULL, "x-prefiller-host-port '%s' is not an allowed prefill target", hp);
        return -1;
    }
    /* A configured prefill of that address keeps its health and counters. */
    size_t nm;
    px_backend **m = px_pool_members(&r->ps->prefill, &nm);
    for (size_t i = 0; i < nm; i++) {
        if (!r->hb && !strcmp(m[i]->name, hp))
            r->hb = m[i];
        else
            px_backend_release(m[i]);
    }
    free(m);
    if (!r->hb) r->hb = px_backend_create(url);
    if (!r->hb) goto bad;
    return 0;
bad:
    req_fail(r, 400, NULL, "x-prefiller-host-port must be host:port");
    return -1;
}

void px_req_start(px_worker *w, px_conn *c, px_endpoint ep, const px_http_head *h, px_buf *body) {
    px_req *r = px_xcalloc(1, sizeof *r);
    r->w = w;
    r->next = w->reqs;
    if (w->reqs) w->reqs->prev = r;
    w->reqs = r;
    w->nreqs++;
    r->s = w->srv;
    r->g = px_server_gen(r->s);
    r->ps = &r->g->ps[0];
    r->conn = c;
    r->ep = ep;
    r->state = RS_NEW;
    r->t0 = px_now_ns();
    r->body = *body;
    px_buf_init(body);
    px_buf_init(&r->pbody);
    px_buf_init(&r->dbody);
    px_buf_init(&r->presp);
    px_buf_init(&r->hdrs_p);
    px_buf_init(&r->hdrs_d);

    const px_http_header *xid = px_http_find(h, "x-request-id");
    if (xid && valid_request_id(xid->value, xid->value_len)) {
        memcpy(r->id, xid->value, xid->value_len);
        r->id[xid->value_len] = '\0';
    } else {
        px_uuid4(r->id);
    }
    px_log_value(r->id, r->lid, sizeof r->lid);
    /* One trace for the request: the client's when it sent exactly one
     * valid traceparent, else a new one; P and D get child spans of it. */
    const px_http_header *tp = NULL;
    int ntp = 0;
    for (size_t i = 0; i < h->nheaders; i++)
        if (px_http_token_eq(h->headers[i].name, h->headers[i].name_len, "traceparent")) {
            tp = &h->headers[i];
            ntp++;
        }
    int traced = ntp == 1 && px_trace_parse(tp->value, tp->value_len, r->trace_id, r->trace_flags);
    if (!traced) {
        px_trace_new(r->trace_id);
        memcpy(r->trace_flags, "01", 3);
    } else {
        memcpy(r->parent_span, tp->value + 36, 16);
    }
    px_otlp_sample(r->trace_id, traced ? r->trace_flags : NULL, r->trace_flags);
    span_new(r->span_root);
    span_new(r->span_p);
    span_new(r->span_d);
    headers_for(r, h, traced, r->span_p, &r->hdrs_p);
    headers_for(r, h, traced, r->span_d, &r->hdrs_d);

    long max = r->s->cfg->max_inflight;
    long now = atomic_fetch_add(&r->s->inflight, 1) + 1;
    r->counted = 1;
    if (max > 0 && now > max) {
        req_fail(r, 503, "Retry-After: 1\r\n", "too many requests in flight (--max-inflight %ld)",
                 max);
        return;
    }
    px_conn_bind(c, &client_cbs, r);
    if (ep == PX_EP_MODELS) {
        start_decode(r);
        return;
    }
    char err[128];
    px_json_type t =
        px_json_validate(r->body.data ? r->body.data : "", r->body.len, err, sizeof err);
    if (t == PX_JSON_INVALID) {
        req_fail(r, 400, NULL, "request body is not valid JSON: %s", err);
        return;
    }
    if (t != PX_JSON_OBJECT) {
        req_fail(r, 400, NULL, "request body must be a JSON object");
        return;
    }
    if (choose_pool(r) < 0 || sidecar_prefill(r, h) < 0) return;
    /* A prefill without a decode to hand its blocks to would strand them
     * until they expire: refuse before starting one. */
    if (!px_pool_usable(&r->ps->decode)) {
        size_t nd;
        px_pool_counts(&r->ps->decode, &nd, NULL);
        req_fail(r, 503, "Retry-After: 1\r\n",
                 "no decode backend can take the request (%s%s%s%s); no prefill was started",
                 nd ? "every decode backend is ejected or drained" : "no decode backend",
                 r->g->named ? " in pool '" : "", r->g->named ? r->ps->name : "",
                 r->g->named ? "'" : "");
        return;
    }
    /* The client's body is held already (the connection counted it); the
     * prefill copy needs room in the budget too. */
    account(r);
    if (!px_budget_try(&r->s->shared, (int64_t)r->body.len + 512)) {
        atomic_fetch_add_explicit(&r->s->shared.budget_rejected, 1, memory_order_relaxed);
        req_fail(r, 503, "Retry-After: 1\r\n",
                 "request refused: the proxy's memory budget for buffered bodies "
                 "(--max-buffered-bytes) is spent; retry later");
        return;
    }
    r->held += (int64_t)r->body.len + 512;
    px_rewrite_prefill(r->body.data, r->body.len, &r->pbody);
    account(r);
    if (r->ps->prefill.cfg.policy == PX_POLICY_PREFIX_AFFINITY) find_key(r);
    if (r->s->cfg->prefill_timeout > 0)
        r->prefill_deadline = r->t0 + (uint64_t)(r->s->cfg->prefill_timeout * 1e9);
    start_prefill(r);
}

void px_req_free_all(px_worker *w) {
    while (w->reqs) {
        px_req *r = w->reqs;
        if (r->conn) {
            px_conn_abort(r->conn);
            r->conn = NULL;
        }
        finish_log(r, 499, "stopped");
        req_free(r);
    }
}
