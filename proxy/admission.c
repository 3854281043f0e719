/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/admission.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "proxy/bodyidx.h"

void px_admq_init(px_admq *q, const uint32_t *weights, size_t ntenants, size_t max_n,
                  size_t max_bytes) {
    /* A class's flows (one per tenant, 10 KiB at the default capacity) are
     * made by its first request: most classes of most workers never see
     * one. */
    *q = (px_admq){.weights = weights, .ntenants = ntenants, .max_n = max_n,
                   .max_bytes = max_bytes};
}

void px_admq_cleanup(px_admq *q) {
    for (int c = 0; c < PX_ADM_CLASSES; c++) {
        free(q->cls[c].flows);
        q->cls[c].flows = NULL;
    }
}

static void activate(px_adm_class *c, px_adm_flow *f) {
    f->active = 1;
    f->anext = NULL;
    f->aprev = c->atail;
    if (c->atail)
        c->atail->anext = f;
    else
        c->ahead = f;
    c->atail = f;
    c->nactive++;
}

static void deactivate(px_adm_class *c, px_adm_flow *f) {
    if (f->aprev)
        f->aprev->anext = f->anext;
    else
        c->ahead = f->anext;
    if (f->anext)
        f->anext->aprev = f->aprev;
    else
        c->atail = f->aprev;
    f->anext = f->aprev = NULL;
    f->active = 0;
    f->credit = 0;
    c->nactive--;
}

/* The head flow to the tail of the active list: its turn is over. */
static void rotate(px_adm_class *c) {
    px_adm_flow *f = c->ahead;
    if (!f || c->nactive < 2) return;
    uint32_t credit = f->credit;
    deactivate(c, f);
    activate(c, f);
    f->credit = credit;
}

int px_admq_push(px_admq *q, px_adm_item *it) {
    if (q->n + 1 > q->max_n || (q->max_bytes && q->bytes + it->bytes > q->max_bytes)) {
        q->dropped++;
        return -1;
    }
    if (it->cls < 0 || it->cls >= PX_ADM_CLASSES) it->cls = px_adm_class_of(it->cls);
    if (it->tenant >= q->ntenants) it->tenant = q->ntenants ? q->ntenants - 1 : 0;
    px_adm_class *c = &q->cls[it->cls];
    if (!c->flows) c->flows = px_xcalloc(q->ntenants ? q->ntenants : 1, sizeof(px_adm_flow));
    px_adm_flow *f = &c->flows[it->tenant];
    it->next = NULL;
    it->prev = f->tail;
    if (f->tail)
        f->tail->next = it;
    else
        f->head = it;
    f->tail = it;
    if (!f->active) activate(c, f);
    it->queued = 1;
    c->n++;
    q->n++;
    q->bytes += it->bytes;
    q->pushed++;
    return 0;
}

void px_admq_remove(px_admq *q, px_adm_item *it) {
    if (!it->queued) return;
    px_adm_class *c = &q->cls[it->cls];
    px_adm_flow *f = &c->flows[it->tenant];
    if (it->prev)
        it->prev->next = it->next;
    else
        f->head = it->next;
    if (it->next)
        it->next->prev = it->prev;
    else
        f->tail = it->prev;
    it->prev = it->next = NULL;
    it->queued = 0;
    if (!f->head) deactivate(c, f);
    c->n--;
    q->n--;
    q->bytes -= it->bytes;
}

/* The next item of class ci that ok accepts (DRR between its tenants). */
static px_adm_item *pop_class(px_admq *q, int ci, int (*ok)(void *arg, px_adm_item *it),
                              void *arg) {
    px_adm_class *c = &q->cls[ci];
    /* Each active flow is looked at once at most. */
    for (size_t i = 0, n = c->nactive; i < n; i++) {
        px_adm_flow *f = c->ahead;
        if (!f->credit) {
            /* A reload may change a weight meanwhile (px_adm_reconfigure). */
            uint32_t w =
                q->weights ? __atomic_load_n(&q->weights[f - c->flows], __ATOMIC_RELAXED) : 1;
            f->credit = w ? w : 1;
        }
        px_adm_item *it = f->head;
        if (ok && !ok(arg, it)) {
            rotate(c); /* keeps its credit for its next turn */
            continue;
        }
        f->credit--;
        int spent = f->credit == 0;
        px_admq_remove(q, it); /* deactivates f when it empties */
        if (f->active && spent) rotate(c);
        return it;
    }
    return NULL;
}

void px_admq_set_shares(px_admq *q, const px_prio_map *m) {
    int on = m && m->n && m->c[0].share;
    for (int ci = 0; ci < PX_ADM_CLASSES; ci++) {
        uint32_t sh = on && (size_t)ci < m->n ? m->c[ci].share : 0;
        if (sh != q->share[ci]) q->ccredit[ci] = sh;
        q->share[ci] = sh;
    }
    q->shares = on;
}

