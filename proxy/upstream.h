/* Upstream HTTP requests: one libcurl multi handle per worker, driven by the
 * worker's libevent loop (socket and timer callbacks). Connections to the
 * engines are pooled and reused by the multi handle. */
#ifndef PX_UPSTREAM_H
#define PX_UPSTREAM_H

#include <curl/curl.h>
#include <event2/event.h>
#include <stddef.h>

typedef struct px_uploop px_uploop;
typedef struct px_upstream px_upstream;

/* Creates the curl multi handle for one event loop. NULL on failure. */
px_uploop *px_uploop_create(struct event_base *base);
/* Cancels every transfer still running (their on_done is NOT called). */
void px_uploop_destroy(px_uploop *l);

typedef struct px_upstream_cbs {
    /* The final response head arrived (1xx skipped). Runs inside a curl
     * callback: it must not call into curl (no px_upstream_cancel). */
    void (*on_headers)(void *arg, int status, const char *content_type);
    /* Body bytes. Return 0 when consumed, 1 to pause the transfer without
     * consuming them (they are delivered again after px_upstream_resume), or
     * -1 to abort (on_done follows with CURLE_WRITE_ERROR). Runs inside a
     * curl callback, same restriction. */
    int (*on_data)(void *arg, const char *p, size_t n);
    /* The transfer ended: rc is CURLE_OK or the failure, errbuf curl's text;
     * `connected` is 0 when no byte of the request was sent (the backend
     * cannot have seen it). Runs from the event loop, outside curl; the
     * px_upstream is freed when this returns, so the callee drops it. */
    void (*on_done)(void *arg, CURLcode rc, const char *errbuf, int connected);
} px_upstream_cbs;

typedef struct px_upstream_opts {
    long connect_timeout_ms;
    long total_timeout_ms;  /* 0: none */
    long idle_timeout_s;    /* abort when no byte arrives for this long; 0: none */
    const char *ca_file;    /* https: CA bundle; NULL: the system store */
    int insecure;           /* https: skip certificate verification */
    const char *connect_to; /* "host:port:addr:port" pin, or NULL */
    int track_upload; /* report when the body has been sent (px_upstream_abort_after_upload) */
} px_upstream_opts;

/* Starts `method` (POST with a body, or GET with body NULL) on url, with
 * body[0..len) (borrowed: valid until on_done) and the header list `hdrs`
 * (borrowed likewise). Returns NULL when curl refuses the handle; nothing is
 * called back then. */
px_upstream *px_upstream_start(px_uploop *l, const char *method, const char *url, const char *body,
                               size_t len, struct curl_slist *hdrs, const px_upstream_opts *o,
                               const px_upstream_cbs *cbs, void *arg);

/* Whether the backend has started answering: its response head arrived, or
 * bytes wait unread on the connection. */
int px_upstream_answering(px_upstream *u);

/* Arranges for the transfer to be aborted as soon as the whole request body
 * has been handed to the connection (needs opts.track_upload). Returns 1
 * when that has already happened: the caller may cancel at once. */
int px_upstream_abort_after_upload(px_upstream *u);

/* Resumes a transfer paused by on_data returning 1. Not from inside a curl
 * callback. Delivered bytes may arrive in on_data before this returns. */
void px_upstream_resume(px_upstream *u);

/* Aborts a transfer and frees it; its connection is closed, not reused.
 * on_done is not called. Not from inside a curl callback. */
void px_upstream_cancel(px_upstream *u);

/* Maps a curl failure to the HTTP status the client should get: 504 for
 * timeouts, 502 otherwise. */
int px_upstream_status_for(CURLcode rc);

#endif
