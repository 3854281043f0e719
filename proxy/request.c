#include "request.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"
#include "log.h"
#include "rewrite.h"

/* Largest prefill answer kept; a prefill answers one token, so anything near
 * this is a broken engine, not a big request. */
#define PREFILL_MAX_ANSWER (8 * 1024 * 1024)

typedef enum { RS_NEW, RS_PREFILL, RS_DECODE, RS_STREAM, RS_DONE, RS_CLOSING } req_state;

static const char *const state_names[] = {"new", "prefill", "decode", "stream", "done", "closing"};

struct px_req {
    px_worker *w;           /* borrowed: the worker this request runs on */
    px_conn *conn;          /* borrowed: NULL once the exchange ended */
    req_state state;
    px_endpoint ep;
    char id[129];
    px_buf body;            /* owned: the client's body */
    px_buf up_body;         /* owned: body of the upstream request in flight */
    px_buf presp;           /* owned: the prefill's answer */
    px_buf url;             /* owned */
    struct curl_slist *hdrs;/* owned */
    px_upstream *up;        /* owned: the transfer in flight */
    const px_backend *pb;   /* borrowed: server pools outlive requests */
    const px_backend *db;
    int pstatus;
    char pctype[128];
    int dstatus;
    int too_big;
    int paused;
    uint64_t t0, t_prefill, t_first;
    size_t bytes_out;
};

static const char *const ep_paths[] = {"/v1/completions", "/v1/chat/completions"};

static void req_free(px_req *r)
{
    px_upstream_cancel(r->up);
    px_buf_cleanup(&r->body);
    px_buf_cleanup(&r->up_body);
    px_buf_cleanup(&r->presp);
    px_buf_cleanup(&r->url);
    curl_slist_free_all(r->hdrs);
    free(r);
}

/* The one place a request changes state. */
static void set_state(px_req *r, req_state st)
{
    PX_LOG(PX_LOG_DEBUG, "req=%s msg=\"state\" from=%s to=%s", r->id, state_names[r->state],
           state_names[st]);
    r->state = st;
}

static double ms_since(uint64_t t)
{
    return t ? (double)(px_now_ns() - t) / 1e6 : -1;
}

static void access_log(px_req *r, int status, const char *outcome)
{
    PX_LOG(PX_LOG_INFO,
           "req=%s msg=\"request\" endpoint=%s prefill=%s decode=%s status=%d prefill_ms=%.2f "
           "ttfb_ms=%.2f total_ms=%.2f bytes_out=%zu outcome=%s",
           r->id, ep_paths[r->ep], r->pb ? r->pb->name : "-", r->db ? r->db->name : "-", status,
           r->t_prefill ? (double)(r->t_prefill - r->t0) / 1e6 : -1.0,
           r->t_first ? (double)(r->t_first - r->t0) / 1e6 : -1.0, ms_since(r->t0), r->bytes_out,
           outcome);
}

/* Ends a request that failed: logs, answers once in OpenAI error JSON when
 * nothing was sent yet (else cuts the stream), and frees it. */
static void req_fail(px_req *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void req_fail(px_req *r, int status, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    PX_LOG(status >= 500 ? PX_LOG_WARN : PX_LOG_INFO, "req=%s msg=\"%s\" status=%d state=%s", r->id,
           msg, status, state_names[r->state]);
    if (r->conn) {
        if (r->state == RS_STREAM)
            px_conn_abort(r->conn);
        else
            px_conn_reply_error(r->conn, status, r->id, NULL, msg);
        r->conn = NULL;
    }
    access_log(r, status, r->state == RS_STREAM ? "stream_failed" : "error");
    set_state(r, RS_DONE);
    req_free(r);
}

static int valid_request_id(const char *v, size_t n)
{
    if (n == 0 || n > 128) return 0;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)v[i] < 0x20 || (unsigned char)v[i] > 0x7e) return 0;
    return 1;
}

