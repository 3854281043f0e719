/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/latency.h"

#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "base/util.h"

/* ---------- one fit ---------- */

void px_lat_fit_add(px_lat_fit *f, double x, double y, uint64_t now_ns, double keep,
                    double half_life_s) {
    if (!(x >= 0) || !(y >= 0) || !isfinite(x) || !isfinite(y)) return;
    double k = f->t_ns ? keep : 0;
    if (f->t_ns && now_ns > f->t_ns && half_life_s > 0)
        k *= exp2(-(double)(now_ns - f->t_ns) / 1e9 / half_life_s);
    f->s0 = f->s0 * k + 1;
    f->sx = f->sx * k + x;
    f->sy = f->sy * k + y;
    f->sxx = f->sxx * k + x * x;
    f->sxy = f->sxy * k + x * y;
    if (now_ns > f->t_ns) f->t_ns = now_ns;
    f->n++;
}

double px_lat_fit_solve(const px_lat_fit *f, double prior_b, double *a, double *b) {
    if (!(f->s0 > 1e-9)) {
        *a = 0;
        *b = prior_b;
        return 0;
    }
    double mx = f->sx / f->s0, my = f->sy / f->s0;
    double cxx = f->sxx - f->sx * mx, cxy = f->sxy - f->sx * my;
    if (cxx < 0) cxx = 0;
    double ridge = 1e-4 * f->sxx + 1e-12;
    double bb = (cxy + ridge * prior_b) / (cxx + ridge);
    double aa = my - bb * mx;
    if (aa < 0) { /* through the origin */
        aa = 0;
        bb = f->sxx > 1e-12 ? f->sxy / f->sxx : prior_b;
    }
    if (bb < 0) {
        bb = 0;
        aa = my > 0 ? my : 0;
    }
    *a = aa;
    *b = bb;
    return f->s0;
}

/* ---------- entries: fits behind a writer flag, lines behind a sequence ---------- */

#define PROBES 8
#define NAME_MAX_LEN 80
/* How much of its own fit an entry's prediction takes: w^2 / (w^2 + BLEND):
 * half after one sample, 0.9 after three. */
#define BLEND 1.0
#define PAIR_KIND 0 /* a pair entry's one fit */

typedef struct entry {
    _Atomic uint64_t key; /* 0: free */
    _Atomic unsigned seq; /* odd: its lines or key are being written */
    _Atomic int busy;     /* 1: held by the writer of its fits (calloc's 0: free) */
    _Atomic uint64_t last_ns;
    _Atomic char name[NAME_MAX_LEN];
    px_lat_fit fit[PX_LAT_KINDS]; /* under busy */
    /* The fitted lines, published under seq. */
    _Atomic double a[PX_LAT_KINDS], b[PX_LAT_KINDS], w[PX_LAT_KINDS];
    _Atomic uint64_t n[PX_LAT_KINDS];
} entry;

typedef struct table {
    entry *e; /* owned */
    size_t mask;
    _Atomic uint64_t taken_over; /* entries reused for another key: the table was full */
} table;

#define ERR_BUCKETS 21 /* relative error in 0.05 steps; the last: 1.0 and over */

struct px_latmodel {
    table eng, pair;
    entry pooled[PX_LAT_KINDS]; /* key unused; fit[k] of pooled[k] */
    entry pooled_kv;
    double keep, half_life_s;
    _Atomic uint64_t err[ERR_BUCKETS];
    _Atomic uint64_t err_n;
    _Atomic double err_sum;
};

/* Slopes before anything is known: a prompt token costs 100 us to compute
 * (a mid-size model on one GPU), twice that on a decode, whose prompts
 * also hold up the tokens of every request it generates for (so before
 * anything is learned, a prompt is disaggregated), a token of KV moves in
 * 1 us, and a request's tokens do not slow another's output. */
static const double default_b[PX_LAT_KINDS] = {1e-4, 1e-4, 2e-4, 0};
static const double default_kv_b = 1e-6;

static const char *const kind_names[PX_LAT_KINDS] = {"prefill", "decode", "local", "tpot"};

const char *px_lat_kind_name(px_lat_kind k) {
    return k < PX_LAT_KINDS ? kind_names[k] : "kv";
}

static size_t pow2(size_t n) {
    size_t p = 16;
    while (p < n && p < ((size_t)1 << 20))
        p <<= 1;
    return p;
}

