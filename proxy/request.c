/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/request.h"

#include <arpa/inet.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <event2/event_struct.h> /* free_ev is embedded */

#include "base/json.h"
#include "base/list.h"
#include "base/log.h"
#include "proxy/access.h"
#include "proxy/admission.h"
#include "proxy/disagg.h"
#include "proxy/dispatch.h"
#include "proxy/dp.h"
#include "proxy/kvindex.h"
#include "proxy/otlp.h"
#include "proxy/predict.h"
#include "proxy/rewrite.h"
#include "proxy/tokenize.h"
#include "proxy/trace.h"
#include "proxy/usage.h"

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
    RS_TOKENIZE, /* asking an engine's /tokenize for the prompt's exact tokens */
    RS_PREFILL,
    RS_RETRY_WAIT,
    RS_DECODE,
    RS_STREAM,
    RS_RELEASING,
    RS_DONE /* finished: waits for its free on the next loop turn */
} req_state;

static const char *const state_names[] = {"new",    "tokenize",  "prefill", "retry_wait",
                                          "decode", "stream", "releasing", "done"};
/* A decode answer whose usage is rewritten is held whole (JSON) or an
 * event at a time (SSE); past this, it passes through untouched. */
#define USAGE_MAX_HOLD (8 * 1024 * 1024)

/* A decode's callbacks: the transfer's, and what ends a decode idle past
 * --decode-idle-timeout (its transfer already cancelled). The normal path
 * and the release each have one. */
typedef struct decode_table {
    px_upstream_cbs up;
    void (*idle)(px_req *r);
} decode_table;

struct px_req {
    px_req *prev, *next; /* in w->reqs */
    px_wctx *w;          /* borrowed: the worker this request runs on */
    px_ctx *ctx;         /* borrowed */
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
    const decode_table *dtbl;       /* the callbacks of the decode in flight */
    char pname[128], dname[128];    /* the backends' names, for logs after release */
    unsigned char p_https, d_https; /* their schemes, for the spans' url.full */
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
    uint64_t t0, t_prefill, t_first;
    uint64_t prefill_deadline; /* --prefill-timeout covers every attempt; 0: none */
    struct event *idle_timer;  /* owned: --decode-idle-timeout */
    uint64_t idle_since_ns;    /* the last byte (or start) the idle timer counts from */
    struct event *grace_timer; /* owned: a prefill whose client left may still answer */
    struct event free_ev;      /* frees the request on the loop turn after it finished */
    size_t bytes_out;
    int64_t held; /* bytes of the bodies above counted in the server's memory budget */

    /* Tracing (otlp.h): the client's span id ("" when the trace is new),
     * this request's spans, and when its first prefill and decode attempts
     * left. */
    char parent_span[17];
    char span_root[17], span_p[17], span_d[17];
    uint64_t t_pstart, t_dstart;
    int streamed; /* decode answered text/event-stream: 1, else 0 */

    /* What goes to decode: the client's method and target (passed-through
     * endpoints), and whether decode gets prefill's kv_transfer_params. */
    char method[16];
    char client[48]; /* the client's IP address, for the access line */
    char *target;    /* owned: path and query sent to decode; NULL: the endpoint's path */
    char lpath[300]; /* the path as a logfmt value, for the access line */
    int disagg;      /* decode's body carries prefill's kv_transfer_params */
    int decided;     /* decision below is set */
    px_decision decision;
    int fell_back; /* fallback below is set */
    px_fallback fallback;
    px_disagg dis; /* its hash owned: conditional disaggregation's estimate */
    uint32_t *tok;  /* owned: the prompt's exact tokens for kv_aware; NULL: unknown */
    size_t ntok;
    long pcharge, dcharge; /* prompt tokens charged on pb, db (kv_aware's load) */
    px_backend *tb;        /* owned reference: the engine asked for the tokens */
    px_buf tokbody;        /* owned: the /tokenize request */
    px_buf tokresp;        /* owned: its answer */
    int tstatus;
    uint64_t tkey;    /* the prompt's key in the worker's token cache */
    uint64_t session; /* --session-header's value or the body's "user", hashed; 0: none */

    /* --usage-from prefill: prefill's cached_tokens (number text) put into
     * decode's usage by the filter (inactive: decode's bytes pass as they
     * come). */
    char p_cached[24];
    px_usage usage; /* owned */

    /* --fallback-decode-only with prefill's KV: decode's answer is held
     * until it shows whether decode failed to load the KV (vLLM's
     * kv_load_failure_policy fail: a 500 InternalServerError, or a
     * stream whose first event is that error); then it is retried once
     * without kv_transfer_params, or let go to the client. */
    int hold;          /* decode's head and first bytes are held in dhold */
    char dctype[128];  /* the held answer's Content-Type */
    px_buf dhold;      /* owned */
    int kv_load_retry; /* the decode-only retry after a failed KV load was sent */
    int kv_load_failed; /* the held answer was that failure */

    /* Data-parallel ranks (dp.h) of the attempts in flight: -1 none. */
    int prank, drank;
    char prank_of[128], drank_of[128]; /* the backends they belong to */
    px_adm_req adm; /* admission control: its queue entry, pool slot, tenant */
    int p_busy;     /* prefill answered 429/503: its queue is full, not a failure */
    int d_requeue;  /* decode answered 429/503 and the request waits again: its
                       answer is dropped, not passed on */

    /* --dispatch (dispatch.h). disp: how the legs were sent (-1: no prefill
     * leg). With concurrent, pup is prefill's leg beside decode's in r->up,
     * and conc_live says that the decode in flight waits for that
     * prefill's KV (a failed prefill then cancels it). */
    int disp;
    px_upstream *pup; /* owned: concurrent prefill leg in flight */
    int conc_live;
    int conc_wait;            /* decode's answer is out: waiting for the prefill leg's end */
    struct event *conc_timer; /* owned: bounds that wait */
    int kv_waited;     /* decode sent X-KV-Wait-Ms: */
    double kv_wait_ms; /* its value */
    px_lat_req lat;    /* routing and admission by predicted latency (predict.h) */
};