px_adm_item *px_admq_pop(px_admq *q, int (*ok)(void *arg, px_adm_item *it), void *arg) {
    if (!q->shares) { /* strict order */
        for (int ci = 0; ci < PX_ADM_CLASSES && q->n; ci++) {
            px_adm_item *it = q->cls[ci].n ? pop_class(q, ci, ok, arg) : NULL;
            if (it) return it;
        }
        return NULL;
    }
    /* Shares: classes in order, each while it has credit in this round;
     * a new round when every class with requests has spent its credit (a
     * class whose requests wait for their pool keeps its credit). */
    for (int round = 0; round < 2 && q->n; round++) {
        int waiting = 0;
        for (int ci = 0; ci < PX_ADM_CLASSES; ci++) {
            if (!q->cls[ci].n || !q->ccredit[ci]) continue;
            px_adm_item *it = pop_class(q, ci, ok, arg);
            if (it) {
                q->ccredit[ci]--;
                return it;
            }
            waiting = 1;
        }
        if (waiting) {
            /* Work conserving: a class out of credit may still use a pool
             * the waiting ones cannot. */
            for (int ci = 0; ci < PX_ADM_CLASSES; ci++) {
                px_adm_item *it = q->cls[ci].n && !q->ccredit[ci] ? pop_class(q, ci, ok, arg)
                                                                   : NULL;
                if (it) return it;
            }
            return NULL;
        }
        for (int ci = 0; ci < PX_ADM_CLASSES; ci++)
            q->ccredit[ci] = q->share[ci];
    }
    return NULL;
}

/* ---------- the gate, on a worker's loop ---------- */

#include <errno.h>
#include <event2/event.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/json.h"
#include "base/log.h"
#include "proxy/kvindex.h"
#include "proxy/rewrite.h"
#include "proxy/tenant.h"

/* How often a worker with requests waiting looks again on its own:
 * back-offs ending and engines' figures (which change every
 * --metrics-interval at most) are seen this late at most. A slot freed on
 * another worker does not wait for it: that worker wakes this one (see
 * wake_others). */
#define POLL_US 20000

struct px_adm_worker {
    px_wctx *w; /* borrowed */
    px_admq q;
    struct event *poll; /* owned */
    int dispatching;    /* in dispatch(): leave() asks for another round */
    int again;
    int stopping;       /* the worker stops: nothing more is dispatched */
    unsigned turn;      /* slots freed here while others wait: every other one is theirs */
    /* Cross-thread: other workers read nq and write efd. */
    int efd;                 /* owned eventfd: "a pool slot was freed elsewhere" */
    struct event *wake;      /* owned: reads efd on this worker's loop */
    atomic_size_t nq;        /* q.n, published for the other workers */
    atomic_int wake_pending; /* efd written and not yet read: no second write */
};

static void dispatch(px_adm_worker *a);

static void on_poll(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    dispatch(arg);
}

static void on_wake(evutil_socket_t fd, short what, void *arg) {
    (void)what;
    px_adm_worker *a = arg;
    uint64_t v;
    if (read(fd, &v, sizeof v) < 0 && errno != EAGAIN) return;
    atomic_store(&a->wake_pending, 0);
    px_m_inc(&a->w->metrics.adm[PX_ADM_M_WOKEN]);
    dispatch(a);
}

/* The queue's length, for the other workers' wake_others. */
static void publish(px_adm_worker *a) {
    atomic_store(&a->nq, a->q.n);
}

/* A slot of a pool was freed on worker `self`, and its own queue could not
 * use it: every other worker with requests waiting is woken, through its
 * eventfd (the loops have no locking, so no event_active across threads),
 * to look at its queue now. Each is written once until it has read. */
/* Whether another worker has requests waiting. */
static int others_wait(px_wctx *self) {
    px_ctx *c = self->ctx;
    for (int i = 0; i < c->nworkers; i++) {
        px_adm_worker *o = c->workers[i] ? c->workers[i]->adm : NULL;
        if (o && o != self->adm && atomic_load(&o->nq)) return 1;
    }
    return 0;
}

static void wake_others(px_wctx *self) {
    px_ctx *c = self->ctx;
    for (int i = 0; i < c->nworkers; i++) {
        px_adm_worker *o = c->workers[i] ? c->workers[i]->adm : NULL;
        if (!o || o == self->adm || o->efd < 0 || !atomic_load(&o->nq)) continue;
        if (atomic_exchange(&o->wake_pending, 1)) continue;
        uint64_t one = 1;
        if (write(o->efd, &one, sizeof one) < 0) atomic_store(&o->wake_pending, 0);
    }
}

px_adm_worker *px_adm_worker_create(px_wctx *w) {
    const px_config *cfg = w->ctx->cfg;
    px_adm_worker *a = px_xcalloc(1, sizeof *a);
    a->w = w;
    int nw = w->ctx->nworkers > 0 ? w->ctx->nworkers : 1;
    size_t max_n = cfg->queue_max ? ((size_t)cfg->queue_max + (size_t)nw - 1) / (size_t)nw : 0;
    size_t max_b = cfg->queue_max_bytes ? ((size_t)cfg->queue_max_bytes + (size_t)nw - 1) / (size_t)nw : 0;
    px_admq_init(&a->q, w->ctx->tenant_weights, w->ctx->tenants.cap + 1, max_n, max_b);
    a->poll = event_new(w->base, -1, 0, on_poll, a);
    a->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (a->efd >= 0) {
        a->wake = event_new(w->base, a->efd, EV_READ | EV_PERSIST, on_wake, a);
        event_add(a->wake, NULL);
    } /* else: other workers' slots are seen by the poll alone */
    return a;
}


