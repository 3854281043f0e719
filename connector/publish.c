/* SPDX-License-Identifier: Apache-2.0 */
/* Producer bookkeeping: the table of published requests (hash by request id),
 * kvc_publish / kvc_unpublish, and expiry.  Release by notification is in
 * notify.c.
 *
 * Expiry: a list sorted by deadline (usually appended at the tail, since
 * most requests use the agent's expiry_ms), swept on each progress; the
 * head's deadline feeds the agent's timer. */
#include "connector/kvc_int.h"

#include <stdlib.h>
#include <string.h>

#define INITIAL_BUCKETS 1024

static uint64_t hash(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

kvc_status_t kvc_pubtab_init(kvc_pubtab_t *t) {
    memset(t, 0, sizeof(*t));
    t->buckets = calloc(INITIAL_BUCKETS, sizeof(*t->buckets));
    if (!t->buckets) return KVC_ERR_NO_MEMORY;
    t->nbuckets = INITIAL_BUCKETS;
    return KVC_OK;
}

void kvc_pub_free(kvc_pub_t *p) {
    if (!p) return;
    kvc_cuda_capture_put(p->cap);
    free(p->holds);
    free(p->id);
    free(p->blocks);
    free(p->sorted);
    free(p->ready);
    free(p);
}

void kvc_pubtab_cleanup(kvc_pubtab_t *t) {
    while (t->draining) {
        kvc_pub_t *p = t->draining;
        t->draining = p->dnext;
        kvc_pub_free(p);
    }
    for (size_t i = 0; t->buckets && i < t->nbuckets; i++) {
        kvc_pub_t *p = t->buckets[i];
        while (p) {
            kvc_pub_t *nx = p->hnext;
            kvc_pub_free(p);
            p = nx;
        }
    }
    free(t->buckets);
    memset(t, 0, sizeof(*t));
}

kvc_pub_t *kvc_pubtab_find(kvc_pubtab_t *t, const char *id, size_t len) {
    for (kvc_pub_t *p = t->buckets[hash(id, len) % t->nbuckets]; p; p = p->hnext)
        if (strlen(p->id) == len && !memcmp(p->id, id, len)) return p;
    return NULL;
}

static void grow(kvc_pubtab_t *t) {
    size_t nb = t->nbuckets * 2;
    kvc_pub_t **b = calloc(nb, sizeof(*b));
    if (!b) return; /* keep the longer chains */
    for (size_t i = 0; i < t->nbuckets; i++) {
        kvc_pub_t *p = t->buckets[i];
        while (p) {
            kvc_pub_t *nx = p->hnext;
            size_t k = hash(p->id, strlen(p->id)) % nb;
            p->hnext = b[k];
            b[k] = p;
            p = nx;
        }
    }
    free(t->buckets);
    t->buckets = b;
    t->nbuckets = nb;
}

static void expiry_insert(kvc_pubtab_t *t, kvc_pub_t *p) {
    kvc_pub_t *at = t->etail;
    while (at && at->deadline_ns > p->deadline_ns)
        at = at->eprev;
    p->eprev = at;
    p->enext = at ? at->enext : t->ehead;
    if (p->enext)
        p->enext->eprev = p;
    else
        t->etail = p;
    if (at)
        at->enext = p;
    else
        t->ehead = p;
}

static void expiry_remove(kvc_pubtab_t *t, kvc_pub_t *p) {
    if (p->eprev)
        p->eprev->enext = p->enext;
    else
        t->ehead = p->enext;
    if (p->enext)
        p->enext->eprev = p->eprev;
    else
        t->etail = p->eprev;
    p->eprev = p->enext = NULL;
}

void kvc_pubtab_insert(kvc_pubtab_t *t, kvc_pub_t *p) {
    if (t->count >= t->nbuckets) grow(t);
    size_t k = hash(p->id, strlen(p->id)) % t->nbuckets;
    p->hnext = t->buckets[k];
    t->buckets[k] = p;
    t->count++;
    expiry_insert(t, p);
}

void kvc_pubtab_remove(kvc_pubtab_t *t, kvc_pub_t *p) {
    kvc_pub_t **pp = &t->buckets[hash(p->id, strlen(p->id)) % t->nbuckets];
    while (*pp && *pp != p)
        pp = &(*pp)->hnext;
    if (*pp) {
        *pp = p->hnext;
        t->count--;
    }
    p->hnext = NULL;
    expiry_remove(t, p);
}

static int cmp_u64(const void *x, const void *y) {
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? -1 : a > b;
}

bool kvc_pub_has_run(const kvc_pub_t *p, uint64_t start, uint64_t count) {
    /* The run's blocks are consecutive ids: find the first in the sorted
     * list, then they must follow it one by one. */
    if (count == 0 || count > p->n) return false;
    size_t lo = 0, hi = p->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (p->sorted[mid] < start)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo >= p->n || p->sorted[lo] != start) return false;
    uint64_t want = start;
    for (size_t i = lo; i < p->n && want - start < count; i++) {
        if (p->sorted[i] == want - 1 && want != start) continue; /* repeated id */
        if (p->sorted[i] != want) return false;
        want++;
    }
    return want - start == count;
}