/* The flow, top-down: each section below calls into later ones. */
static void headers_for(px_req *r, const px_http_head *h, int traced, const char *span, px_buf *l);
static int choose_pool(px_req *r);
static int sidecar_prefill(px_req *r, const px_http_head *h);
static int decide(px_req *r);
static void start_prefill(px_req *r);
static int pick_prefill(px_req *r);
static int send_prefill(px_req *r, const px_upstream_cbs *cbs);
static void dispatch_concurrent(px_req *r);
static void conc_prefill_stop(px_req *r);
static void conc_await_prefill(px_req *r);
static void proceed_to_decode(px_req *r);
static px_kvp_status decode_body(px_req *r, char *err, size_t errlen);
static void decode_only(px_req *r);
static void fall_back(px_req *r, px_fallback why);
static void start_decode(px_req *r);
static px_backend *pick_decode(px_req *r, size_t *n);
static int send_decode(px_req *r, const decode_table *tbl);
static int decode_retry(px_req *r, int connected, const char *why);
static void touch_idle(px_req *r);
static void release_prefill(px_req *r);
static void release_decode(px_req *r);
static void release_through_decode(px_req *r);
static void start_release(px_req *r);
static void released_via_decode(px_req *r);
static void on_retry_timer(evutil_socket_t fd, short what, void *arg);
static void on_grace_timer(evutil_socket_t fd, short what, void *arg);
static void req_fail(px_req *r, int status, const char *extra, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void req_abandon(px_req *r);
static void req_finish(px_req *r, int status, const char *outcome, const char *extra,
                       const char *msg);
static void on_free(evutil_socket_t fd, short what, void *arg);
static void write_access(const px_req *r, int status, const char *outcome, uint64_t now);
static void finish_log(px_req *r, int status, const char *outcome);
static void submit_spans(px_req *r, int status, const char *outcome, uint64_t now);
static void req_free(px_req *r);
static const px_exchange_cbs client_cbs;
static const px_upstream_cbs prefill_cbs, release_prefill_cbs, conc_prefill_cbs;
static const decode_table decode_tbl, release_tbl;
static void usage_out(void *arg, const char *p, size_t n);

/* ---------- helpers ---------- */

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

/* Takes back the prompt tokens kv_aware charged on the prefill (0) or the
 * decode (1) before the request lets go of it. */
static void uncharge(px_req *r, int decode) {
    long *c = decode ? &r->dcharge : &r->pcharge;
    px_backend_charge(decode ? r->db : r->pb, -*c);
    *c = 0;
}

/* The LoRA key of the request's blocks: its model when that names an
 * adapter the engines' KV events stored blocks under. */
static uint64_t kv_extra(px_req *r) {
    px_json_member m;
    if (!r->ctx->kvindex || !r->body.data ||
        !px_json_find(r->body.data, r->body.len, "model", &m) || m.type != PX_JSON_STRING ||
        m.val_len < 2)
        return 0;
    return px_kvindex_request_extra(r->ctx->kvindex, m.val + 1, m.val_len - 2);
}

/* A pick of a kv_aware pool: the prompt's tokens and the index. */
static px_pick kv_pick(px_req *r, px_pool *p, px_pick k) {
    if (p == &r->ps->decode && r->session) { /* a conversation stays on its decode */
        k.sessions = r->ctx->sessions;
        k.session = r->session;
    }
    if (p->cfg.policy != PX_POLICY_KV_AWARE && p->cfg.policy != PX_POLICY_LATENCY) return k;
    k.kv = r->ctx->kvindex;
    k.tok = r->tok;
    k.ntok = r->ntok;
    k.kv_extra = kv_extra(r);
    /* Tokens unknown (the engine's /tokenize did not answer in time): no
     * cache to match, but the engine chosen computes the whole prompt, and
     * the load others see must say so. */
    if (!r->tok) {
        long est = px_disagg_estimate(r->ctx->cfg, r->ep, r->body.data, r->body.len);
        k.ntok = est > 0 ? (size_t)est : 0;
    }
    px_lat_req_prefer(&r->lat, p == &r->ps->decode, &k);
    return k;
}

/* Brings the memory budget's count of this request's bodies up to date. */
static void account(px_req *r) {
    int64_t now = (int64_t)(r->body.len + r->pbody.len + r->dbody.len + r->presp.len + r->dhold.len +
                            px_usage_held(&r->usage));
    px_budget_add(&r->ctx->shared, now - r->held);
    r->held = now;
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

/* The attempt of `role` ended: its data-parallel rank is free again. */
static void dp_end(px_req *r, px_dp_role role) {
    int *rank = role == PX_DP_PREFILL ? &r->prank : &r->drank;
    if (*rank < 0) return;
    px_dp_done(role, role == PX_DP_PREFILL ? r->prank_of : r->drank_of, *rank);
    *rank = -1;
}

/* total: seconds for the whole exchange, 0: no limit. */
static int start_upstream(px_req *r, px_backend *b, const char *method, const char *path,
                          const px_buf *body, const px_buf *hdrs, const px_upstream_cbs *cbs,
                          double total) {
    const px_config *cfg = r->ctx->cfg;
    /* A data-parallel backend: the rank with the fewest requests in flight. */
    px_dp_role role = b == r->pb ? PX_DP_PREFILL : PX_DP_DECODE;
    int64_t dp = px_dp_size(b->src, (int)(role == PX_DP_PREFILL ? cfg->prefill_dp_size
                                                                 : cfg->decode_dp_size));
    px_buf hd;
    px_buf_init(&hd);
    if (dp > 1) {
        dp_end(r, role);
        int rank = px_dp_take(role, b->name, (int)dp);
        if (rank >= 0) {
            if (role == PX_DP_PREFILL) {
                r->prank = rank;
                snprintf(r->prank_of, sizeof r->prank_of, "%s", b->name);
            } else {
                r->drank = rank;
                snprintf(r->drank_of, sizeof r->drank_of, "%s", b->name);
            }
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
        .track_upload = body && cbs != NULL && b == r->db,
    };
    r->up = px_upstream_start(r->w->up, &q, cbs, r);
    px_buf_cleanup(&hd);
    if (!r->up) dp_end(r, role);
    return r->up ? 0 : -1;
}

/* ---------- entry: parse, choose the pool, find the key, decide ---------- */

void px_req_announce(void) {
    /* vLLM took kv_transfer_params on ResponsesRequest and returns them in
     * ResponsesResponse since PR #37424; the token-in generate endpoint
     * (GenerateRequest/GenerateResponse) always has. */
    PX_LOG(PX_LOG_INFO, "msg=\"/v1/responses, /v1/messages and /inference/v1/generate are "
                        "disaggregated like chat: vLLM accepts kv_transfer_params there\" "
                        "decision=disaggregated");
}

/* A request for `ep` on worker w, owning the client's body (moved out of
 * `body`), with its method and the path decode is sent. */
static px_req *req_new(px_wctx *w, px_conn *c, px_endpoint ep, const px_http_head *h,
                       px_buf *body) {
    px_req *r = px_xcalloc(1, sizeof *r);
    r->w = w;
    PX_LIST_PUSH(w->reqs, r);
    w->nreqs++;
    r->ctx = w->ctx;
    r->g = px_ctx_gen(r->ctx);
    r->ps = &r->g->ps[0];
    r->conn = c;
    px_conn_peer(c, r->client, sizeof r->client);
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
    px_buf_init(&r->dhold);
    r->prank = r->drank = -1;
    r->disp = -1;
    if (px_endpoint_passthrough(ep)) {
        /* The client's method, path and query as it sent them (an
         * absolute-form target loses its scheme and authority). */
        snprintf(r->method, sizeof r->method, "%.*s", (int)h->method_len, h->method);
        const char *path;
        size_t plen;
        px_http_path(h, &path, &plen);
        r->target = px_xstrndup(path, (size_t)(h->target + h->target_len - path));
        char pbuf[256];
        snprintf(pbuf, sizeof pbuf, "%.*s", (int)(plen < 200 ? plen : 200), path);
        px_log_value(pbuf, r->lpath, sizeof r->lpath);
    } else {
        snprintf(r->method, sizeof r->method, "%s", ep == PX_EP_MODELS ? "GET" : "POST");
        snprintf(r->lpath, sizeof r->lpath, "%s", px_endpoints[ep].path);
    }
    px_http_request_id(h, r->id);
    px_log_value(r->id, r->lid, sizeof r->lid);
    return r;
}

/* One trace for the request: the client's when it sent exactly one valid
 * traceparent, else a new one; P and D get child spans of it, in the
 * header lines built here. */
static void trace_and_headers(px_req *r, const px_http_head *h) {
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
    px_trace_span_new(r->span_root);
    px_trace_span_new(r->span_p);
    px_trace_span_new(r->span_d);
    /* Only the P/D endpoints ever reach a prefill. */
    if (!px_endpoint_passthrough(r->ep) && r->ep != PX_EP_MODELS)
        headers_for(r, h, traced, r->span_p, &r->hdrs_p);
    headers_for(r, h, traced, r->span_d, &r->hdrs_d);
}

/* Takes one of --max-inflight's slots. Returns -1 when r has ended. */
static int admit(px_req *r) {
    long max = r->ctx->cfg->max_inflight;
    long now = atomic_fetch_add(&r->ctx->inflight, 1) + 1;
    r->counted = 1;
    if (max > 0 && now > max) {
        req_fail(r, 503, "Retry-After: 1\r\n", "too many requests in flight (--max-inflight %ld)",
                 max);
        return -1;
    }
    return 0;
}

/* The client's bytes to a decode, with the keys the proxy owns taken out of
 * a JSON object body (kv_transfer_params: SECURITY.md). */
static void start_passthrough(px_req *r) {
    px_buf clean;
    px_buf_init(&clean);
    int st = px_rewrite_forwarded(r->body.data ? r->body.data : "", r->body.len, &clean);
    if (st > 0) {
        px_buf t = r->body;
        r->body = clean;
        clean = t;
    }
    px_buf_cleanup(&clean);
    if (st < 0) {
        req_fail(r, 400, NULL,
                 st == -2 ? "request body must be UTF-8 JSON without a byte-order mark"
                          : "request body is not valid JSON");
        return;
    }
    r->dbody = r->body;
    px_buf_init(&r->body);
    account(r);
    start_decode(r);
}

/* The checks before any backend sees a P/D request: a JSON object body, a
 * pool serving its model, the sidecar's prefill, a decode that can take
 * it, room in the memory budget. Returns -1 when r has ended. */
static int check_pd(px_req *r, const px_http_head *h) {
    char err[128];
    px_json_type t =
        px_json_validate(r->body.data ? r->body.data : "", r->body.len, err, sizeof err);
    if (t == PX_JSON_INVALID) {
        req_fail(r, 400, NULL, "request body is not valid JSON: %s", err);
        return -1;
    }
    if (t != PX_JSON_OBJECT) {
        req_fail(r, 400, NULL, "request body must be a JSON object");
        return -1;
    }
    if (choose_pool(r) < 0 || sidecar_prefill(r, h) < 0) return -1;
    /* A prefill without a decode to hand its blocks to would strand them
     * until they expire: refuse before starting one. */
    const char *why;
    if (!px_pset_ready(r->ps, 1, &why)) { /* 1: decode's side alone */
        req_fail(r, 503, "Retry-After: 1\r\n",
                 "no decode backend can take the request (%s%s%s%s); no prefill was started", why,
                 r->g->named ? " in pool '" : "", r->g->named ? r->ps->name : "",
                 r->g->named ? "'" : "");
        return -1;
    }
    /* The client's body is held already (the connection counted it); the
     * prefill copy needs room in the budget too. */
    account(r);
    if (!px_budget_try(&r->ctx->shared, (int64_t)r->body.len + 512)) {
        atomic_fetch_add_explicit(&r->ctx->shared.budget_rejected, 1, memory_order_relaxed);
        req_fail(r, 503, "Retry-After: 1\r\n",
                 "request refused: the proxy's memory budget for buffered bodies "
                 "(--max-buffered-bytes) is spent; retry later");
        return -1;
    }
    r->held += (int64_t)r->body.len + 512;
    return 0;
}

/* Admission control (admission.h): dispatched out of the queue. */
static void pd_go(px_req *r);
static void route_pd(px_req *r);
static int requeue(px_req *r, void (*go)(void *));

static void adm_go(void *arg) {
    pd_go(arg);
}

static void adm_expire(void *arg) {
    px_req *r = arg;
    r->lat.refused = r->lat.waited; /* it waited for its prediction in vain */
    req_fail(r, 503, "Retry-After: 1\r\n",
             "the request waited %.3f s in the admission queue for a saturated pool: its "
             "deadline passed (--queue-timeout, x-queue-timeout)",
             (double)r->adm.wait_ns / 1e9);
}

/* The tenant's rate limits and the pool's saturation. Returns 0 to go on
 * now, 1 when r waits in the queue, -1 when r has ended. */
static int admission(px_req *r, const px_http_head *h) {
    int status = 0;
    char extra[768], msg[300];
    r->adm.it.owner = r;
    r->adm.go = adm_go;
    r->adm.expire = adm_expire;
    px_adm_verdict v = px_adm_enter(r->w, &r->adm, r->ps, h, r->body.data, r->body.len, &status,
                                    extra, sizeof extra, msg, sizeof msg);
    if (v == PX_ADM_GO) return 0;
    if (v == PX_ADM_QUEUED) {
        PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"queued\" class=%d", r->lid, r->adm.it.cls);
        return 1;
    }
    req_fail(r, status, extra, "%s", msg);
    return -1;
}

/* An engine refused the request with 429/503 (its own queue is full):
 * back in the admission queue, to go to `go` when dispatched again.
 * Returns 1 when it waits, 0 when it cannot (the caller answers). */
static int requeue(px_req *r, void (*go)(void *)) {
    r->adm.go = go;
    set_state(r, RS_RETRY_WAIT);
    if (px_adm_requeue(r->w, &r->adm) == 0) {
        PX_LOG(PX_LOG_INFO, "req=%s msg=\"an engine's queue is full: waiting again\"", r->lid);
        return 1;
    }
    return 0;
}

static void adm_reprefill(void *arg) {
    start_prefill(arg);
}

static void adm_redecode(void *arg) {
    start_decode(arg);
}

/* ---------- exact prompt tokens ---------- */

#define TOKENIZE_MAX_TOKENS (1u << 20)
#define TOKENIZE_MAX_ANSWER (16u << 20)
#define TOKENIZE_CACHE_MAX_TOKENS 65536

static void route_pd(px_req *r);

static void tok_headers(void *arg, int status, const char *ctype) {
    px_req *r = arg;
    r->tstatus = status;
}

static int tok_data(void *arg, const char *p, size_t n) {
    px_req *r = arg;
    if (r->tokresp.len + n > TOKENIZE_MAX_ANSWER) return -1;
    px_buf_append(&r->tokresp, p, n);
    return 0;
}

static void tok_done(void *arg, px_up_result rc, const char *why, int connected) {
    px_req *r = arg;
    r->up = NULL; /* freed by the upstream module when this returns */
    long n = -1;
    if (rc == PX_UP_OK && r->tstatus == 200)
        n = px_tokenize_parse(r->tokresp.data, r->tokresp.len, TOKENIZE_MAX_TOKENS, &r->tok);
    int res = n > 0 ? PX_TOK_OK : rc == PX_UP_TIMEOUT ? PX_TOK_TIMEOUT : PX_TOK_ERROR;
    px_m_inc(&r->w->metrics.tokenize[res]);
    if (n > 0) {
        r->ntok = (size_t)n;
        px_tokcache_put(r->w->tokcache, r->tkey, r->tok, r->ntok);
    } else {
        PX_LOG(PX_LOG_DEBUG,
               "req=%s msg=\"no exact tokens: the byte estimate stands\" engine=%s "
               "status=%d result=%s",
               r->lid, r->tb->name, r->tstatus, why);
    }
    px_backend_release(r->tb);
    r->tb = NULL;
    px_buf_cleanup(&r->tokbody);
    px_buf_cleanup(&r->tokresp);
    if (r->state == RS_TOKENIZE) route_pd(r);
}

static const px_upstream_cbs tokenize_cbs = {tok_headers, tok_data, tok_done};

/* Asks an engine of the pool for the prompt's tokens when kv_aware or the
 * KV index would use them: from the worker's cache, else POST /tokenize
 * within --tokenize-timeout. Returns 1 when the request waits for it. */
static int want_tokens(px_req *r, int kva) {
    const px_config *cfg = r->ctx->cfg;
    if (r->tok || cfg->tokenize_timeout <= 0 ||
        !(kva || (r->ctx->kvindex && cfg->disagg_min_tokens > 0)))
        return 0;
    if (px_tokenize_body(r->ep, r->body.data, r->body.len, &r->tokbody, &r->tkey) < 0) {
        px_buf_cleanup(&r->tokbody);
        return 0;
    }
    if (!r->w->tokcache)
        r->w->tokcache = px_tokcache_create((size_t)cfg->tokenize_cache_entries,
                                            TOKENIZE_CACHE_MAX_TOKENS);
    long n = px_tokcache_get(r->w->tokcache, r->tkey, &r->tok);
    if (n > 0) {
        r->ntok = (size_t)n;
        px_m_inc(&r->w->metrics.tokenize[PX_TOK_CACHED]);
        px_buf_cleanup(&r->tokbody);
        return 0;
    }
    /* Any healthy engine of the pool tokenizes alike: the one the prompt's
     * key names, so that its answers stay warm in one place. */
    px_pool *pool = px_pool_usable(&r->ps->prefill) ? &r->ps->prefill : &r->ps->decode;
    size_t nm;
    px_backend **m = px_pool_members(pool, &nm);
    for (size_t j = 0; j < nm && !r->tb; j++) {
        px_backend *b = m[(r->tkey + j) % nm];
        if (atomic_load(&b->healthy) && !atomic_load(&b->drained)) {
            r->tb = b;
            atomic_fetch_add(&b->refs, 1);
        }
    }
    for (size_t j = 0; j < nm; j++)
        px_backend_release(m[j]);
    free(m);
    if (r->tb) {
        set_state(r, RS_TOKENIZE);
        if (start_upstream(r, r->tb, "POST", "/tokenize", &r->tokbody, &r->hdrs_p, &tokenize_cbs,
                           cfg->tokenize_timeout) == 0)
            return 1;
        set_state(r, RS_NEW);
        px_backend_release(r->tb);
        r->tb = NULL;
    }
    px_m_inc(&r->w->metrics.tokenize[PX_TOK_ERROR]);
    px_buf_cleanup(&r->tokbody);
    return 0;
}

/* A P/D request: admitted, decided, then a prefill or decode alone. */
static void start_pd(px_req *r, const px_http_head *h) {
    if (check_pd(r, h) < 0) return;
    /* The session key comes from the client's head, which admission's
     * queue does not keep. */
    const px_config *cfg = r->ctx->cfg;
    const px_http_header *sh = cfg->session_header[0] && r->ctx->sessions
                                   ? px_http_find(h, cfg->session_header)
                                   : NULL;
    px_json_member user;
    if (sh && sh->value_len)
        r->session = px_hash64_seed(sh->value, sh->value_len, 1);
    else if (r->ctx->sessions && px_json_find(r->body.data, r->body.len, "user", &user) &&
             user.type == PX_JSON_STRING && user.val_len > 2)
        r->session = px_hash64_seed(user.val, user.val_len, 2);
    px_lat_req_headers(&r->lat, r->ctx, h, r->body.data, r->body.len);
    if (admission(r, h) != 0) return;
    pd_go(r);
}

/* Admitted: the prompt's key and tokens, then routing. */
static void pd_go(px_req *r) {
    /* One look at the prompt gives prefix_affinity its key and kv_aware
     * its token ids. */
    px_json_member pm;
    int has = px_disagg_prompt(r->ep, r->body.data, r->body.len, &pm);
    px_policy pp = r->ps->prefill.cfg.policy;
    if (has && (pp == PX_POLICY_PREFIX_AFFINITY || pp == PX_POLICY_PREFIX_AFFINITY_BYTES)) {
        r->key = pm.val;
        r->key_len =
            pp == PX_POLICY_PREFIX_AFFINITY_BYTES && pm.val_len > r->ps->prefill.cfg.prefix_bytes
                ? r->ps->prefill.cfg.prefix_bytes
                : pm.val_len;
    }
    int kva = pp == PX_POLICY_KV_AWARE || r->ps->decode.cfg.policy == PX_POLICY_KV_AWARE ||
              px_lat_pool(r->ps);
    if (has && (kva || r->ctx->kvindex) && !r->tok)
        r->ntok = px_disagg_prompt_ids(r->ep, &pm, 1u << 20, &r->tok);
    if (want_tokens(r, kva)) return;
    route_pd(r);
}

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
    long est = r->tok ? 0 : px_disagg_estimate(r->ctx->cfg, r->ep, r->body.data, r->body.len);
    px_lat_verdict v = px_lat_req_route(&r->lat, r->ctx, r->ps, r->adm.tenant, r->tok,
                                        r->tok ? r->ntok : (size_t)(est > 0 ? est : 0),
                                        kv_extra(r), r->t0, r->adm.deadline_ns);
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
    r->decided = 1;
    r->decision = PX_DEC_PREDICTED;
    px_m_inc(&r->w->metrics.decisions[r->decision]);
    decode_only(r);
    return 1;
}

/* Routes a P/D request once its tokens are known (or are not to be). */
static void route_pd(px_req *r) {
    int kva = r->ps->prefill.cfg.policy == PX_POLICY_KV_AWARE ||
              r->ps->decode.cfg.policy == PX_POLICY_KV_AWARE || px_lat_pool(r->ps);
    if (kva && !r->key && r->tok) { /* kv_aware's tie-break spreads by prompt */
        r->key = (const char *)r->tok;
        r->key_len = r->ntok * sizeof *r->tok;
    }
    if (!r->hb && !r->no_prefill && lat_route(r)) return; /* sidecar: the header decides */
    r->decided = 1;
    int disagg = decide(r);
    if (r->no_prefill) { /* sidecar without the header: decode alone, said so */
        disagg = 0;
        r->decision = PX_DEC_NO_HEADER;
    }
    if (disagg && !r->hb && !r->no_prefill && r->ctx->cfg->fallback_decode_only &&
        px_pool_usable(&r->ps->prefill) == 0) {
        disagg = 0;
        r->decision = PX_DEC_NO_PREFILL;
    }
    px_m_inc(&r->w->metrics.decisions[r->decision]);
    if (!disagg) {
        if (r->decision == PX_DEC_NO_PREFILL) {
            PX_LOG(PX_LOG_WARN,
                   "req=%s msg=\"no healthy prefill: sending the request to decode alone\"",
                   r->lid);
            fall_back(r, PX_FB_NO_PREFILL);
        } else {
            decode_only(r);
        }
        return;
    }
    if (r->ep == PX_EP_RESPONSES)
        px_rewrite_prefill_responses(r->body.data, r->body.len, &r->pbody);
    else if (r->ep == PX_EP_GENERATE)
        px_rewrite_prefill_generate(r->body.data, r->body.len, &r->pbody);
    else
        px_rewrite_prefill(r->body.data, r->body.len, &r->pbody);
    account(r);
    if (r->ctx->cfg->prefill_timeout > 0)
        r->prefill_deadline = px_now_ns() + (uint64_t)(r->ctx->cfg->prefill_timeout * 1e9);
    if (r->ps->dispatch == PX_DISPATCH_CONCURRENT) {
        dispatch_concurrent(r);
        return;
    }
    r->disp = PX_DISP_SERIAL;
    px_m_inc(&r->w->metrics.dispatch[PX_DISP_SERIAL]);
    start_prefill(r);
}

void px_req_start(px_wctx *w, px_conn *c, px_endpoint ep, const px_http_head *h, px_buf *body) {
    px_req *r = req_new(w, c, ep, h, body);
    trace_and_headers(r, h);
    if (admit(r) < 0) return;
    if (px_http_via_count(h) > r->ctx->cfg->loop_limit) {
        req_fail(r, 508, NULL,
                 "loop detected: the request passed through this proxy %d times already "
                 "(--loop-limit %lld); a backend leads back to it",
                 px_http_via_count(h), (long long)r->ctx->cfg->loop_limit);
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

/* ---------- headers ---------- */

/* The header lines both upstream requests carry ("Name: value\r\n" each);
 * Host and the body's framing are the transport's. */
static void headers_for(px_req *r, const px_http_head *h, int traced, const char *span, px_buf *l) {
    if (px_endpoint_passthrough(r->ep)) {
        for (size_t i = 0; i < h->nheaders; i++)
            if (px_http_forwarded_header(&h->headers[i])) {
                px_buf_append(l, h->headers[i].name, h->headers[i].name_len);
                px_buf_append(l, ": ", 2);
                px_buf_append(l, h->headers[i].value, h->headers[i].value_len);
                px_buf_append(l, "\r\n", 2);
            }
    } else if (r->ep != PX_EP_MODELS) {
        px_buf_appends(l, "Content-Type: application/json\r\n");
    }
    px_http_via_append(h, l); /* loops through proxies end in 508 (px_req_start) */
    /* Appended piece by piece, no printf: built twice per request. */
    px_buf_appends(l, "X-Request-Id: ");
    px_buf_appends(l, r->id);
    px_buf_append(l, "\r\n", 2);
    const px_http_header *auth = px_http_find(h, "authorization");
    if (r->ctx->upstream_auth_forced || !auth) {
        if (r->ctx->upstream_auth) {
            px_buf_appends(l, r->ctx->upstream_auth);
            px_buf_append(l, "\r\n", 2);
        }
    } else {
        px_buf_appends(l, "Authorization: ");
        px_buf_append(l, auth->value, auth->value_len);
        px_buf_append(l, "\r\n", 2);
    }
    char child[56];
    px_trace_child(r->trace_id, span, r->trace_flags, child);
    px_buf_appends(l, "traceparent: ");
    px_buf_appends(l, child);
    px_buf_append(l, "\r\n", 2);
    /* tracestate belongs to the client's trace: dropped when that was
     * unusable and a new trace started. */
    const px_http_header *ts = traced ? px_http_find(h, "tracestate") : NULL;
    if (ts && ts->value_len <= 512)
        px_buf_printf(l, "tracestate: %.*s\r\n", (int)ts->value_len, ts->value);
}

/* Named pools: the body's model chooses the pool; an unknown one gets
 * OpenAI's 404 model_not_found. Returns -1 when r has ended. */
static int choose_pool(px_req *r) {
    if (!r->g->named) return 0;
    px_json_member m;
    char model[512];
    long n = -1;
    int str = px_json_find(r->body.data, r->body.len, "model", &m) && m.val_len >= 2 &&
              m.val[0] == '"';
    if (str) n = px_json_str_decode(m.val + 1, m.val_len - 2, model, sizeof model);
    if (n < 0 && str && m.val_len >= sizeof model) {
        req_fail(r, 400, NULL, "the request's model name is longer than %zu bytes: no pool "
                 "serves it", sizeof model - 1);
        return -1;
    }
    if (n < 0) {
        req_fail(r, 400, NULL, "the request names no model (a string \"model\" member)");
        return -1;
    }
    r->ps = px_gen_find(r->g, model, (size_t)n);
    if (r->ps) return 0;
    r->ps = &r->g->ps[0];
    px_buf b;
    px_buf_init(&b);
    px_req_model_not_found(&b, model, (size_t)n);
    char q[600];
    PX_LOG(PX_LOG_INFO, "req=%s msg=\"unknown model\" model=%s status=404", r->lid,
           px_log_value(model, q, sizeof q));
    if (r->conn) px_conn_reply(r->conn, 404, "application/json", r->id, NULL, b.data, b.len);
    r->conn = NULL;
    px_buf_cleanup(&b);
    req_finish(r, 404, "model_not_found", NULL, NULL);
    return -1;
}

void px_req_model_not_found(px_buf *b, const char *model, size_t n) {
    px_buf msg;
    px_buf_init(&msg);
    px_buf_printf(&msg, "The model `%.*s` does not exist.", (int)(n > 200 ? 200 : n), model);
    px_buf_appends(b, "{\"error\":{\"message\":");
    px_buf_append_json_str(b, msg.data, msg.len);
    px_buf_appends(b, ",\"type\":\"invalid_request_error\",\"param\":\"model\","
                      "\"code\":\"model_not_found\"}}");
    px_buf_cleanup(&msg);
}

/* --prefiller-from-header (llm-d's routing sidecar): x-prefiller-host-port
 * names the prefill, host:port; of several (header lines, or one line of
 * comma-separated values) the first counts; without it, decode alone. Its
 * host must be in --prefiller-allowlist, or the request is refused before
 * any backend sees it. Returns -1 when r has ended. */
static int sidecar_prefill(px_req *r, const px_http_head *h) {
    if (!r->ctx->cfg->prefiller_from_header) return 0;
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
    if (!px_target_allowed(&r->ctx->cfg->prefiller_allowlist, host, port)) {
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
    if (!r->hb) {
        /* A name would be resolved here, blocking this worker's loop on
         * DNS: only an address (what an endpoint picker sends: the pod's)
         * or a configured prefill is taken. */
        unsigned char a[sizeof(struct in6_addr)];
        if (inet_pton(AF_INET, host, a) != 1 && inet_pton(AF_INET6, host, a) != 1) {
            req_fail(r, 400, NULL,
                     "x-prefiller-host-port '%s': give the prefill's IP address (names are "
                     "taken only for prefills configured with --prefill)",
                     hp);
            return -1;
        }
        r->hb = px_backend_create(url);
    }
    if (!r->hb) goto bad;
    return 0;
bad:
    req_fail(r, 400, NULL, "x-prefiller-host-port must be host:port");
    return -1;
}

/* ---------- conditional disaggregation ---------- */

/* Decides whether r goes through a prefill (disagg.c), the decode chosen
 * first so that its cache can count. Returns 1 to disaggregate. */
static int decide(px_req *r) {
    const px_config *cfg = r->ctx->cfg;
    if (cfg->disagg_min_tokens > 0) {
        size_t nd, cached = 0;
        px_pick k = kv_pick(r, &r->ps->decode,
                            (px_pick){.key = r->key, .key_len = r->key_len, .cached = &cached});
        r->db = px_pool_pick(&r->ps->decode, &k, &nd);
        if (r->db) r->dcharge = (long)(k.ntok - cached);
        if (!r->w->pindex) r->w->pindex = px_pindex_create((size_t)cfg->disagg_index_blocks);
    }
    px_disagg_decide(cfg, r->ep, r->body.data, r->body.len, r->w->pindex,
                     r->db ? &r->db->key_hash : NULL, &r->dis);
    /* The engine's own KV events know what it holds: the exact remainder. */
    px_kvindex *kv = r->ctx->kvindex;
    int slot = r->db && kv && r->tok ? px_kvindex_slot(kv, r->db->name, 0) : -1;
    size_t bs = px_kvindex_block_size(kv, slot);
    if (slot >= 0 && bs) {
        size_t cap = r->ntok / bs + 1;
        uint64_t *keys = px_xmalloc(cap * sizeof *keys);
        size_t nk = px_kv_prompt_keys(r->tok, r->ntok, bs, kv_extra(r), keys, cap);
        size_t cached = px_kv_reusable(px_kvindex_match(kv, slot, keys, nk), bs, r->ntok);
        free(keys);
        px_disagg_exact(cfg, (long)r->ntok, (long)cached, &r->dis);
    }
    r->decision = r->dis.decision;
    /* Through a prefill, the decode receives the prompt's KV and computes
     * none of it: not load in kv_aware's tokens. */
    if (r->dis.disagg) uncharge(r, 1);
    return r->dis.disagg;
}

/* ---------- prefill ---------- */

static void start_prefill(px_req *r) {
    if (pick_prefill(r) == 0) send_prefill(r, &prefill_cbs);
}

/* Takes the prefill of the next attempt into r->pb. Returns -1 when there
 * is none: r went on to decode alone or ended. */
static int pick_prefill(px_req *r) {
    px_pick k = {
        .key = r->key, .key_len = r->key_len, .exclude = r->tried_p, .nexclude = r->ntried_p};
    size_t n = 0;
    if (r->hb) { /* sidecar: the prefill the header named */
        r->pb = r->hb;
        px_backend_take(r->pb);
    } else if (!r->no_prefill) {
        size_t cached = 0;
        k = kv_pick(r, &r->ps->prefill, k);
        k.cached = &cached;
        r->pb = px_pool_pick(&r->ps->prefill, &k, &n);
        if (r->pb) r->pcharge = (long)(k.ntok - cached);
    }
    if (!r->pb) {
        if (r->no_prefill) {
            PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"no x-prefiller-host-port: decode alone\"", r->lid);
            decode_only(r);
            return -1;
        }
        if (r->ctx->cfg->fallback_decode_only) {
            PX_LOG(PX_LOG_WARN,
                   "req=%s msg=\"no healthy prefill: sending the request to decode alone\" "
                   "prefill_backends=%zu",
                   r->lid, n);
            fall_back(r, PX_FB_NO_PREFILL);
            return -1;
        }
        req_fail(r, 503, "Retry-After: 1\r\n", "no healthy prefill backend (%zu configured%s)", n,
                 px_pool_unusable_why(&r->ps->prefill));
        return -1;
    }
    return 0;
}

/* Sends r->pbody to r->pb with the callbacks `cbs`; the transfer is r->up.
 * Returns -1 when r has ended. */
static int send_prefill(px_req *r, const px_upstream_cbs *cbs) {
    snprintf(r->pname, sizeof r->pname, "%s", r->pb->name);
    r->p_https = (unsigned char)r->pb->https;
    if (!r->t_pstart) r->t_pstart = px_now_ns();
    if (r->ntried_p < MAX_TRIES) r->tried_p[r->ntried_p++] = r->pb;
    set_state(r, RS_PREFILL);
    double ptimeout = 0;
    if (r->prefill_deadline) {
        uint64_t now = px_now_ns();
        if (now + 1000000 >= r->prefill_deadline) {
            req_fail(r, 504, NULL, "prefill did not answer within --prefill-timeout %gs",
                     r->ctx->cfg->prefill_timeout);
            return -1;
        }
        ptimeout = (double)(r->prefill_deadline - now) / 1e9;
    }
    if (start_upstream(r, r->pb, "POST", px_endpoints[r->ep].path, &r->pbody, &r->hdrs_p, cbs,
                       ptimeout) < 0) {
        req_fail(r, 502, NULL, "prefill %s: cannot start the request", r->pname);
        return -1;
    }
    return 0;
}

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

/* A prefill attempt ended: its answer is counted, its backend handed back.
 * Returns how the attempt went. */
static px_outcome prefill_ended(px_req *r, px_up_result rc) {
    dp_end(r, PX_DP_PREFILL);
    account(r); /* the prefill's answer */
    px_outcome o = outcome_of(rc, r->pstatus);
    if (r->too_big) o = PX_OUT_SERVER_ERR;
    if (r->p_busy) o = PX_OUT_CLIENT_ERR; /* a full engine queue, not a failure */
    uncharge(r, 0);
    attempt_done(&r->ps->prefill, r->pb, r->tried_p, r->ntried_p, o);
    r->pb = NULL;
    return o;
}

/* The message of an engine's JSON error: {"error": {"message": M}} (OpenAI)
 * or {"message": M} (vLLM's older ErrorResponse). "" when the body is
 * neither; at most outlen - 1 bytes (cut on a UTF-8 boundary). */
static void engine_error_message(const char *body, size_t n, char *out, size_t outlen) {
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
    long l = px_json_str_decode(m.val + 1, m.val_len - 2, t, m.val_len);
    if (l > 0) {
        size_t k = (size_t)l < outlen - 1 ? (size_t)l : outlen - 1;
        while (k && k < (size_t)l && ((unsigned char)t[k] & 0xc0) == 0x80)
            k--;
        memcpy(out, t, k);
        out[k] = '\0';
    }
    free(t);
}

static void prefill_done(void *arg, px_up_result rc, const char *errbuf, int connected) {
    px_req *r = arg;
    r->up = NULL; /* freed by the upstream module when this returns */
    /* A full engine queue (admission.h) while the request may wait again:
     * the backend backs off, not counted as failed, and the request goes
     * back in the queue. Without a queue or time left, as before: a 503
     * is retried elsewhere, a 429 passed on. */
    r->p_busy = rc == PX_UP_OK && r->pb && !r->hb && px_adm_can_requeue(&r->adm, r->pstatus) &&
                px_adm_engine_status(r->ctx, r->ps, r->pb, r->pstatus);
    px_outcome o = prefill_ended(r, rc);
    const char *why = errbuf[0] ? errbuf : px_up_result_str(rc);
    if (r->p_busy) {
        r->p_busy = 0;
        px_m_inc(&r->w->metrics.adm[PX_ADM_M_ENGINE_FULL]);
        px_buf_reset(&r->presp);
        r->pstatus = 0;
        if (r->ntried_p) r->ntried_p--; /* not a failed attempt */
        if (requeue(r, adm_reprefill)) return;
        req_fail(r, 503, "Retry-After: 1\r\n",
                 "prefill %s's queue is full and the admission queue has no room", r->pname);
        return;
    }

    /* Refused, reset or 5xx: another prefill, after a jittered pause. */
    int retryable = o == PX_OUT_CONNECT_ERR || o == PX_OUT_RESET || o == PX_OUT_SERVER_ERR;
    if (retryable && !r->too_big && (int64_t)(r->ntried_p) <= r->ctx->cfg->prefill_retries &&
        r->ntried_p < MAX_TRIES) {
        size_t np = 0;
        if (!r->hb) px_pool_counts(&r->ps->prefill, &np, NULL);
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"prefill failed, retrying%s\" prefill=%s attempt=%zu "
               "error=\"%s\" status=%d",
               r->lid, np > 1 ? " on another instance" : " on the same instance (the only one)",
               r->pname, r->ntried_p, rc ? why : "", r->pstatus);
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
    /* Retries spent on a prefill that failed (5xx, refused, reset): with
     * --fallback-decode-only decode computes the prefill itself. Never
     * after a 4xx (the client's error, returned below as it is), nor after
     * a timeout (the prefill may still be working). */
    int failed_5xx = rc == PX_UP_OK && r->pstatus >= 500 && r->pstatus < 600;
    int failed_conn = rc == PX_UP_CONNECT || rc == PX_UP_RESET;
    if ((failed_5xx || failed_conn) && !r->too_big && r->ctx->cfg->fallback_decode_only) {
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"prefill failed: sending the request to decode alone\" prefill=%s "
               "status=%d error=\"%s\"",
               r->lid, r->pname, r->pstatus, rc ? why : "");
        px_buf_reset(&r->presp);
        account(r);
        fall_back(r, failed_5xx ? PX_FB_PREFILL_5XX : PX_FB_PREFILL_CONN);
        return;
    }
    if (rc != PX_UP_OK) {
        if (r->too_big)
            req_fail(r, 502, NULL, "prefill %s answer exceeds %d bytes", r->pname,
                     PREFILL_MAX_ANSWER);
        else
            req_fail(r, px_upstream_status_for(rc), NULL, "prefill %s: %s", r->pname, why);
        return;
    }
    if (r->pstatus >= 400 && r->pstatus < 500 && r->hb) {
        /* Sidecar mode: the prefill is whatever the header named, so its
         * body is not relayed; the status is, with the engine's message
         * when it answered an OpenAI (or vLLM) error object. */
        char em[320];
        engine_error_message(r->presp.data, r->presp.len, em, sizeof em);
        char msg[512];
        snprintf(msg, sizeof msg, "prefill %s answered HTTP %d%s%s", r->pname, r->pstatus,
                 em[0] ? ": " : "", em);
        PX_LOG(PX_LOG_INFO, "req=%s msg=\"prefill rejected the request\" prefill=%s status=%d",
               r->lid, r->pname, r->pstatus);
        req_finish(r, r->pstatus, "prefill_rejected", NULL, msg);
        return;
    }
    if (r->pstatus >= 400 && r->pstatus < 500) {
        /* The client's fault: its status and the engine's words, as they are
         * (a configured prefill: the operator's engine). */
        PX_LOG(PX_LOG_INFO, "req=%s msg=\"prefill rejected the request\" prefill=%s status=%d",
               r->lid, r->pname, r->pstatus);
        if (r->conn) {
            px_conn_reply(r->conn, r->pstatus, r->pctype, r->id, NULL, r->presp.data, r->presp.len);
            r->conn = NULL;
        }
        req_finish(r, r->pstatus, "prefill_rejected", NULL, NULL);
        return;
    }
    if (r->pstatus < 200 || r->pstatus >= 300) {
        /* 508: a loop through proxies, reported as one to the client. */
        req_fail(r, r->pstatus == 508 ? 508 : 502, NULL, "prefill %s answered HTTP %d", r->pname,
                 r->pstatus);
        return;
    }
    proceed_to_decode(r);
}

static const px_upstream_cbs prefill_cbs = {prefill_headers, prefill_data, prefill_done};

static void on_retry_timer(evutil_socket_t fd, short what, void *arg) {
    start_prefill(arg);
}

static void proceed_to_decode(px_req *r) {
    char err[128];
    if (decode_body(r, err, sizeof err) == PX_KVP_BAD_RESPONSE) {
        req_fail(r, 502, NULL, "prefill %s returned an invalid answer: %s", r->pname, err);
        return;
    }
    start_decode(r);
}

/* Builds decode's body from the client's and prefill's kv_transfer_params.
 * Returns what prefill's answer held; for PX_KVP_BAD_RESPONSE nothing is
 * built and err says why. */
static px_kvp_status decode_body(px_req *r, char *err, size_t errlen) {
    const char *kvp = NULL;
    size_t kvp_len = 0;
    px_kvp_status ks = px_extract_kv_params(r->presp.data ? r->presp.data : "", r->presp.len, &kvp,
                                            &kvp_len, err, errlen);
    if (ks == PX_KVP_BAD_RESPONSE) return ks;
    if (ks == PX_KVP_MISSING) {
        px_m_inc(&r->w->metrics.kvp_missing);
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"prefill answer has no kv_transfer_params; decode will recompute the "
               "prefill\" prefill=%s",
               r->lid, r->pname);
        kvp = NULL;
    } else if (ks == PX_KVP_NO_REQUEST_ID) {
        px_m_inc(&r->w->metrics.rrid_missing);
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"kv_transfer_params lack remote_request_id; decode cannot release "
               "prefill's blocks\" prefill=%s",
               r->lid, r->pname);
    }
    /* --dispatch concurrent learns the prefill's identity from its
     * answers. */
    if (kvp && r->ps->dispatch == PX_DISPATCH_CONCURRENT) px_dispatch_learn(r->pname, kvp, kvp_len);
    px_buf_reset(&r->dbody);
    px_rewrite_decode(r->body.data, r->body.len, kvp, kvp_len, &r->dbody);
    r->disagg = kvp != NULL;
    /* Prefill's cached_tokens, for --usage-from prefill (only then: three
     * searches of prefill's answer). */
    if (r->presp.data && !strcmp(r->ctx->cfg->usage_from, "prefill"))
        px_usage_cached_tokens(r->presp.data, r->presp.len, r->p_cached);
    /* From here on only the decode body is needed (retries resend it): one
     * copy of the request is held, not three. */
    px_buf_cleanup(&r->body);
    px_buf_cleanup(&r->pbody);
    /* Prefill's answer stays only for the trace (its remote_request_id and
     * usage go into the spans). */
    if (!px_otlp_enabled()) px_buf_cleanup(&r->presp);
    r->key = NULL;
    account(r);
    return ks;
}