void px_adm_worker_stop(px_adm_worker *a) {
    if (a) a->stopping = 1;
}

void px_adm_worker_destroy(px_adm_worker *a) {
    if (!a) return;
    if (a->poll) event_free(a->poll);
    if (a->wake) event_free(a->wake);
    if (a->efd >= 0) close(a->efd);
    px_admq_cleanup(&a->q);
    free(a);
}

static const char *const sat_names[PX_SAT_SIGNALS] = {"inflight", "backoff", "waiting",
                                                      "kv_usage", "ttfb"};

const char *px_sat_signal_name(int i) {
    return i >= 0 && i < PX_SAT_SIGNALS ? sat_names[i] : "";
}

int px_adm_wants_engine_load(const px_config *cfg) {
    return cfg->saturate_waiting > 0 || cfg->saturate_kv_usage > 0;
}

unsigned px_pool_saturation(px_ctx *c, px_pset *ps, uint64_t now) {
    const px_config *cfg = c->cfg;
    unsigned why = 0;
    long admitted = atomic_load(&ps->admitted);
    int64_t max = atomic_load_explicit(&c->pool_max_inflight, memory_order_relaxed);
    if (max > 0 && admitted >= max) why |= PX_SAT_INFLIGHT;
    if (cfg->saturate_ttfb > 0 && admitted > 0 &&
        (double)atomic_load_explicit(&ps->ttfb_ewma_us, memory_order_relaxed) >=
            cfg->saturate_ttfb * 1e6)
        why |= PX_SAT_TTFB;
    int backoff = atomic_load_explicit(&ps->backoff_until_ns, memory_order_relaxed) > now;
    if (backoff) {
        /* Every prefill backing off saturates the pool as well. */
        px_pool *pp = &ps->prefill;
        int pusable = 0, pfull = 0;
        pthread_mutex_lock(&pp->mu);
        for (size_t i = 0; i < pp->n; i++) {
            px_backend *b = pp->b[i];
            if (!atomic_load(&b->healthy) || atomic_load(&b->drained)) continue;
            pusable++;
            if (atomic_load(&b->backoff_until_ns) > now) pfull++;
        }
        pthread_mutex_unlock(&pp->mu);
        if (pusable > 0 && pfull == pusable) why |= PX_SAT_BACKOFF;
    }
    if (!backoff && !px_adm_wants_engine_load(cfg)) return why;
    /* Every decode that would take the request is backing off or reports
     * a full queue or KV cache. */
    long kv_milli = (long)(cfg->saturate_kv_usage * 1000.0 + 0.5);
    px_pool *p = &ps->decode;
    int usable = 0, full = 0;
    unsigned seen = 0;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->n; i++) {
        px_backend *b = p->b[i];
        if (!atomic_load(&b->healthy) || atomic_load(&b->drained)) continue;
        usable++;
        unsigned bw = 0;
        if (atomic_load(&b->backoff_until_ns) > now) bw |= PX_SAT_BACKOFF;
        if (atomic_load(&b->load_known)) {
            if (cfg->saturate_waiting > 0 && atomic_load(&b->waiting) >= cfg->saturate_waiting)
                bw |= PX_SAT_WAITING;
            if (cfg->saturate_kv_usage > 0 && atomic_load(&b->kv_usage_milli) >= kv_milli)
                bw |= PX_SAT_KV;
        }
        if (bw) full++;
        seen |= bw;
    }
    pthread_mutex_unlock(&p->mu);
    if (usable > 0 && full == usable) why |= seen;
    return why;
}

int px_pool_saturated(px_ctx *c, px_pset *ps, uint64_t now) {
    return px_pool_saturation(c, ps, now) != 0;
}

void px_adm_first_byte(px_adm_req *a) {
    if (!a->t_sent || !a->ps) return;
    uint64_t now = px_now_ns();
    uint64_t us = now > a->t_sent ? (now - a->t_sent) / 1000 : 0;
    a->t_sent = 0; /* one sample per request (a retry's second answer is not one) */
    unsigned long long cur = atomic_load_explicit(&a->ps->ttfb_ewma_us, memory_order_relaxed);
    unsigned long long next;
    do {
        /* The first sample sets it; then 7/8 of the old and 1/8 of the new. */
        next = cur ? (cur * 7 + us) / 8 : (us ? us : 1);
    } while (!atomic_compare_exchange_weak(&a->ps->ttfb_ewma_us, &cur, next));
}

/* A Prometheus label value: backslash, quote and newline escaped. */
static void label_value(px_buf *o, const char *v) {
    for (; *v; v++) {
        if (*v == '\n') {
            px_buf_appends(o, "\\n");
            continue;
        }
        if (*v == '\\' || *v == '"') px_buf_append(o, "\\", 1);
        px_buf_append(o, v, 1);
    }
}

