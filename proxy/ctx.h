/* SPDX-License-Identifier: Apache-2.0 */
/* What requests, health checks, discovery, metrics and the admin API see of
 * the running proxy: the settings, the current generation of pools, the
 * credentials and the shared limits (px_ctx), and per worker thread its
 * loop, upstream connections, counters and requests (px_wctx). server.c
 * owns and fills them (reload.c swaps the generation); the threads,
 * listeners and signals stay inside it. */
#ifndef PX_CTX_H
#define PX_CTX_H

#include <event2/event.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "base/conn.h"
#include "base/http.h"
#include "proxy/config.h"
#include "proxy/metrics.h"
#include "proxy/ratelimit.h"
#include "proxy/route.h"
#include "proxy/upstream.h"

struct px_discovery;
struct px_req;
struct px_pindex;
struct px_kvindex;
struct px_kvsub;
struct px_tkeys;
struct px_tcerts;
struct px_cidr;
struct px_pf_cache;
struct px_dp_table;
struct px_kv_decls;

/* The process-wide tables about backends that outlive a generation of
 * pools, each its own module's (its functions take it): server.c creates
 * them before the workers start and destroys them after they stopped. */
typedef struct px_registry {
    struct px_pf_cache *identities; /* owned: prefills' identities, --dispatch (dispatch.h) */
    struct px_dp_table *dp;         /* owned: data-parallel ranks and declared sizes (dp.h) */
    struct px_kv_decls *kv_decls;   /* owned: declared KV-event endpoints (kvevents.h) */
} px_registry;

/* One model pool at run time: its prefill and decode backends. */
typedef struct px_pset {
    char *name;        /* owned; "": the unnamed pool, which serves every model */
    px_strlist models; /* owned */
    px_pool prefill;
    px_pool decode;
    int dispatch; /* px_dispatch_mode (dispatch.h): how its P/D legs are sent */
    atomic_long admitted;            /* admission: requests sent on (not queued) */
    atomic_ullong backoff_until_ns;  /* admission: the latest decode back-off's end */
    atomic_ullong ttfb_ewma_us;      /* admission: time to first byte since dispatch, EWMA */
} px_pset;

/* A generation: the pools built from one configuration. Requests hold a
 * reference to the generation they started on and finish on it whatever
 * reloads happen meanwhile; the last reference frees its pools, and with
 * them the backends no newer generation kept. */
typedef struct px_gen {
    atomic_int refs;
    /* 1 for the configuration the server started with; an admin API change
     * made in place (reload.c) raises it while requests read it. */
    atomic_ullong id;
    px_pset *ps; /* owned array */
    size_t nps;
    int named;                 /* pools are named: requests route by their model */
    struct px_discovery *disc; /* control thread only */
} px_gen;

/* Drops a reference; the last frees the generation (its discovery must
 * have been detached). NULL is a no-op. */
void px_gen_release(px_gen *g);
/* The pool serving `model` (n bytes): the unnamed pool serves all; NULL
 * when the pools are named and none serves it. */
px_pset *px_gen_find(px_gen *g, const char *model, size_t n);
/* Whether the pool can take a request now, and when not, why (static
 * text). */
int px_pset_ready(const px_pset *p, int fallback_decode_only, const char **why);

typedef struct px_wctx px_wctx;