/* Sends the client's request to decode alone (no kv_transfer_params:
 * decode computes the prefill itself). */
static void decode_only(px_req *r) {
    px_buf_reset(&r->dbody);
    px_rewrite_decode(r->body.data, r->body.len, NULL, 0, &r->dbody);
    r->disagg = 0;
    account(r);
    start_decode(r);
}

/* --fallback-decode-only: prefill could not serve the request. */
static void fall_back(px_req *r, px_fallback why) {
    r->fell_back = 1;
    r->fallback = why;
    px_m_inc(&r->w->metrics.fallbacks[why]);
    decode_only(r);
}

/* ---------- concurrent dispatch: both legs at once ---------- */

/* --dispatch concurrent (dispatch.h): prefill is told to publish under an
 * id and token minted here, decode is told where to register for them,
 * and both are sent now. Decode's leg is the request's r->up and goes on
 * as any decode (its answer streamed, its failed KV load retried); the
 * prefill leg, r->pup, is only read for its status and identity. A
 * prefill whose identity is not known yet is sent serial: its answer
 * teaches it (decode_body). */
static void dispatch_concurrent(px_req *r) {
    if (pick_prefill(r) < 0) return;
    px_pf_identity pf;
    char id[PX_DISPATCH_ID_LEN], tok[33];
    if (!px_dispatch_get(r->pb->name, &pf) || px_dispatch_mint(id, tok) < 0) {
        r->disp = PX_DISP_NO_IDENTITY;
        px_m_inc(&r->w->metrics.dispatch[PX_DISP_NO_IDENTITY]);
        PX_LOG(PX_LOG_DEBUG,
               "req=%s msg=\"prefill's identity not known yet: sent serial\" prefill=%s", r->lid,
               r->pb->name);
        send_prefill(r, &prefill_cbs);
        return;
    }
    r->disp = PX_DISP_CONCURRENT;
    px_m_inc(&r->w->metrics.dispatch[PX_DISP_CONCURRENT]);
    px_buf kvp, body;
    px_buf_init(&kvp);
    px_buf_init(&body);
    px_dispatch_prefill_kvp(id, tok, &kvp);
    px_rewrite_decode(r->pbody.data, r->pbody.len, kvp.data, kvp.len, &body);
    px_buf_cleanup(&r->pbody);
    r->pbody = body;
    px_buf_reset(&kvp);
    px_dispatch_decode_kvp(&pf, id, tok, &kvp);
    px_buf_reset(&r->dbody);
    px_rewrite_decode(r->body.data, r->body.len, kvp.data, kvp.len, &r->dbody);
    px_buf_cleanup(&kvp);
    r->disagg = 1;
    account(r);
    PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"concurrent dispatch\" prefill=%s remote_request_id=%s",
           r->lid, r->pb->name, id);
    if (send_prefill(r, &conc_prefill_cbs) < 0) return;
    r->pup = r->up;
    r->up = NULL;
    r->conc_live = 1;
    start_decode(r);
}

