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
 * dispatches at once when one of its own requests ends, and re-checks on a
 * short timer while its queue is not empty. The bounds in requests and
 * bytes are per worker: --queue-max / threads each (at least 1).
 *
 * Order: the lowest class first (priority 0 before 1, as vLLM serves a
 * lower `priority` first); inside a class, deficit round robin between
 * tenants with a cost of one request and a quantum of the tenant's weight:
 * a tenant of weight w is dispatched up to w requests in a row, then the
 * next tenant with requests waiting. Unit cost, because a request's real
 * cost (its tokens) is known only after its answer; DRR rather than
 * virtual time because each dispatch is O(1) with integer credit and no
 * clock. Inside a tenant and class: first in, first out. Pure: no loop. */
#ifndef PX_ADMISSION_H
#define PX_ADMISSION_H

#include <stddef.h>
#include <stdint.h>

#define PX_ADM_CLASSES 16 /* priorities 0..15; outside that range, clamped */

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
    px_adm_flow *flows; /* owned: one per tenant */
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
} px_admq;

/* Maps a priority (vLLM's `priority`: lower first) to a class. */
int px_adm_class_of(long long priority);

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
/* The next item to dispatch among those `ok` accepts (ok NULL: all):
 * classes in order, tenants by DRR, each tenant's oldest first; a tenant
 * whose oldest is not accepted is passed over this time. NULL when none. */
px_adm_item *px_admq_pop(px_admq *q, int (*ok)(void *arg, px_adm_item *it), void *arg);

#endif
