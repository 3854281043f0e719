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

/* One model pool at run time: its prefill and decode backends. */
typedef struct px_pset {
    char *name;        /* owned; "": the unnamed pool, which serves every model */
    px_strlist models; /* owned */
    px_pool prefill;
    px_pool decode;
} px_pset;

/* A generation: the pools built from one configuration. Requests hold a
 * reference to the generation they started on and finish on it whatever
 * reloads happen meanwhile; the last reference frees its pools, and with
 * them the backends no newer generation kept. */
typedef struct px_gen {
    atomic_int refs;
    uint64_t id; /* 1 for the configuration the server started with */
    px_pset *ps; /* owned array */
    size_t nps;
    int named;                 /* pools are named: requests route by their model */
    struct px_discovery *disc; /* control thread only */
} px_gen;

/* The current generation, with a reference taken. Any thread. */
px_gen *px_server_gen(px_server *s);
/* The addresses to listen on for host:port (getaddrinfo's result and
 * return value). */
struct addrinfo;
int px_listen_addrs(const char *host, int port, struct addrinfo **res);
/* Drops a reference; the last frees the generation. NULL is a no-op. */
void px_gen_release(px_gen *g);
/* The pool serving `model` (n bytes): the unnamed pool serves all; NULL
 * when the pools are named and none serves it. */
px_pset *px_gen_find(px_gen *g, const char *model, size_t n);
/* Whether the pool can take a request now, and when not, why (static
 * text). */
int px_pset_ready(const px_pset *p, int fallback_decode_only, const char **why);

/* Commands the control thread posts to workers. */
enum { PX_CMD_DRAIN = 1, PX_CMD_STOP = 2, PX_CMD_RETIRE = 4 };

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
    const px_config *cfg;   /* borrowed: outlives the server; listeners, limits, timeouts */
    pthread_mutex_t gen_mu; /* guards gen */
    px_gen *gen;            /* owned reference: the generation new requests use */
    uint64_t last_gen;      /* control thread */
    /* Reloading: the command line and environment to merge over the file
     * again, the file's last good settings and the admin API's changes
     * since (control thread). */
    int argc;
    char **argv;           /* borrowed: main's */
    char **envp;           /* borrowed: main's */
    px_config *file_cfg;   /* owned: the last reload's, or NULL: cfg */
    struct px_api_op *ops; /* owned: admin API changes since the last file reload */
    size_t nops;
    struct px_discovery **retired; /* owned: replaced generations' discoveries whose
                                       cancelled lookups may still call back */
    size_t nretired;
    struct px_admin *admin;        /* owned, or NULL */
    char *upstream_auth;           /* owned: "Authorization: Bearer …" line, or NULL */
    int upstream_auth_forced;      /* --upstream-api-key: always, over the client's */
    px_buf health_hdrs;            /* owned: header lines of health checks and scrapes */
    unsigned char (*api_keys)[32]; /* owned: SHA-256 of each accepted key */
    size_t napi_keys;
    SSL_CTX *tls;              /* owned, or NULL */
    struct px_discovery *disc; /* owned */
    px_worker *workers;        /* owned array */
    int nworkers;
    atomic_long inflight;        /* P/D requests in flight, all workers */
    px_conn_shared shared;       /* memory budget and connection cap, all workers */
    struct event_base *ctl_base; /* owned: the control loop (signals, DNS, health) */
    struct evconnlistener *mlev; /* owned: --metrics-port listener, or NULL */
    px_conn_list mconns;         /* owned: its connections (control thread) */
    px_conn_cfg mconn_cfg;
    atomic_int draining;
    atomic_int workers_running;
};

/* Binds the listeners, resolves the backends and builds the workers;
 * nothing runs yet. Returns NULL with a message in err on failure. */
px_server *px_server_create(const px_config *cfg, char *err, size_t errlen);
/* Where reloads read the settings again: main's arguments (borrowed; they
 * must outlive the server). Without it reloads use cfg's file alone. */
void px_server_set_args(px_server *s, int argc, char **argv, char **envp);

/* A change the admin API made to the backends. */
typedef struct px_api_op {
    int add;     /* 1: add, 0: remove */
    int prefill; /* role */
    char *pool;  /* owned: pool name ("" the unnamed one) */
    char *url;   /* owned */
} px_api_op;

/* Builds and swaps in a new generation, on the control thread. from_file:
 * read the --config file again (merged with the environment and flags) and
 * drop the admin API's changes; else apply `op` (NULL: none) to the
 * current settings. On any error nothing changes and err says what.
 * Returns 0 or -1. */
int px_server_reload(px_server *s, int from_file, const px_api_op *op, char *err, size_t errlen);
/* DNS discovery of the current generation (metrics). Any thread. */
uint64_t px_server_dns_failures(px_server *s);
size_t px_server_dns_unresolved(px_server *s);

/* The settings the current generation was built from. Control thread. */
const px_config *px_server_config(px_server *s);
/* Runs until SIGTERM (graceful drain) or SIGINT (prompt stop); returns the
 * exit status. */
int px_server_run(px_server *s);
void px_server_destroy(px_server *s);

#endif