/* CUDA regions: the blocks must be captured before any consumer can read
 * them.  The private streams wait for the engine's event or stream (never a
 * sync of the engine's own stream).  Staged regions need nothing more: their
 * device -> pool copies are queued on those streams when a pull is served,
 * behind this wait, so kvc_publish returns without a host sync.  Regions
 * registered directly are read by UCX outside any stream, so a host sync
 * of that wait ends the capture.  Exported ones (CUDA IPC, ipc.c) are read
 * by consumers' copies only after a HOLD is confirmed (push.c): an event
 * recorded after the wait (*cap) is checked there, and waited for on the
 * host only if the writes still run then.  On failure nothing stays
 * queued. */
static kvc_status_t capture(kvc_agent_t *a, const kvc_publish_params_t *params,
                            kvc_cuda_cap_t **cap) {
    uint64_t m = params ? params->field_mask : 0;
    void *ev = (m & KVC_PUBLISH_FIELD_CUDA_EVENT) ? params->cuda_event : NULL;
    /* A stream that is given is a stream, 0 (the legacy default stream)
     * included; only an unset field means none. */
    bool has_stream = !ev && (m & KVC_PUBLISH_FIELD_CUDA_STREAM);
    void *stream = has_stream ? params->cuda_stream : NULL;
    if (!ev && !has_stream) return KVC_OK; /* caller-ordered */
    kvc_status_t st = kvc_cuda_wait_for(a->cuda, ev, has_stream, stream);
    if (st == KVC_OK && a->cuda_direct) {
        st = kvc_cuda_sync(a->cuda);
        a->stats[KVC_STAT_CUDA_SYNCS]++;
    } else if (st == KVC_OK && a->ipc_tab.len) {
        st = kvc_cuda_capture(a->cuda, cap);
    }
    if (st != KVC_OK) {
        kvc_cuda_drain(a->cuda);
        KVC_LOG(a, KVC_LOG_ERROR, "publish: capturing CUDA blocks failed: %s (%s)",
                kvc_cuda_last_error(a->cuda), kvc_status_str(st));
    }
    return st;
}