void px_adm_render_metrics(px_ctx *c, px_buf *o) {
    uint64_t now = px_now_ns();
    px_gen *g = px_ctx_gen(c);
    px_buf_appends(o, "# HELP pdproxy_pool_saturated Whether a signal saturates the pool now "
                      "(requests for it wait in the admission queue).\n"
                      "# TYPE pdproxy_pool_saturated gauge\n");
    for (size_t i = 0; i < g->nps; i++) {
        unsigned why = px_pool_saturation(c, &g->ps[i], now);
        for (int s = 0; s < PX_SAT_SIGNALS; s++) {
            px_buf_appends(o, "pdproxy_pool_saturated{pool=\"");
            label_value(o, g->ps[i].name);
            px_buf_printf(o, "\",signal=\"%s\"} %d\n", sat_names[s], (why >> s) & 1);
        }
    }
    px_buf_appends(o, "# HELP pdproxy_pool_ttfb_ewma_seconds Time to first byte since "
                      "dispatch, moving average per pool (--saturate-ttfb compares it).\n"
                      "# TYPE pdproxy_pool_ttfb_ewma_seconds gauge\n");
    for (size_t i = 0; i < g->nps; i++) {
        px_buf_appends(o, "pdproxy_pool_ttfb_ewma_seconds{pool=\"");
        label_value(o, g->ps[i].name);
        px_buf_printf(o, "\"} %.6f\n",
                      (double)atomic_load_explicit(&g->ps[i].ttfb_ewma_us,
                                                   memory_order_relaxed) / 1e6);
    }
    px_gen_release(g);
}

int px_adm_engine_status(px_ctx *c, px_pset *ps, px_backend *b, int status) {
    if (status != 429 && status != 503) return 0;
    if (!b || c->cfg->engine_backoff <= 0) return 1;
    uint64_t until = px_now_ns() + (uint64_t)(c->cfg->engine_backoff * 1e9);
    atomic_store(&b->backoff_until_ns, until);
    unsigned long long cur = atomic_load(&ps->backoff_until_ns);
    while (cur < until && !atomic_compare_exchange_weak(&ps->backoff_until_ns, &cur, until)) {
    }
    PX_LOG(PX_LOG_INFO, "msg=\"engine refused a request: backing off\" backend=%s status=%d "
           "backoff_s=%.3f", b->name, status, c->cfg->engine_backoff);
    return 1;
}

/* Takes one of the pool's --pool-max-inflight slots: 1, or 0 when none is
 * free. A compare-and-swap, so workers admitting at once never pass the
 * limit between them. */
static int take_slot(px_ctx *c, px_pset *ps) {
    long max = (long)atomic_load_explicit(&c->pool_max_inflight, memory_order_relaxed);
    long cur = atomic_load(&ps->admitted);
    do {
        if (max > 0 && cur >= max) return 0;
    } while (!atomic_compare_exchange_weak(&ps->admitted, &cur, cur + 1));
    return 1;
}

/* The queue's test of an item: its pool has room, and then it holds one of
 * the pool's slots. */
static int pool_free(void *arg, px_adm_item *it) {
    px_adm_req *r = (px_adm_req *)it; /* it is the first member */
    if (r->ready && !r->ready(it->owner)) return 0;
    return !px_pool_saturated(arg, r->ps, px_now_ns()) && take_slot(arg, r->ps);
}

static void take_out(px_adm_worker *a, px_adm_req *r, uint64_t now) {
    px_admq_remove(&a->q, &r->it);
    if (r->timer) {
        event_free(r->timer);
        r->timer = NULL;
    }
    publish(a);
    r->wait_ns += now - r->t_enq; /* a requeued request waits more than once */
    px_hist_observe(&a->w->metrics.queue_wait, (double)r->wait_ns / 1e9);
}

static void dispatch(px_adm_worker *a) {
    if (a->stopping) return;
    if (a->dispatching) {
        a->again = 1;
        return;
    }
    a->dispatching = 1;
    px_admq_set_shares(&a->q, px_adm_classes(a->w->ctx));
    do {
        a->again = 0;
        px_adm_item *it;
        while ((it = px_admq_pop(&a->q, pool_free, a->w->ctx))) {
            px_adm_req *r = (px_adm_req *)it;
            /* popped: out of the queue already */
            take_out(a, r, px_now_ns());
            r->sent = 1; /* pool_free took its slot */
            r->t_sent = px_now_ns();
            px_m_inc(&a->w->metrics.adm[PX_ADM_M_DISPATCHED]);
            r->go(it->owner);
        }
    } while (a->again);
    a->dispatching = 0;
    publish(a);
    if (a->q.n) {
        struct timeval tv = {0, POLL_US};
        event_add(a->poll, &tv);
    }
}

static void on_deadline(evutil_socket_t fd, short what, void *arg) {
    (void)fd, (void)what;
    px_adm_req *r = arg;
    px_wctx *w = r->w;
    px_m_inc(&w->metrics.adm[PX_ADM_M_TIMEOUT]);
    take_out(w->adm, r, px_now_ns());
    r->expire(r->it.owner);
}

/* The request's priority class: the header (a number or a class's name),
 * else the body's "priority" (else vLLM's default, 0), through the
 * --priority-class map; never better than its tenant's floor= (a claim of
 * a better priority is served at the floor: who may claim which class is
 * the tenant's configuration, not the client's word). */
