/* SPDX-License-Identifier: Apache-2.0 */
/* Backends, pools of them per role, their health, and the routing policies
 * that choose one for a request. The choice itself (px_pool_pick) is a pure
 * function of the pool's state and the request's routing key, so replicas of
 * the proxy that see the same backends route a prefix the same way; the one
 * exception is prefix_affinity's memory of where each block chain went
 * (px_pool.chains), which a prompt's first placement does not depend on. */
#ifndef PX_ROUTE_H
#define PX_ROUTE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "base/hash.h"     /* px_hash64: routing keys and the ring */
#include "proxy/latency.h" /* px_lat_cand: px_pool_snapshot's answer */

typedef enum {
    PX_POLICY_ROUND_ROBIN = 0,
    PX_POLICY_LEAST_INFLIGHT,
    PX_POLICY_POWER_OF_TWO,
    PX_POLICY_PREFIX_AFFINITY,
    PX_POLICY_LOAD_AWARE,
    PX_POLICY_KV_AWARE,
    /* The old prefix_affinity: the ring point of the prompt's first
     * --prefix-bytes bytes only (kept to compare, bench/kv_routing.py). */
    PX_POLICY_PREFIX_AFFINITY_BYTES,
    /* The prefill-decode pair with the lowest predicted time to first
     * token (latency.h): the request's plan names each pool's member
     * (px_pick.prefer); without a plan, as kv_aware. */
    PX_POLICY_LATENCY,
} px_policy;

/* Parses a policy name; -1 when unknown. */
int px_policy_parse(const char *s);
const char *px_policy_name(px_policy p);

/* Outcome of one upstream request, for passive health and metrics. */
typedef enum {
    PX_OUT_OK = 0,      /* 2xx */
    PX_OUT_CLIENT_ERR,  /* 4xx: the client's fault, never the backend's */
    PX_OUT_SERVER_ERR,  /* 5xx */
    PX_OUT_CONNECT_ERR, /* refused, unreachable, connect timeout */
    PX_OUT_RESET,       /* reset or closed before a complete answer */
    PX_OUT_TIMEOUT,     /* answer too slow */
    PX_OUT_CANCELLED,   /* the client left; says nothing about the backend */
    PX_OUT_COUNT
} px_outcome;

const char *px_outcome_name(px_outcome o);

typedef struct px_backend {
    char *name;      /* owned: "host:port" as shown in logs and metrics */
    char *url;       /* owned: "http[s]://host:port" */
    char *src;       /* owned: the configured URL this backend came from */
    char *authority; /* owned: "host:port" of the URL, sent as Host */
    int https;
    /* http://: where to connect. Set once when the backend is made, then
     * read without a lock. */
    struct sockaddr_storage addr;
    socklen_t addrlen; /* 0: the name did not resolve */
    uint64_t key_hash; /* of name: the place on the consistent-hash ring */
    atomic_int refs;   /* the pool's reference + one per request using it */
    atomic_int inflight;
    atomic_int healthy;          /* 1: receives traffic; 0: ejected */
    atomic_int fails;            /* consecutive failures, passive and active */
    atomic_int oks;              /* consecutive successful health checks */
    atomic_int ejections;        /* times ejected, for the passive backoff */
    atomic_int check_failing;    /* its last active health check failed */
    atomic_int ejected_by_check; /* the current ejection came from health checks */
    atomic_int drained;          /* admin API: takes no new request */
    atomic_ullong readmit_ns;    /* without active checks: when an ejected backend is tried again */
    /* load_aware: the engine's own figures, read by load probes of its /metrics. */
    atomic_int load_known;
    atomic_int waiting;
    atomic_int running;
    atomic_int kv_usage_milli;
    atomic_ullong backoff_until_ns; /* admission: answered 429/503; saturated until then */
    /* kv_aware: prompt tokens of the requests routed here and not done. */
    atomic_long tokens;
    atomic_ullong outcomes[PX_OUT_COUNT]; /* upstream requests by outcome */
    atomic_int echoes_id; /* its prefill answers' remote_request_id held the X-Request-Id sent */
    int check_busy;                       /* control thread only: a health check is in flight */
    int probe_busy; /* control thread only: a load probe (GET /metrics) is in flight */
} px_backend;

/* Drops a reference; the last one frees the backend. NULL is a no-op. */
void px_backend_release(px_backend *b);

typedef struct px_pool_cfg {
    px_policy policy;
    int unhealthy_after;
    int healthy_after;
    int active_checks; /* health checks run: readmission is theirs */
    size_t prefix_bytes;
    double load_factor; /* prefix_affinity bounded load: c in ceil(c * mean) */
    double kv_cache_weight; /* kv_aware: score per cached prompt token */
    double kv_load_weight;  /* kv_aware: score lost per queued or in-flight prompt token */
} px_pool_cfg;