/* Cuts the concurrent prefill leg; its backend is handed back. */
static void conc_prefill_stop(px_req *r) {
    px_upstream_cancel(r->pup);
    r->pup = NULL;
    dp_end(r, PX_DP_PREFILL);
    uncharge(r, 0);
    px_backend_done(&r->ps->prefill, r->pb, PX_OUT_CANCELLED);
    r->pb = NULL;
}

/* Decode answered in full while prefill's leg still runs (decode loaded
 * the KV as prefill published it, or computed the prompt itself). The
 * client has its answer; prefill is let answer, so that a publication
 * being made is not cut half-way (it would wait for expiry) and its
 * answer refreshes the identity, but not for longer than
 * PREFILL_ANSWER_GRACE_US. The access line is written at that end. */
static void on_conc_timer(evutil_socket_t fd, short what, void *arg) {
    px_req *r = arg;
    req_finish(r, r->dstatus, "ok", NULL, NULL);
}

static void conc_await_prefill(px_req *r) {
    r->conc_wait = 1;
    r->conc_live = 0;
    if (!r->conc_timer) r->conc_timer = evtimer_new(r->w->base, on_conc_timer, r);
    struct timeval tv = {PREFILL_ANSWER_GRACE_US / 1000000, PREFILL_ANSWER_GRACE_US % 1000000};
    evtimer_add(r->conc_timer, &tv);
}

