/* Producer bookkeeping: the table of published requests (hash by request id)
 * and kvc_publish / kvc_unpublish.  Release by notification is in notify.c,
 * by time in expiry.c. */
#include "kvc_int.h"

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
    free(p->id);
    free(p->blocks);
    free(p->sorted);
    free(p);
}

void kvc_pubtab_cleanup(kvc_pubtab_t *t) {
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

void kvc_pubtab_insert(kvc_pubtab_t *t, kvc_pub_t *p) {
    if (t->count >= t->nbuckets) grow(t);
    size_t k = hash(p->id, strlen(p->id)) % t->nbuckets;
    p->hnext = t->buckets[k];
    t->buckets[k] = p;
    t->count++;
    kvc_expiry_insert(t, p);
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
    kvc_expiry_remove(t, p);
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
 * them, i.e. before the params leave kvc_publish.  The private streams wait
 * for the engine's event or stream (never a sync of the engine's own
 * stream), staged regions are copied to their mirrors, and one host sync per
 * device ends it.  On failure nothing stays queued. */
static kvc_status_t capture(kvc_agent_t *a, const kvc_publish_params_t *params, const uint64_t *ids,
                            size_t n) {
    uint64_t m = params ? params->field_mask : 0;
    void *ev = (m & KVC_PUBLISH_FIELD_CUDA_EVENT) ? params->cuda_event : NULL;
    void *stream = (m & KVC_PUBLISH_FIELD_CUDA_STREAM) ? params->cuda_stream : NULL;
    if (!ev && !stream && !a->n_staged) return KVC_OK; /* direct, caller-ordered */
    kvc_status_t st = kvc_cuda_wait_for(a->cuda, ev, stream);
    if (st == KVC_OK && a->n_staged) st = kvc_stage_copy(a, ids, n, false);
    if (st == KVC_OK) {
        st = kvc_cuda_sync(a->cuda);
        a->stats[KVC_STAT_CUDA_SYNCS]++;
    }
    if (st != KVC_OK) {
        kvc_cuda_drain(a->cuda);
        KVC_LOG(a, KVC_LOG_ERROR, "publish: capturing CUDA blocks failed: %s (%s)",
                kvc_cuda_last_error(a->cuda), kvc_status_str(st));
    }
    return st;
}

kvc_status_t kvc_publish(kvc_agent_t *a, const char *request_id, const uint64_t *block_ids,
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
    if ((st = kvc_random(p->token, KVC_TOKEN_LEN)) != KVC_OK) goto err_pub;
    st = KVC_ERR_NO_MEMORY;
    uint64_t m = params ? params->field_mask : 0;
    p->consumers = (m & KVC_PUBLISH_FIELD_CONSUMERS) ? params->consumers : 0;
    uint32_t exp = (m & KVC_PUBLISH_FIELD_EXPIRY) ? params->expiry_ms : a->expiry_ms;
    p->deadline_ns = kvc_now_ns() + (uint64_t)exp * 1000000ull;
    p->user_data = (m & KVC_PUBLISH_FIELD_USER_DATA) ? params->user_data : 0;
    char *json = kvc_params_to_json(a->engine_id, request_id, a->adv_host, a->port, block_ids, n,
                                    a->tp_size, p->token);
    if (!json) goto err_pub;
    if (a->cuda && n && (st = capture(a, params, block_ids, n)) != KVC_OK) goto err_json;
    kvc_pubtab_insert(&a->pubs, p);
    a->stats[KVC_STAT_PUBLISHED]++;
    kvc_wake(a); /* re-arm the timer with this deadline */
    KVC_LOG(a, KVC_LOG_DEBUG, "published req=%s blocks=%zu expiry_ms=%u", request_id, n, exp);
    *json_out = json;
    return KVC_OK;

err_json:
    kvc_free(json);
err_pub:
    kvc_pub_free(p);
    return st;
}

kvc_status_t kvc_unpublish(kvc_agent_t *a, const char *request_id) {
    if (!a || !request_id) return KVC_ERR_INVALID_PARAM;
    kvc_pub_t *p = kvc_pubtab_find(&a->pubs, request_id, strlen(request_id));
    if (!p) return KVC_ERR_NOT_FOUND;
    kvc_pubtab_remove(&a->pubs, p);
    kvc_pub_free(p);
    return KVC_OK;
}