/* Zeroed memory is a table of free, unlocked entries: its pages become
 * resident only as engines and pairs are seen. */
static void table_init(table *t, size_t n) {
    size_t cap = pow2(n);
    t->e = px_xcalloc(cap, sizeof *t->e);
    t->mask = cap - 1;
}

px_latmodel *px_latmodel_create(size_t engines, size_t pairs, double keep, double half_life_s) {
    px_latmodel *m = px_xcalloc(1, sizeof *m);
    table_init(&m->eng, engines);
    table_init(&m->pair, pairs);
    m->keep = keep > 0 && keep <= 1 ? keep : 0.95;
    m->half_life_s = half_life_s > 0 ? half_life_s : 30;
    return m;
}

void px_latmodel_destroy(px_latmodel *m) {
    if (!m) return;
    free(m->eng.e);
    free(m->pair.e);
    free(m);
}

static void lock(entry *e) {
    while (atomic_exchange_explicit(&e->busy, 1, memory_order_acquire)) {
    }
}

static void unlock(entry *e) {
    atomic_store_explicit(&e->busy, 0, memory_order_release);
}

/* Writer side of the sequence: odd while the lines (or key) change. */
static void write_begin(entry *e) {
    atomic_fetch_add_explicit(&e->seq, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
}

static void write_end(entry *e) {
    atomic_fetch_add_explicit(&e->seq, 1, memory_order_release);
}

static void set_name(entry *e, const char *name) {
    size_t i = 0;
    for (; name && name[i] && i + 1 < NAME_MAX_LEN; i++)
        atomic_store_explicit(&e->name[i], name[i], memory_order_relaxed);
    atomic_store_explicit(&e->name[i], 0, memory_order_relaxed);
}

/* A line as readers see it. */
typedef struct line {
    double a, b, w;
    uint64_t n;
} line;

/* A reader's attempts at a consistent read of an entry: spinning first,
 * then yielding the CPU (a writer preempted mid-update, with more threads
 * than cores, finishes only when it runs again). Past them the entry is
 * taken as unknown (the pooled line answers). */
#define READ_SPINS 64
#define READ_TRIES 1024

/* Reads kind k's line of e, and checks e still holds `key` (0: any).
 * Returns 0 when e holds another key now, or no consistent read came. */
static int read_line(const entry *e0, uint64_t key, int k, line *l) {
    entry *e = (entry *)e0; /* the atomics are only loaded */
    for (int tries = 0; tries < READ_TRIES; tries++) {
        if (tries >= READ_SPINS) sched_yield();
        unsigned s1 = atomic_load_explicit(&e->seq, memory_order_acquire);
        if (s1 & 1) continue; /* a writer is mid-update */
        uint64_t kk = atomic_load_explicit(&e->key, memory_order_relaxed);
        l->a = atomic_load_explicit(&e->a[k], memory_order_relaxed);
        l->b = atomic_load_explicit(&e->b[k], memory_order_relaxed);
        l->w = atomic_load_explicit(&e->w[k], memory_order_relaxed);
        l->n = atomic_load_explicit(&e->n[k], memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&e->seq, memory_order_relaxed) == s1) return !key || kk == key;
    }
    return 0;
}

static entry *find(const table *t, uint64_t key) {
    size_t h = (size_t)px_mix64(key);
    for (size_t i = 0; i < PROBES; i++) {
        entry *e = &t->e[(h + i) & t->mask];
        uint64_t k = atomic_load_explicit(&e->key, memory_order_acquire);
        if (k == key) return e;
        if (!k) return NULL;
    }
    return NULL;
}

/* The entry of `key`, made when missing: a free cell of its window, else
 * the one used longest ago (its fits start over). Returned locked. */