static void build_headers(px_req *r, const px_http_head *h)
{
    char line[300];
    const px_http_header *auth = px_http_find(h, "authorization");
    r->hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    snprintf(line, sizeof line, "X-Request-Id: %s", r->id);
    r->hdrs = curl_slist_append(r->hdrs, line);
    if (auth) {
        px_buf b;
        px_buf_init(&b);
        px_buf_printf(&b, "Authorization: %.*s", (int)auth->value_len, auth->value);
        r->hdrs = curl_slist_append(r->hdrs, b.data);
        px_buf_cleanup(&b);
    } else if (r->w->srv->env_auth) {
        px_buf b;
        px_buf_init(&b);
        px_buf_printf(&b, "Authorization: %s", r->w->srv->env_auth);
        r->hdrs = curl_slist_append(r->hdrs, b.data);
        px_buf_cleanup(&b);
    }
    /* No 100-continue round trip on large bodies. */
    r->hdrs = curl_slist_append(r->hdrs, "Expect:");
}

static int start_upstream(px_req *r, const px_backend *b, const px_upstream_cbs *cbs,
                          long total_timeout_ms)
{
    const px_config *cfg = r->w->srv->cfg;
    px_upstream_opts o = {
        .connect_timeout_ms = (long)(cfg->connect_timeout * 1000),
        .total_timeout_ms = total_timeout_ms,
        .idle_timeout_s = 0,
    };
    px_buf_reset(&r->url);
    px_buf_printf(&r->url, "%s%s", b->url, ep_paths[r->ep]);
    r->up = px_upstream_post(r->w->up, r->url.data, r->up_body.data, r->up_body.len, r->hdrs, &o,
                             cbs, r);
    return r->up ? 0 : -1;
}

/* ---------- decode ---------- */

static void decode_headers(void *arg, int status, const char *ctype)
{
    px_req *r = arg;
    r->dstatus = status;
    r->t_first = px_now_ns();
    set_state(r, RS_STREAM);
    if (r->conn) px_conn_stream_start(r->conn, status, ctype, r->id, NULL);
}

static int decode_data(void *arg, const char *p, size_t n)
{
    px_req *r = arg;
    if (!r->conn) return -1;
    if (px_conn_pending(r->conn) >= PX_CONN_HIGH_WATER) {
        r->paused = 1;
        return 1;
    }
    px_conn_stream_write(r->conn, p, n);
    r->bytes_out += n;
    return 0;
}

static void decode_done(void *arg, CURLcode rc, const char *errbuf)
{
    px_req *r = arg;
    r->up = NULL; /* freed by the upstream module when this returns */
    if (rc != CURLE_OK) {
        if (r->state == RS_STREAM) {
            req_fail(r, r->dstatus, "decode %s failed mid-stream after %zu bytes: %s", r->db->name,
                     r->bytes_out, errbuf[0] ? errbuf : curl_easy_strerror(rc));
        } else {
            req_fail(r, px_upstream_status_for(rc), "decode %s: %s", r->db->name,
                     errbuf[0] ? errbuf : curl_easy_strerror(rc));
        }
        return;
    }
    if (r->conn) {
        px_conn_stream_end(r->conn);
        r->conn = NULL;
    }
    access_log(r, r->dstatus, "ok");
    set_state(r, RS_DONE);
    req_free(r);
}

static const px_upstream_cbs decode_cbs = {decode_headers, decode_data, decode_done};

/* ---------- prefill ---------- */

static void prefill_headers(void *arg, int status, const char *ctype)
{
    px_req *r = arg;
    r->pstatus = status;
    snprintf(r->pctype, sizeof r->pctype, "%s", ctype ? ctype : "application/json");
}

static int prefill_data(void *arg, const char *p, size_t n)
{
    px_req *r = arg;
    if (r->presp.len + n > PREFILL_MAX_ANSWER) {
        r->too_big = 1;
        return -1;
    }
    px_buf_append(&r->presp, p, n);
    return 0;
}

static void start_decode(px_req *r)
{
    const char *kvp = NULL;
    size_t kvp_len = 0;
    char err[128];
    px_kvp_status ks = px_extract_kv_params(r->presp.data ? r->presp.data : "", r->presp.len, &kvp,
                                            &kvp_len, err, sizeof err);
    if (ks == PX_KVP_BAD_RESPONSE) {
        req_fail(r, 502, "prefill %s returned an invalid answer: %s", r->pb->name, err);
        return;
    }
    if (ks == PX_KVP_MISSING) {
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"prefill answer has no kv_transfer_params; decode will recompute the "
               "prefill\" prefill=%s",
               r->id, r->pb->name);
        kvp = NULL;
    } else if (ks == PX_KVP_NO_REQUEST_ID) {
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"kv_transfer_params lack remote_request_id; decode cannot release "
               "prefill's blocks\" prefill=%s",
               r->id, r->pb->name);
    }
    px_buf_reset(&r->up_body);
    px_rewrite_decode(r->body.data, r->body.len, kvp, kvp_len, &r->up_body);
    r->db = &r->w->srv->decode.b[px_pool_pick_rr(&r->w->srv->decode)];
    set_state(r, RS_DECODE);
    if (start_upstream(r, r->db, &decode_cbs, 0) < 0)
        req_fail(r, 502, "decode %s: cannot start the request", r->db->name);
}

