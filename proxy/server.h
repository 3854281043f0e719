/* The HTTP front: worker threads, listeners, client connections, routes, and
 * the response-writing API the request state machine uses. */
#ifndef PX_SERVER_H
#define PX_SERVER_H

#include <event2/event.h>
#include <pthread.h>
#include <stddef.h>

#include "config.h"
#include "route.h"
#include "upstream.h"

typedef struct px_server px_server;
typedef struct px_conn px_conn;

typedef struct px_worker {
    px_server *srv;             /* borrowed: outlives the worker */
    int index;
    struct event_base *base;    /* owned */
    struct evconnlistener *lev; /* owned */
    px_uploop *up;              /* owned */
    struct event *wake;         /* owned: stop requests from the main thread */
    int wake_fd;                /* owned eventfd */
    px_conn *conns;             /* owned: open client connections */
    pthread_t thread;
} px_worker;

struct px_server {
    const px_config *cfg;   /* borrowed: outlives the server */
    px_pool prefill;
    px_pool decode;
    char *env_auth;         /* owned: "Bearer $OPENAI_API_KEY", or NULL */
    px_worker *workers;     /* owned array */
    int nworkers;
};

/* Binds the listeners and builds the workers; nothing runs yet. Returns NULL
 * with a message in err on failure (address in use, ...). */
px_server *px_server_create(const px_config *cfg, char *err, size_t errlen);
/* Runs the workers until SIGINT or SIGTERM; returns the exit status. */
int px_server_run(px_server *s);
void px_server_destroy(px_server *s);

/* --- Responses, for request.c. Every call below ends the exchange except
 * px_conn_stream_start/_write; after an ending call the request must drop its
 * px_conn pointer. All run on the connection's worker thread. --- */

/* A complete response with a Content-Length body. */
void px_conn_reply(px_conn *c, int status, const char *ctype, const char *req_id,
                   const char *body, size_t n);
/* An OpenAI-style error: {"error":{"message","type","code"}}. */
void px_conn_reply_error(px_conn *c, int status, const char *req_id, const char *msg);
/* Starts a streamed response (chunked for HTTP/1.1 clients). */
void px_conn_stream_start(px_conn *c, int status, const char *ctype, const char *req_id);
void px_conn_stream_write(px_conn *c, const char *p, size_t n);
void px_conn_stream_end(px_conn *c);
/* Drops the connection without completing the response, so the client sees
 * a truncated stream rather than a clean end. */
void px_conn_abort(px_conn *c);
/* Bytes queued for the client and not yet written to its socket. */
size_t px_conn_pending(px_conn *c);

/* Above this many queued bytes a streaming request pauses its upstream;
 * px_req_on_drained() is called once the queue falls below the low mark. */
#define PX_CONN_HIGH_WATER (1024 * 1024)
#define PX_CONN_LOW_WATER (256 * 1024)

#endif