static kvc_status_t publish_impl(kvc_agent_t *a, const char *request_id, const uint64_t *block_ids,
                         size_t n, const kvc_publish_params_t *params, char **json_out) {
    if (!a || !request_id || !json_out || (n && !block_ids)) return KVC_ERR_INVALID_PARAM;
    size_t idlen = strlen(request_id);
    if (idlen == 0 || idlen > KVC_WIRE_MAX_STR || !kvc_printable(request_id, idlen))
        return KVC_ERR_INVALID_PARAM;
    if (!a->n_regions) return KVC_ERR_STATE;
    for (size_t i = 0; i < n; i++)
        if (block_ids[i] >= a->num_blocks) {
            KVC_LOG(a, KVC_LOG_WARN, "publish req=%s: block %llu out of range (%llu)", request_id,
                    (unsigned long long)block_ids[i], (unsigned long long)a->num_blocks);
            return KVC_ERR_INVALID_PARAM;
        }
    if (kvc_pubtab_find(&a->pubs, request_id, idlen)) return KVC_ERR_EXISTS;

    kvc_status_t st = KVC_ERR_NO_MEMORY;
    kvc_pub_t *p = calloc(1, sizeof(*p));
    if (!p) return st;
    if (!(p->id = kvc_strdup(request_id))) goto err_pub;
    if (n) {
        if (!(p->blocks = malloc(n * sizeof(uint64_t)))) goto err_pub;
        if (!(p->sorted = malloc(n * sizeof(uint64_t)))) goto err_pub;
        memcpy(p->blocks, block_ids, n * sizeof(uint64_t));
        memcpy(p->sorted, block_ids, n * sizeof(uint64_t));
        qsort(p->sorted, n, sizeof(uint64_t), cmp_u64);
    }
    p->n = n;
    uint64_t m = params ? params->field_mask : 0;
    if (m & KVC_PUBLISH_FIELD_TOKEN) { /* the caller's: vLLM's scheduler drew it */
        if ((st = kvc_token_parse(params->kv_token, p->token)) != KVC_OK) {
            KVC_LOG(a, KVC_LOG_WARN, "publish req=%s: kv_token is not 32 hex digits", request_id);
            goto err_pub;
        }
    } else if ((st = kvc_random(p->token, KVC_TOKEN_LEN)) != KVC_OK)
        goto err_pub;
    st = KVC_ERR_NO_MEMORY;
    p->consumers = (m & KVC_PUBLISH_FIELD_CONSUMERS) ? params->consumers : 0;
    uint32_t exp = (m & KVC_PUBLISH_FIELD_EXPIRY) ? params->expiry_ms : a->expiry_ms;
    uint32_t lease = (m & KVC_PUBLISH_FIELD_LEASE) ? params->lease_ms : a->lease_ms;
    uint64_t now = kvc_now_ns();
    p->hard_deadline_ns = now + (uint64_t)exp * 1000000ull;
    p->lease_ns = (uint64_t)lease * 1000000ull;
    p->deadline_ns = p->hard_deadline_ns;
    if (p->lease_ns && now + p->lease_ns < p->deadline_ns) p->deadline_ns = now + p->lease_ns;
    p->user_data = (m & KVC_PUBLISH_FIELD_USER_DATA) ? params->user_data : 0;
    char *json = kvc_params_to_json(a->engine_id, request_id, a->adv_host, a->port, block_ids, n,
                                    a->tp_size, p->token);
    if (!json) goto err_pub;
    if (m & KVC_PUBLISH_FIELD_LAYERWISE) { /* nothing written yet: kvc_publish_ready */
        if (!(p->ready = calloc(a->n_regions, 1))) goto err_json;
        p->unready = a->n_regions;
    } else if (a->cuda && n && (st = capture(a, params, &p->cap)) != KVC_OK)
        goto err_json;
    kvc_pubtab_insert(&a->pubs, p);
    a->stats[KVC_STAT_PUBLISHED]++;
    kvc_wake(a); /* re-arm the timer with this deadline */
    KVC_LOG(a, KVC_LOG_DEBUG, "published req=%s blocks=%zu expiry_ms=%u lease_ms=%u%s",
            request_id, n, exp, lease, p->ready ? " layer-wise" : "");
    *json_out = json;
    if (a->pending) { /* fetches registered before it: served on this progress turn (push.c) */
        a->pending_check = true;
        kvc_wake(a);
    }
    return KVC_OK;

err_json:
    kvc_free(json);
err_pub:
    kvc_pub_free(p);
    return st;
}

/* Regions [first, +count) of a layer-wise publication are written: their
 * CUDA writes captured as kvc_publish's, then readable.  The pushes waiting
 * for them (push.c) send them on the next progress turn. */
static kvc_status_t ready_impl(kvc_agent_t *a, const char *request_id, size_t first, size_t count,
                               const kvc_publish_params_t *params) {
    if (!a || !request_id || count == 0 || first >= a->n_regions || count > a->n_regions - first)
        return KVC_ERR_INVALID_PARAM;
    kvc_pub_t *p = kvc_pubtab_find(&a->pubs, request_id, strlen(request_id));
    if (!p) return KVC_ERR_NOT_FOUND;
    if (!p->unready) return KVC_OK; /* whole, or complete already */
    /* An IPC capture recorded now follows every earlier wait on the same
     * private streams: it replaces the one before. */
    kvc_cuda_cap_t *cap = NULL;
    kvc_status_t st = a->cuda && p->n ? capture(a, params, &cap) : KVC_OK;
    if (st != KVC_OK) return st;
    if (cap) {
        kvc_cuda_capture_put(p->cap);
        p->cap = cap;
    }
    for (size_t r = first; r < first + count; r++)
        if (!p->ready[r]) {
            p->ready[r] = 1;
            p->unready--;
        }
    KVC_LOG(a, KVC_LOG_DEBUG, "req=%s: regions [%zu,+%zu) ready, %zu to go", p->id, first, count,
            p->unready);
    /* Waiting pushes take the new regions; once complete, the held pulls
     * that wait for the whole publication are served. */
    if (a->defers || (!p->unready && a->pending)) {
        a->pending_check = a->pending_check || !p->unready;
        kvc_wake(a);
    }
    return KVC_OK;
}

