/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/health.h"

#include <stdlib.h>
#include <string.h>

#include "base/list.h"
#include "base/log.h"
#include "proxy/admission.h"
#include "proxy/ctx.h"
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
    px_buf body;
    px_buf url;
    px_upstream *up; /* owned until on_done */
    struct check *prev, *next;
} check;

struct px_health {
    px_ctx *ctx;
    struct event_base *base;
    px_uploop *loop;
    struct event *check_timer;
    struct event *probe_timer;
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
    px_buf_cleanup(&c->url);
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

static void on_done(void *arg, px_up_result rc, const char *errbuf, int connected) {
    check *c = arg;
    c->up = NULL;
    int ok = rc == PX_UP_OK && c->status >= 200 && c->status < 300;
    if (c->kind == K_HEALTH) {
        if (!ok)
            PX_LOG(PX_LOG_DEBUG,
                   "msg=\"health check failed\" role=%s backend=%s status=%d error=\"%s\"",
                   c->pool->role, c->b->name, c->status,
                   rc ? (errbuf[0] ? errbuf : px_up_result_str(rc)) : "");
        px_backend_check(c->pool, c->b, ok);
    } else {
        double w = 0, r = 0, kv = 0;
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

static void start_check(px_health *h, px_gen *g, px_pool *pool, px_backend *b, check_kind kind) {
    const px_config *cfg = h->ctx->cfg;
    check *c = px_xcalloc(1, sizeof *c);
    c->h = h;
    c->g = g;
    atomic_fetch_add(&g->refs, 1);
    c->pool = pool;
    c->b = b; /* takes the caller's reference */
    c->kind = kind;
    px_buf_init(&c->body);
    px_buf_init(&c->url);
    px_buf_appends(&c->url, kind == K_HEALTH ? "/health" : "/metrics");
    double t = kind == K_HEALTH ? cfg->health_timeout : cfg->metrics_interval;
    if (t < 0.001) t = 0.001; /* a check always has a limit */
    px_upstream_req q = {
        .backend = b,
        .method = "GET",
        .path = c->url.data,
        .headers = &h->ctx->health_hdrs,
        .connect_timeout = t,
        .total_timeout = t,
        .ca_file = cfg->upstream_ca,
        .insecure = cfg->upstream_insecure,
    };
    if (kind == K_HEALTH)
        b->check_busy = 1;
    else
        b->probe_busy = 1;
    PX_LIST_PUSH(h->live, c);
    c->up = px_upstream_start(h->loop, &q, &check_cbs, c);
    if (!c->up) check_free(c);
}

/* Control thread: the generation swaps happen here, so h->ctx->gen is
 * stable. A backend kept by a reload is checked once, in its newest pool. */
static void sweep(px_health *h, check_kind kind) {
    px_gen *g = h->ctx->gen;
    for (size_t p = 0; p < g->nps; p++) {
        px_pool *pools[2] = {&g->ps[p].prefill, &g->ps[p].decode};
        for (int r = 0; r < 2; r++) {
            /* Decode's figures also tell admission control (--saturate-waiting)
             * that the engines' own queues are full. */
            if (kind == K_LOAD_PROBE && pools[r]->cfg.policy != PX_POLICY_LOAD_AWARE &&
                !(r == 1 && px_adm_wants_engine_load(h->ctx->cfg)))
                continue;
            size_t n;
            px_backend **m = px_pool_members(pools[r], &n);
            for (size_t i = 0; i < n; i++) {
                int busy = kind == K_HEALTH ? m[i]->check_busy : m[i]->probe_busy;
                if (busy)
                    px_backend_release(m[i]);
                else
                    start_check(h, g, pools[r], m[i], kind);
            }
            free(m);
        }
    }
}

static void on_check_timer(evutil_socket_t fd, short what, void *arg) {
    sweep(arg, K_HEALTH);
}

static void on_probe_timer(evutil_socket_t fd, short what, void *arg) {
    sweep(arg, K_LOAD_PROBE);
}

static struct event *every(px_health *h, double seconds, event_callback_fn fn) {
    struct event *ev = event_new(h->base, -1, EV_PERSIST, fn, h);
    struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
    event_add(ev, &tv);
    event_active(ev, EV_TIMEOUT, 0); /* a first round at once */
    return ev;
}

px_health *px_health_start(px_ctx *ctx, struct event_base *base) {
    const px_config *cfg = ctx->cfg;
    px_health *h = px_xcalloc(1, sizeof *h);
    h->ctx = ctx;
    h->base = base;
    h->loop = px_uploop_create(base, 4);
    if (!h->loop) {
        free(h);
        return NULL;
    }
    if (cfg->health_interval > 0) h->check_timer = every(h, cfg->health_interval, on_check_timer);
    /* Load probes run always: a reload may choose load_aware at any time. */
    h->probe_timer = every(h, cfg->metrics_interval, on_probe_timer);
    return h;
}

void px_health_stop(px_health *h) {
    if (!h) return;
    if (h->check_timer) event_free(h->check_timer);
    if (h->probe_timer) event_free(h->probe_timer);
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