typedef struct px_pool {
    const char *role; /* "prefill" or "decode" */
    px_pool_cfg cfg;
    pthread_mutex_t mu; /* guards the member list, cursor and ring */
    px_backend **b;     /* owned references */
    size_t n;
    size_t cap; /* of b */
    size_t rr;
    uint64_t *ring; /* prefix_affinity: sorted (point << 16 | member index) */
    size_t nring;
    /* prefix_affinity: which member each prompt block chain (128-byte
     * blocks, pindex.h) was last routed to; owned, made on the
     * first pick that has a whole block, under mu. */
    struct px_pindex *chains;
    unsigned long members_ver;  /* under mu: bumped by each change of the members */
    atomic_ullong panic_routed; /* picks made with every member ejected */
} px_pool;

void px_pool_init(px_pool *p, const char *role, const px_pool_cfg *cfg);
void px_pool_cleanup(px_pool *p);

/* Creates a backend for `url` (borrowed). connect_ip, when not NULL, pins
 * the connection to that address while requests keep the URL's host name.
 * The pool takes the new backend's only reference. */
px_backend *px_pool_add(px_pool *p, const char *url, const char *connect_ip);

/* A reload keeps the backends it keeps, with their health and counters:
 * the previous pool's members indexed by the URL (`src`) they were made
 * for, so that n backends are adopted in O(n log n) rather than one scan
 * of the old pool per URL. The index holds a reference to each member
 * until a pool adopts it or the index is destroyed. */
typedef struct px_adopt_index px_adopt_index;
px_adopt_index *px_adopt_index_create(px_pool *from); /* from NULL: an empty index */
/* Adds to p the members of the index made for `src` that no pool adopted
 * yet. Returns how many. */
size_t px_pool_adopt_indexed(px_pool *p, px_adopt_index *x, const char *src);
void px_adopt_index_destroy(px_adopt_index *x);

/* Adding members (px_pool_add, px_pool_adopt*) leaves the prefix_affinity
 * ring as it was: call this once after a batch of additions, before the
 * pool serves (a ring rebuilt per addition made start-up and reloads
 * quadratic). Pools of other policies build no ring. The ring is built
 * and sorted off the pool's lock and swapped in under it, so a DNS change
 * of hundreds of members does not stall the requests picking meanwhile. */
void px_pool_seal(px_pool *p);

/* One backend more, at once (the admin API's add): made for `url`
 * (borrowed), appended, and its virtual nodes merged into the ring of a
 * prefix_affinity pool (no re-sort). The pool takes the only reference;
 * the result is borrowed. NULL when the URL is malformed. */
px_backend *px_pool_insert(px_pool *p, const char *url);
/* Takes out, at once, the members made for `src` (the URL as configured),
 * at most 16 (one URL's addresses), dropping their virtual nodes from the
 * ring in one pass. Requests holding one finish on it. Returns how many. */
size_t px_pool_remove_src(px_pool *p, const char *src);
/* Sets the drained flag of the members made for `src` (Kubernetes: a
 * terminating endpoint). Returns how many. */
size_t px_pool_set_drained_src(px_pool *p, const char *src, int on);

/* A backend outside any pool (the sidecar's prefill named by a request),
 * with one reference for the caller. NULL when the URL is malformed. */
px_backend *px_backend_create(const char *url);

/* Replaces the members that were added for `url` by one per address in
 * `ips` (DNS discovery). Existing backends for a kept address stay, with
 * their health and counters. Returns how many members changed. */
size_t px_pool_sync_addrs(px_pool *p, const char *url, const char *host, int port, char **ips,
                          size_t nips);

/* What a request brings to the choice. */
typedef struct px_pick {
    /* prefix_affinity: the prompt's bytes (its block chain is hashed);
     * prefix_affinity_bytes: its first --prefix-bytes bytes. */
    const void *key;
    size_t key_len;
    px_backend *const *exclude; /* already tried; avoided while others remain */
    size_t nexclude;
    /* kv_aware: the prompt's exact tokens (NULL: unknown, only load counts)
     * and the index of what each engine caches (NULL: none). */
    struct px_kvindex *kv;
    const uint32_t *tok;
    size_t ntok;
    size_t *cached; /* out, when not NULL: the chosen backend's cached prompt tokens (the
                     * engine's rule: whole blocks, never the prompt's last token) */
    uint64_t kv_extra; /* the prompt's LoRA key (px_kvindex_request_extra), 0: base model */
    uint64_t kv_salt;  /* its cache_salt's key (px_kv_salt_key), 0: none */
    /* Sessions: a conversation (its key, 0: none) stays on the backend it
     * was routed to while that one is usable and not overloaded (over
     * ceil(load_factor * mean in-flight)). */
    struct px_sessions *sessions;
    uint64_t session;
    /* latency: the member the request's plan chose (its key_hash; 0: none)
     * and the prompt tokens it reuses; taken when it is a candidate. */
    uint64_t prefer;
    size_t prefer_cached;
} px_pick;

/* Which backend (its key_hash) each session was last routed to: at most
 * `entries`, forgotten after ttl seconds unused; any thread. */
typedef struct px_sessions px_sessions;
px_sessions *px_sessions_create(size_t entries, double ttl);
void px_sessions_destroy(px_sessions *s); /* NULL is a no-op */
/* 1 with *backend_key when the session is known and fresh. */
int px_sessions_get(px_sessions *s, uint64_t session, uint64_t *backend_key);
void px_sessions_put(px_sessions *s, uint64_t session, uint64_t backend_key);