static int class_of(px_ctx *c, const px_tenant *t, const px_http_head *h,
                    const px_body_idx *bx, const char *body, size_t blen) {
    const px_config *cfg = c->cfg;
    const px_prio_map *m = px_adm_classes(c);
    const px_http_header *ph = cfg->priority_header[0] ? px_http_find(h, cfg->priority_header)
                                                       : NULL;
    long long v = 0;
    int k = -1;
    px_json_member jm;
    if (ph && ph->value_len && px_prio_number(ph->value, ph->value + ph->value_len, &v) == 0)
        k = -2; /* a number */
    else if (ph && ph->value_len && (k = px_prio_map_named(m, ph->value, ph->value_len)) >= 0)
        v = m->c[k].lo;
    if (k == -1 && !(px_body_idx_get(bx, PX_BK_PRIORITY, body, blen, &jm) &&
                     jm.type == PX_JSON_NUMBER &&
                     px_prio_number(jm.val, jm.val + jm.val_len, &v) == 0))
        v = 0;
    if (t && atomic_load_explicit(&t->has_floor, memory_order_relaxed)) {
        long long fl = atomic_load_explicit(&t->floor, memory_order_relaxed);
        if (v < fl) return px_prio_map_class(m, fl);
    }
    return k >= 0 ? k : px_prio_map_class(m, v);
}

int px_adm_request_class(px_ctx *c, const px_http_head *h, const char *body, size_t blen) {
    return class_of(c, NULL, h, NULL, body, blen); /* the class claimed, before any tenant's floor */
}

int px_adm_set_classes(px_ctx *c, char *const *specs, size_t n, char *err, size_t errlen) {
    return px_prio_publish(&c->prio, specs, n, err, errlen);
}

const px_prio_map *px_adm_classes(px_ctx *c) {
    return px_prio_current(&c->prio);
}

static double header_seconds(const px_http_head *h, const char *name) {
    const px_http_header *x = px_http_find(h, name);
    char num[32];
    if (!x || !x->value_len || x->value_len >= sizeof num) return -1;
    memcpy(num, x->value, x->value_len);
    num[x->value_len] = 0;
    char *end;
    double v = strtod(num, &end);
    return *end || !(v >= 0) ? -1 : v;
}

/* Who the request is: its tenant from its key (--tenant-keys), else from
 * its client certificate (--tenant-certs), else from the tenant header when
 * a trusted gateway sent it (--tenant-header-from), else the default
 * tenant. The name the credentials gave goes to tname ("" for
 * none: a gateway's tenant unknown here keeps its name, for its salt). 0,
 * or -1 with msg when the header came from anyone else (the caller answers
 * 403). */
static int identify(px_ctx *c, px_adm_req *a, const px_http_head *h, char *tname, size_t tcap,
                    char *msg, size_t cap) {
    const px_config *cfg = c->cfg;
    int bearer = px_bearer_digest(h, a->key); /* hashed once for both key lists */
    long ki = bearer ? px_tkeys_find_digest(c->tkeys, a->key) : -1;
    a->keyed = ki >= 0 || (bearer && px_digest_in(a->key, (const unsigned char(*)[32])c->api_keys,
                                                  c->napi_keys));
    const px_http_header *th = cfg->tenant_header[0] && cfg->tenant_header_from.n
                                   ? px_http_find(h, cfg->tenant_header)
                                   : NULL;
    if (th && !px_cidr_match(c->trusted, c->ntrusted, a->peer ? a->peer : "")) {
        snprintf(msg, cap, "the %s header is accepted from the trusted gateways only "
                 "(--tenant-header-from): a caller's tenant comes from its API key",
                 cfg->tenant_header);
        return -1;
    }
    long ci = ki < 0 && a->cert ? px_tcerts_find(c->tcerts, a->cert) : -1;
    if (ki >= 0)
        snprintf(tname, tcap, "%s", px_tkeys_tenant(c->tkeys, ki));
    else if (ci >= 0)
        snprintf(tname, tcap, "%s", px_tcerts_tenant(c->tcerts, ci));
    else if (th)
        snprintf(tname, tcap, "%.*s", (int)(th->value_len < tcap - 1 ? th->value_len : tcap - 1),
                 th->value);
    else
        tname[0] = 0;
    a->tenant = tname[0] ? px_tenants_find(&c->tenants, tname, strlen(tname))
                         : px_tenants_default(&c->tenants);
    return 0;
}

/* The client's cache_salt value (its bytes as sent) in body, if any. */
static int own_salt(const px_body_idx *bx, const char *body, size_t blen, const char **v,
                    size_t *vn) {
    px_json_member m;
    if (!px_body_idx_get(bx, PX_BK_CACHE_SALT, body, blen, &m) || m.type == PX_JSON_NULL)
        return 0;
    *v = m.val;
    *vn = m.val_len;
    return 1;
}

/* The request's cache_salt (--cache-salt): its tenant's or its key's with
 * the client's own folded in, or (off) the client's own as it is. */
