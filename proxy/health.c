/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/health.h"

#include <stdlib.h>
#include <string.h>

#include "base/list.h"
#include "base/log.h"
#include "proxy/admission.h"
#include "proxy/ctx.h"
#include "proxy/dispatch.h"
#include "proxy/dp.h"
#include "proxy/route.h"
#include "proxy/upstream.h"

#define PROBE_MAX (4 * 1024 * 1024)

typedef enum { K_HEALTH, K_LOAD_PROBE } check_kind;

typedef struct check {
    struct px_health *h;
    px_gen *g;     /* owned reference: the generation of pool */
    px_pool *pool; /* borrowed: g's */
    px_backend *b; /* owned reference */
    check_kind kind;
    int status;
    int too_big;
    int retried; /* a health check goes once more after a reset */
    px_buf body;
    px_upstream *up; /* owned until on_done */
    struct check *prev, *next;
} check;

/* One kind of check, spread over its interval: the timer fires `nslices`
 * times an interval, each time for one slice of each pool's members (by
 * position), so 10,000 backends get 100 checks every 50 ms rather than
 * 10,000 at once. */
typedef struct round {
    struct px_health *h;
    check_kind kind;
    struct event *ev; /* owned */
    unsigned slice, nslices;
} round;

struct px_health {
    px_ctx *ctx;
    struct event_base *base;
    px_uploop *loop;
    round checks, probes;
    check *live;
};

static void check_free(check *c) {
    px_health *h = c->h;
    PX_LIST_UNLINK(h->live, c);
    if (c->kind == K_HEALTH)
        c->b->check_busy = 0;
    else
        c->b->probe_busy = 0;
    px_backend_release(c->b);
    px_gen_release(c->g);
    px_buf_cleanup(&c->body);
    free(c);
}

static void on_headers(void *arg, int status, const char *ct) {
    ((check *)arg)->status = status;
}

static int on_data(void *arg, const char *p, size_t n) {
    check *c = arg;
    if (c->kind == K_HEALTH) return 0; /* the status is the answer */
    if (c->body.len + n > PROBE_MAX) {
        c->too_big = 1;
        return -1;
    }
    px_buf_append(&c->body, p, n);
    return 0;
}

static int send_check(check *c);

static void on_done(void *arg, px_up_result rc, const char *errbuf, int connected) {
    check *c = arg;
    c->up = NULL;
    /* A kept-alive connection the engine closed as the check went out
     * (its idle timeout met ours): once more, on a fresh connection. A
     * health check is a GET: sending it twice is harmless. */
    if (rc == PX_UP_RESET && c->kind == K_HEALTH && !c->retried) {
        c->retried = 1;
        c->status = 0;
        if (send_check(c) == 0) return;
    }
    int ok = rc == PX_UP_OK && c->status >= 200 && c->status < 300;
    if (c->kind == K_HEALTH) {
        if (!ok) {
            PX_LOG(PX_LOG_DEBUG,
                   "msg=\"health check failed\" role=%s backend=%s status=%d error=\"%s\"",
                   c->pool->role, c->b->name, c->status,
                   rc ? (errbuf[0] ? errbuf : px_up_result_str(rc)) : "");
            /* A prefill that fails its check may come back as another
             * engine, pulling where it pushed: what --dispatch concurrent
             * learned of it is learned again from its next answer. */
            if (!strcmp(c->pool->role, "prefill"))
                px_dispatch_forget(c->h->ctx->reg->identities, c->b->name);
        }
        px_backend_check(c->pool, c->b, ok);
    } else {
        double w = 0, r = 0, kv = 0;
        /* Data-parallel engines: each rank's own figures (proxy/dp.c). */
        px_dp_engine_load(c->h->ctx->reg->dp, c->b->name,
                          ok ? (c->body.data ? c->body.data : "") : NULL, c->body.len);
        if (ok &&
            px_parse_engine_load(c->body.data ? c->body.data : "", c->body.len, &w, &r, &kv) > 0) {
            /* Engine figures are outside input: clamp before converting. */
            atomic_store(&c->b->waiting, (int)(w > 0 && w < 1e6 ? w : w >= 1e6 ? 1e6 : 0));
            atomic_store(&c->b->running, (int)(r > 0 && r < 1e6 ? r : r >= 1e6 ? 1e6 : 0));
            atomic_store(&c->b->kv_usage_milli, (int)(kv > 0 && kv < 1 ? kv * 1000
                                                      : kv >= 1        ? 1000
                                                                       : 0));
            atomic_store(&c->b->load_known, 1);
        } else {
            atomic_store(&c->b->load_known, 0);
        }
    }
    check_free(c);
}