/* kv_aware's score of backend b for a prompt of which it caches `cached`
 * tokens: cache weight * cached - load weight * b's uncached prompt tokens
 * queued or in flight. With both weights 1 the best score is the engine
 * that would finish this prompt first (its queue plus what it lacks of
 * this prompt). */
double px_kv_score(const px_pool_cfg *c, size_t cached, long load_tokens);

/* Of a prompt of ntok tokens whose first `blocks` whole blocks of `bs`
 * tokens an engine holds, the tokens it reuses: vLLM recomputes the last
 * prompt token, so at most (ntok - 1) / bs blocks count
 * (vllm/v1/core/kv_cache_manager.py, get_computed_blocks:
 * max_cache_hit_length = request.num_tokens - 1). */
size_t px_kv_reusable(size_t blocks, size_t bs, size_t ntok);

/* kv_aware: counts `tokens` more (or, negative, fewer) prompt tokens as
 * queued or in flight on b. px_pool_pick charges a kv_aware pick with the
 * prompt's tokens the chosen engine does not cache (ntok - *cached: what it
 * computes, what the TTFT of requests behind it waits for); the caller
 * takes them back when the request leaves b. */
void px_backend_charge(px_backend *b, long tokens);

/* Chooses a healthy backend and returns it with a reference taken and its
 * in-flight count raised: hand it back with px_backend_done(). When every
 * member is ejected, the ones ejected for request failures (not those
 * failing their active health checks) are chosen from anyway, and counted
 * (panic routing: passive ejection must never turn errors into an outage).
 * Returns NULL when no member can be chosen; *nmembers says how many there
 * are. */
px_backend *px_pool_pick(px_pool *p, const px_pick *k, size_t *nmembers);

/* What each member a request could be routed to now offers it (the
 * latency policy's plan, latency.h): up to `cap` eligible members not
 * excluded by k, with their queued tokens, in-flight requests and, when k
 * has the prompt's tokens and the KV index, the prompt tokens each would
 * reuse (`pr`: the prompt's keys, hashed lazily and shared between the
 * two pools' snapshots). Returns how many were written; 0 when none is
 * eligible (px_pool_pick's panic routing then decides). */
struct px_kv_prompt;
size_t px_pool_snapshot(px_pool *p, const px_pick *k, struct px_kv_prompt *pr, px_lat_cand *out,
                        size_t cap);

/* Ends one request on b: lowers in-flight, counts the outcome, feeds passive
 * health, drops the reference. A success readmits an ejected backend. */
void px_backend_done(px_pool *p, px_backend *b, px_outcome o);
/* Takes b for a request as px_pool_pick would (a reference and an
 * in-flight count), for a backend the request named itself (sidecar mode);
 * hand it back with px_backend_done(). */
void px_backend_take(px_backend *b);
/* The same, but a failure is not counted toward --unhealthy-after: for a
 * retry of one request on a backend that already failed it (one request's
 * retries are one failure). */
void px_backend_done_repeat(px_pool *p, px_backend *b, px_outcome o);

/* Active health check result for b. */
void px_backend_check(px_pool *p, px_backend *b, int ok);

/* A snapshot of the members with a reference on each; release each with
 * px_backend_release() and free the array. */
px_backend **px_pool_members(px_pool *p, size_t *n);
/* The same for slice `slice` of `nslices` by position: the members at
 * [n * slice / nslices, n * (slice + 1) / nslices), O(n / nslices). The
 * health checker's spread of its checks over its interval (a change of
 * the members meanwhile may move one member past its slice for a round). */
px_backend **px_pool_members_slice(px_pool *p, unsigned slice, unsigned nslices, size_t *n);

/* Number of members, and of healthy ones. */
/* Why a pool with members has none usable, for error messages:
 * ", all ejected", ", all drained" or ", all ejected or drained"; "" when
 * it has no member. */
const char *px_pool_unusable_why(px_pool *p);

void px_pool_counts(px_pool *p, size_t *n, size_t *healthy);
/* Members a request could be routed to now: the healthy ones or, when
 * none is, those panic routing would use. */
size_t px_pool_usable(px_pool *p);

/* The connect addresses of pools' members, as a hash set: which upstream
 * connections still lead to a backend after a change, answered in O(1)
 * per connection (a scan of every pool per connection was O(connections *
 * members) on the workers' threads). Built on the control thread, then
 * read-only and shared by reference. */
typedef struct px_addrset px_addrset;
px_addrset *px_addrset_create(void); /* one reference, for the caller */
void px_addrset_add_pool(px_addrset *s, px_pool *p);
int px_addrset_has(const px_addrset *s, const struct sockaddr *sa, socklen_t len);
px_addrset *px_addrset_ref(px_addrset *s);
void px_addrset_release(px_addrset *s); /* NULL is a no-op */

/* Splits "http[s]://host[:port][/]" (host may be a bracketed IPv6 literal).
 * Returns 0, or -1 when malformed. */
int px_url_split(const char *url, char *host, size_t hostcap, int *port, int *https);

#endif