static void make_salt(px_ctx *c, px_adm_req *a, const char *tname, const char *body,
                      size_t blen) {
    const char *own = NULL;
    size_t on = 0;
    int has_own = own_salt(a->bx, body, blen, &own, &on);
    const px_config *cfg = c->cfg;
    px_salt_mode mode = px_salt_mode_of(cfg->cache_salt, c->tkeys || c->tcerts ||
                                                             cfg->tenant_header_from.n);
    a->salt_own = mode == PX_SALT_OFF;
    a->salt[0] = 0;
    a->salt_key = 0;
    if (a->salt_own) {
        /* The index keys by its decoded text, as the engine hashes it. */
        char text[1024];
        long n = has_own && on >= 2 && own[0] == '"'
                     ? px_json_str_decode(own + 1, on - 2, text, sizeof text)
                     : -1;
        if (n > 0) a->salt_key = px_kv_salt_key(text, (size_t)n);
        return;
    }
    px_salt_derive(tname, mode == PX_SALT_KEY && a->keyed ? a->key : NULL, has_own ? own : NULL,
                   has_own ? on : 0, a->salt);
    a->salt_key = px_kv_salt_key(a->salt, strlen(a->salt));
}

/* The most tokens a request may be charged: its prompt (at most a token a
 * byte of the body, and a template's worth) and its completion limit
 * (max_tokens and its spellings, else --default-max-tokens). *reserve:
 * what admission takes from its tenant's tpm, the completion limit (the
 * prompt is charged when the usage settles). */
#define TEMPLATE_SLACK 1024
static uint64_t token_cap(const px_config *cfg, const px_body_idx *bx, const char *body,
                          size_t blen, uint64_t *reserve, int *explicit_max) {
    static const px_bkey keys[] = {PX_BK_MAX_TOKENS, PX_BK_MAX_COMPLETION_TOKENS,
                                   PX_BK_MAX_OUTPUT_TOKENS};
    uint64_t out = (uint64_t)cfg->default_max_tokens;
    px_json_member m, sp;
    const char *obj = body;
    size_t on = blen;
    int nested = px_body_idx_get(bx, PX_BK_SAMPLING_PARAMS, body, blen, &sp) &&
                 sp.type == PX_JSON_OBJECT;
    if (nested) obj = sp.val, on = sp.val_len; /* /inference/v1/generate */
    for (size_t i = 0; obj && i < sizeof keys / sizeof *keys; i++) {
        long long v;
        if (px_body_idx_get(nested ? NULL : bx, keys[i], obj, on, &m) && m.type == PX_JSON_NUMBER &&
            px_prio_number(m.val, m.val + m.val_len, &v) == 0 && v >= 0) {
            out = v > 1000000000LL ? 1000000000ULL : (uint64_t)v;
            *explicit_max = 1;
            break;
        }
    }
    *reserve = out;
    return out + blen + TEMPLATE_SLACK;
}

