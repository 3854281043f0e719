/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/slo.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "proxy/prio.h" /* PX_ADM_CLASSES */

static const char *const miss_names[] = {"send", "queue", "refuse"};
static const char *const result_names[PX_SLO_RESULTS] = {"met", "missed", "refused", "failed"};

const char *px_slo_miss_name(px_slo_miss m) {
    return (unsigned)m < 3 ? miss_names[m] : "send";
}

int px_slo_miss_parse(const char *s, size_t n) {
    for (int i = 0; i < 3; i++)
        if (strlen(miss_names[i]) == n && !memcmp(s, miss_names[i], n)) return i;
    return -1;
}

const char *px_slo_result_name(px_slo_result r) {
    return (unsigned)r < PX_SLO_RESULTS ? result_names[r] : "failed";
}

/* ---------- specs ---------- */

static int parse_spec(const char *spec, char *kind, char *name, px_slo_target *t, char *err,
                      size_t errlen) {
    const char *eq = strchr(spec, '=');
    const char *colon = eq ? strchr(eq + 1, ':') : NULL;
    size_t kl = eq ? (size_t)(eq - spec) : 0;
    if (!eq || !colon) goto bad;
    if (kl == 6 && !memcmp(spec, "tenant", 6))
        *kind = 't';
    else if (kl == 5 && !memcmp(spec, "class", 5))
        *kind = 'c';
    else if (kl == 4 && !memcmp(spec, "pool", 4))
        *kind = 'p';
    else
        goto bad;
    size_t nl = (size_t)(colon - eq - 1);
    if (nl >= PX_SLO_NAME_MAX || (nl == 0 && *kind != 'p')) goto bad;
    memcpy(name, eq + 1, nl);
    name[nl] = 0;
    *t = (px_slo_target){0};
    for (const char *p = colon + 1;;) {
        size_t len = strcspn(p, ":");
        if (!len) goto bad;
        const char *v = memchr(p, '=', len);
        if (!v) goto bad;
        size_t key = (size_t)(v - p), vl = len - key - 1;
        char num[32];
        if (vl == 0 || vl >= sizeof num) goto bad;
        memcpy(num, v + 1, vl);
        num[vl] = 0;
        char *end;
        double x = strtod(num, &end);
        int isnum = !*end && end != num;
        if (key == 4 && !memcmp(p, "ttft", 4) && isnum && x > 0 && x <= 3600000) {
            t->ttft_ms = x;
            t->set |= PX_SLO_HAS_TTFT;
        } else if (key == 4 && !memcmp(p, "tpot", 4) && isnum && x > 0 && x <= 3600000) {
            t->tpot_ms = x;
            t->set |= PX_SLO_HAS_TPOT;
        } else if (key == 4 && !memcmp(p, "miss", 4) && px_slo_miss_parse(v + 1, vl) >= 0) {
            t->miss = px_slo_miss_parse(v + 1, vl);
            t->set |= PX_SLO_HAS_MISS;
        } else if (key == 6 && !memcmp(p, "status", 6) && isnum && (x == 503 || x == 429)) {
            t->status = (int)x;
            t->set |= PX_SLO_HAS_STATUS;
        } else {
            goto bad;
        }
        if (!p[len]) break;
        p += len + 1;
    }
    if (!t->set) goto bad;
    return 0;
bad:
    snprintf(err, errlen,
             "--slo '%s': expected KIND=NAME:key=value[:...], KIND tenant, class or pool, keys "
             "ttft and tpot (ms, up to 3600000), miss (send|queue|refuse), status (503|429)",
             spec);
    return -1;
}

int px_slo_spec_check(const char *spec, char *err, size_t errlen) {
    char kind, name[PX_SLO_NAME_MAX];
    px_slo_target t;
    return parse_spec(spec, &kind, name, &t, err, errlen);
}

int px_slo_map_parse(char *const *specs, size_t n, px_slo_map *m, char *err, size_t errlen) {
    if (n > PX_SLO_MAX_SPECS) {
        snprintf(err, errlen, "--slo: %zu specs; at most %d", n, PX_SLO_MAX_SPECS);
        return -1;
    }
    px_slo_map *t = px_xcalloc(1, sizeof *t);
    for (size_t i = 0; i < n; i++) {
        if (parse_spec(specs[i], &t->v[i].kind, t->v[i].name, &t->v[i].t, err, errlen) < 0) {
            free(t);
            return -1;
        }
        t->n++;
    }
    *m = *t;
    free(t);
    return 0;
}