static entry *find_or_take(table *t, uint64_t key, const char *name) {
    size_t h = (size_t)px_mix64(key);
    for (int round = 0; round < 4; round++) {
        entry *stalest = NULL;
        for (size_t i = 0; i < PROBES; i++) {
            entry *e = &t->e[(h + i) & t->mask];
            uint64_t k = atomic_load_explicit(&e->key, memory_order_acquire);
            if (k == key) {
                lock(e);
                if (atomic_load_explicit(&e->key, memory_order_relaxed) == key) return e;
                unlock(e);
                break; /* taken over meanwhile: look again */
            }
            if (!k) {
                lock(e);
                if (atomic_load_explicit(&e->key, memory_order_relaxed) != 0) {
                    unlock(e);
                    break;
                }
                write_begin(e);
                set_name(e, name);
                atomic_store_explicit(&e->key, key, memory_order_relaxed);
                write_end(e);
                return e;
            }
            if (!stalest || atomic_load_explicit(&e->last_ns, memory_order_relaxed) <
                                atomic_load_explicit(&stalest->last_ns, memory_order_relaxed))
                stalest = e;
        }
        if (!stalest) continue;
        lock(stalest);
        write_begin(stalest);
        memset(stalest->fit, 0, sizeof stalest->fit);
        for (int k = 0; k < PX_LAT_KINDS; k++) {
            atomic_store_explicit(&stalest->a[k], 0, memory_order_relaxed);
            atomic_store_explicit(&stalest->b[k], 0, memory_order_relaxed);
            atomic_store_explicit(&stalest->w[k], 0, memory_order_relaxed);
            atomic_store_explicit(&stalest->n[k], 0, memory_order_relaxed);
        }
        set_name(stalest, name);
        atomic_store_explicit(&stalest->key, key, memory_order_relaxed);
        write_end(stalest);
        atomic_fetch_add_explicit(&t->taken_over, 1, memory_order_relaxed);
        return stalest;
    }
    return NULL;
}

/* Adds a sample to kind k of the locked entry e and republishes its line
 * (prior: the slope before samples say more). Unlocks e. */
static void add_and_publish(px_latmodel *m, entry *e, int k, double x, double y, uint64_t now,
                            double prior_b) {
    px_lat_fit_add(&e->fit[k], x, y, now, m->keep, m->half_life_s);
    double a, b, w = px_lat_fit_solve(&e->fit[k], prior_b, &a, &b);
    write_begin(e);
    atomic_store_explicit(&e->a[k], a, memory_order_relaxed);
    atomic_store_explicit(&e->b[k], b, memory_order_relaxed);
    atomic_store_explicit(&e->w[k], w, memory_order_relaxed);
    atomic_store_explicit(&e->n[k], e->fit[k].n, memory_order_relaxed);
    write_end(e);
    atomic_store_explicit(&e->last_ns, now, memory_order_relaxed);
    unlock(e);
}

/* The pooled line of kind k (kv: k == PX_LAT_KINDS). */
static line pooled_line(const px_latmodel *m, int k) {
    line l;
    const entry *e = k == PX_LAT_KINDS ? &m->pooled_kv : &m->pooled[k];
    if (!read_line(e, 0, k == PX_LAT_KINDS ? PAIR_KIND : k, &l) || l.w <= 0) {
        l.a = 0;
        l.b = k == PX_LAT_KINDS ? default_kv_b : default_b[k];
        l.w = 0;
        l.n = 0;
    }
    return l;
}

void px_lat_observe(px_latmodel *m, uint64_t key, const char *name, px_lat_kind k, double x,
                    double y_s, uint64_t now_ns) {
    if (!m || k >= PX_LAT_KINDS || !(y_s >= 0) || !(x >= 0)) return;
    entry *pe = &m->pooled[k];
    lock(pe);
    add_and_publish(m, pe, k, x, y_s, now_ns, default_b[k]);
    line pl = pooled_line(m, k);
    entry *e = find_or_take(&m->eng, key, name);
    if (e) add_and_publish(m, e, k, x, y_s, now_ns, pl.b);
}

void px_lat_observe_pair(px_latmodel *m, uint64_t pkey, uint64_t dkey, const char *pname,
                         const char *dname, double tokens, double y_s, uint64_t now_ns) {
    if (!m || !(y_s >= 0) || !(tokens >= 0)) return;
    lock(&m->pooled_kv);
    add_and_publish(m, &m->pooled_kv, PAIR_KIND, tokens, y_s, now_ns, default_kv_b);
    line pl = pooled_line(m, PX_LAT_KINDS);
    char name[NAME_MAX_LEN];
    snprintf(name, sizeof name, "%.38s>%.38s", pname ? pname : "?", dname ? dname : "?");
    uint64_t key = px_mix64(pkey ^ px_mix64(dkey + 0x9e3779b97f4a7c15ull)) | 1;
    entry *e = find_or_take(&m->pair, key, name);
    if (e) add_and_publish(m, e, PAIR_KIND, tokens, y_s, now_ns, pl.b);
}

