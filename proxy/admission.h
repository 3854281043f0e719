/* SPDX-License-Identifier: Apache-2.0 */
/* Admission control (issue 26): the bounded queue in front of saturated
 * pools, with priority classes and fairness between tenants inside a class.
 *
 * One queue per worker thread. A queued request stays on the thread that
 * owns its client connection, so it is dispatched by that thread's loop
 * and nothing crosses threads: pdproxy's libevent bases are not built with
 * evthread locking, and handing a request (its px_conn, timers, upstream
 * pool) to another loop would need it. The limits that decide saturation
 * are shared atomics (a pool's admitted count, its backends' back-off), so
 * a slot freed on one thread is seen by every thread: each worker
 * dispatches at once when one of its own requests ends, and when a request
 * ending on another worker leaves a slot its own queue did not take, that
 * worker wakes it through an eventfd (one per worker), so dispatch out of
 * a full queue never waits for a timer. A longer timer re-checks while the
 * queue is not empty, for back-offs ending and engines' figures. The bounds in requests and
 * bytes are per worker: --queue-max / threads each (at least 1).
 *
 * Order: the lowest class first (priority 0 before 1, as vLLM serves a
 * lower `priority` first), or, when --priority-class gives every class a
 * share, rounds in which each class is served up to its share (no class
 * starves); a request's class is never better than its tenant's floor=
 * allows (the client's claim alone decides nothing); inside a class, deficit round robin between
 * tenants with a cost of one request and a quantum of the tenant's weight:
 * a tenant of weight w is dispatched up to w requests in a row, then the
 * next tenant with requests waiting. Unit cost, because a request's real
 * cost (its tokens) is known only after its answer; DRR rather than
 * virtual time because each dispatch is O(1) with integer credit and no
 * clock. Inside a tenant and class: first in, first out. The queue
 * (px_admq) is pure; the gate below (px_adm_enter and friends) runs it on
 * a worker's loop. */
#ifndef PX_ADMISSION_H
#define PX_ADMISSION_H

#include <stddef.h>
#include <stdint.h>

#include "proxy/prio.h"
#include "proxy/ratelimit.h"


typedef struct px_adm_item {
    struct px_adm_item *prev, *next; /* in its flow */
    int cls;                         /* 0..PX_ADM_CLASSES-1 */
    size_t tenant;                   /* index into the queue's weights */
    size_t bytes;                    /* held while queued, for the byte bound */
    int queued;                      /* in a queue now */
    void *owner;                     /* the caller's: the request */
} px_adm_item;

typedef struct px_adm_flow {
    px_adm_item *head, *tail;
    struct px_adm_flow *anext, *aprev; /* in the class's active list */
    uint32_t credit;                   /* requests left in this turn */
    int active;
} px_adm_flow;

typedef struct px_adm_class {
    px_adm_flow *flows; /* owned: one per tenant; NULL until the class's first request */
    px_adm_flow *ahead, *atail;
    size_t nactive;
    size_t n;
} px_adm_class;

typedef struct px_admq {
    px_adm_class cls[PX_ADM_CLASSES];
    const uint32_t *weights; /* borrowed: ntenants */
    size_t ntenants;
    size_t n, bytes;          /* queued now */
    size_t max_n, max_bytes;  /* bounds; max_bytes 0: none */
    uint64_t pushed, dropped; /* counters for tests and metrics */
    /* --priority-class shares (px_admq_set_shares); all 0: strict order. */
    int shares;
    uint32_t share[PX_ADM_CLASSES];
    uint32_t ccredit[PX_ADM_CLASSES]; /* what each class has left of this round */
} px_admq;


void px_admq_init(px_admq *q, const uint32_t *weights, size_t ntenants, size_t max_n,
                  size_t max_bytes);
/* The queue must be empty (every item removed or popped). */
void px_admq_cleanup(px_admq *q);
/* Queues `it` (cls, tenant, bytes, owner set by the caller). 0, or -1 when
 * a bound would be passed (nothing queued). */
int px_admq_push(px_admq *q, px_adm_item *it);
/* Takes a queued item out (its client left, its deadline passed). A no-op
 * when it is not queued. */
void px_admq_remove(px_admq *q, px_adm_item *it);
/* The classes' shares of the map m (NULL or no shares: strict order). */
void px_admq_set_shares(px_admq *q, const px_prio_map *m);
/* The next item to dispatch among those `ok` accepts (ok NULL: all):
 * classes in order (strictly, or by their shares in rounds), tenants by
 * DRR, each tenant's oldest first; a tenant whose oldest is not accepted
 * is passed over this time. NULL when none. */
px_adm_item *px_admq_pop(px_admq *q, int (*ok)(void *arg, px_adm_item *it), void *arg);


/* ---------- the gate, on a worker's loop ---------- */

#include "base/http.h"
#include "proxy/ctx.h"

