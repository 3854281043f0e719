/* SPDX-License-Identifier: Apache-2.0 */
/* An HTTP/1.1 client for plain http:// upstreams on libevent (sockets with events of their own):
 * per-loop keep-alive pools keyed by backend address, TCP_NODELAY, connect,
 * total and idle timeouts, the response head parsed with base/http's strict
 * parser, the body handed to the caller as it arrives (spans of the input,
 * no copy) with pause/resume for backpressure.
 *
 * A request is never sent twice when the backend may have read it. An idle
 * connection the backend closed, or sent bytes nobody asked for, is noticed
 * before it is used: the loop keeps its read event armed (and one reported
 * in the loop turn that picks the connection, its callback not run yet,
 * rules it out too); one idle for over a second is also peeked at. A request
 * whose write to a reused connection failed before a byte left (the
 * backend had closed it) goes once more on a fresh connection.
 *
 * Answers must belong to their request. Bytes that arrive while a
 * connection is idle close it; bytes that arrive after the next request was
 * written are checked here: an answer that echoes another X-Request-Id
 * than the one sent, from a backend that echoes it, is refused
 * (PX_CR_MISMATCH), and a connection on which
 * an answer began before the whole request was written (no engine answers
 * a request it has not read: such bytes are another request's) is never
 * reused. px_client_answer_counts() counts both.
 *
 * Everything runs on the loop's thread. Callbacks run from inside the
 * client's own event handlers: on_head and on_data must not call
 * px_creq_cancel/_resume on their own request; on_done may do anything (the
 * request is gone when it is called). */
#ifndef PX_CLIENT_H
#define PX_CLIENT_H

#include <event2/event.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "base/http.h"
#include "base/util.h"

typedef struct px_client px_client;
typedef struct px_creq px_creq;

/* How an exchange ended. Values never change meaning. */
typedef enum {
    PX_CR_OK = 0,   /* a complete response */
    PX_CR_CONNECT,  /* could not connect: refused, unreachable, connect timeout */
    PX_CR_TIMEOUT,  /* connected, but the total or idle timeout passed */
    PX_CR_RESET,    /* closed or reset before the response was complete */
    PX_CR_PROTOCOL, /* the response was malformed (or its head too large) */
    PX_CR_ABORTED,  /* on_data said stop, or the upload finished with abort_after_upload */
    PX_CR_MISMATCH, /* the answer names another request (opts.expect_id): not read as ours */
} px_cresult;

typedef struct px_client_cfg {
    int max_idle_per_host; /* idle connections kept per backend address (0: 64) */
    double idle_close_s;   /* an idle connection is closed after this (0: 4 s, below
                              uvicorn's 5 s keep-alive, which vLLM runs on) */
} px_client_cfg;

typedef struct px_creq_cbs {
    /* The final response head (1xx skipped). `h` is valid during the call. */
    void (*on_head)(void *arg, const px_http_head *h);
    /* Body bytes: return 0 when consumed, 1 to pause without consuming them
     * (delivered again after px_creq_resume), -1 to abort (on_done follows
     * with PX_CR_ABORTED). */
    int (*on_data)(void *arg, const char *p, size_t n);
    /* The exchange ended. `why` is a short text for logs; `sent` is 0 when
     * no byte of the request can have reached the backend. The px_creq is
     * freed before this is called. */
    void (*on_done)(void *arg, px_cresult r, const char *why, int sent);
} px_creq_cbs;

typedef struct px_creq_opts {
    double connect_timeout; /* seconds; 0: 5 */
    double total_timeout;   /* seconds for the whole exchange; 0: none */
    double idle_timeout;    /* seconds without a byte from the backend once sent; 0: none */
    int head_request;       /* the request is a HEAD: its response has no body */
    int track_upload;       /* px_creq_abort_after_upload may be used */
    /* The X-Request-Id the request carries (borrowed until on_done; NULL:
     * none). Once a backend address answered with an X-Request-Id holding
     * the one sent, an answer from it whose X-Request-Id does not is some
     * other request's (a faulty engine's late extra answer): the exchange
     * ends with PX_CR_MISMATCH and the connection is closed. A backend that
     * sends ids of its own is never held to it. */
    const char *expect_id;
} px_creq_opts;

/* A client for one event loop (borrowed; it must outlive the client). */
px_client *px_client_create(struct event_base *base, const px_client_cfg *cfg);
/* Closes every connection; requests in flight are cancelled without on_done.
 * NULL is a no-op. */
void px_client_destroy(px_client *c);

/* After the backends changed: for every address `keep` says no to, idle
 * connections close now and busy ones once their exchange ends (a request
 * for the address later makes it a backend again). */
void px_client_retire(px_client *cl,
                      int (*keep)(void *ctx, const struct sockaddr *sa, socklen_t salen),
                      void *ctx);

/* Sends `head` (request line and header fields through the blank line,
 * copied) and body[0..len) (borrowed: valid until on_done) to the backend at
 * `sa` (copied), over an idle connection of that address when one is kept.
 * Returns NULL when no socket could be created (nothing is called back). */
px_creq *px_creq_start(px_client *c, const struct sockaddr *sa, socklen_t salen, const char *head,
                       size_t head_len, const char *body, size_t len, const px_creq_opts *o,
                       const px_creq_cbs *cbs, void *arg);

/* Whether the backend has started answering (a byte of its response came). */
int px_creq_answering(const px_creq *q);
/* Aborts the exchange as soon as the whole request has been written (needs
 * opts.track_upload): on_done follows with PX_CR_ABORTED. Returns 1 when that
 * has already happened (the caller may cancel at once). */
int px_creq_abort_after_upload(px_creq *q);
/* Tells the backend the request's client is gone while still reading its
 * answer: the connection's write side is shut (the backend reads an end of
 * stream, as when its client closes, and an engine aborts such a request),
 * and the connection is not reused. An answer the backend had already sent
 * still arrives. 0, or -1 when the request is not written whole yet (or no
 * connection holds it). */
int px_creq_shutdown_write(px_creq *q);
/* Delivers again what a paused on_data left, and reads on. */
void px_creq_resume(px_creq *q);
/* Ends the exchange now: its connection is closed, not reused; on_done is
 * not called. NULL is a no-op. */
void px_creq_cancel(px_creq *q);

/* Answers refused for naming another request, and connections not reused
 * because an answer began before the request was written whole, since the
 * process started (all clients; any thread). */
void px_client_answer_counts(unsigned long long *mismatched, unsigned long long *early);

/* Connections kept idle now, all addresses (for tests and metrics). */
size_t px_client_idle(const px_client *c);
/* Backend addresses a request or a connection refers to now (for tests). */
size_t px_client_hosts(const px_client *c);

#endif