static const px_upstream_cbs check_cbs = {on_headers, on_data, on_done};

static int send_check(check *c) {
    const px_config *cfg = c->h->ctx->cfg;
    double t = c->kind == K_HEALTH ? cfg->health_timeout : cfg->metrics_interval;
    if (t < 0.001) t = 0.001; /* a check always has a limit */
    px_upstream_req q = {
        .backend = c->b,
        .method = "GET",
        .path = c->kind == K_HEALTH ? "/health" : "/metrics",
        .headers = &c->h->ctx->health_hdrs,
        .connect_timeout = t,
        .total_timeout = t,
        .ca_file = cfg->upstream_ca,
        .insecure = cfg->upstream_insecure,
    };
    c->up = px_upstream_start(c->h->loop, &q, &check_cbs, c);
    return c->up ? 0 : -1;
}

static void start_check(px_health *h, px_gen *g, px_pool *pool, px_backend *b, check_kind kind) {
    check *c = px_xcalloc(1, sizeof *c);
    c->h = h;
    c->g = g;
    atomic_fetch_add(&g->refs, 1);
    c->pool = pool;
    c->b = b; /* takes the caller's reference */
    c->kind = kind;
    px_buf_init(&c->body);
    if (kind == K_HEALTH)
        b->check_busy = 1;
    else
        b->probe_busy = 1;
    PX_LIST_PUSH(h->live, c);
    if (send_check(c) < 0) check_free(c);
}

/* Control thread: the generation swaps happen here, so h->ctx->gen is
 * stable. A backend kept by a reload is checked once, in its newest pool.
 * Checks the members of one slice of nslices. */
static void sweep(px_health *h, check_kind kind, unsigned slice, unsigned nslices) {
    px_gen *g = h->ctx->gen;
    for (size_t p = 0; p < g->nps; p++) {
        px_pool *pools[2] = {&g->ps[p].prefill, &g->ps[p].decode};
        for (int r = 0; r < 2; r++) {
            /* Decode's figures also tell admission control (--saturate-waiting)
             * that the engines' own queues are full. */
            int dp_only = kind == K_LOAD_PROBE && pools[r]->cfg.policy != PX_POLICY_LOAD_AWARE &&
                          !(r == 1 && px_adm_wants_engine_load(h->ctx->cfg));
            int dp_def = (int)(r == 0 ? h->ctx->cfg->prefill_dp_size : h->ctx->cfg->decode_dp_size);
            if (dp_only && dp_def < 2 && !px_dp_declared(h->ctx->reg->dp)) continue;
            size_t n;
            px_backend **m = px_pool_members_slice(pools[r], slice, nslices, &n);
            for (size_t i = 0; i < n; i++) {
                int busy = kind == K_HEALTH ? m[i]->check_busy : m[i]->probe_busy;
                /* Else only data-parallel backends: the engine's per-rank
                 * figures steer the rank choice (proxy/dp.c). */
                if (busy || (dp_only && px_dp_size(h->ctx->reg->dp, m[i]->src, dp_def) < 2))
                    px_backend_release(m[i]);
                else
                    start_check(h, g, pools[r], m[i], kind);
            }
            free(m);
        }
    }
}

static void on_round(evutil_socket_t fd, short what, void *arg) {
    round *r = arg;
    sweep(r->h, r->kind, r->slice, r->nslices);
    r->slice = (r->slice + 1) % r->nslices;
}

