/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/dp.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "base/util.h"

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
    /* The engine's own figures from its last load probe: running + waiting
     * of each rank (vllm:num_requests_* labelled engine="K"), and pdproxy's
     * in-flight count of that rank at that moment. eng_known: 0 until a
     * probe found per-rank series, and again after one failed. */
    atomic_int eng_known;
    atomic_int eng_ranks; /* ranks the last probe reported */
    atomic_long eng[PX_DP_MAX];
    atomic_long own_at[PX_DP_MAX];
} dp_slot;

/* ---- DP sizes backends declare (config file entries, admin API) ----
 * Keyed by the backend's configured URL (px_backend.src), so every address
 * a name resolves to shares its entry. Two layers: the file's, replaced by
 * each accepted configuration, and the admin API's, over it. Entries stay
 * once made (at 0: undeclared), so workers read without a lock. */
#define DECL_SLOTS 4096

typedef struct decl_slot {
    atomic_int ready;
    char url[512];
    atomic_int file_size;  /* 0: none */
    atomic_int admin_size; /* 0: none */
    unsigned mark;         /* control thread: the file layer's last declaration */
} decl_slot;

struct px_dp_table {
    dp_slot slots[DP_SLOTS];
    pthread_mutex_t insert_mu; /* inserts into slots and decls */
    /* Made by the first declaration (2 MiB, most of it never touched), so
     * that a proxy whose backends declare no size spends no memory on it;
     * freed with the table. Workers read it without a lock. */
    _Atomic(decl_slot *) decls;
    unsigned decl_gen;
    atomic_int ndecl; /* slots made: 0 until a backend declared a size */
};

/* Linear probing from the key's hash: an unready slot ends the chain
 * (slots are never removed). `claim`: take that slot for the key. */