static kvc_status_t unpublish_impl(kvc_agent_t *a, const char *request_id) {
    if (!a || !request_id) return KVC_ERR_INVALID_PARAM;
    kvc_pub_t *p = kvc_pubtab_find(&a->pubs, request_id, strlen(request_id));
    if (!p) return KVC_ERR_NOT_FOUND;
    if (p->pushes == 0 && p->nholds == 0) {
        kvc_pubtab_remove(&a->pubs, p);
        kvc_pub_free(p);
        return KVC_OK;
    }
    KVC_LOG(a, KVC_LOG_DEBUG, "unpublish req=%s: blocks back once %u pushes and %zu reads end",
            p->id, p->pushes, p->nholds);
    kvc_pub_release(a, p, KVC_EV_RELEASED, KVC_ERR_CANCELED, "unpublished");
    return KVC_INPROGRESS;
}

/* ------------------------------------------------------------- readers -- */

static void hand_back(kvc_agent_t *a, kvc_pub_t *p) {
    if (p->rel_type)
        kvc_event_push(a, p->rel_type, p->rel_status, 0, p->user_data, p->id, p->blocks, p->n, 0,
                       p->rel_msg);
    kvc_pub_free(p);
}

/* A released publication whose last reader ended: off the draining list,
 * blocks back to the engine. */
static void drained(kvc_agent_t *a, kvc_pub_t *p) {
    if (!p->released || p->pushes || p->nholds) return;
    kvc_pub_t **pp = &a->pubs.draining;
    while (*pp && *pp != p)
        pp = &(*pp)->dnext;
    if (*pp) *pp = p->dnext;
    KVC_LOG(a, KVC_LOG_DEBUG, "req=%s: last reader ended, blocks handed back", p->id);
    hand_back(a, p);
}

void kvc_pub_release(kvc_agent_t *a, kvc_pub_t *p, kvc_event_type_t type, kvc_status_t st,
                     const char *msg) {
    kvc_pubtab_remove(&a->pubs, p);
    kvc_token_remember(a, p->id, p->token); /* a late notification is told apart */
    p->rel_type = type;
    p->rel_status = st;
    p->rel_msg = msg;
    if (p->pushes == 0 && p->nholds == 0) {
        hand_back(a, p);
        return;
    }
    p->released = true;
    p->dnext = a->pubs.draining;
    a->pubs.draining = p;
    kvc_wake(a); /* the timer takes the holds' deadlines */
}

void kvc_pub_lease_renew(kvc_agent_t *a, kvc_pub_t *p) {
    if (!p->lease_ns || p->released) return;
    uint64_t d = kvc_now_ns() + p->lease_ns;
    if (d > p->hard_deadline_ns) d = p->hard_deadline_ns;
    if (d <= p->deadline_ns) return;
    expiry_remove(&a->pubs, p);
    p->deadline_ns = d;
    expiry_insert(&a->pubs, p);
}

void kvc_pub_push_begin(kvc_pub_t *p) {
    p->pushes++;
}

void kvc_pub_push_end(kvc_agent_t *a, kvc_pub_t *p) {
    p->pushes--;
    drained(a, p);
}

/* Holds past their deadline break: a consumer that went quiet does not keep
 * the blocks forever (its read, if it ever ends, is told it failed).  Swept
 * on released publications each progress, and on a live one when it takes
 * a new hold (the pull bound caps how many it can take). */
static void holds_sweep(kvc_agent_t *a, kvc_pub_t *p, uint64_t now, uint64_t *next) {
    for (size_t i = 0; i < p->nholds;) {
        if (p->holds[i].deadline_ns <= now) {
            KVC_LOG(a, KVC_LOG_WARN, "req=%s: read by fetch %llu not ended in time, hold broken",
                    p->id, (unsigned long long)p->holds[i].xfer_id);
            p->holds[i] = p->holds[--p->nholds];
            continue;
        }
        if (p->holds[i].deadline_ns < *next) *next = p->holds[i].deadline_ns;
        i++;
    }
}