/* y at x, the entry's own line blended with the pooled one. */
static double blend(const line *own, const line *pooled, double x) {
    double yp = pooled->a + pooled->b * x;
    if (!own || own->w <= 0) return yp;
    double f = own->w * own->w / (own->w * own->w + BLEND);
    return f * (own->a + own->b * x) + (1 - f) * yp;
}

static int own_line(const table *t, uint64_t key, int k, line *l) {
    const entry *e = find(t, key);
    return e && read_line(e, key, k, l);
}

/* y at x, and the weight of the engine's own fit in *w. */
static double engine_pred(const px_latmodel *m, uint64_t key, px_lat_kind k, double x, double *w) {
    line pl = pooled_line(m, k), own;
    int have = own_line(&m->eng, key, k, &own);
    *w = have ? own.w : 0;
    return blend(have ? &own : NULL, &pl, x);
}

double px_lat_predict(const px_latmodel *m, uint64_t key, px_lat_kind k, double x) {
    double w;
    return m && k < PX_LAT_KINDS ? engine_pred(m, key, k, x, &w) : 0;
}

double px_lat_slope(const px_latmodel *m, uint64_t key, px_lat_kind k) {
    if (!m || k >= PX_LAT_KINDS) return 0;
    line pl = pooled_line(m, k), own;
    if (!own_line(&m->eng, key, k, &own) || own.w <= 0) return pl.b;
    double f = own.w * own.w / (own.w * own.w + BLEND);
    return f * own.b + (1 - f) * pl.b;
}

static double pair_pred(const px_latmodel *m, uint64_t pkey, uint64_t dkey, double tokens,
                        double *w) {
    uint64_t key = px_mix64(pkey ^ px_mix64(dkey + 0x9e3779b97f4a7c15ull)) | 1;
    line pl = pooled_line(m, PX_LAT_KINDS), own;
    int have = own_line(&m->pair, key, PAIR_KIND, &own);
    *w = have ? own.w : 0;
    return blend(have ? &own : NULL, &pl, tokens);
}

double px_lat_predict_pair(const px_latmodel *m, uint64_t pkey, uint64_t dkey, double tokens) {
    double w;
    return m ? pair_pred(m, pkey, dkey, tokens, &w) : 0;
}

/* ---------- errors ---------- */

void px_lat_error(px_latmodel *m, double predicted_s, double observed_s) {
    if (!m || !(observed_s > 0) || !(predicted_s >= 0)) return;
    double rel = fabs(predicted_s - observed_s) / observed_s;
    int b = rel >= 1 ? ERR_BUCKETS - 1 : (int)(rel / 0.05);
    atomic_fetch_add_explicit(&m->err[b], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->err_n, 1, memory_order_relaxed);
    double cur = atomic_load_explicit(&m->err_sum, memory_order_relaxed);
    while (!atomic_compare_exchange_weak(&m->err_sum, &cur, cur + rel)) {
    }
}

double px_lat_error_median(const px_latmodel *m) {
    px_latmodel *mm = (px_latmodel *)m;
    uint64_t n = atomic_load(&mm->err_n), acc = 0;
    if (!n) return -1;
    for (int b = 0; b < ERR_BUCKETS; b++) {
        acc += atomic_load(&mm->err[b]);
        if (2 * acc >= n) return (b + 0.5) * 0.05;
    }
    return 1;
}

/* ---------- the views ---------- */

static void json_line(struct px_buf *o, const char *kind, const line *l) {
    px_buf_printf(o, "\"%s\":{\"a\":%.6g,\"b\":%.6g,\"weight\":%.3f,\"samples\":%llu}", kind, l->a,
                  l->b, l->w, (unsigned long long)l->n);
}

