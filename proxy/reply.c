/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/reply.h"

#include <string.h>
#include <strings.h>

/* A decode answer whose usage is rewritten is held whole (JSON) or an
 * event at a time (SSE); past this, it passes through untouched. */
#define USAGE_MAX_HOLD (8 * 1024 * 1024)

void px_reply_init(px_reply *o, px_conn *c, px_ctx *ctx, px_adm_req *adm, const char *id,
                   size_t *bytes_out) {
    o->conn = c;
    o->ctx = ctx;
    o->adm = adm;
    o->id = id;
    o->bytes_out = bytes_out;
    px_kvhold_init(&o->hold);
}

void px_reply_cleanup(px_reply *o) {
    px_kvhold_cleanup(&o->hold);
    px_usage_cleanup(&o->usage);
}

size_t px_reply_held(const px_reply *o) {
    return o->hold.held.len + px_usage_held(&o->usage);
}

void px_reply_body(px_reply *o, int status, const char *ctype, const char *body, size_t n) {
    if (!o->conn) return;
    px_conn_reply(o->conn, status, ctype, o->id, NULL, body, n);
    *o->bytes_out += n; /* a relayed 4xx or a 404's body counts in the access line */
    o->conn = NULL;
}

void px_reply_fail(px_reply *o, int status, const char *extra, const char *msg) {
    if (!o->conn) return;
    if (msg && !o->started)
        *o->bytes_out += px_conn_reply_error(o->conn, status, o->id, extra, msg);
    else
        px_conn_abort(o->conn);
    o->conn = NULL;
}

/* The usage filter's output: to the client, counted. */
static void usage_out(void *arg, const char *p, size_t n) {
    px_reply *o = arg;
    if (!o->conn || !n) return;
    px_conn_stream_write(o->conn, p, n);
    *o->bytes_out += n;
}

void px_reply_start(px_reply *o, int status, const char *ctype, int sse, int kv) {
    int json = ctype && !strncasecmp(ctype, "application/json", 16);
    /* A stream whose usage the proxy asked for (the tenant's tokens count,
     * admission.h): the usage chunk is the proxy's, not the client's. */
    int strip = o->adm->strip_usage && sse && status == 200;
    if (kv && o->cached[0] && status == 200 && (sse || json) &&
        !strcmp(o->ctx->cfg->usage_from, "prefill"))
        px_usage_init(&o->usage, o->cached, sse, USAGE_MAX_HOLD, usage_out, o);
    else if (strip)
        px_usage_init(&o->usage, "", 1, USAGE_MAX_HOLD, usage_out, o);
    if (strip) px_usage_strip(&o->usage);
    o->started = 1;
    char rl[512];
    px_adm_ratelimit_headers(o->ctx, o->adm, rl, sizeof rl);
    if (o->conn) px_conn_stream_start(o->conn, status, ctype, o->id, rl[0] ? rl : NULL);
}

/* Whether the client's queue is at its high-water mark: decode is paused
 * (the caller returns 1) until the client drains it. The decode idle
 * timeout, armed already, now bounds how long the client may leave its
 * queue full, so a reader that stopped reading does not hold a decode
 * forever. */
static int client_full(px_reply *o) {
    if (px_conn_pending(o->conn) < PX_CONN_HIGH_WATER) return 0;
    o->paused = 1;
    return 1;
}

int px_reply_pass(px_reply *o, const char *p, size_t n) {
    if (client_full(o)) return 1;
    px_adm_answer(o->adm, p, n);
    if (o->lat) px_lat_req_answer(o->lat, p, n);
    if (o->usage.active) {
        /* Held, or given up on: then what was held went first. */
        if (px_usage_feed(&o->usage, p, n) == 0) return 0;
        if (client_full(o)) return 1;
    }
    px_conn_stream_write(o->conn, p, n);
    *o->bytes_out += n;
    return 0;
}

void px_reply_release(px_reply *o, int status, const char *ctype, int kv) {
    px_reply_start(o, status, ctype, o->hold.sse, kv);
    px_buf held;
    px_kvhold_take(&o->hold, &held);
    /* Held bytes cannot be delivered again: all of them are queued (the
     * client's queue is soft, at most PX_KVHOLD_MAX over its mark; the
     * next delivery pauses decode when it is full). */
    if (held.len) px_adm_answer(o->adm, held.data, held.len);
    if (held.len && o->conn &&
        (!o->usage.active || px_usage_feed(&o->usage, held.data, held.len) != 0)) {
        px_conn_stream_write(o->conn, held.data, held.len);
        *o->bytes_out += held.len;
    }
    px_buf_cleanup(&held);
}

void px_reply_end(px_reply *o, int whole) {
    /* The answer is complete (or cut): what is held goes out, fixed when
     * it is whole. */
    if (o->usage.active) px_usage_end(&o->usage, whole);
    if (!whole) return;
    if (o->conn) px_conn_stream_end(o->conn);
    o->conn = NULL;
}
