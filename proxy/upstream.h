/* SPDX-License-Identifier: Apache-2.0 */
/* Upstream HTTP requests, one transport-neutral interface over two clients:
 * plain http:// backends go through base's own HTTP/1.1 client (keep-alive
 * pools per backend address on the worker's loop), https:// backends
 * through libcurl (certificate verification, CA bundles), whose multi
 * handle is created on the first https request. Nothing of curl leaves
 * upstream.c. */
#ifndef PX_UPSTREAM_H
#define PX_UPSTREAM_H

#include <event2/event.h>
#include <stddef.h>

#include "base/json.h"
#include "base/util.h"
#include "proxy/route.h"

typedef struct px_uploop px_uploop;
typedef struct px_upstream px_upstream;

/* How a transfer ended. */
typedef enum {
    PX_UP_OK = 0,  /* a complete response (whatever its status) */
    PX_UP_CONNECT, /* could not connect or resolve */
    PX_UP_TIMEOUT, /* a timeout passed */
    PX_UP_RESET,   /* closed, reset, or malformed before a complete response */
    PX_UP_ABORTED, /* on_data said stop, or aborted after the upload */
} px_up_result;

/* Creates the upstream state of one event loop, keeping at most `max_idle`
 * idle connections per backend address. NULL on failure. */
px_uploop *px_uploop_create(struct event_base *base, int max_idle);
/* The same, with plain-http idle connections closed after idle_close_s
 * (0: the client's default, 4 s): the health checker keeps its connections
 * over its interval. */
px_uploop *px_uploop_create_keep(struct event_base *base, int max_idle, double idle_close_s);
/* Cancels every transfer still running (their on_done is NOT called). */
void px_uploop_destroy(px_uploop *l);
/* After the backends changed: plain-http connections to addresses `keep`
 * says no to close (idle ones now, busy ones after their exchange). */
void px_uploop_retire(px_uploop *l,
                      int (*keep)(void *ctx, const struct sockaddr *sa, socklen_t salen),
                      void *ctx);

typedef struct px_upstream_cbs {
    /* The final response head arrived (1xx skipped); content_type is NULL
     * when there is none. Runs inside the transport's callback: it must
     * not cancel or resume this transfer. */
    void (*on_headers)(void *arg, int status, const char *content_type);
    /* Body bytes. Return 0 when consumed, 1 to pause the transfer without
     * consuming them (they are delivered again after px_upstream_resume), or
     * -1 to abort (on_done follows with PX_UP_ABORTED). Same restriction. */
    int (*on_data)(void *arg, const char *p, size_t n);
    /* The transfer ended; `why` is a short text for logs; `connected` is 0
     * when no byte of the request was sent (the backend cannot have seen
     * it). The px_upstream is freed when this is called: drop it. */
    void (*on_done)(void *arg, px_up_result r, const char *why, int connected);
} px_upstream_cbs;

/* One upstream request: what goes where, and its limits. Every pointer is
 * borrowed until on_done (or until px_upstream_start returns NULL). Times
 * are in seconds, as in the configuration; 0: none. */
typedef struct px_upstream_req {
    px_backend *backend;   /* the caller holds a reference until on_done */
    const char *method;    /* usually "POST" with a body, "GET" without; any token for
                              passed-through endpoints, a body sent when one is given */
    const char *path;      /* with its query, if any */
    const char *body;      /* NULL: no body */
    size_t len;            /* of body */
    const px_buf *headers; /* "Name: value\r\n" lines, without Host, Content-Length or
                              framing; or NULL */
    double connect_timeout;
    double total_timeout;
    double idle_timeout; /* abort when no byte arrives for this long */
    const char *ca_file; /* https: CA bundle; NULL or "": the system store */
    int insecure;        /* https: skip certificate verification */
    int track_upload;    /* report when the body has been sent (px_upstream_abort_after_upload) */
    const char *request_id; /* the X-Request-Id sent: an answer echoing another is refused
                               (http://, base/client.h expect_id); NULL: not checked */
} px_upstream_req;

/* Whether a prefill answer of backend b (a 2xx, whose kv_transfer_params'
 * remote_request_id is `rid`, the raw JSON member, val NULL: none) is another
 * request's: an engine that puts the X-Request-Id it got into its
 * remote_request_id (vLLM, engine-sim: the id plus a suffix) is known to
 * once one answer of b did so, and from then on an answer whose
 * remote_request_id lacks `id` is refused (a late extra answer would give
 * decode another request's kv_transfer_params). 1: refuse it. Any thread. */
int px_upstream_answer_foreign(px_backend *b, const px_json_member *rid, const char *id);

/* Starts the request `q` describes. Returns NULL when the transfer cannot
 * even start; nothing is called back then. */
px_upstream *px_upstream_start(px_uploop *l, const px_upstream_req *q, const px_upstream_cbs *cbs,
                               void *arg);

/* Whether the backend has started answering: its response head arrived, or
 * bytes of it wait unread on the connection. */
int px_upstream_answering(px_upstream *u);

/* Arranges for the transfer to be aborted as soon as the whole request body
 * has been handed to the connection (needs opts.track_upload). Returns 1
 * when that has already happened: the caller may cancel at once. */
int px_upstream_abort_after_upload(px_upstream *u);
/* The request's client left: the backend is told (its connection's write
 * side shut, base/client.h px_creq_shutdown_write) while its answer is
 * still read. 0, or -1 when that cannot be done (https, or the request not
 * written whole): the caller cancels instead. */
int px_upstream_half_close(px_upstream *u);

/* From inside on_headers only: copies the value of the answer's header
 * `name` (case-insensitive) into out (cap bytes, NUL-terminated, cut to
 * fit). Returns 1 when the answer has it, else 0. */
int px_upstream_header(px_upstream *u, const char *name, char *out, size_t cap);

/* Replaces the callbacks of a transfer in flight (its arg stays); the next
 * callback is the new table's. */
void px_upstream_set_cbs(px_upstream *u, const px_upstream_cbs *cbs);

/* Resumes a transfer paused by on_data returning 1. Not from inside its own
 * callbacks. Delivered bytes may arrive in on_data before this returns. */
void px_upstream_resume(px_upstream *u);

/* Aborts a transfer and frees it; its connection is closed, not reused.
 * on_done is not called. NULL is a no-op. */
void px_upstream_cancel(px_upstream *u);

/* The HTTP status the client should get for a failed transfer: 504 for
 * timeouts, 502 otherwise. */
int px_upstream_status_for(px_up_result r);
const char *px_up_result_str(px_up_result r);

#endif