static void prefill_done(void *arg, CURLcode rc, const char *errbuf)
{
    px_req *r = arg;
    r->up = NULL;
    r->t_prefill = px_now_ns();
    if (rc != CURLE_OK) {
        if (r->too_big)
            req_fail(r, 502, "prefill %s answer exceeds %d bytes", r->pb->name, PREFILL_MAX_ANSWER);
        else
            req_fail(r, px_upstream_status_for(rc), "prefill %s: %s", r->pb->name,
                     errbuf[0] ? errbuf : curl_easy_strerror(rc));
        return;
    }
    if (r->pstatus >= 400 && r->pstatus < 500) {
        /* The client's fault: its status and the engine's words, as they are. */
        PX_LOG(PX_LOG_INFO, "req=%s msg=\"prefill rejected the request\" prefill=%s status=%d",
               r->id, r->pb->name, r->pstatus);
        if (r->conn) {
            px_conn_reply(r->conn, r->pstatus, r->pctype, r->id, NULL, r->presp.data, r->presp.len);
            r->conn = NULL;
        }
        access_log(r, r->pstatus, "prefill_rejected");
        set_state(r, RS_DONE);
        req_free(r);
        return;
    }
    if (r->pstatus < 200 || r->pstatus >= 300) {
        req_fail(r, 502, "prefill %s answered HTTP %d", r->pb->name, r->pstatus);
        return;
    }
    start_decode(r);
}

static const px_upstream_cbs prefill_cbs = {prefill_headers, prefill_data, prefill_done};

/* ---------- entry points ---------- */

static void client_gone(void *arg);
static void client_drained(void *arg);
static const px_exchange_cbs client_cbs = {client_gone, client_drained};

px_req *px_req_start(px_worker *w, px_conn *c, px_endpoint ep, const px_http_head *h,
                     px_buf *body)
{
    px_req *r = px_xcalloc(1, sizeof *r);
    r->w = w;
    r->conn = c;
    r->ep = ep;
    r->state = RS_NEW;
    r->t0 = px_now_ns();
    r->body = *body;
    px_buf_init(body);
    px_buf_init(&r->up_body);
    px_buf_init(&r->presp);
    px_buf_init(&r->url);

    const px_http_header *xid = px_http_find(h, "x-request-id");
    if (xid && valid_request_id(xid->value, xid->value_len)) {
        memcpy(r->id, xid->value, xid->value_len);
        r->id[xid->value_len] = '\0';
    } else {
        px_uuid4(r->id);
    }

    char err[128];
    px_json_type t = px_json_validate(r->body.data ? r->body.data : "", r->body.len, err, sizeof err);
    if (t == PX_JSON_INVALID) {
        req_fail(r, 400, "request body is not valid JSON: %s", err);
        return NULL;
    }
    if (t != PX_JSON_OBJECT) {
        req_fail(r, 400, "request body must be a JSON object");
        return NULL;
    }
    build_headers(r, h);
    px_rewrite_prefill(r->body.data, r->body.len, &r->up_body);
    r->pb = &w->srv->prefill.b[px_pool_pick_rr(&w->srv->prefill)];
    set_state(r, RS_PREFILL);
    long ptimeout = (long)(w->srv->cfg->prefill_timeout * 1000);
    if (start_upstream(r, r->pb, &prefill_cbs, ptimeout) < 0) {
        req_fail(r, 502, "prefill %s: cannot start the request", r->pb->name);
        return NULL;
    }
    px_conn_bind(c, &client_cbs, r);
    return r;
}

static void client_gone(void *arg)
{
    px_req *r = arg;
    r->conn = NULL;
    set_state(r, RS_CLOSING);
    access_log(r, 499, "client_disconnected");
    req_free(r); /* cancels the upstream transfer, closing its connection */
}

static void client_drained(void *arg)
{
    px_req *r = arg;
    if (r->paused && r->up) {
        r->paused = 0;
        px_upstream_resume(r->up);
    }
}