static void json_entries(const table *t, struct px_buf *o, int pairs, uint64_t now) {
    int first = 1;
    for (size_t i = 0; i <= t->mask; i++) {
        entry *e = &t->e[i];
        uint64_t key = atomic_load_explicit(&e->key, memory_order_acquire);
        if (!key) continue;
        char name[NAME_MAX_LEN];
        for (size_t j = 0; j < NAME_MAX_LEN; j++)
            name[j] = atomic_load_explicit(&e->name[j], memory_order_relaxed);
        name[NAME_MAX_LEN - 1] = 0;
        px_buf_appends(o, first ? "{\"name\":" : ",{\"name\":");
        first = 0;
        if (pairs) {
            char *gt = strchr(name, '>');
            if (gt) *gt = 0;
            px_buf_append_json_str(o, name, strlen(name));
            px_buf_appends(o, ",\"decode\":");
            const char *d = gt ? gt + 1 : "";
            px_buf_append_json_str(o, d, strlen(d));
        } else {
            px_buf_append_json_str(o, name, strlen(name));
        }
        uint64_t last = atomic_load_explicit(&e->last_ns, memory_order_relaxed);
        px_buf_printf(o, ",\"idle_s\":%.1f", last && now > last ? (double)(now - last) / 1e9 : 0.0);
        for (int k = 0; k < (pairs ? 1 : PX_LAT_KINDS); k++) {
            line l;
            if (!read_line(e, key, k, &l)) l = (line){0, 0, 0, 0};
            px_buf_appends(o, ",");
            if (pairs) {
                json_line(o, "kv", &l);
                px_buf_printf(o, ",\"tokens_per_s\":%.6g", l.b > 0 ? 1 / l.b : 0.0);
            } else {
                json_line(o, kind_names[k], &l);
            }
        }
        px_buf_appends(o, "}");
    }
}

void px_lat_render_json(const px_latmodel *m, struct px_buf *o) {
    uint64_t now = px_now_ns();
    px_buf_printf(o, "{\"keep\":%.4f,\"half_life_s\":%.3f,\"pooled\":{", m->keep, m->half_life_s);
    for (int k = 0; k <= PX_LAT_KINDS; k++) {
        line l = pooled_line(m, k);
        if (k) px_buf_appends(o, ",");
        json_line(o, px_lat_kind_name((px_lat_kind)k), &l);
    }
    px_buf_appends(o, "},\"engines\":[");
    json_entries(&m->eng, o, 0, now);
    px_buf_appends(o, "],\"pairs\":[");
    json_entries(&m->pair, o, 1, now);
    px_latmodel *mm = (px_latmodel *)m;
    uint64_t n = atomic_load(&mm->err_n);
    px_buf_printf(o,
                  "],\"taken_over\":{\"engines\":%llu,\"pairs\":%llu},\"ttft_error\":{"
                  "\"predictions\":%llu,\"median\":%.3f,\"mean\":%.3f,\"buckets\":[",
                  (unsigned long long)atomic_load(&mm->eng.taken_over),
                  (unsigned long long)atomic_load(&mm->pair.taken_over), (unsigned long long)n,
                  n ? px_lat_error_median(m) : 0.0,
                  n ? atomic_load(&mm->err_sum) / (double)n : 0.0);
    for (int b = 0; b < ERR_BUCKETS; b++)
        px_buf_printf(o, "%s%llu", b ? "," : "", (unsigned long long)atomic_load(&mm->err[b]));
    px_buf_appends(o, "]}}");
}

void px_lat_render_metrics(const px_latmodel *m, struct px_buf *o) {
    px_latmodel *mm = (px_latmodel *)m;
    px_buf_appends(o, "# HELP pdproxy_latency_model_ttft_error Relative error of the latency "
                      "model's predicted TTFT, |predicted - observed| / observed.\n"
                      "# TYPE pdproxy_latency_model_ttft_error histogram\n");
    uint64_t acc = 0;
    for (int b = 0; b < ERR_BUCKETS - 1; b++) {
        acc += atomic_load(&mm->err[b]);
        px_buf_printf(o, "pdproxy_latency_model_ttft_error_bucket{le=\"%.2f\"} %llu\n",
                      (b + 1) * 0.05, (unsigned long long)acc);
    }
    uint64_t n = atomic_load(&mm->err_n);
    px_buf_printf(o,
                  "pdproxy_latency_model_ttft_error_bucket{le=\"+Inf\"} %llu\n"
                  "pdproxy_latency_model_ttft_error_sum %.6f\n"
                  "pdproxy_latency_model_ttft_error_count %llu\n",
                  (unsigned long long)n, atomic_load(&mm->err_sum), (unsigned long long)n);
}

/* ---------- the plan ---------- */