/* A request's part in admission, embedded in it. */
typedef struct px_adm_req {
    px_adm_item it;      /* it.owner: the request */
    px_pset *ps;         /* borrowed: the pool it waits for or was sent to */
    size_t tenant;       /* index into ctx->tenants */
    int sent;            /* counted in ps->admitted */
    struct event *timer; /* owned while queued: its deadline */
    uint64_t t_enq;      /* when queued; 0: never */
    uint64_t t_sent;     /* when sent on (admitted or dispatched); 0: not yet */
    uint64_t deadline_ns; /* the end of its wait, first queued or not: a requeue keeps it */
    uint64_t wait_ns;    /* time spent queued */
    px_tokscan tok;      /* the answer's total_tokens, for --tenant tpm= */
    int count_tokens;    /* the tenant has a tpm= limit */
    uint64_t tok_reserved; /* tpm units taken at admission, settled when it ends */
    uint64_t tok_cap;      /* the most tokens its usage may count (prompt bytes + max_tokens) */
    int answered;          /* decode's answer passed (px_adm_answer) */
    /* Who it is (tenant.h): set by px_adm_enter. */
    const char *peer;       /* borrowed, set by the caller: the client's address text */
    const struct x509_st *cert; /* borrowed, set by the caller: the client's verified
                                 * certificate (px_conn_client_cert), read by px_adm_enter
                                 * only; NULL: none */
    struct px_body_idx *bx; /* borrowed, set by the caller: the body's members (bodyidx.h),
                             * read by px_adm_enter, rebuilt by px_adm_body; NULL: searched */
    int keyed;              /* it presented an accepted key */
    unsigned char key[32];  /* that key's SHA-256 */
    char salt[33];          /* the cache_salt engines get ("": none); see px_adm_salted */
    int salt_own;           /* the salt is the client's own (--cache-salt off): body untouched */
    uint64_t salt_key;      /* the salt's key in the KV index (kvindex.h), 0: none */
    int strip_usage;        /* the proxy asked decode for the usage chunk: drop it */
    void *w;             /* borrowed: the px_wctx it entered on */
    void (*go)(void *owner);     /* dispatched out of the queue */
    void (*expire)(void *owner); /* its deadline passed while queued */
    /* NULL, or whether the request itself may leave the queue now, asked
     * before its pool's room (a request waiting for its predicted latency
     * to fit its target, predict.h). */
    int (*ready)(void *owner);
} px_adm_req;

/* What a worker holds for admission: its queue and the timer that looks
 * again while requests wait. */
typedef struct px_adm_worker px_adm_worker;
px_adm_worker *px_adm_worker_create(px_wctx *w);
void px_adm_worker_destroy(px_adm_worker *a); /* its queue must be empty; NULL: no-op */
/* The worker stops: requests ending no longer dispatch queued ones. */
void px_adm_worker_stop(px_adm_worker *a);

typedef enum { PX_ADM_GO = 0, PX_ADM_QUEUED, PX_ADM_REFUSED } px_adm_verdict;

/* Admits a P/D request for pool ps: who it is (its tenant from its key,
 * or from --tenant-header when a trusted gateway sent it; 403 when
 * another peer sent that header), its cache_salt, its tenant's rate limits
 * (tpm= reserves the request's most tokens), then the pool's saturation.
 * GO: send it on now (counted in ps->admitted). QUEUED: a->go or
 * a->expire will be called from this worker's loop. REFUSED: answer
 * *status (403, 429 or 503) with the header lines in extra and the message
 * in msg. go and expire (and it.owner, peer) must be set. */
px_adm_verdict px_adm_enter(px_wctx *w, px_adm_req *a, px_pset *ps, const px_http_head *h,
                            const char *body, size_t blen, int *status, char *extra,
                            size_t extra_cap, char *msg, size_t msg_cap);

/* The request ended (answered, failed, client gone): out of the queue or
 * its pool slot given back, and the queue looked at again. Idempotent. */
void px_adm_leave(px_wctx *w, px_adm_req *a);

/* Whether a request that an engine refused with `status` may wait again
 * (px_adm_requeue): 429 or 503, a queue and --engine-backoff configured,
 * and the back-off over before its deadline (--queue-timeout or
 * x-queue-timeout, counted from its arrival). */
int px_adm_can_requeue(const px_adm_req *a, int status);
/* Puts a request that was sent on back in the queue, its pool slot given
 * back and its place by class and tenant as on arrival; a->go (which the
 * caller may change) or a->expire is called later from this worker's loop,
 * and a->go may run before this returns when the pool has room. 0, or -1
 * (queue full, deadline passed): nothing changed but the slot given back. */
int px_adm_requeue(px_wctx *w, px_adm_req *a);

/* The request's priority class: the priority header (a number or a
 * --priority-class name), else the body's "priority", else 0, through
 * the classes in effect. Any thread. */
int px_adm_request_class(px_ctx *c, const px_http_head *h, const char *body, size_t blen);

/* Decode's answer passes: tokens counted for the tenant's tpm when it
 * ends (px_adm_leave settles the reservation on them, clamped to what the
 * request could have produced; no usage seen: the reservation stands when
 * an answer passed, else it is given back). */