kvc_status_t kvc_pub_hold(kvc_agent_t *a, kvc_pub_t *p, uint64_t xfer_id,
                          const uint8_t token[KVC_TOKEN_LEN], uint64_t deadline_ns) {
    uint64_t ignored = UINT64_MAX;
    holds_sweep(a, p, kvc_now_ns(), &ignored);
    if (p->nholds == p->holds_cap) {
        size_t cap = p->holds_cap ? p->holds_cap * 2 : 4;
        kvc_hold_t *h = realloc(p->holds, cap * sizeof(*h));
        if (!h) return KVC_ERR_NO_MEMORY;
        p->holds = h;
        p->holds_cap = cap;
    }
    kvc_hold_t *h = &p->holds[p->nholds++];
    h->xfer_id = xfer_id;
    memcpy(h->token, token, KVC_TOKEN_LEN);
    h->deadline_ns = deadline_ns;
    kvc_wake(a);
    return KVC_OK;
}

static bool take_hold(kvc_pub_t *p, uint64_t xfer_id, const uint8_t token[KVC_TOKEN_LEN]) {
    for (size_t i = 0; i < p->nholds; i++)
        if (p->holds[i].xfer_id == xfer_id &&
            kvc_mac_equal(p->holds[i].token, token, KVC_TOKEN_LEN)) {
            p->holds[i] = p->holds[--p->nholds];
            return true;
        }
    return false;
}

kvc_status_t kvc_pub_unhold(kvc_agent_t *a, const char *id, size_t len, uint64_t xfer_id,
                            const uint8_t token[KVC_TOKEN_LEN]) {
    kvc_pub_t *p = kvc_pubtab_find(&a->pubs, id, len);
    if (p && take_hold(p, xfer_id, token)) return KVC_OK;
    for (p = a->pubs.draining; p; p = p->dnext)
        if (strlen(p->id) == len && !memcmp(p->id, id, len) && take_hold(p, xfer_id, token)) {
            drained(a, p);
            return KVC_OK;
        }
    return KVC_ERR_DENIED;
}

void kvc_expiry_run(kvc_agent_t *a, uint64_t now, uint64_t *next) {
    kvc_pub_t *p;
    while ((p = a->pubs.ehead) && p->deadline_ns <= now) {
        a->stats[KVC_STAT_EXPIRED]++;
        bool lease = p->deadline_ns < p->hard_deadline_ns;
        if (lease) a->stats[KVC_STAT_LEASE_EXPIRED]++;
        KVC_LOG(a, KVC_LOG_WARN, "Releasing expired KV blocks for request req=%s blocks=%zu%s",
                p->id, p->n, lease ? " (lease not renewed)" : "");
        kvc_pub_release(a, p, KVC_EV_EXPIRED, KVC_ERR_TIMED_OUT,
                        lease ? "lease not renewed" : "not claimed before expiry");
    }
    if (p && p->deadline_ns < *next) *next = p->deadline_ns;
    kvc_pub_t **pp = &a->pubs.draining;
    while ((p = *pp)) {
        holds_sweep(a, p, now, next);
        if (p->pushes == 0 && p->nholds == 0) {
            *pp = p->dnext;
            hand_back(a, p);
            continue;
        }
        pp = &p->dnext;
    }
}

kvc_status_t kvc_token_new(char out[33]) {
    if (!out) return KVC_ERR_INVALID_PARAM;
    uint8_t t[KVC_TOKEN_LEN];
    kvc_status_t st = kvc_random(t, sizeof(t));
    if (st != KVC_OK) return st;
    kvc_token_hex(t, out);
    return KVC_OK;
}

kvc_status_t kvc_publish(kvc_agent_t *a, const char *request_id, const uint64_t *block_ids,
                         size_t n, const kvc_publish_params_t *params, char **json_out) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_lock(a);
    kvc_status_t st = publish_impl(a, request_id, block_ids, n, params, json_out);
    kvc_unlock(a);
    return st;
}

kvc_status_t kvc_unpublish(kvc_agent_t *a, const char *request_id) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_lock(a);
    kvc_status_t st = unpublish_impl(a, request_id);
    kvc_unlock(a);
    return st;
}

kvc_status_t kvc_publish_ready(kvc_agent_t *a, const char *request_id, size_t first_region,
                               size_t num_regions, const kvc_publish_params_t *params) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_lock(a);
    kvc_status_t st = ready_impl(a, request_id, first_region, num_regions, params);
    kvc_unlock(a);
    return st;
}