/* The choice is made on predictions less an exploration bonus: a part
 * predicted from little of its own evidence (weight w) counts EXPLORE /
 * (1 + w) less, so an engine, pair or decode-alone path never tried is
 * tried (its pooled stand-in could hide that it is the fastest), and one
 * idle long enough for its evidence to fade is tried again. */
#define EXPLORE 0.5

static double optimistic(double y, double w) {
    return y * (1 - EXPLORE / (1 + w));
}

void px_lat_plan_make(const px_latmodel *m, const px_lat_cand *P, size_t np, const px_lat_cand *D,
                      size_t nd, size_t ntok, double tpot_s, px_lat_plan *out) {
    memset(out, 0, sizeof *out);
    double best = INFINITY, best_local = INFINITY, w;
    /* Decode's parts do not depend on the prefill: once per decode. Its
     * TPOT decides whether it may take the request at all. */
    double dec[64], dscore[64], backlog[64], tp[64], pre[64], pscore[64], pslope[64];
    int tpot_ok[64], any_ok = 0;
    size_t n_d = nd < 64 ? nd : 64, n_p = np < 64 ? np : 64;
    for (size_t i = 0; i < n_p; i++) {
        size_t u = ntok > P[i].cached ? ntok - P[i].cached : 0;
        pre[i] = engine_pred(m, P[i].key, PX_LAT_PREFILL, (double)P[i].tokens + (double)u, &w);
        pscore[i] = optimistic(pre[i], w);
        pslope[i] = px_lat_slope(m, P[i].key, PX_LAT_PREFILL);
    }
    for (size_t j = 0; j < n_d; j++) {
        dec[j] = engine_pred(m, D[j].key, PX_LAT_DECODE, (double)D[j].inflight, &w);
        dscore[j] = optimistic(dec[j], w);
        /* The prompts it computes for decode-only requests, in seconds at
         * its own speed: its first token waits for what is left of them
         * when the KV lands. */
        backlog[j] = px_lat_slope(m, D[j].key, PX_LAT_LOCAL) * (double)D[j].tokens;
        tp[j] = px_lat_predict(m, D[j].key, PX_LAT_TPOT, (double)D[j].inflight);
        tpot_ok[j] = tpot_s <= 0 || tp[j] <= tpot_s;
        any_ok |= tpot_ok[j];
    }
    for (size_t j = 0; j < n_d; j++) {
        if (any_ok && !tpot_ok[j]) continue;
        /* Decode alone: it computes what it lacks of the prompt, which
         * holds up the first token of every request whose KV lands on it
         * meanwhile (those routed after this plan too, which no plan can
         * see): only on a decode computing no other prompt, so that such
         * delays stay one prompt long. */
        size_t lu = ntok > D[j].cached ? ntok - D[j].cached : 0;
        double lx = (double)D[j].tokens + (double)lu;
        double local = engine_pred(m, D[j].key, PX_LAT_LOCAL, lx, &w);
        if (D[j].tokens <= 0 && optimistic(local, w) < best_local) {
            best_local = optimistic(local, w);
            out->local_score = best_local;
            out->local_ok = 1;
            out->lkey = D[j].key;
            out->l_cached = D[j].cached;
            out->local = local;
            out->local_wait = backlog[j];
            out->l_x = lx;
            out->ltp_x = D[j].inflight;
        }
        for (size_t i = 0; i < n_p; i++) {
            size_t u = ntok > P[i].cached ? ntok - P[i].cached : 0;
            double kv = pair_pred(m, P[i].key, D[j].key, (double)ntok, &w);
            double held = backlog[j] - pre[i] - kv;
            if (held < 0) held = 0;
            double score = pscore[i] + optimistic(kv, w) + dscore[j] + held;
            if (score < best) {
                best = score;
                out->score = score;
                out->ok = 1;
                out->pkey = P[i].key;
                out->dkey = D[j].key;
                out->p_cached = P[i].cached;
                out->ttft = pre[i] + kv + dec[j] + held;
                out->pre = pre[i];
                out->kv = kv;
                out->dec = dec[j] + held;
                out->wait = pslope[i] * (double)P[i].tokens + held;
                out->tpot = tp[j];
                out->p_x = (double)P[i].tokens + (double)u;
                out->d_x = D[j].inflight;
                out->d_backlog = backlog[j];
                out->tp_x = D[j].inflight;
            }
        }
    }
}