/* What every worker shares. */
typedef struct px_ctx {
    const px_config *cfg;     /* borrowed: the settings at start; listeners, limits, timeouts */
    pthread_mutex_t gen_mu;   /* guards gen, and gen->disc while read */
    px_gen *gen;              /* owned reference: the generation new requests use */
    char *upstream_auth;      /* owned: "Authorization: Bearer …" line, or NULL */
    int upstream_auth_forced; /* --upstream-api-key: always, over the client's */
    px_buf health_hdrs;       /* owned: header lines of health checks and load probes */
    unsigned char (*api_keys)[32]; /* owned: SHA-256 of each accepted client key */
    size_t napi_keys;
    struct px_tkeys *tkeys; /* owned: --tenant-keys (tenant.h); NULL: none */
    struct px_tcerts *tcerts; /* owned: --tenant-certs (tenant.h); NULL: none */
    struct px_cidr *trusted;  /* owned: --tenant-header-from, parsed (tenant.h) */
    size_t ntrusted;
    atomic_long inflight;  /* P/D requests in flight, all workers */
    atomic_int draining;   /* SIGTERM: readiness says no */
    /* Reloads of the --config file (SIGHUP, POST /admin/reload): how many
     * swapped in, how many failed (the running configuration stayed), and
     * whether the last one failed. Control thread writes, scrapes read. */
    atomic_ullong reloads_ok, reloads_failed;
    atomic_int last_reload_failed;
    px_conn_shared shared; /* memory budget and connection cap, all workers */
    px_wctx **workers;     /* owned array of borrowed pointers: each worker's context */
    int nworkers;
    px_tenants tenants;        /* owned: --tenant, with their rate-limit buckets */
    uint32_t *tenant_weights;  /* owned: tenants.cap + 1; a reload changes them (__atomic) */
    _Atomic(struct px_prio_node *) prio; /* owned: --priority-class maps, newest first
                                            (admission.h) */
    _Atomic int64_t pool_max_inflight; /* --pool-max-inflight, as the last reload set it */
    struct px_kvindex *kvindex; /* owned: what each engine caches; NULL without --kv-events-port
                                 * or a backend entry declaring kv_events_endpoint */
    px_kv_counters kvc;         /* the KV-event subscriber's totals */
    struct px_kvsub *kvsub;     /* borrowed: the subscriber, control thread only; NULL when off */
    px_sessions *sessions;      /* owned: sessions' decode backends; NULL: --session-ttl 0 */
    px_registry *reg;           /* borrowed: the process-wide tables (server.c's) */
    struct px_latmodel *lat;    /* owned: the live latency model (latency.h) */
    struct px_slo *slo;         /* owned: latency targets and their attainment (slo.h) */
} px_ctx;

/* What one worker thread owns for its requests; only that thread touches
 * it (the metrics are read by scrapes on any thread). */
struct px_wctx {
    px_ctx *ctx;             /* borrowed: outlives the worker */
    struct event_base *base; /* borrowed: the worker's loop */
    px_uploop *up;           /* owned: upstream connections */
    px_metrics metrics;      /* written by this thread only */
    struct px_req *reqs;     /* owned: requests alive, some without a client */
    size_t nreqs;
    px_spares spare_reqs;    /* owned: freed requests' blocks (5.5 KiB each) */
    struct px_pindex *pindex; /* owned: --disagg-min-tokens' prefix index; NULL until used */
    struct px_adm_worker *adm; /* owned: admission queue (admission.h) */
    struct px_tokcache *tokcache; /* owned: prompts' exact tokens (/tokenize); NULL until used */
};

/* The connection settings of a listener on the control thread (metrics,
 * admin API): small bodies, cfg's client timeouts, and `dispatch` with
 * `arg`. */
px_conn_cfg px_ctx_control_conn_cfg(const px_config *cfg,
                                    void (*dispatch)(void *arg, px_conn *c, const px_http_head *h,
                                                     px_buf *body),
                                    void *arg);

/* Sets up the credentials from cfg: the client keys of --api-key and
 * --api-key-file, the upstream Authorization line. 0, or -1 with err. */
int px_ctx_init(px_ctx *c, const px_config *cfg, char *err, size_t errlen);

/* The file a secret option names: a leading ${CREDENTIALS_DIRECTORY}/ (or
 * $CREDENTIALS_DIRECTORY/) is the directory systemd's LoadCredential= gives
 * the service (packaging/pdproxy.service), so that a unit running as a
 * dynamic user reads copies of root-only files. Fills out (cap bytes); 0,
 * or -1 with err when the variable is named but not set or the path does
 * not fit. `what` names the option in the message. */
int px_cred_path(const char *path, const char *what, char *out, size_t cap, char *err,
                 size_t errlen);
void px_ctx_cleanup(px_ctx *c);
/* The current generation, with a reference taken. Any thread. */
px_gen *px_ctx_gen(px_ctx *c);
/* Whether the request's Authorization is "Bearer <key>" with a key whose
 * SHA-256 is one of the n digests. Compared in constant time (of the
 * digests, so neither the key's length nor its bytes leak through timing). */
int px_bearer_matches(const px_http_head *h, const unsigned char (*keys)[32], size_t n);
/* Whether a client request carries an accepted key (--api-key,
 * --api-key-file, --tenant-keys), or no --api-key/--api-key-file is
 * configured (tenant keys alone require none: other callers are the
 * default tenant). */
int px_ctx_authorized(const px_ctx *c, const px_http_head *h);

#endif