/* Slices of about 50 ms, at most 100 an interval. */
static void round_start(px_health *h, round *r, check_kind kind, double seconds) {
    r->h = h;
    r->kind = kind;
    double n = seconds / 0.05;
    r->nslices = n < 1 ? 1 : n > 100 ? 100 : (unsigned)n;
    double tick = seconds / r->nslices;
    r->ev = event_new(h->base, -1, EV_PERSIST, on_round, r);
    struct timeval tv = {(time_t)tick, (suseconds_t)((tick - (double)(time_t)tick) * 1e6)};
    event_add(r->ev, &tv);
    sweep(h, kind, 0, 1); /* a first round of every member at once */
}

px_health *px_health_start(px_ctx *ctx, struct event_base *base) {
    const px_config *cfg = ctx->cfg;
    px_health *h = px_xcalloc(1, sizeof *h);
    h->ctx = ctx;
    h->base = base;
    /* Each backend's connection is kept from one check to its next (about
     * an interval apart), so that a check is one request, not a TCP
     * handshake too: 10,000 backends at 5 s were 2,000 connects a second.
     * Engines with a shorter keep-alive close it first; on_done retries. */
    double every =
        cfg->health_interval > cfg->metrics_interval ? cfg->health_interval : cfg->metrics_interval;
    h->loop = px_uploop_create_keep(base, 4, every * 2 + 1 < 120 ? every * 2 + 1 : 120);
    if (!h->loop) {
        free(h);
        return NULL;
    }
    if (cfg->health_interval > 0) round_start(h, &h->checks, K_HEALTH, cfg->health_interval);
    /* Load probes run always: a reload may choose load_aware at any time. */
    round_start(h, &h->probes, K_LOAD_PROBE, cfg->metrics_interval);
    return h;
}

void px_health_stop(px_health *h) {
    if (!h) return;
    if (h->checks.ev) event_free(h->checks.ev);
    if (h->probes.ev) event_free(h->probes.ev);
    for (check *c = h->live; c; c = c->next) {
        px_upstream_cancel(c->up);
        c->up = NULL;
    }
    while (h->live)
        check_free(h->live);
    px_uploop_destroy(h->loop);
    free(h);
}

int px_parse_engine_load(const char *text, size_t n, double *waiting, double *running,
                         double *kv_usage) {
    int found_w = 0, found_r = 0, found_k = 0;
    double w = 0, r = 0, k = 0;
    const char *p = text, *end = text + n;
    while (p < end) {
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        if (!eol) eol = end;
        if (p < eol && *p != '#') {
            size_t nl = strcspn(p, "{ \t");
            if (nl > (size_t)(eol - p)) nl = (size_t)(eol - p);
            /* The value is the last field before the optional timestamp: take
             * the field after the closing brace or the name. */
            const char *v = p + nl;
            if (v < eol && *v == '{') {
                const char *close = memchr(v, '}', (size_t)(eol - v));
                v = close ? close + 1 : eol;
            }
            while (v < eol && (*v == ' ' || *v == '\t'))
                v++;
            char num[64];
            size_t vl = strcspn(v, " \t\n");
            if (vl > (size_t)(eol - v)) vl = (size_t)(eol - v);
            if (vl && vl < sizeof num) {
                memcpy(num, v, vl);
                num[vl] = '\0';
                char *e;
                double x = strtod(num, &e);
                if (!*e && x == x) {
#define IS(lit) (nl == sizeof(lit) - 1 && !memcmp(p, lit, nl))
                    if (IS("vllm:num_requests_waiting")) {
                        w += x;
                        found_w = 1;
                    } else if (IS("vllm:num_requests_running")) {
                        r += x;
                        found_r = 1;
                    } else if (IS("vllm:kv_cache_usage_perc") || IS("vllm:gpu_cache_usage_perc")) {
                        if (!found_k || x > k) k = x;
                        found_k = 1;
                    }
#undef IS
                }
            }
        }
        p = eol + 1;
    }
    *waiting = w;
    *running = r;
    *kv_usage = k;
    return found_w + found_r + found_k;
}