px_adm_verdict px_adm_enter(px_wctx *w, px_adm_req *a, px_pset *ps, const px_http_head *h,
                            const char *body, size_t blen, int *status, char *extra,
                            size_t extra_cap, char *msg, size_t msg_cap) {
    px_ctx *c = w->ctx;
    const px_config *cfg = c->cfg;
    uint64_t now = px_now_ns();
    a->ps = ps;
    a->w = w;
    extra[0] = 0;
    char tname[256];
    if (identify(c, a, h, tname, sizeof tname, msg, msg_cap) < 0) {
        *status = 403;
        px_m_inc(&w->metrics.adm[PX_ADM_M_TENANT_REFUSED]);
        return PX_ADM_REFUSED;
    }
    make_salt(c, a, tname, body, blen);
    px_tenant *t = &c->tenants.v[a->tenant];
    a->count_tokens = atomic_load(&t->tpm.limit) > 0;
    uint64_t reserve = 0;
    int explicit_max = 0;
    if (a->count_tokens) {
        a->tok_cap = token_cap(cfg, a->bx, body, blen, &reserve, &explicit_max);
        /* --default-max-tokens is a guess: never more than a minute's
         * worth, so a request without max_tokens is never too large. */
        uint64_t tl = atomic_load(&t->tpm.limit);
        if (!explicit_max && reserve > tl) reserve = tl;
    }
    uint64_t retry = 0;
    px_rl_verdict rl = px_tenant_admit(t, now, reserve, &retry);
    if (rl == PX_RL_TOO_LARGE) {
        *status = 429;
        px_tenant_headers(t, now, extra, extra_cap);
        snprintf(msg, msg_cap, "request too large for tenant '%s': its max_tokens is %llu, its "
                 "limit %llu tokens per minute", t->name[0] ? t->name : "(default)",
                 (unsigned long long)reserve, (unsigned long long)t->tpm.limit);
        px_m_inc(&w->metrics.adm[PX_ADM_M_RATE_TOKENS]);
        return PX_ADM_REFUSED;
    }
    if (rl != PX_RL_OK) {
        *status = 429;
        snprintf(extra, extra_cap, "Retry-After: %llu\r\n",
                 (unsigned long long)((retry + 999999999ULL) / 1000000000ULL));
        px_tenant_headers(t, now, extra, extra_cap);
        snprintf(msg, msg_cap, "rate limit reached for tenant '%s': %llu %s per minute",
                 t->name[0] ? t->name : "(default)",
                 (unsigned long long)(rl == PX_RL_REQUESTS ? t->rpm.limit : t->tpm.limit),
                 rl == PX_RL_REQUESTS ? "requests" : "tokens");
        px_m_inc(&w->metrics.adm[rl == PX_RL_REQUESTS ? PX_ADM_M_RATE_REQUESTS
                                                      : PX_ADM_M_RATE_TOKENS]);
        return PX_ADM_REFUSED;
    }
    a->tok_reserved = reserve;
    double limit = cfg->queue_timeout;
    double asked = header_seconds(h, "x-queue-timeout");
    if (asked >= 0 && asked < limit) limit = asked;
    a->deadline_ns = now + (uint64_t)(limit * 1e9);
    int saturated = px_pool_saturated(c, ps, now);
    if (!saturated && !w->adm->q.n) {
        if (take_slot(c, ps)) {
            a->sent = 1;
            a->t_sent = now;
            return PX_ADM_GO;
        }
        saturated = 1; /* another worker took the last slot meanwhile */
    }
    a->it.cls = class_of(c, t, h, a->bx, body, blen);
    a->it.tenant = a->tenant;
    a->it.bytes = blen;
    if (!cfg->queue_max || limit <= 0 || px_admq_push(&w->adm->q, &a->it) < 0) {
        /* Others wait for other pools, and the queue is full. */
        if (!saturated && take_slot(c, ps)) {
            a->sent = 1;
            a->t_sent = now;
            return PX_ADM_GO;
        }
        *status = 429;
        snprintf(extra, extra_cap, "Retry-After: 1\r\n");
        if (limit <= 0) {
            /* x-queue-timeout: 0 asks not to wait: no queue is full. */
            snprintf(msg, msg_cap, "the pool is saturated and the request asked not to wait "
                     "(x-queue-timeout: 0); retry later");
            px_m_inc(&w->metrics.adm[PX_ADM_M_NO_WAIT]);
            return PX_ADM_REFUSED;
        }
        if (!cfg->queue_max)
            snprintf(msg, msg_cap, "the pool is saturated and no admission queue is configured "
                     "(--queue-max 0); retry later");
        else
            snprintf(msg, msg_cap,
                     "the pool is saturated and the admission queue is full (--queue-max %lld, "
                     "--queue-max-bytes %lld); retry later",
                     (long long)cfg->queue_max, (long long)cfg->queue_max_bytes);
        px_m_inc(&w->metrics.adm[PX_ADM_M_QUEUE_FULL]);
        return PX_ADM_REFUSED;
    }
    publish(w->adm);
    a->t_enq = now;
    a->timer = evtimer_new(w->base, on_deadline, a);
    struct timeval tv = {(time_t)limit, (suseconds_t)((limit - (double)(time_t)limit) * 1e6)};
    evtimer_add(a->timer, &tv);
    px_m_inc(&w->metrics.adm[PX_ADM_M_QUEUED]);
    /* Its pool is free but others wait here: the queue's order decides,
     * now (a->go may run before this returns). */
    if (!saturated) {
        dispatch(w->adm);
        return PX_ADM_QUEUED;
    }
    /* A worker freeing a slot reads nq after giving the slot back; this
     * one published nq before looking at the pool again here: one of the
     * two sees the other (sequentially consistent atomics), so no wake is
     * lost between them. */
    if (!px_pool_saturated(c, ps, px_now_ns())) {
        dispatch(w->adm);
        return PX_ADM_QUEUED;
    }
    /* The pool may free up on another worker (which wakes this one), or
     * its back-off end: look again later. */
    if (!event_pending(w->adm->poll, EV_TIMEOUT, NULL)) {
        struct timeval pt = {0, POLL_US};
        event_add(w->adm->poll, &pt);
    }
    return PX_ADM_QUEUED;
}

int px_adm_can_requeue(const px_adm_req *a, int status) {
    if ((status != 429 && status != 503) || !a->w || !a->ps || a->it.queued) return 0;
    const px_config *cfg = ((px_wctx *)a->w)->ctx->cfg;
    /* Only with a back-off (else it would be sent straight back), and only
     * when the back-off ends before the deadline. */
    return cfg->queue_max > 0 && cfg->engine_backoff > 0 &&
           px_now_ns() + (uint64_t)(cfg->engine_backoff * 1e9) < a->deadline_ns;
}