static dp_slot *probe(px_dp_table *t, px_dp_role role, const char *name, uint64_t h, int claim) {
    for (size_t i = 0; i < DP_SLOTS; i++) {
        dp_slot *s = &t->slots[(h + i) % DP_SLOTS];
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
static dp_slot *find(px_dp_table *t, px_dp_role role, const char *name, int create) {
    uint64_t h = px_hash64(name, strlen(name)) ^ (uint64_t)role;
    dp_slot *s = probe(t, role, name, h, 0);
    if (s || !create) return s;
    pthread_mutex_lock(&t->insert_mu);
    s = probe(t, role, name, h, 1);
    pthread_mutex_unlock(&t->insert_mu);
    return s;
}

px_dp_table *px_dp_table_create(void) {
    px_dp_table *t = px_xcalloc(1, sizeof *t);
    pthread_mutex_init(&t->insert_mu, NULL);
    return t;
}

void px_dp_table_destroy(px_dp_table *t) {
    if (!t) return;
    pthread_mutex_destroy(&t->insert_mu);
    free(atomic_load_explicit(&t->decls, memory_order_relaxed));
    free(t);
}

int px_dp_declared(px_dp_table *t) {
    return atomic_load_explicit(&t->ndecl, memory_order_relaxed) > 0;
}

static decl_slot *decl_find(px_dp_table *t, const char *url, int create) {
    if (strlen(url) >= sizeof((decl_slot *)0)->url) return NULL;
    decl_slot *tab = atomic_load_explicit(&t->decls, memory_order_acquire);
    if (!tab) {
        if (!create) return NULL;
        pthread_mutex_lock(&t->insert_mu);
        tab = atomic_load_explicit(&t->decls, memory_order_acquire);
        if (!tab) {
            tab = px_xcalloc(DECL_SLOTS, sizeof *tab);
            atomic_store_explicit(&t->decls, tab, memory_order_release);
        }
        pthread_mutex_unlock(&t->insert_mu);
    }
    uint64_t h = px_hash64(url, strlen(url));
    for (size_t i = 0; i < DECL_SLOTS; i++) {
        decl_slot *d = &tab[(h + i) % DECL_SLOTS];
        if (!atomic_load_explicit(&d->ready, memory_order_acquire)) {
            if (!create) return NULL;
            pthread_mutex_lock(&t->insert_mu);
            int taken = atomic_load_explicit(&d->ready, memory_order_acquire);
            if (!taken) {
                snprintf(d->url, sizeof d->url, "%s", url);
                atomic_store_explicit(&d->ready, 1, memory_order_release);
                atomic_fetch_add_explicit(&t->ndecl, 1, memory_order_relaxed);
            }
            pthread_mutex_unlock(&t->insert_mu);
            if (!taken) return d;
        }
        if (!strcmp(d->url, url)) return d;
    }
    return NULL;
}

int px_dp_size(px_dp_table *t, const char *url, int fallback) {
    decl_slot *d = url ? decl_find(t, url, 0) : NULL;
    if (d) {
        int a = atomic_load_explicit(&d->admin_size, memory_order_relaxed);
        if (a > 0) return a;
        int f = atomic_load_explicit(&d->file_size, memory_order_relaxed);
        if (f > 0) return f;
    }
    return fallback;
}

int px_dp_declare_file(px_dp_table *t, const px_strlist *decl) {
    unsigned gen = ++t->decl_gen;
    int rc = 0;
    for (size_t i = 0; i < decl->n; i++) {
        char *end;
        long n = strtol(decl->v[i], &end, 10);
        decl_slot *d = *end == ' ' ? decl_find(t, end + 1, 1) : NULL;
        if (!d) {
            rc = -1;
            continue;
        }
        atomic_store_explicit(&d->file_size, (int)n, memory_order_relaxed);
        d->mark = gen;
    }
    decl_slot *tab = atomic_load_explicit(&t->decls, memory_order_acquire);
    for (size_t i = 0; tab && i < DECL_SLOTS; i++)
        if (atomic_load_explicit(&tab[i].ready, memory_order_acquire) && tab[i].mark != gen)
            atomic_store_explicit(&tab[i].file_size, 0, memory_order_relaxed);
    return rc;
}

void px_dp_forget_admin(px_dp_table *t) {
    decl_slot *tab = atomic_load_explicit(&t->decls, memory_order_acquire);
    for (size_t i = 0; tab && i < DECL_SLOTS; i++)
        if (atomic_load_explicit(&tab[i].ready, memory_order_acquire))
            atomic_store_explicit(&tab[i].admin_size, 0, memory_order_relaxed);
}

int px_dp_declare_admin(px_dp_table *t, const char *url, int size) {
    decl_slot *d = decl_find(t, url, size > 0);
    if (!d) return size > 0 ? -1 : 0;
    atomic_store_explicit(&d->admin_size, size, memory_order_relaxed);
    return 0;
}

/* A rank's load: pdproxy's in-flight count, or, once the engine reported
 * the rank, the engine's count corrected by what pdproxy sent there or saw
 * end since (the engine's figure already holds pdproxy's requests of that
 * moment, and other clients' too); never below pdproxy's own count. */
static long load_of(dp_slot *s, int k) {
    long own = atomic_load_explicit(&s->inflight[k], memory_order_relaxed);
    if (!atomic_load_explicit(&s->eng_known, memory_order_acquire)) return own;
    long v = atomic_load_explicit(&s->eng[k], memory_order_relaxed) + own -
             atomic_load_explicit(&s->own_at[k], memory_order_relaxed);
    return v > own ? v : own;
}

int px_dp_take(px_dp_table *t, px_dp_role role, const char *name, int size) {
    if (size < 2) return -1;
    if (size > PX_DP_MAX) size = PX_DP_MAX;
    dp_slot *s = find(t, role, name, 1);
    if (!s) return -1;
    int best = 0;
    long least = 0;
    for (int k = 0; k < size; k++) {
        long v = load_of(s, k);
        if (k == 0 || v < least) {
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

void px_dp_done(px_dp_table *t, px_dp_role role, const char *name, int rank) {
    if (rank < 0 || rank >= PX_DP_MAX) return;
    dp_slot *s = find(t, role, name, 0);
    if (s) atomic_fetch_sub_explicit(&s->inflight[rank], 1, memory_order_relaxed);
}

/* The value of `engine="K"` in a sample's labels [l, e), or -1. */
static int engine_label(const char *l, const char *e) {
    static const char key[] = "engine=\"";
    for (const char *p = l; p + sizeof key - 1 < e; p++) {
        if (memcmp(p, key, sizeof key - 1) || (p > l && p[-1] != '{' && p[-1] != ',' &&
                                               p[-1] != ' '))
            continue;
        p += sizeof key - 1;
        int k = 0, digits = 0;
        for (; p < e && *p >= '0' && *p <= '9' && digits < 3; p++, digits++)
            k = k * 10 + (*p - '0');
        return digits && p < e && *p == '"' && k < PX_DP_MAX ? k : -1;
    }
    return -1;
}

int px_dp_parse_ranks(const char *text, size_t n, long load[PX_DP_MAX]) {
    int found = 0;
    memset(load, 0, PX_DP_MAX * sizeof *load);
    const char *p = text, *end = text + n;
    while (p < end) {
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        if (!eol) eol = end;
        static const char run[] = "vllm:num_requests_running{",
                          wait[] = "vllm:num_requests_waiting{";
        size_t len = (size_t)(eol - p);
        if ((len > sizeof run - 1 && !memcmp(p, run, sizeof run - 1)) ||
            (len > sizeof wait - 1 && !memcmp(p, wait, sizeof wait - 1))) {
            const char *l = p + sizeof run - 1; /* both names are as long */
            const char *close = memchr(l, '}', (size_t)(eol - l));
            int k = close ? engine_label(l, close) : -1;
            if (k >= 0) {
                char num[64];
                const char *v = close + 1;
                while (v < eol && (*v == ' ' || *v == '\t'))
                    v++;
                size_t vl = strcspn(v, " \t\r\n");
                if (vl > (size_t)(eol - v)) vl = (size_t)(eol - v);
                if (vl && vl < sizeof num) {
                    memcpy(num, v, vl);
                    num[vl] = '\0';
                    char *x;
                    double d = strtod(num, &x);
                    /* Outside input: only finite, sane counts. */
                    if (!*x && d >= 0 && d < 1e6) {
                        load[k] += (long)d;
                        if (k + 1 > found) found = k + 1;
                    }
                }
            }
        }
        p = eol + 1;
    }
    return found;
}

/* Stores the per-rank figures for one role's slot of the backend. */
static void engine_store(px_dp_table *t, px_dp_role role, const char *name, const long *load,
                         int ranks) {
    dp_slot *s = find(t, role, name, ranks > 0);
    if (!s) return;
    if (ranks <= 0) {
        atomic_store_explicit(&s->eng_known, 0, memory_order_release);
        return;
    }
    for (int k = 0; k < PX_DP_MAX; k++) {
        atomic_store_explicit(&s->eng[k], load[k], memory_order_relaxed);
        atomic_store_explicit(&s->own_at[k],
                              atomic_load_explicit(&s->inflight[k], memory_order_relaxed),
                              memory_order_relaxed);
    }
    atomic_store_explicit(&s->eng_ranks, ranks, memory_order_relaxed);
    atomic_store_explicit(&s->eng_known, 1, memory_order_release);
}

void px_dp_engine_load(px_dp_table *t, const char *name, const char *text, size_t n) {
    long load[PX_DP_MAX];
    int ranks = text ? px_dp_parse_ranks(text, n, load) : 0;
    /* One engine behind one address: whichever role pdproxy gives it. A
     * single rank (engine="0" only) says nothing a rank choice can use. */
    if (ranks < 2) ranks = 0;
    engine_store(t, PX_DP_PREFILL, name, load, ranks);
    engine_store(t, PX_DP_DECODE, name, load, ranks);
}

static void label_value(px_buf *out, const char *v) {
    for (const char *c = v; *c; c++) {
        if (*c == '"' || *c == '\\') px_buf_append(out, "\\", 1);
        if (*c == '\n')
            px_buf_append(out, "\\n", 2);
        else
            px_buf_append(out, c, 1);
    }
}

static void label(px_buf *out, const dp_slot *s, int k) {
    px_buf_printf(out, "{role=\"%s\",backend=\"", s->role == PX_DP_PREFILL ? "prefill" : "decode");
    label_value(out, s->name);
    px_buf_printf(out, "\",rank=\"%d\"}", k);
}

void px_dp_render(px_dp_table *t, px_buf *out) {
    px_buf_appends(out, "# HELP pdproxy_dp_rank_in_flight Requests in flight on a data-parallel "
                        "rank of a backend (X-data-parallel-rank), as pdproxy counts them.\n"
                        "# TYPE pdproxy_dp_rank_in_flight gauge\n");
    for (size_t i = 0; i < DP_SLOTS; i++) {
        dp_slot *s = &t->slots[i];
        if (!atomic_load_explicit(&s->ready, memory_order_acquire)) continue;
        int used = atomic_load_explicit(&s->used, memory_order_relaxed);
        for (int k = 0; k < used; k++) {
            px_buf_appends(out, "pdproxy_dp_rank_in_flight");
            label(out, s, k);
            px_buf_printf(out, " %ld\n", atomic_load_explicit(&s->inflight[k], memory_order_relaxed));
        }
    }
    px_buf_appends(out, "# HELP pdproxy_dp_rank_engine_load Running plus waiting requests of a "
                        "data-parallel rank as the engine's /metrics last reported them "
                        "(vllm:num_requests_* labelled engine).\n"
                        "# TYPE pdproxy_dp_rank_engine_load gauge\n");
    for (size_t i = 0; i < DP_SLOTS; i++) {
        dp_slot *s = &t->slots[i];
        /* Both roles' slots hold the same figures: the decode one speaks. */
        if (!atomic_load_explicit(&s->ready, memory_order_acquire) || s->role != PX_DP_DECODE ||
            !atomic_load_explicit(&s->eng_known, memory_order_acquire))
            continue;
        int n = atomic_load_explicit(&s->eng_ranks, memory_order_relaxed);
        for (int k = 0; k < n && k < PX_DP_MAX; k++) {
            px_buf_appends(out, "pdproxy_dp_rank_engine_load{backend=\"");
            label_value(out, s->name);
            px_buf_printf(out, "\",rank=\"%d\"} %ld\n", k,
                          atomic_load_explicit(&s->eng[k], memory_order_relaxed));
        }
    }
    px_buf_appends(out, "# HELP pdproxy_dp_rank_requests_total Requests sent to a data-parallel "
                        "rank of a backend.\n# TYPE pdproxy_dp_rank_requests_total counter\n");
    for (size_t i = 0; i < DP_SLOTS; i++) {
        dp_slot *s = &t->slots[i];
        if (!atomic_load_explicit(&s->ready, memory_order_acquire)) continue;
        int used = atomic_load_explicit(&s->used, memory_order_relaxed);
        for (int k = 0; k < used; k++) {
            px_buf_appends(out, "pdproxy_dp_rank_requests_total");
            label(out, s, k);
            px_buf_printf(out, " %llu\n", atomic_load_explicit(&s->total[k], memory_order_relaxed));
        }
    }
}
