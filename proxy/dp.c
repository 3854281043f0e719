/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/dp.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "base/hash.h"

/* Backends are few and live as long as the process is likely to name them
 * (a reload that drops one leaves its rows, at zero in flight). */
#define DP_SLOTS 256

typedef struct dp_slot {
    atomic_int ready; /* 1: role, name and size below are set for good */
    px_dp_role role;
    char name[128];
    atomic_long inflight[PX_DP_MAX];
    atomic_ullong total[PX_DP_MAX];
    atomic_int used; /* ranks that took a request: 1 + the highest */
} dp_slot;

static dp_slot slots[DP_SLOTS];
static pthread_mutex_t insert_mu = PTHREAD_MUTEX_INITIALIZER;

/* Linear probing from the key's hash: an unready slot ends the chain
 * (slots are never removed). `claim`: take that slot for the key. */
static dp_slot *probe(px_dp_role role, const char *name, uint64_t h, int claim) {
    for (size_t i = 0; i < DP_SLOTS; i++) {
        dp_slot *s = &slots[(h + i) % DP_SLOTS];
        if (!atomic_load_explicit(&s->ready, memory_order_acquire)) {
            if (!claim) return NULL;
            s->role = role;
            snprintf(s->name, sizeof s->name, "%s", name);
            atomic_store_explicit(&s->ready, 1, memory_order_release);
            return s;
        }
        if (s->role == role && !strncmp(s->name, name, sizeof s->name - 1)) return s;
    }
    return NULL;
}

/* The slot of (role, name), created when `create`; NULL when absent or
 * the table is full. Lookups are lock-free; inserts take the lock (and
 * look again under it: another thread may have inserted the key). */
static dp_slot *find(px_dp_role role, const char *name, int create) {
    uint64_t h = px_hash64(name, strlen(name)) ^ (uint64_t)role;
    dp_slot *s = probe(role, name, h, 0);
    if (s || !create) return s;
    pthread_mutex_lock(&insert_mu);
    s = probe(role, name, h, 1);
    pthread_mutex_unlock(&insert_mu);
    return s;
}

int px_dp_take(px_dp_role role, const char *name, int size) {
    if (size < 2) return -1;
    if (size > PX_DP_MAX) size = PX_DP_MAX;
    dp_slot *s = find(role, name, 1);
    if (!s) return -1;
    int best = 0;
    long least = atomic_load_explicit(&s->inflight[0], memory_order_relaxed);
    for (int k = 1; k < size; k++) {
        long v = atomic_load_explicit(&s->inflight[k], memory_order_relaxed);
        if (v < least) {
            least = v;
            best = k;
        }
    }
    atomic_fetch_add_explicit(&s->inflight[best], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->total[best], 1, memory_order_relaxed);
    int used = atomic_load_explicit(&s->used, memory_order_relaxed);
    while (used < best + 1 &&
           !atomic_compare_exchange_weak_explicit(&s->used, &used, best + 1, memory_order_relaxed,
                                                  memory_order_relaxed)) {
    }
    return best;
}

void px_dp_done(px_dp_role role, const char *name, int rank) {
    if (rank < 0 || rank >= PX_DP_MAX) return;
    dp_slot *s = find(role, name, 0);
    if (s) atomic_fetch_sub_explicit(&s->inflight[rank], 1, memory_order_relaxed);
}

static void label(px_buf *out, const dp_slot *s, int k) {
    px_buf_printf(out, "{role=\"%s\",backend=\"", s->role == PX_DP_PREFILL ? "prefill" : "decode");
    for (const char *c = s->name; *c; c++) {
        if (*c == '"' || *c == '\\') px_buf_append(out, "\\", 1);
        if (*c == '\n')
            px_buf_append(out, "\\n", 2);
        else
            px_buf_append(out, c, 1);
    }
    px_buf_printf(out, "\",rank=\"%d\"}", k);
}

void px_dp_render(px_buf *out) {
    px_buf_appends(out, "# HELP pdproxy_dp_rank_in_flight Requests in flight on a data-parallel "
                        "rank of a backend (X-data-parallel-rank), as pdproxy counts them.\n"
                        "# TYPE pdproxy_dp_rank_in_flight gauge\n");
    for (size_t i = 0; i < DP_SLOTS; i++) {
        dp_slot *s = &slots[i];
        if (!atomic_load_explicit(&s->ready, memory_order_acquire)) continue;
        int used = atomic_load_explicit(&s->used, memory_order_relaxed);
        for (int k = 0; k < used; k++) {
            px_buf_appends(out, "pdproxy_dp_rank_in_flight");
            label(out, s, k);
            px_buf_printf(out, " %ld\n", atomic_load_explicit(&s->inflight[k], memory_order_relaxed));
        }
    }
    px_buf_appends(out, "# HELP pdproxy_dp_rank_requests_total Requests sent to a data-parallel "
                        "rank of a backend.\n# TYPE pdproxy_dp_rank_requests_total counter\n");
    for (size_t i = 0; i < DP_SLOTS; i++) {
        dp_slot *s = &slots[i];
        if (!atomic_load_explicit(&s->ready, memory_order_acquire)) continue;
        int used = atomic_load_explicit(&s->used, memory_order_relaxed);
        for (int k = 0; k < used; k++) {
            px_buf_appends(out, "pdproxy_dp_rank_requests_total");
            label(out, s, k);
            px_buf_printf(out, " %llu\n", atomic_load_explicit(&s->total[k], memory_order_relaxed));
        }
    }
}