void px_adm_answer(px_adm_req *a, const char *p, size_t n);

/* The body engines get for an admitted request: with the salt px_adm_enter
 * chose (the client's cache_salt members removed, "cache_salt":"<salt>"
 * added; not with the client's own), and, on a `usage_route` (chat and
 * completions) whose tenant counts tokens, a stream that does not ask for
 * usage asks for it (rewrite.h px_rewrite_include_usage; a->strip_usage
 * set: its usage chunk is dropped before the client, usage.h). Returns 1
 * when *body was replaced (a->bx, when set, indexes the new one), 0 when it
 * goes as it is. */
int px_adm_body(px_adm_req *a, int usage_route, struct px_buf *body);

/* The KV index's key of a request's salt (kvindex.h), 0: none. */
uint64_t px_adm_salt_key(const px_adm_req *a);

/* Decode answered `status`: 429 and 503 (a full engine queue) put the
 * backend in back-off for --engine-backoff. Returns 1 when the answer is
 * such a refusal (not a failure of the backend), else 0. */
int px_adm_engine_status(px_ctx *c, px_pset *ps, px_backend *b, int status);

/* The tenant's x-ratelimit-* lines for a successful answer ("" without
 * limits). */
void px_adm_ratelimit_headers(px_ctx *c, const px_adm_req *a, char *out, size_t cap);

/* Why a pool is saturated: bits of px_pool_saturation's answer. */
enum {
    PX_SAT_INFLIGHT = 1, /* --pool-max-inflight requests sent on */
    PX_SAT_BACKOFF = 2,  /* every prefill, or every decode, answered 429/503 within
                            --engine-backoff */
    PX_SAT_WAITING = 4,  /* decodes report --saturate-waiting requests waiting */
    PX_SAT_KV = 8,       /* decodes report --saturate-kv-usage of their KV cache used */
    PX_SAT_TTFB = 16,    /* the pool's time-to-first-byte EWMA is past --saturate-ttfb */
};
#define PX_SAT_SIGNALS 5
/* The name of bit i (0..PX_SAT_SIGNALS-1): "inflight", "backoff", ... */
const char *px_sat_signal_name(int i);

/* The signals that saturate the pool now, 0 when none. Engines' figures
 * (backoff, waiting, KV usage) count when every usable decode backend is
 * full by one of them; the bits say which were seen. The TTFB signal holds
 * only while some request is sent on: with none, one goes through and its
 * first byte updates the average, so a slow spell cannot close the pool
 * for good. Any thread. */
unsigned px_pool_saturation(px_ctx *c, px_pset *ps, uint64_t now);
/* px_pool_saturation(...) != 0. */
int px_pool_saturated(px_ctx *c, px_pset *ps, uint64_t now);

/* Decode's first byte for a request admitted by px_adm_enter: its time
 * since dispatch goes into the pool's TTFB average (an EWMA, weight 1/8
 * for each new sample), which --saturate-ttfb compares. */
void px_adm_first_byte(px_adm_req *a);

/* Whether load probes must read the decode engines' /metrics for
 * admission (--saturate-waiting, --saturate-kv-usage). */
int px_adm_wants_engine_load(const px_config *cfg);

/* New admission settings at run time (a reload from the file, or POST
 * /admin/admission), on the control thread while workers admit: the
 * tenants become those of `specs` (as --tenant) by px_tenants_apply:
 * known ones get their new weight and limits at once, queued requests
 * included; new ones are added; missing ones are removed (their queued
 * requests keep their place, served at weight 1; new requests naming them
 * go to the default tenant). *note gets "tenants_added=N
 * tenants_removed=N". `max_inflight` >= 0 becomes --pool-max-inflight
 * (< 0: unchanged). 0, or -1 with err (a bad spec, or no free tenant
 * slot: nothing changed). */
int px_adm_reconfigure(px_ctx *c, char *const *specs, size_t n, int64_t max_inflight,
                       char *note, size_t note_cap, char *err, size_t errlen);

/* New --priority-class specs at run time (reload, POST /admin/admission),
 * on the control thread: a new map is published with one atomic pointer
 * store, and workers load the pointer once per request (RCU style); the
 * old maps are kept until the process ends (a few hundred bytes a
 * change), so no worker can read freed memory without a grace period.
 * Queued requests keep the class they were given on arrival. n == 0: the
 * default mapping. 0, or -1 with err (nothing changed). */
int px_adm_set_classes(px_ctx *c, char *const *specs, size_t n, char *err, size_t errlen);
/* The classes in effect; never NULL after px_ctx_init. Any thread. */
const px_prio_map *px_adm_classes(px_ctx *c);

/* The admission series of each pool of the current generation for
 * /metrics: pdproxy_pool_saturated{pool,signal} and
 * pdproxy_pool_ttfb_ewma_seconds{pool}. */
struct px_buf;
void px_adm_render_metrics(px_ctx *c, struct px_buf *o);

#endif