void px_slo_merge(px_slo_target *t, const px_slo_target *from) {
    if (!from) return;
    unsigned add = from->set & ~t->set;
    if (add & PX_SLO_HAS_TTFT) t->ttft_ms = from->ttft_ms;
    if (add & PX_SLO_HAS_TPOT) t->tpot_ms = from->tpot_ms;
    if (add & PX_SLO_HAS_MISS) t->miss = from->miss;
    if (add & PX_SLO_HAS_STATUS) t->status = from->status;
    t->set |= add;
}

const px_slo_target *px_slo_find(const px_slo_map *m, char kind, const char *name, size_t len) {
    for (size_t i = 0; m && i < m->n; i++)
        if (m->v[i].kind == kind && strlen(m->v[i].name) == len && !memcmp(m->v[i].name, name, len))
            return &m->v[i].t;
    return NULL;
}

/* ---------- published specs and counters ---------- */

typedef struct node {
    px_slo_map m;
    struct node *older;
} node;

#define POOLS_MAX 64

typedef struct pool_counts {
    _Atomic uint64_t key; /* hash of the name + 1; 0: free */
    char name[PX_SLO_NAME_MAX];
    _Atomic uint64_t c[PX_ADM_CLASSES][PX_SLO_RESULTS];
    char cls[PX_ADM_CLASSES][PX_PRIO_NAME_MAX]; /* the label each class was counted under */
    _Atomic int cls_named[PX_ADM_CLASSES];
} pool_counts;

struct px_slo {
    _Atomic(node *) head;
    pool_counts pools[POOLS_MAX];
    _Atomic uint64_t lost; /* counts of pools past POOLS_MAX */
};

static const px_slo_map empty_map;

px_slo *px_slo_create(void) {
    return px_xcalloc(1, sizeof(px_slo));
}

void px_slo_destroy(px_slo *s) {
    if (!s) return;
    for (node *n = atomic_load(&s->head), *o; n; n = o) {
        o = n->older;
        free(n);
    }
    free(s);
}

int px_slo_publish(px_slo *s, char *const *specs, size_t n, char *err, size_t errlen) {
    node *nd = px_xcalloc(1, sizeof *nd);
    if (px_slo_map_parse(specs, n, &nd->m, err, errlen) < 0) {
        free(nd);
        return -1;
    }
    /* One publisher at a time: the control thread (reload, admin API). */
    nd->older = atomic_load(&s->head);
    atomic_store_explicit(&s->head, nd, memory_order_release);
    return 0;
}

const px_slo_map *px_slo_current(px_slo *s) {
    node *n = s ? atomic_load_explicit(&s->head, memory_order_acquire) : NULL;
    return n ? &n->m : &empty_map;
}

static pool_counts *pool_of(px_slo *s, const char *pool) {
    size_t len = strlen(pool);
    if (len >= PX_SLO_NAME_MAX) len = PX_SLO_NAME_MAX - 1;
    uint64_t key = 1;
    for (size_t i = 0; i < len; i++)
        key = (key ^ (unsigned char)pool[i]) * 0x100000001b3ull;
    key |= 1;
    if (key < 3) key = 3; /* 0: free, 2: being claimed */
    for (size_t i = 0; i < POOLS_MAX; i++) {
        pool_counts *p = &s->pools[(key + i) % POOLS_MAX];
        uint64_t k;
        while ((k = atomic_load_explicit(&p->key, memory_order_acquire)) == 2) {
        }
        if (k == key) return p;
        if (k) continue;
        /* Claimed with a marker first, so that the name is written before
         * the key says it is there. */
        uint64_t zero = 0;
        if (!atomic_compare_exchange_strong(&p->key, &zero, 2)) {
            while (atomic_load_explicit(&p->key, memory_order_acquire) == 2) {
            }
            if (atomic_load_explicit(&p->key, memory_order_acquire) == key) return p;
            continue;
        }
        memcpy(p->name, pool, len);
        p->name[len] = 0;
        atomic_store_explicit(&p->key, key, memory_order_release);
        return p;
    }
    return NULL;
}