int px_adm_requeue(px_wctx *w, px_adm_req *a) {
    const px_config *cfg = w->ctx->cfg;
    if (a->sent) {
        a->sent = 0;
        atomic_fetch_sub(&a->ps->admitted, 1);
    }
    uint64_t now = px_now_ns();
    a->t_sent = 0;
    if (a->it.queued || !cfg->queue_max || now + 1000000 >= a->deadline_ns ||
        px_admq_push(&w->adm->q, &a->it) < 0) {
        /* The slot given back may serve another worker's queue. */
        if (w->ctx->nworkers > 1) wake_others(w);
        return -1;
    }
    publish(w->adm);
    a->t_enq = now;
    if (!a->timer) a->timer = evtimer_new(w->base, on_deadline, a);
    uint64_t left = a->deadline_ns - now;
    struct timeval tv = {(time_t)(left / 1000000000u), (suseconds_t)(left % 1000000000u / 1000)};
    evtimer_add(a->timer, &tv);
    px_m_inc(&w->metrics.adm[PX_ADM_M_REQUEUED]);
    if (!px_pool_saturated(w->ctx, a->ps, now)) {
        dispatch(w->adm);
        return 0;
    }
    if (!event_pending(w->adm->poll, EV_TIMEOUT, NULL)) {
        struct timeval pt = {0, POLL_US};
        event_add(w->adm->poll, &pt);
    }
    return 0;
}

void px_adm_leave(px_wctx *w, px_adm_req *a) {
    if (a->it.queued) {
        px_m_inc(&w->metrics.adm[PX_ADM_M_LEFT]);
        take_out(w->adm, a, px_now_ns());
    }
    if (a->count_tokens) {
        /* Settled once: on the usage the answer reported (never more than
         * the request could have produced: an engine's wild number must
         * not lock its tenant out), else on the reservation when an answer
         * passed, else nothing is charged. */
        uint64_t used = a->tok.total ? a->tok.total : a->answered ? a->tok_reserved : 0;
        if (used > a->tok_cap) used = a->tok_cap;
        px_tenant_settle(&w->ctx->tenants.v[a->tenant], px_now_ns(), a->tok_reserved, used);
        a->count_tokens = 0;
        a->tok.total = 0;
        a->tok_reserved = 0;
    }
    if (a->sent) {
        a->sent = 0;
        atomic_fetch_sub(&a->ps->admitted, 1);
        /* A worker whose queue always refills would keep every slot it
         * frees, and the others' requests would wait for their timer to
         * win a race: while others wait too, every other slot freed here
         * is left to them (they are woken below). */
        int handoff = w->ctx->nworkers > 1 && w->adm->q.n && others_wait(w) &&
                      (w->adm->turn++ & 1);
        if (w->adm->q.n && !handoff) dispatch(w->adm);
        /* The slot is still free when this worker's queue did not take
         * it (empty, handed off, or waiting for other pools): another
         * worker's may. */
        if (w->ctx->nworkers > 1 && !px_pool_saturated(w->ctx, a->ps, px_now_ns()))
            wake_others(w);
    }
}

int px_adm_reconfigure(px_ctx *c, char *const *specs, size_t n, int64_t max_inflight,
                       char *note, size_t note_cap, char *err, size_t errlen) {
    note[0] = 0;
    if (specs) {
        px_tenants nt;
        size_t added = 0, removed = 0;
        if (px_tenants_parse(specs, n, &nt, err, errlen) < 0) return -1;
        int rc = px_tenants_apply(&c->tenants, &nt, c->tenant_weights, &added, &removed, err,
                                  errlen);
        px_tenants_cleanup(&nt);
        if (rc < 0) return -1;
        snprintf(note, note_cap, "tenants_added=%zu tenants_removed=%zu", added, removed);
    }
    if (max_inflight >= 0) atomic_store(&c->pool_max_inflight, max_inflight);
    PX_LOG(PX_LOG_INFO, "msg=\"admission settings changed\" tenants=%zu pool_max_inflight=%lld%s%s",
           specs ? n : atomic_load(&c->tenants.n), (long long)atomic_load(&c->pool_max_inflight),
           note[0] ? " " : "", note);
    return 0;
}

void px_adm_answer(px_adm_req *a, const char *p, size_t n) {
    a->answered = 1;
    if (a->count_tokens) px_tokscan_feed(&a->tok, p, n);
}

/* Replaces *body by out when rc is 1. */
static int take_body(int rc, px_buf *body, px_buf *out) {
    if (rc == 1) {
        px_buf_cleanup(body);
        *body = *out;
        return 1;
    }
    px_buf_cleanup(out);
    return 0;
}

int px_adm_body(px_adm_req *a, int usage_route, px_buf *body) {
    int changed = 0;
    px_buf out;
    if (a->salt[0] && !a->salt_own && body->data) {
        px_buf_init(&out);
        changed |= take_body(
            px_rewrite_cache_salt(body->data, body->len, a->bx, a->salt, &out) == 0 ? 1 : 0, body,
            &out);
    }
    if (usage_route && a->count_tokens && body->data) {
        px_buf_init(&out);
        a->strip_usage = take_body(px_rewrite_include_usage(body->data, body->len, &out), body,
                                   &out);
        changed |= a->strip_usage;
    }
    /* Its members moved with it: found again, in the new bytes. */
    if (changed && a->bx) px_body_idx_build(a->bx, body->data, body->len);
    return changed;
}

uint64_t px_adm_salt_key(const px_adm_req *a) {
    return a->salt_key;
}

void px_adm_ratelimit_headers(px_ctx *c, const px_adm_req *a, char *out, size_t cap) {
    out[0] = 0;
    if (!c->tenants.v) return;
    px_tenant_headers(&c->tenants.v[a->tenant], px_now_ns(), out, cap);
}
