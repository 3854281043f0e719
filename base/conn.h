/* SPDX-License-Identifier: Apache-2.0 */
/* HTTP/1.1 server connections on libevent bufferevents: reading requests
 * (heads, Content-Length and chunked bodies, pipelining, timeouts) and
 * writing responses (whole, or streamed with backpressure). Used by the
 * proxy's workers and by engine-sim. Everything runs on the loop's thread. */
#ifndef PX_CONN_H
#define PX_CONN_H

#include <event2/event.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "base/http.h"
#include "base/util.h"

typedef struct px_conn px_conn;

/* What every connection of the process shares, across worker threads: the
 * memory budget for request bodies held and responses queued, and the
 * connection cap. Counters only grow; the gauges are exact. */
typedef struct px_conn_shared {
    atomic_llong buffered; /* bytes of request bodies held + client output queued */
    int64_t max_buffered;  /* new bodies are refused beyond it (503); 0: no budget */
    atomic_long conns;     /* client connections open */
    long max_conns;        /* connections past it are answered 503 and closed; 0: none */
    atomic_ullong budget_rejected; /* bodies refused for the budget */
    atomic_ullong conns_refused;   /* connections refused past max_conns */
    atomic_ullong send_timeouts;   /* connections closed: the peer read nothing */
} px_conn_shared;

/* Takes n bytes of the budget: 1, or 0 when that would pass it (nothing is
 * taken). A NULL budget always grants. */
int px_budget_try(px_conn_shared *sh, int64_t n);
/* Adds n (negative: returns) unconditionally: memory already held. */
void px_budget_add(px_conn_shared *sh, int64_t n);

typedef struct px_conn_cfg {
    int64_t max_body_bytes;   /* 413 beyond */
    double header_timeout;    /* seconds to receive a whole request (408) */
    double keepalive_timeout; /* seconds an idle connection is kept */
    double send_timeout;      /* seconds queued output may wait on a peer that reads nothing */
    px_conn_shared *shared;   /* borrowed: process-wide budget and caps, or NULL */
    /* A complete request arrived. The handler ends the exchange, now or
     * later, with exactly one reply, stream end or abort. `body` may be
     * moved out (px_buf ownership). `h` is valid until the exchange ends. */
    void (*dispatch)(void *ctx, px_conn *c, const px_http_head *h, px_buf *body);
    void *ctx;              /* borrowed */
    struct ssl_ctx_st *tls; /* borrowed: serve TLS with it, or NULL for plain HTTP */
    int draining;           /* answer with Connection: close from now on */
} px_conn_cfg;

/* The connections of one loop, so they can be closed when it stops. */
typedef struct px_conn_list {
    px_conn *head;
    size_t n;
} px_conn_list;

/* Takes a connected socket (owned from now on) and the peer's address
 * accept() returned (copied; required). cfg and list are
 * borrowed and must outlive the connection. Returns NULL (fd closed) on
 * failure. Past cfg->shared->max_conns the connection is answered 503 and
 * closed. */
px_conn *px_conn_accept(struct event_base *base, evutil_socket_t fd, const struct sockaddr *sa,
                        socklen_t salen, const px_conn_cfg *cfg, px_conn_list *list);

/* Closes the connections that have no exchange in flight (draining). */
void px_conn_list_close_idle(px_conn_list *list);

/* Closes and frees every connection of the list, for use once the loop has
 * stopped: exchanges in flight get on_gone first. */
void px_conn_list_close_all(px_conn_list *list);

/* What the handler of the exchange in flight wants to hear about. */
typedef struct px_exchange_cbs {
    /* The client went away before the exchange ended. The connection is
     * gone: drop the pointer. Not called for exchanges already ended. */
    void (*on_gone)(void *arg);
    /* The queued output fell below PX_CONN_LOW_WATER (resume a paused
     * producer). May be NULL. */
    void (*on_drained)(void *arg);
} px_exchange_cbs;

/* Binds callbacks to the current exchange; cleared when it ends. */
void px_conn_bind(px_conn *c, const px_exchange_cbs *cbs, void *arg);

/* --- Responses. Every call below ends the exchange except
 * px_conn_stream_start/_write; afterwards the caller drops its pointer. --- */

/* A complete response with a Content-Length body; `extra` holds more header
 * lines ("Name: value\r\n"...) or is NULL. */
void px_conn_reply(px_conn *c, int status, const char *ctype, const char *req_id, const char *extra,
                   const char *body, size_t n);
/* An OpenAI-style error: {"error":{"message","type","code"}}. Returns the
 * body's bytes (for the access line's bytes_out). */
size_t px_conn_reply_error(px_conn *c, int status, const char *req_id, const char *extra,
                           const char *msg);
/* Starts a streamed response (chunked for HTTP/1.1 clients, close-delimited
 * for HTTP/1.0). */
void px_conn_stream_start(px_conn *c, int status, const char *ctype, const char *req_id,
                          const char *extra);
void px_conn_stream_write(px_conn *c, const char *p, size_t n);
void px_conn_stream_end(px_conn *c);
/* Drops the connection without completing the response, so the client sees
 * a truncated stream rather than a clean end. on_gone is not called. */
void px_conn_abort(px_conn *c);
/* Bytes queued for the client and not yet written to its socket. */
size_t px_conn_pending(const px_conn *c);
/* The client's IP address as text (IPv4 or IPv6, no port) into out; "" when
 * the socket has none (a Unix socket). Read once, when it was accepted. */
void px_conn_peer(const px_conn *c, char *out, size_t n);

/* The client's certificate when the connection is TLS and its handshake
 * verified one (a listener with --tls-client-ca); NULL otherwise. Borrowed:
 * valid while the connection is. */
const struct x509_st *px_conn_client_cert(const px_conn *c);

/* The OpenAI error "type" for a status. */
const char *px_error_type(int status);

/* Above this many queued bytes a streaming producer should pause, and
 * pipelined requests wait (the connection stops reading); on_drained is
 * called, and reading resumes, once the queue falls below the low mark. */
#define PX_CONN_HIGH_WATER (1024 * 1024)
#define PX_CONN_LOW_WATER (256 * 1024)

#endif