/* Cuts the decode leg that waits for the failed prefill's KV. */
static void conc_decode_stop(px_req *r) {
    px_upstream_cancel(r->up);
    r->up = NULL;
    dp_end(r, PX_DP_DECODE);
    if (r->idle_timer) evtimer_del(r->idle_timer);
    uncharge(r, 1);
    px_backend_done(&r->ps->decode, r->db, PX_OUT_CANCELLED);
    r->db = NULL;
    r->conc_live = 0;
}

/* The prefill leg ended. A good answer refreshes the identity cache. A
 * failure while decode still waits for the KV (no answer head from it
 * yet, so nothing reached the client) cancels decode's leg, then: a 4xx
 * goes to the client as prefill said it; --fallback-decode-only sends the
 * request to decode alone; else an OpenAI error. No other prefill is
 * tried: decode's params name this one. Once decode has answered, it had
 * its KV (or computed it): prefill's late failure changes nothing. */
static void conc_prefill_done(void *arg, px_up_result rc, const char *errbuf, int connected) {
    px_req *r = arg;
    r->pup = NULL; /* freed by the upstream module when this returns */
    prefill_ended(r, rc);
    r->t_prefill = px_now_ns();
    px_hist_observe(&r->w->metrics.prefill, secs(r->t0, r->t_prefill));
    const char *why = errbuf[0] ? errbuf : px_up_result_str(rc);
    if (rc == PX_UP_OK && r->pstatus >= 200 && r->pstatus < 300 && !r->too_big) {
        const char *kvp = NULL;
        size_t kl = 0;
        char err[128];
        px_kvp_status ks = px_extract_kv_params(r->presp.data ? r->presp.data : "", r->presp.len,
                                                &kvp, &kl, err, sizeof err);
        if ((ks == PX_KVP_OK || ks == PX_KVP_NO_REQUEST_ID) && kvp)
            px_dispatch_learn(r->pname, kvp, kl);
        if (r->presp.data && !r->p_cached[0] && !strcmp(r->ctx->cfg->usage_from, "prefill"))
            px_usage_cached_tokens(r->presp.data, r->presp.len, r->p_cached);
        if (!px_otlp_enabled()) px_buf_cleanup(&r->presp);
        account(r);
        if (r->conc_wait) req_finish(r, r->dstatus, "ok", NULL, NULL);
        return;
    }
    if (r->conc_wait) {
        px_buf_reset(&r->presp);
        req_finish(r, r->dstatus, "ok", NULL, NULL);
        return;
    }
    if (!r->conc_live || r->t_first) {
        px_buf_reset(&r->presp);
        account(r);
        PX_LOG(PX_LOG_INFO,
               "req=%s msg=\"prefill leg failed after decode answered: decode's answer stands\" "
               "prefill=%s status=%d error=\"%s\"",
               r->lid, r->pname, r->pstatus, rc ? why : "");
        return;
    }
    PX_LOG(PX_LOG_WARN,
           "req=%s msg=\"prefill failed while decode waited for its KV: decode's leg cancelled\" "
           "prefill=%s decode=%s status=%d error=\"%s\"",
           r->lid, r->pname, r->dname, r->pstatus, rc ? why : "");
    conc_decode_stop(r);
    if (rc == PX_UP_OK && r->pstatus >= 400 && r->pstatus < 500 && !r->too_big) {
        /* The client's fault: its status and the engine's words, as serial. */
        if (r->conn) {
            px_conn_reply(r->conn, r->pstatus, r->pctype, r->id, NULL, r->presp.data, r->presp.len);
            r->conn = NULL;
        }
        req_finish(r, r->pstatus, "prefill_rejected", NULL, NULL);
        return;
    }
    px_buf_reset(&r->presp);
    account(r);
    if (r->ctx->cfg->fallback_decode_only) {
        fall_back(r, PX_FB_CONC_PREFILL);
        return;
    }
    if (r->too_big)
        req_fail(r, 502, NULL, "prefill %s answer exceeds %d bytes", r->pname, PREFILL_MAX_ANSWER);
    else if (rc != PX_UP_OK)
        req_fail(r, px_upstream_status_for(rc), NULL, "prefill %s: %s", r->pname, why);
    else
        req_fail(r, r->pstatus == 508 ? 508 : 502, NULL, "prefill %s answered HTTP %d", r->pname,
                 r->pstatus);
}

