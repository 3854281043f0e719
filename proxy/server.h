/* The HTTP front: worker threads, listeners, client connections, routes, and
 * the response-writing API the request state machine uses. */
#ifndef PX_SERVER_H
#define PX_SERVER_H

#include <event2/event.h>
#include <pthread.h>
#include <stddef.h>

#include "config.h"
#include "conn.h"
#include "route.h"
#include "upstream.h"

typedef struct px_server px_server;

typedef struct px_worker {
    px_server *srv;             /* borrowed: outlives the worker */
    int index;
    struct event_base *base;    /* owned */
    struct evconnlistener *lev; /* owned */
    px_uploop *up;              /* owned */
    struct event *wake;         /* owned: stop requests from the main thread */
    int wake_fd;                /* owned eventfd */
    px_conn_list conns;         /* owned: open client connections */
    px_conn_cfg conn_cfg;
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

#endif
