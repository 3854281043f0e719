/* SPDX-License-Identifier: Apache-2.0 */
/* Per-tenant rate limits (issue 26): requests per minute and tokens per
 * minute, each a token bucket kept as one atomic word so that every worker
 * thread takes from it without a lock. The bucket is the generic cell rate
 * algorithm (GCRA): the word is the "theoretical arrival time" (TAT) of the
 * next unit; taking n units moves it n * interval later, refused when it
 * would run more than a full minute (the burst) ahead of now. That is a
 * token bucket of capacity `limit` refilled at limit/minute, with one
 * compare-and-swap per take. Tenants come from --tenant specs; a request's
 * tenant comes from its credentials (tenant.h, admission.c): unknown
 * callers are the default tenant's (weight 1 and no limits unless a spec
 * named "default" sets them). Pure apart from the atomics: no loop, no I/O. */
#ifndef PX_RATELIMIT_H
#define PX_RATELIMIT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define PX_RL_WINDOW_NS 60000000000ULL /* the limits are per minute */
/* The tenant table's slots: at least this many, and twice those configured
 * at start, so tenants can be added at run time. */
#define PX_TENANT_SLOTS 256

typedef struct px_bucket {
    /* A reload may change these two (px_bucket_set) while workers take. */
    _Atomic uint64_t limit;       /* units per minute; 0: unlimited */
    _Atomic uint64_t interval_ns; /* ns per unit: window / limit */
    _Atomic uint64_t tat; /* when the bucket is full again, in px_now_ns() time */
} px_bucket;

void px_bucket_init(px_bucket *b, uint64_t per_minute);
/* A new limit for a bucket in use (any thread): what was taken stays
 * taken, refilled at the new rate from now on. */
void px_bucket_set(px_bucket *b, uint64_t per_minute);
/* Takes n units at `now` when they fit: 1. Else 0, nothing taken, and
 * *retry_ns (when not NULL) says how long until they fit. */
int px_bucket_take(px_bucket *b, uint64_t now, uint64_t n, uint64_t *retry_ns);
/* Takes n units whether they fit or not (tokens counted after the answer):
 * the bucket may go into debt, and takes refuse until it is paid back. */
void px_bucket_charge(px_bucket *b, uint64_t now, uint64_t n);
/* Units that may be taken now (0..limit). */
uint64_t px_bucket_remaining(px_bucket *b, uint64_t now);
/* ns until the bucket is full again. */
uint64_t px_bucket_reset_ns(px_bucket *b, uint64_t now);

typedef struct px_tenant {
    char *name;      /* owned; never changes once the slot is published */
    _Atomic uint32_t weight; /* share of dispatch out of the admission queue */
    _Atomic int live;        /* requests naming it find it; 0: removed at run time */
    px_bucket rpm;
    px_bucket tpm;
    /* floor=P: the best (lowest) priority its requests may claim; a claim
     * of a better one is served as P. has_floor 0: any. */
    _Atomic long long floor;
    _Atomic int has_floor;
} px_tenant;

/* The tenants, shared by all workers: a table of `cap` slots and the
 * default tenant (name "", weight 1, no limits) at v[cap], so an index is
 * always valid. Tenants are added and removed at run time
 * (px_tenants_apply) without a lock on the workers' path: slots are
 * filled in order, and a slot is published by a release store of n after
 * its name, weight and buckets are set; workers read n with acquire and
 * never see a half-made slot. A slot is never freed nor given another
 * name while the process runs, so a worker holding an index (a queued or
 * running request) needs no reference count or grace period; a removed
 * tenant's slot is marked not live (weight 1, no limits) and revived when
 * its name comes back. The price: at most `cap` distinct names over the
 * process's life (a restart reclaims removed ones). One writer at a time
 * (the control thread). */
typedef struct px_tenants {
    px_tenant *v;     /* owned, cap + 1 */
    size_t cap;       /* slots */
    _Atomic size_t n; /* slots published (live or removed) */
} px_tenants;

/* The default tenant's index. */
static inline size_t px_tenants_default(const px_tenants *t) {
    return t->cap;
}

/* Parses the n --tenant specs "NAME[:weight=W][:rpm=N][:tpm=N][:floor=P]"
 * (each setting once); the spec
 * named "default" sets the default tenant's weight and limits. 0, or -1
 * with err naming the spec and what is wrong (t untouched). */
int px_tenants_parse(char *const *specs, size_t n, px_tenants *t, char *err, size_t errlen);
void px_tenants_cleanup(px_tenants *t);
/* Checks one spec as px_tenants_parse would. 0, or -1 with err. */
int px_tenant_spec_check(const char *spec, char *err, size_t errlen);
/* Grows a parsed table to at least `cap` slots, before workers share it.
 * The default tenant moves to v[cap]. */
void px_tenants_reserve(px_tenants *t, size_t cap);
/* Makes t's tenants those of `nt` (parsed specs), while workers use t:
 * tenants in both get nt's weight and limits (their buckets keep what was
 * taken); tenants of nt new to t take a free slot; live tenants missing
 * from nt are removed: requests naming them go to the default tenant from
 * now on, while their queued and running requests keep their index (and
 * their place in the queue), served at weight 1 without limits; the
 * default tenant takes nt's default settings. weights[]
 * (cap + 1, read by the queues with __atomic loads) follow. *added and
 * *removed (may be NULL) count the changes. 0, or -1 with err when the new
 * names need more free slots than are left (nothing changed). One writer
 * at a time. */
int px_tenants_apply(px_tenants *t, const px_tenants *nt, uint32_t *weights, size_t *added,
                     size_t *removed, char *err, size_t errlen);
/* The index of the live tenant named name[0..n); the default when none.
 * Any thread, no lock. */
size_t px_tenants_find(const px_tenants *t, const char *name, size_t n);

/* Gives back n units taken before (a reservation not used): the bucket
 * never becomes fuller than full. */
void px_bucket_refund(px_bucket *b, uint64_t now, uint64_t n);

/* Why a request is refused by its tenant's limits. */
typedef enum { PX_RL_OK = 0, PX_RL_REQUESTS, PX_RL_TOKENS, PX_RL_TOO_LARGE } px_rl_verdict;

/* Takes `tokens` from the tenant's token bucket (a reservation: the
 * request's most tokens, settled by px_tenant_settle once its usage is
 * known) and one request from its request bucket, both or neither.
 * tokens 0: the token bucket must only not be in debt. TOO_LARGE: more
 * tokens than the limit allows in a minute, never admitted. On refusal
 * *retry_ns says when to retry (not for TOO_LARGE). */
px_rl_verdict px_tenant_admit(px_tenant *t, uint64_t now, uint64_t tokens, uint64_t *retry_ns);
/* A request that reserved `reserved` tokens used `used`: the difference is
 * charged (the bucket may go into debt) or given back. */
void px_tenant_settle(px_tenant *t, uint64_t now, uint64_t reserved, uint64_t used);

/* The x-ratelimit-* header lines OpenAI clients read, for a tenant with a
 * limit ("" for one without), appended to out (NUL-terminated, truncated
 * to cap). */
void px_tenant_headers(px_tenant *t, uint64_t now, char *out, size_t cap);

/* Finds usage's "total_tokens": N in an answer passing in pieces (JSON or
 * SSE events; the last number seen wins). Keeps a few bytes across pieces
 * so a key split between two reads is still found. */
typedef struct px_tokscan {
    char tail[32];
    size_t ntail;
    uint64_t total; /* the last total_tokens seen; 0: none */
} px_tokscan;

void px_tokscan_feed(px_tokscan *s, const char *p, size_t n);

#endif