static const px_upstream_cbs conc_prefill_cbs = {prefill_headers, prefill_data, conc_prefill_done};

/* ---------- decode ---------- */

/* Picks a decode and sends it r->dbody (built by the caller) or, for
 * /v1/models, a GET. */
static void start_decode(px_req *r) {
    size_t n;
    if (!pick_decode(r, &n)) {
        req_fail(r, 503, "Retry-After: 1\r\n", "no healthy decode backend (%zu configured%s)", n,
                 px_pool_unusable_why(&r->ps->decode));
        return;
    }
    set_state(r, RS_DECODE);
    send_decode(r, &decode_tbl);
}

/* Takes the decode of the next attempt: NULL when none can (*n: how many
 * are configured). */
static px_backend *pick_decode(px_req *r, size_t *n) {
    px_pick k = {.exclude = r->tried_d, .nexclude = r->ntried_d};
    *n = 0;
    /* Conditional disaggregation chose the decode before prefill. */
    if (!r->db) {
        size_t cached = 0;
        k = kv_pick(r, &r->ps->decode, k);
        k.cached = &cached;
        r->db = px_pool_pick(&r->ps->decode, &k, n);
        if (r->db) r->dcharge = (long)(k.ntok - cached);
    }
    if (!r->db) return NULL;
    snprintf(r->dname, sizeof r->dname, "%s", r->db->name);
    r->d_https = (unsigned char)r->db->https;
    if (!r->t_dstart) r->t_dstart = px_now_ns();
    if (r->ntried_d < MAX_TRIES) r->tried_d[r->ntried_d++] = r->db;
    return r->db;
}

/* Sends the decode request to r->db, with the callbacks of `tbl`. Returns
 * -1 when it could not start (r has ended). */
static int send_decode(px_req *r, const decode_table *tbl) {
    /* This decode will hold the prompt's prefix in its cache. */
    if (r->dis.hash && r->w->pindex)
        px_pindex_add(r->w->pindex, r->db->key_hash, r->dis.hash, r->dis.nhash);
    /* A GET (or a DELETE) without a body is sent without one. */
    int bodyless =
        r->ep == PX_EP_MODELS ||
        (r->dbody.len == 0 && (!strcmp(r->method, "GET") || !strcmp(r->method, "DELETE")));
    r->dtbl = tbl;
    if (start_upstream(r, r->db, r->method, r->target ? r->target : px_endpoints[r->ep].path,
                       bodyless ? NULL : &r->dbody, &r->hdrs_d, &tbl->up, 0) < 0) {
        req_fail(r, 502, NULL, "decode %s: cannot start the request", r->dname);
        return -1;
    }
    touch_idle(r);
    return 0;
}

/* The most of a decode answer held to see whether it is a failed KV load. */
#define KV_FAIL_HOLD_MAX 65536

/* Whether decode's answer is held (see px_req.hold): only an answer that
 * could be a failed KV load, and only while a retry is still possible. */
static int hold_for_kv_failure(const px_req *r, int status, int streamed) {
    return r->disagg && r->ctx->cfg->fallback_decode_only && !r->kv_load_retry &&
           (status == 500 || (status == 200 && streamed));
}

/* The answer's head goes to the client (the usage filter set up first). */
static void start_client_stream(px_req *r, int status, const char *ctype) {
    int json = ctype && !strncasecmp(ctype, "application/json", 16);
    if (r->disagg && r->p_cached[0] && status == 200 && (r->streamed || json) &&
        !strcmp(r->ctx->cfg->usage_from, "prefill"))
        px_usage_init(&r->usage, r->p_cached, r->streamed, USAGE_MAX_HOLD, usage_out, r);
    set_state(r, RS_STREAM);
    char rl[512];
    px_adm_ratelimit_headers(r->ctx, &r->adm, rl, sizeof rl);
    if (r->conn) px_conn_stream_start(r->conn, status, ctype, r->id, rl[0] ? rl : NULL);
}

static void decode_headers(void *arg, int status, const char *ctype) {
    px_req *r = arg;
    r->dstatus = status;
    touch_idle(r);
    if (px_adm_can_requeue(&r->adm, status)) {
        r->d_requeue = 1; /* decode_done puts it back in the queue */
        return;
    }
    r->t_first = px_now_ns();
    px_adm_first_byte(&r->adm);
    char w[32], *end;
    if (px_upstream_header(r->up, "x-kv-wait-ms", w, sizeof w)) {
        double ms = strtod(w, &end);
        if (end != w && ms >= 0 && ms < 1e9) {
            r->kv_waited = 1;
            r->kv_wait_ms = ms;
            px_hist_observe(&r->w->metrics.kv_wait, ms / 1e3);
        }
    }
    r->streamed = ctype && !strncasecmp(ctype, "text/event-stream", 17);
    if (hold_for_kv_failure(r, status, r->streamed)) {
        r->hold = 1;
        snprintf(r->dctype, sizeof r->dctype, "%s", ctype ? ctype : "application/json");
        return;
    }
    start_client_stream(r, status, ctype);
}

/* Whether a JSON error object is vLLM's GenerationError: what its OpenAI
 * front answers for a request that finished with finish_reason "error",
 * as a failed KV load under kv_load_failure_policy fail does. */
static int is_generation_error(const char *p, size_t n) {
    static const char want[] = "\"InternalServerError\"";
    px_json_member e, t;
    return px_json_find(p, n, "error", &e) && e.type == PX_JSON_OBJECT &&
           px_json_find(e.val, e.val_len, "type", &t) && t.val_len == sizeof want - 1 &&
           !memcmp(t.val, want, sizeof want - 1);
}

/* Decode's held answer so far: 1 when it is a failed KV load, 0 when it
 * is not, -1 when more is needed to tell. `whole`: the answer ended. */
static int held_kv_failure(px_req *r, int whole) {
    const char *p = r->dhold.data ? r->dhold.data : "";
    size_t n = r->dhold.len;
    if (!r->streamed) {
        if (!whole && n < KV_FAIL_HOLD_MAX) return -1;
        char err[8];
        return whole && px_json_validate(p, n, err, sizeof err) == PX_JSON_OBJECT &&
               is_generation_error(p, n);
    }
    /* The first event, whole: "data: {...}" up to its blank line. */
    const char *end = NULL;
    for (size_t i = 0; i + 1 < n; i++)
        if (p[i] == '\n' && p[i + 1] == '\n') {
            end = p + i;
            break;
        }
    if (!end) return whole || n >= KV_FAIL_HOLD_MAX ? 0 : -1;
    if (n < 6 || memcmp(p, "data: ", 6)) return 0;
    char err[8];
    size_t len = (size_t)(end - p) - 6;
    return px_json_validate(p + 6, len, err, sizeof err) == PX_JSON_OBJECT &&
           is_generation_error(p + 6, len);
}

static int decode_pass(px_req *r, const char *p, size_t n);

/* The held answer is not a failed KV load: it goes to the client as it
 * came. Returns what decode_data returns. */
static int release_hold(px_req *r) {
    r->hold = 0;
    start_client_stream(r, r->dstatus, r->dctype);
    px_buf held = r->dhold;
    px_buf_init(&r->dhold);
    /* Held bytes cannot be delivered again: all of them are queued (the
     * client's queue is soft, at most KV_FAIL_HOLD_MAX over its mark; the
     * next delivery pauses decode when it is full). */
    if (held.len) px_adm_answer(&r->adm, held.data, held.len);
    if (held.len && r->conn &&
        (!r->usage.active || px_usage_feed(&r->usage, held.data, held.len) != 0)) {
        px_conn_stream_write(r->conn, held.data, held.len);
        r->bytes_out += held.len;
    }
    px_buf_cleanup(&held);
    account(r);
    return 0;
}

/* Whether the client's queue is at its high-water mark: decode is paused
 * (the caller returns 1) until the client drains it. The decode idle
 * timeout, armed already, now bounds how long the client may leave its
 * queue full, so a reader that stopped reading does not hold a decode
 * forever. */
static int client_full(px_req *r) {
    if (px_conn_pending(r->conn) < PX_CONN_HIGH_WATER) return 0;
    r->paused = 1;
    return 1;
}

static int decode_data(void *arg, const char *p, size_t n) {
    px_req *r = arg;
    if (!r->conn) return -1;
    touch_idle(r);
    if (r->d_requeue) return 0; /* a refusal nobody reads */
    if (r->hold) {
        px_buf_append(&r->dhold, p, n);
        account(r);
        int k = held_kv_failure(r, 0);
        if (k < 0) return 0;
        if (k > 0) {
            r->kv_load_failed = 1;
            return -1; /* ends the transfer: decode_done retries */
        }
        return release_hold(r);
    }
    return decode_pass(r, p, n);
}

/* Decode's bytes to the client (through the usage filter when active);
 * 1: the client's queue is full, decode pauses and delivers them again. */
static int decode_pass(px_req *r, const char *p, size_t n) {
    if (client_full(r)) return 1;
    px_adm_answer(&r->adm, p, n);
    px_lat_req_answer(&r->lat, p, n);
    if (r->usage.active) {
        /* Held, or given up on: then what was held went first. */
        int held = px_usage_feed(&r->usage, p, n) == 0;
        account(r);
        if (held) return 0;
        if (client_full(r)) return 1;
    }
    px_conn_stream_write(r->conn, p, n);
    r->bytes_out += n;
    return 0;
}

/* Decode failed to load prefill's KV: the request goes once more to a
 * decode, without kv_transfer_params, so it computes the prompt itself.
 * Nothing has reached the client yet. */
static void retry_without_kv(px_req *r) {
    px_buf clean;
    px_buf_init(&clean);
    if (px_rewrite_forwarded(r->dbody.data, r->dbody.len, &clean) == 1) {
        px_buf t = r->dbody;
        r->dbody = clean;
        clean = t;
    }
    px_buf_cleanup(&clean);
    px_buf_reset(&r->dhold);
    r->hold = 0;
    r->kv_load_failed = 0;
    r->kv_load_retry = 1;
    r->disagg = 0;
    if (r->disp == PX_DISP_CONCURRENT) {
        /* Decode could not load from the prefill it was pointed at: that
         * identity is not trusted again until the prefill answers anew. */
        r->conc_live = 0;
        px_dispatch_forget(r->pname);
    }
    r->dstatus = 0;
    r->t_first = 0;
    r->fell_back = 1;
    r->fallback = PX_FB_KV_LOAD;
    px_m_inc(&r->w->metrics.fallbacks[PX_FB_KV_LOAD]);
    account(r);
    PX_LOG(PX_LOG_WARN,
           "req=%s msg=\"decode failed to load prefill's KV: retrying once without "
           "kv_transfer_params\" decode=%s",
           r->lid, r->dname);
    start_decode(r);
}

