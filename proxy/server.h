/* The HTTP front: worker threads with their listeners and routes, and the
 * control loop on the main thread (signals, drain, health checks). */
#ifndef PX_SERVER_H
#define PX_SERVER_H

#include <event2/event.h>
#include <openssl/ssl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

#include "config.h"
#include "conn.h"
#include "metrics.h"
#include "route.h"
#include "upstream.h"

typedef struct px_server px_server;
struct px_discovery;

/* Commands the control thread posts to workers. */
enum { PX_CMD_DRAIN = 1, PX_CMD_STOP = 2 };

typedef struct px_worker {
    px_server *srv; /* borrowed: outlives the worker */
    int index;
    struct event_base *base;    /* owned */
    struct evconnlistener *lev; /* owned; NULL once draining */
    px_uploop *up;              /* owned */
    struct event *wake;         /* owned: commands from the control thread */
    int wake_fd;                /* owned eventfd */
    atomic_int cmd;             /* PX_CMD_* bits */
    struct event *drain_poll;   /* owned: while draining, exits when idle */
    px_conn_list conns;         /* owned: open client connections */
    px_conn_cfg conn_cfg;
    px_metrics metrics;  /* written by this thread only */
    struct px_req *reqs; /* owned: requests alive, some without a client */
    px_pindex *pindex;   /* owned: --disagg-min-tokens' prefix index; NULL until used */
    size_t nreqs;
    pthread_t thread;
} px_worker;

struct px_server {
    const px_config *cfg; /* borrowed: outlives the server */
    px_pool prefill;
    px_pool decode;
    char *upstream_auth;            /* owned: "Authorization: Bearer …" line, or NULL */
    int upstream_auth_forced;       /* --upstream-api-key: always, over the client's */
    px_buf health_hdrs;             /* owned: header lines of health checks and scrapes */
    unsigned char (*api_keys)[32];  /* owned: SHA-256 of each accepted key */
    size_t napi_keys;
    SSL_CTX *tls;              /* owned, or NULL */
    struct px_discovery *disc; /* owned */
    px_worker *workers;        /* owned array */
    int nworkers;
    atomic_long inflight; /* P/D requests in flight, all workers */
    px_conn_shared shared;        /* memory budget and connection cap, all workers */
    struct event_base *ctl_base;  /* owned: the control loop (signals, DNS, health) */
    struct evconnlistener *mlev;  /* owned: --metrics-port listener, or NULL */
    px_conn_list mconns;          /* owned: its connections (control thread) */
    px_conn_cfg mconn_cfg;
    atomic_int draining;
    atomic_int workers_running;
};

/* Binds the listeners, resolves the backends and builds the workers;
 * nothing runs yet. Returns NULL with a message in err on failure. */
px_server *px_server_create(const px_config *cfg, char *err, size_t errlen);
/* Runs until SIGTERM (graceful drain) or SIGINT (prompt stop); returns the
 * exit status. */
int px_server_run(px_server *s);
void px_server_destroy(px_server *s);

#endif