void px_slo_count(px_slo *s, const char *pool, int cls, const char *cls_name, px_slo_result r) {
    if (!s || (unsigned)r >= PX_SLO_RESULTS) return;
    if (cls < 0 || cls >= PX_ADM_CLASSES) cls = PX_ADM_CLASSES - 1;
    pool_counts *p = pool_of(s, pool ? pool : "");
    if (!p) {
        atomic_fetch_add_explicit(&s->lost, 1, memory_order_relaxed);
        return;
    }
    /* The class's label: the first name it was counted under. */
    int expect = 0;
    if (atomic_compare_exchange_strong(&p->cls_named[cls], &expect, 2)) {
        snprintf(p->cls[cls], sizeof p->cls[cls], "%s", cls_name && cls_name[0] ? cls_name : "");
        if (!p->cls[cls][0]) snprintf(p->cls[cls], sizeof p->cls[cls], "%d", cls);
        atomic_store_explicit(&p->cls_named[cls], 1, memory_order_release);
    }
    atomic_fetch_add_explicit(&p->c[cls][r], 1, memory_order_relaxed);
}

static void label(struct px_buf *o, const char *v) {
    for (; *v; v++) {
        if (*v == '\\' || *v == '"') px_buf_append(o, "\\", 1);
        if (*v == '\n')
            px_buf_appends(o, "\\n");
        else
            px_buf_append(o, v, 1);
    }
}

void px_slo_render_metrics(px_slo *s, struct px_buf *o) {
    px_buf_appends(o, "# HELP pdproxy_slo_attained_total Requests with a latency target, by "
                      "pool, priority class and result: met (within its TTFT and TPOT targets), "
                      "missed, refused (predicted to miss, refused before any engine saw it), "
                      "failed (not answered).\n# TYPE pdproxy_slo_attained_total counter\n");
    for (size_t i = 0; i < POOLS_MAX; i++) {
        pool_counts *p = &s->pools[i];
        uint64_t k = atomic_load_explicit(&p->key, memory_order_acquire);
        if (k < 3) continue;
        for (int c = 0; c < PX_ADM_CLASSES; c++) {
            if (atomic_load_explicit(&p->cls_named[c], memory_order_acquire) != 1) continue;
            for (int r = 0; r < PX_SLO_RESULTS; r++) {
                px_buf_appends(o, "pdproxy_slo_attained_total{pool=\"");
                label(o, p->name);
                px_buf_appends(o, "\",class=\"");
                label(o, p->cls[c]);
                px_buf_printf(o, "\",result=\"%s\"} %llu\n", result_names[r],
                              (unsigned long long)atomic_load(&p->c[c][r]));
            }
        }
    }
}

void px_slo_render_json(px_slo *s, struct px_buf *o) {
    const px_slo_map *m = px_slo_current(s);
    px_buf_appends(o, "{\"specs\":[");
    for (size_t i = 0; i < m->n; i++) {
        const px_slo_target *t = &m->v[i].t;
        const char *kind = m->v[i].kind == 't' ? "tenant" : m->v[i].kind == 'c' ? "class" : "pool";
        px_buf_printf(o, "%s{\"kind\":\"%s\",\"name\":", i ? "," : "", kind);
        px_buf_append_json_str(o, m->v[i].name, strlen(m->v[i].name));
        if (t->set & PX_SLO_HAS_TTFT) px_buf_printf(o, ",\"ttft_ms\":%.3f", t->ttft_ms);
        if (t->set & PX_SLO_HAS_TPOT) px_buf_printf(o, ",\"tpot_ms\":%.3f", t->tpot_ms);
        if (t->set & PX_SLO_HAS_MISS) px_buf_printf(o, ",\"miss\":\"%s\"", miss_names[t->miss]);
        if (t->set & PX_SLO_HAS_STATUS) px_buf_printf(o, ",\"status\":%d", t->status);
        px_buf_appends(o, "}");
    }
    px_buf_appends(o, "]}");
}