static void decode_done(void *arg, px_up_result rc, const char *errbuf, int connected) {
    px_req *r = arg;
    r->up = NULL; /* freed by the upstream module when this returns */
    dp_end(r, PX_DP_DECODE);
    if (r->idle_timer) evtimer_del(r->idle_timer);
    px_outcome o = outcome_of(rc, r->dstatus);
    const char *why = errbuf[0] ? errbuf : px_up_result_str(rc);
    if (r->kv_load_failed) o = PX_OUT_SERVER_ERR;
    /* A full engine queue is saturation, not a failure (admission.h). */
    if (rc == PX_UP_OK && px_adm_engine_status(r->ctx, r->ps, r->db, r->dstatus)) {
        o = PX_OUT_CLIENT_ERR;
        px_m_inc(&r->w->metrics.adm[PX_ADM_M_ENGINE_FULL]);
    }
    uncharge(r, 1);
    attempt_done(&r->ps->decode, r->db, r->tried_d, r->ntried_d, o);
    r->db = NULL;
    if (r->d_requeue) {
        /* Nothing reached the client: decode is asked again later with the
         * same body (a refused request never read prefill's blocks). */
        r->d_requeue = 0;
        int st = r->dstatus;
        r->dstatus = 0;
        if (r->ntried_d) r->ntried_d--; /* not a failed attempt */
        if (rc == PX_UP_OK && requeue(r, adm_redecode)) return;
        req_fail(r, st ? st : 503, "Retry-After: 1\r\n",
                 "decode %s answered %d (its queue is full) and the request could not wait "
                 "again (admission queue full)", r->dname, st);
        return;
    }
    if (r->hold) {
        int k = r->kv_load_failed ? 1 : rc == PX_UP_OK ? held_kv_failure(r, 1) : 0;
        if (k > 0) {
            retry_without_kv(r);
            return;
        }
        if (rc == PX_UP_OK || r->dhold.len) {
            /* Not a failed load: the held answer goes out as it came (cut
             * like decode's when decode's was cut). */
            release_hold(r);
        } else {
            r->hold = 0;
        }
    }
    if (r->usage.active) {
        /* The answer is complete (or cut): what is held goes out, fixed
         * when it is whole. */
        px_usage_end(&r->usage, rc == PX_UP_OK);
        account(r);
    }
    if (rc == PX_UP_OK) {
        if (r->conn) {
            px_conn_stream_end(r->conn);
            r->conn = NULL;
        }
        if (r->pup) { /* concurrent: prefill's leg is let end (conc_await_prefill) */
            conc_await_prefill(r);
            return;
        }
        req_finish(r, r->dstatus, "ok", NULL, NULL);
        return;
    }
    if (r->state == RS_STREAM) {
        req_fail(r, r->dstatus, NULL, "decode %s failed mid-stream after %zu bytes: %s", r->dname,
                 r->bytes_out, why);
        return;
    }
    if (decode_retry(r, connected, why)) {
        start_decode(r);
        return;
    }
    req_fail(r, px_upstream_status_for(rc), NULL, "decode %s: %s", r->dname, why);
}

/* Whether a failed decode attempt goes to another decode: only what decode
 * never saw is resent (once the request reached it, it may have read
 * prefill's blocks). */
static int decode_retry(px_req *r, int connected, const char *why) {
    size_t ndecode;
    px_pool_counts(&r->ps->decode, &ndecode, NULL);
    if (connected || r->ntried_d >= MAX_TRIES || r->ntried_d >= ndecode) return 0;
    PX_LOG(PX_LOG_WARN, "req=%s msg=\"decode unreachable, trying another\" decode=%s error=\"%s\"",
           r->lid, r->dname, why);
    px_m_inc(&r->w->metrics.retries[1]);
    return 1;
}

/* A decode idle past --decode-idle-timeout with the client there: the
 * message says which wait it was (no head yet, or a stall mid-answer). */
static void decode_idle(px_req *r) {
    double s = r->ctx->cfg->decode_idle_timeout;
    if (r->paused)
        req_fail(r, 504, NULL, "client read nothing for --decode-idle-timeout %gs", s);
    else if (!r->dstatus)
        req_fail(r, 504, NULL,
                 "decode %s sent no response head within %gs of the request "
                 "(--decode-idle-timeout)",
                 r->dname, s);
    else
        req_fail(r, 504, NULL,
                 "decode %s went idle mid-answer: no byte for %gs after %zu bytes "
                 "(--decode-idle-timeout)",
                 r->dname, s, r->bytes_out);
}

static const decode_table decode_tbl = {{decode_headers, decode_data, decode_done}, decode_idle};

static void arm_idle(px_req *r, uint64_t ns) {
    struct timeval tv = {(time_t)(ns / 1000000000ull), (suseconds_t)(ns % 1000000000ull / 1000)};
    evtimer_add(r->idle_timer, &tv);
}

/* --decode-idle-timeout: no byte from decode for that long ends the request.
 * Our own timer, since curl's low-speed check averages over several seconds.
 * A byte only notes the time; the timer, armed once, looks when it fires
 * and waits out the rest if there was activity meanwhile (no timer-heap
 * work per read). */
static void on_idle_timer(evutil_socket_t fd, short what, void *arg) {
    px_req *r = arg;
    uint64_t limit = (uint64_t)(r->ctx->cfg->decode_idle_timeout * 1e9),
             idle = px_now_ns() - r->idle_since_ns;
    if (idle < limit) {
        arm_idle(r, limit - idle);
        return;
    }
    px_upstream_cancel(r->up);
    r->up = NULL;
    dp_end(r, PX_DP_DECODE);
    uncharge(r, 1);
    px_backend_done(&r->ps->decode, r->db, PX_OUT_TIMEOUT);
    r->db = NULL;
    r->dtbl->idle(r);
}

static void touch_idle(px_req *r) {
    double s = r->ctx->cfg->decode_idle_timeout;
    if (s <= 0) return;
    r->idle_since_ns = px_now_ns();
    if (!r->idle_timer) r->idle_timer = evtimer_new(r->w->base, on_idle_timer, r);
    if (!evtimer_pending(r->idle_timer, NULL)) arm_idle(r, (uint64_t)(s * 1e9));
}

/* ---------- usage (--usage-from) ---------- */

/* The usage filter's output: to the client, counted. */
static void usage_out(void *arg, const char *p, size_t n) {
    px_req *r = arg;
    if (!r->conn || !n) return;
    px_conn_stream_write(r->conn, p, n);
    r->bytes_out += n;
}

/* ---------- the client ---------- */

static void client_gone(void *arg) {
    px_req *r = arg;
    r->conn = NULL;
    px_phase phase = r->state == RS_STREAM   ? PX_PHASE_STREAM
                     : r->state == RS_DECODE ? PX_PHASE_DECODE
                                             : PX_PHASE_PREFILL;
    px_m_inc(&r->w->metrics.disconnects[phase]);
    /* Concurrent: prefill's leg is cut at once (an engine drops a prefill
     * whose client left; one that published already is read by decode's
     * registration); decode's is let receive its whole request, as below,
     * so that a publication is met and released. */
    if (r->pup) conc_prefill_stop(r);
    if (r->state == RS_PREFILL && r->up) {
        release_prefill(r);
        return;
    }
    if (r->state == RS_DECODE && r->up && r->disagg && !px_upstream_abort_after_upload(r->up)) {
        release_decode(r);
        return;
    }
    req_abandon(r);
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

/* ---------- releasing: the client left, prefill's blocks are let go ---------- */

/* A request whose client left keeps running only to let prefill's blocks go:
 * a prefill in flight is let answer, then decode is sent the request and
 * aborted once it has it, so that it tells prefill to free the blocks
 * (vLLM's stranded-blocks release). Its callbacks are these tables; the
 * normal path's know nothing of it. */

/* The client left during prefill. Prefill publishes its blocks just before
 * its answer leaves: a client leaving near that moment would strand them if
 * we cut the connection. So prefill gets a short grace (well inside the
 * 100 ms in which a cancelled upstream must close) to answer; an answer
 * goes on to the release through decode, silence is cut. */
static void release_prefill(px_req *r) {
    set_state(r, RS_RELEASING);
    px_upstream_set_cbs(r->up, &release_prefill_cbs);
    long us = px_upstream_answering(r->up) ? PREFILL_ANSWER_GRACE_US : PREFILL_GRACE_US;
    if (!r->grace_timer) r->grace_timer = evtimer_new(r->w->base, on_grace_timer, r);
    struct timeval tv = {us / 1000000, us % 1000000};
    evtimer_add(r->grace_timer, &tv);
}

/* The client left before decode received the request (abort after upload is
 * armed): the body is let reach decode, then the transfer is aborted. */
static void release_decode(px_req *r) {
    set_state(r, RS_RELEASING);
    r->dtbl = &release_tbl;
    px_upstream_set_cbs(r->up, &release_tbl.up);
}

/* Prefill did not answer in its grace. */
static void on_grace_timer(evutil_socket_t fd, short what, void *arg) {
    req_abandon(arg);
}

static void release_prefill_done(void *arg, px_up_result rc, const char *errbuf, int connected) {
    px_req *r = arg;
    if (r->grace_timer) evtimer_del(r->grace_timer); /* it answered in time */
    r->up = NULL;
    prefill_ended(r, rc);
    if (rc == PX_UP_OK && r->pstatus >= 200 && r->pstatus < 300)
        release_through_decode(r);
    else
        req_abandon(r);
}

static const px_upstream_cbs release_prefill_cbs = {prefill_headers, prefill_data,
                                                    release_prefill_done};

/* Prefill answered: without kv_transfer_params in its answer there is
 * nothing to release. */
static void release_through_decode(px_req *r) {
    char err[128];
    px_kvp_status ks = decode_body(r, err, sizeof err);
    if (ks == PX_KVP_BAD_RESPONSE || ks == PX_KVP_MISSING) {
        req_abandon(r);
        return;
    }
    start_release(r);
}

static void start_release(px_req *r) {
    size_t n;
    if (!pick_decode(r, &n)) {
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"client left after prefill and no decode can take "
               "the request: prefill's blocks stay until they expire\"",
               r->lid);
        req_abandon(r);
        return;
    }
    if (send_decode(r, &release_tbl) < 0) return;
    /* The body only has to reach decode (it may have already: our client
     * writes at once, and a nearby decode acknowledges fast). */
    if (px_upstream_abort_after_upload(r->up)) released_via_decode(r);
}

static void release_headers(void *arg, int status, const char *ctype) {
    px_req *r = arg;
    r->dstatus = status;
    touch_idle(r);
}

/* Decode's answer is nobody's: its first byte ends the transfer. */
static int release_data(void *arg, const char *p, size_t n) {
    return -1;
}

static void release_done(void *arg, px_up_result rc, const char *errbuf, int connected) {
    px_req *r = arg;
    r->up = NULL; /* freed by the upstream module when this returns */
    dp_end(r, PX_DP_DECODE);
    if (r->idle_timer) evtimer_del(r->idle_timer);
    if (connected) {
        released_via_decode(r);
        return;
    }
    uncharge(r, 1);
    attempt_done(&r->ps->decode, r->db, r->tried_d, r->ntried_d, outcome_of(rc, r->dstatus));
    r->db = NULL;
    if (decode_retry(r, connected, errbuf[0] ? errbuf : px_up_result_str(rc))) {
        start_release(r);
        return;
    }
    req_abandon(r);
}

/* An idle release decode: nobody to answer. */
static const decode_table release_tbl = {{release_headers, release_data, release_done},
                                         req_abandon};

/* Decode has the request and its kv_transfer_params; it drops the request
 * now that the client left, and tells prefill to free the blocks. Ends r. */
static void released_via_decode(px_req *r) {
    px_m_inc(&r->w->metrics.stranded_released);
    PX_LOG(PX_LOG_INFO,
           "req=%s msg=\"client left after prefill: decode was given the request and "
           "aborted so prefill frees its blocks\" decode=%s",
           r->lid, r->dname);
    req_abandon(r);
}

/* ---------- the end: log, answer, free ---------- */

/* Ends a request that failed: logs the message and answers it (req_finish). */
static void req_fail(px_req *r, int status, const char *extra, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    req_finish(r, status, r->state == RS_STREAM ? "stream_failed" : "error", extra, msg);
}

/* Every path on which the client is gone and nothing is left to do for it. */
static void req_abandon(px_req *r) {
    req_finish(r, 499, "client_disconnected", NULL, NULL);
}

/* The one exit (pgbouncer's disconnect_client). With `msg`, the failure is
 * logged and, when the client has been sent nothing yet, answered in
 * OpenAI error JSON (`extra`: more header lines, or NULL); a client still
 * attached otherwise has its stream cut (callers that answered themselves
 * dropped r->conn first). Then the access line and the metrics, once; then
 * everything that could call back is let go (the transfer cancelled,
 * backends handed back, timers stopped), and r is freed on the next loop
 * turn: the caller may be inside one of r's callbacks. */
static void req_finish(px_req *r, int status, const char *outcome, const char *extra,
                       const char *msg) {
    if (r->state == RS_DONE) return;
    if (msg) {
        char qmsg[1100];
        PX_LOG(status >= 500 ? PX_LOG_WARN : PX_LOG_INFO, "req=%s msg=%s status=%d state=%s",
               r->lid, px_log_value(msg, qmsg, sizeof qmsg), status, state_names[r->state]);
    }
    if (r->conn) {
        if (msg && r->state != RS_STREAM)
            r->bytes_out += px_conn_reply_error(r->conn, status, r->id, extra, msg);
        else
            px_conn_abort(r->conn);
        r->conn = NULL;
    }
    finish_log(r, status, outcome);
    set_state(r, RS_DONE);
    px_upstream_cancel(r->up);
    r->up = NULL;
    px_upstream_cancel(r->pup);
    r->pup = NULL;
    dp_end(r, PX_DP_PREFILL);
    dp_end(r, PX_DP_DECODE);
    uncharge(r, 0);
    px_backend_done(&r->ps->prefill, r->pb, PX_OUT_CANCELLED);
    r->pb = NULL;
    uncharge(r, 1);
    px_backend_done(&r->ps->decode, r->db, PX_OUT_CANCELLED);
    r->db = NULL;
    if (r->retry_timer) evtimer_del(r->retry_timer);
    if (r->idle_timer) evtimer_del(r->idle_timer);
    if (r->grace_timer) evtimer_del(r->grace_timer);
    if (r->conc_timer) evtimer_del(r->conc_timer);
    if (r->counted) atomic_fetch_sub(&r->ctx->inflight, 1);
    r->counted = 0;
    px_adm_leave(r->w, &r->adm);
    event_assign(&r->free_ev, r->w->base, -1, 0, on_free, r);
    event_active(&r->free_ev, EV_TIMEOUT, 0);
}

static void on_free(evutil_socket_t fd, short what, void *arg) {
    req_free(arg);
}

/* The metrics and the access line of a request, once per request. */
static void finish_log(px_req *r, int status, const char *outcome) {
    uint64_t now = px_now_ns();
    px_metrics *m = &r->w->metrics;
    px_metrics_count(m, r->ep, status);
    px_hist_observe(&m->duration, secs(r->t0, now));
    if (r->t_first) px_hist_observe(&m->ttfb[r->streamed], secs(r->t0, r->t_first));
    px_lat_obs lo = {.status = status, .t0 = r->t0, .t_pstart = r->t_pstart,
                     .t_prefill = r->t_prefill, .t_dstart = r->t_dstart, .t_first = r->t_first,
                     .now = now, .kv_waited = r->kv_waited, .kv_wait_ms = r->kv_wait_ms,
                     .pname = r->pname, .dname = r->dname, .disagg = r->disagg,
                     .serial = r->disp == PX_DISP_SERIAL, .tries_p = r->ntried_p,
                     .tries_d = r->ntried_d};
    px_lat_req_finish(&r->lat, r->ctx, r->ps->name, &lo);
    write_access(r, status, outcome, now);
    if (px_otlp_enabled()) submit_spans(r, status, outcome, now);
}

/* The one access-line writer: what r does not know yet (no backend, no
 * answer, no decision) is left out of the line. */
static void write_access(const px_req *r, int status, const char *outcome, uint64_t now) {
    double slo_t, slo_p, pred;
    const char *slo;
    px_lat_req_report(&r->lat, &slo_t, &slo_p, &pred, &slo);
    px_access a = {.slo_ttft_ms = slo_t,
                   .slo_tpot_ms = slo_p,
                   .predicted = pred >= 0,
                   .pred_ttft_ms = pred,
                   .slo = slo,
                   .req = r->lid,
                   .client = r->client,
                   .method = r->method,
                   .endpoint = r->lpath,
                   .prefill = r->pname[0] ? r->pname : NULL,
                   .decode = r->dname[0] ? r->dname : NULL,
                   .status = status,
                   .prefill_ms = r->t_prefill ? secs(r->t0, r->t_prefill) * 1e3 : -1.0,
                   .ttfb_ms = r->t_first ? secs(r->t0, r->t_first) * 1e3 : -1.0,
                   .total_ms = secs(r->t0, now) * 1e3,
                   .bytes_out = r->bytes_out,
                   .outcome = outcome,
                   .trace_id = r->trace_id,
                   /* A fallback overrides the decision made before prefill failed. */
                   .decision = r->fell_back ? "decode_only"
                               : r->decided ? px_decision_name(r->decision)
                                            : NULL,
                   .decision_reason = r->fell_back ? px_fallback_name(r->fallback)
                                      : r->decided ? px_decision_reason(r->decision)
                                                   : NULL,
                   .fallback = r->fell_back ? px_fallback_name(r->fallback) : NULL,
                   .dispatch = r->disp >= 0 ? px_dispatch_kind_mode((px_dispatch_kind)r->disp)
                                            : NULL,
                   .kv_waited = r->kv_waited,
                   .kv_wait_ms = r->kv_wait_ms,
                   .estimated = r->dis.estimated,
                   .prompt_tokens_est = r->dis.tokens,
                   .uncached_tokens_est = r->dis.uncached,
                   .queued = r->adm.t_enq != 0,
                   .queue_ms = (double)r->adm.wait_ns / 1e6};
    px_access_write(&a);
}

/* The request's spans for trace export (otlp.h). */
static void submit_spans(px_req *r, int status, const char *outcome, uint64_t now) {
    /* url.path: the client's path without its query (passed-through
     * requests), else the endpoint's; the model for the GenAI attributes. */
    const char *ep_path = px_endpoints[r->ep].path;
    const char *path = r->target ? r->target : ep_path ? ep_path : "";
    size_t plen = strcspn(path, "?");
    const char *op = r->ep == PX_EP_COMPLETIONS || r->ep == PX_EP_GENERATE ? "text_completion"
                     : r->ep == PX_EP_CHAT || r->ep == PX_EP_MESSAGES || r->ep == PX_EP_RESPONSES
                         ? "chat"
                         : NULL;
    px_json_member mm;
    const px_buf *body = r->body.len ? &r->body : &r->dbody;
    int has_model = op && body->data && px_json_find(body->data, body->len, "model", &mm) &&
                    mm.type == PX_JSON_STRING && mm.val_len >= 2;
    double slo_t, slo_p, pred;
    const char *slo;
    px_lat_req_report(&r->lat, &slo_t, &slo_p, &pred, &slo);
    px_otlp_req q = {.slo_ttft_ms = slo_t,
                     .slo_tpot_ms = slo_p,
                     .predicted = pred >= 0,
                     .pred_ttft_ms = pred,
                     .slo = slo,
                     .trace_id = r->trace_id,
                     .flags = r->trace_flags,
                     .parent_span = r->parent_span[0] ? r->parent_span : NULL,
                     .span_root = r->span_root,
                     .span_prefill = r->span_p,
                     .span_decode = r->span_d,
                     .method = r->method,
                     .route = px_endpoints[r->ep].path ? px_endpoints[r->ep].path : "passthrough",
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
                     .queued = r->adm.t_enq != 0,
                     .queue_wait_ns = r->adm.wait_ns,
                     .t_decode_start = r->t_dstart,
                     .presp = r->presp.data,
                     .presp_len = r->presp.len,
                     .scheme = r->ctx->cfg->tls_cert && r->ctx->cfg->tls_cert[0] ? "https" : "http",
                     .path = path,
                     .path_len = plen,
                     .templated = ep_path != NULL && r->ep != PX_EP_PASSTHROUGH,
                     .prefill_https = r->p_https,
                     .decode_https = r->d_https,
                     .operation = op,
                     .model = has_model ? mm.val + 1 : NULL,
                     .model_len = has_model ? mm.val_len - 2 : 0};
    px_otlp_submit(&q);
}

/* A refused request is a view of a request that knows only its id, path,
 * method and client. Its id is the client's X-Request-Id or a fresh one,
 * echoed in the answer as for every other request. */
void px_req_refuse(px_conn *c, const px_http_head *h, const char *endpoint, int status,
                   const char *extra, const char *msg) {
    px_req v = {0};
    v.disp = -1;
    char id[129], m[20];
    if (!px_http_request_id(h, id)) px_uuid4(id);
    px_log_value(id, v.lid, sizeof v.lid);
    snprintf(v.lpath, sizeof v.lpath, "%s", endpoint);
    snprintf(m, sizeof m, "%.*s", (int)(h->method_len < 16 ? h->method_len : 16), h->method);
    px_log_value(m, v.method, sizeof v.method);
    px_conn_peer(c, v.client, sizeof v.client);
    v.bytes_out = px_conn_reply_error(c, status, id, extra, msg);
    write_access(&v, status, "refused", px_now_ns());
}

/* Releases all r owns; r has finished (req_finish), so nothing calls back. */
static void req_free(px_req *r) {
    PX_LIST_UNLINK(r->w->reqs, r);
    r->w->nreqs--;
    if (event_initialized(&r->free_ev)) event_del(&r->free_ev);
    if (r->retry_timer) event_free(r->retry_timer);
    if (r->idle_timer) event_free(r->idle_timer);
    if (r->grace_timer) event_free(r->grace_timer);
    if (r->conc_timer) event_free(r->conc_timer);
    px_backend_release(r->hb);
    px_gen_release(r->g);
    px_budget_add(&r->ctx->shared, -r->held);
    px_buf_cleanup(&r->body);
    px_buf_cleanup(&r->pbody);
    px_buf_cleanup(&r->dbody);
    px_buf_cleanup(&r->presp);
    px_buf_cleanup(&r->hdrs_p);
    px_buf_cleanup(&r->hdrs_d);
    px_buf_cleanup(&r->dhold);
    px_usage_cleanup(&r->usage);
    free(r->target);
    free(r->dis.hash);
    free(r->tok);
    px_backend_release(r->tb);
    px_buf_cleanup(&r->tokbody);
    px_buf_cleanup(&r->tokresp);
    free(r);
}

/* ---------- worker shutdown ---------- */

void px_req_free_all(px_wctx *w) {
    px_adm_worker_stop(w->adm);
    while (w->reqs) {
        px_req *r = w->reqs;
        /* Finished ones wait for a loop turn that will not come. */
        req_finish(r, 499, "stopped", NULL, NULL);
        req_free(r);
    }
    px_pindex_destroy(w->pindex);
    px_tokcache_destroy(w->tokcache);
    w->tokcache = NULL;
    w->pindex = NULL;
}
