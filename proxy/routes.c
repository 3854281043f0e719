/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/routes.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proxy/discovery.h"
#include "proxy/endpoint.h"
#include "proxy/intake.h"
#include "proxy/reqlog.h"
#include "proxy/request.h"
#include "proxy/scrape.h"

/* The 405 for a method the route does not take: counted, logged (when
 * `epname`) and answered with its Allow header. */
static void reply_method(px_metrics *m, px_endpoint mep, px_conn *c, const px_http_head *h,
                         const char *epname, const char *allow, const char *msg) {
    px_metrics_count(m, mep, 405);
    if (epname)
        px_reqlog_refuse(c, h, epname, 405, allow, msg);
    else
        px_conn_reply_error(c, 405, NULL, allow, msg);
}

/* The 401 for a request without a valid key: counted (when `m`), logged
 * (when `epname`) and answered. */
static void reply_unauthorized(px_metrics *m, px_endpoint mep, px_conn *c, const px_http_head *h,
                               const char *epname) {
    if (m) px_metrics_count(m, mep, 401);
    static const char msg[] = "invalid or missing API key: send Authorization: Bearer <key>";
    if (epname)
        px_reqlog_refuse(c, h, epname, 401, "WWW-Authenticate: Bearer\r\n", msg);
    else
        px_conn_reply_error(c, 401, NULL, "WWW-Authenticate: Bearer\r\n", msg);
}

/* m: the worker's metrics, or NULL on the control thread's listener. */
static void reply_json(px_metrics *m, px_conn *c, px_endpoint ep, int status, const char *json,
                       size_t n) {
    if (m) px_metrics_count(m, ep, status);
    px_conn_reply(c, status, "application/json", NULL, NULL, json, n);
}

static void role_json(px_buf *b, const char *role, px_pool *p) {
    size_t n, h;
    px_pool_counts(p, &n, &h);
    px_buf_printf(b, "\"%s\":{\"healthy\":%zu,\"usable\":%zu,\"total\":%zu}", role, h,
                  px_pool_usable(p), n);
}

/* 200 when every pool has a prefill and a decode backend that can take a
 * request (decode alone with --fallback-decode-only); the JSON says, per
 * pool and role, what is missing. */
static void reply_ready(px_ctx *ctx, px_metrics *m, px_conn *c) {
    px_gen *g = px_ctx_gen(ctx);
    int draining = atomic_load(&ctx->draining);
    /* The sidecar's prefills come with the requests: decode alone decides. */
    int decode_alone = ctx->cfg->fallback_decode_only || ctx->cfg->prefiller_from_header;
    size_t ph = 0, pn = 0, dh = 0, dn = 0;
    int all = 1;
    const char *first_why = NULL;
    px_buf pools;
    px_buf_init(&pools);
    px_buf_appends(&pools, "[");
    for (size_t i = 0; i < g->nps; i++) {
        px_pset *p = &g->ps[i];
        size_t n, h;
        px_pool_counts(&p->prefill, &n, &h);
        pn += n, ph += h;
        px_pool_counts(&p->decode, &n, &h);
        dn += n, dh += h;
        const char *why;
        int ok = px_pset_ready(p, decode_alone, &why);
        if (!ok && !first_why) first_why = why;
        all &= ok;
        if (i) px_buf_appends(&pools, ",");
        px_buf_appends(&pools, "{\"name\":");
        px_buf_append_json_str(&pools, p->name, strlen(p->name));
        px_buf_printf(&pools, ",\"ready\":%s,", ok ? "true" : "false");
        role_json(&pools, "prefill", &p->prefill);
        px_buf_appends(&pools, ",");
        role_json(&pools, "decode", &p->decode);
        px_buf_appends(&pools, ",\"missing\":[");
        int first = 1;
        if (!px_pool_usable(&p->prefill) && !decode_alone) {
            px_buf_appends(&pools, "\"prefill\"");
            first = 0;
        }
        if (!px_pool_usable(&p->decode))
            px_buf_appends(&pools, first ? "\"decode\"" : ",\"decode\"");
        px_buf_appends(&pools, "]");
        if (why) {
            px_buf_appends(&pools, ",\"reason\":");
            px_buf_append_json_str(&pools, why, strlen(why));
        }
        px_buf_appends(&pools, "}");
    }
    px_buf_appends(&pools, "]");
    int ready = !draining && all && g->nps > 0;
    const char *reason = draining ? "draining" : first_why;
    px_buf b;
    px_buf_init(&b);
    px_buf_printf(&b,
                  "{\"status\":\"%s\",\"draining\":%s,\"generation\":%llu,"
                  "\"prefill\":{\"healthy\":%zu,\"total\":%zu},"
                  "\"decode\":{\"healthy\":%zu,\"total\":%zu},\"pools\":",
                  ready ? "ready" : "not ready", draining ? "true" : "false",
                  (unsigned long long)g->id, ph, pn, dh, dn);
    px_buf_append(&b, pools.data, pools.len);
    if (reason) {
        px_buf_appends(&b, ",\"reason\":");
        px_buf_append_json_str(&b, reason, strlen(reason));
    }
    pthread_mutex_lock(&ctx->gen_mu);
    px_discovery_ready_json(ctx->gen->disc, &b);
    pthread_mutex_unlock(&ctx->gen_mu);
    px_buf_appends(&b, "}");
    reply_json(m, c, PX_EP_READY, ready ? 200 : 503, b.data, b.len);
    px_buf_cleanup(&b);
    px_buf_cleanup(&pools);
    px_gen_release(g);
}

/* Named pools: /v1/models lists their models (each once, in the order
 * configured) and /v1/models/{id} answers from that list. id: NULL for the
 * list. */
static void reply_models(px_ctx *ctx, px_metrics *m, px_conn *c, const char *id, size_t idlen) {
    px_gen *g = px_ctx_gen(ctx);
    px_buf b;
    px_buf_init(&b);
    int found = 0;
    if (!id) px_buf_appends(&b, "{\"object\":\"list\",\"data\":[");
    size_t listed = 0;
    for (size_t i = 0; i < g->nps; i++)
        for (size_t j = 0; j < g->ps[i].models.n; j++) {
            const char *mo = g->ps[i].models.v[j];
            if (id) {
                if (found || strlen(mo) != idlen || memcmp(mo, id, idlen)) continue;
                found = 1;
            }
            if (listed++) px_buf_appends(&b, ",");
            px_buf_appends(&b, "{\"id\":");
            px_buf_append_json_str(&b, mo, strlen(mo));
            px_buf_appends(
                &b, ",\"object\":\"model\",\"created\":0,\"owned_by\":\"pdproxy\",\"root\":");
            px_buf_append_json_str(&b, mo, strlen(mo));
            px_buf_appends(&b, ",\"pool\":");
            px_buf_append_json_str(&b, g->ps[i].name, strlen(g->ps[i].name));
            px_buf_appends(&b, "}");
        }
    if (!id) px_buf_appends(&b, "]}");
    px_gen_release(g);
    if (id && !found) {
        px_buf_reset(&b);
        px_intake_model_not_found(&b, id, idlen);
        reply_json(m, c, PX_EP_MODELS, 404, b.data, b.len);
    } else {
        reply_json(m, c, PX_EP_MODELS, 200, b.data, b.len);
    }
    px_buf_cleanup(&b);
}

/* `logged`: an API listener's 404, written to the access log with its id. */
static void not_found(px_conn *c, const px_http_head *h, int logged) {
    px_buf m;
    px_buf_init(&m);
    px_buf_printf(&m, "not found: %.*s %.*s", (int)(h->method_len > 16 ? 16 : h->method_len),
                  h->method, (int)(h->target_len > 200 ? 200 : h->target_len), h->target);
    if (logged)
        px_reqlog_refuse(c, h, px_endpoints[PX_EP_OTHER].name, 404, NULL, m.data);
    else
        px_conn_reply_error(c, 404, NULL, NULL, m.data);
    px_buf_cleanup(&m);
}

/* The proxy's own GET endpoints (HEAD answers as GET, without the body).
 * `metrics_here`: /metrics is served on this listener. Returns 0 when the
 * path is none of them. */
static int serve_local(px_ctx *ctx, px_metrics *m, px_conn *c, const px_http_head *h,
                       int metrics_here) {
    px_endpoint ep = PX_EP_OTHER;
    for (px_endpoint e = 0; e < PX_EP_COUNT; e++)
        if (px_endpoints[e].own && px_http_path_is(h, px_endpoints[e].path)) ep = e;
    if (ep == PX_EP_OTHER || (ep == PX_EP_METRICS && !metrics_here)) return 0;
    const px_endpoint_def *d = &px_endpoints[ep];
    if (!(px_endpoint_method(h) & d->methods)) {
        if (m) px_metrics_count(m, ep, 405);
        px_conn_reply_error(c, 405, NULL, d->allow, d->wrong_method);
        return 1;
    }
    if (ep == PX_EP_METRICS && ctx->cfg->metrics_auth && !px_ctx_authorized(ctx, h)) {
        reply_unauthorized(m, ep, c, h, NULL);
        return 1;
    }
    if (ep == PX_EP_READY) {
        reply_ready(ctx, m, c);
    } else if (ep == PX_EP_METRICS) {
        if (m) px_metrics_count(m, PX_EP_METRICS, 200);
        px_buf b;
        px_buf_init(&b);
        px_scrape_render(ctx, &b);
        px_conn_reply(c, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, NULL, b.data,
                      b.len);
        px_buf_cleanup(&b);
    } else if (ep == PX_EP_HEALTH) {
        reply_json(m, c, PX_EP_HEALTH, 200, "{\"status\":\"ok\"}", 15);
    } else {
        size_t pn = 0, dn = 0;
        px_gen *g = px_ctx_gen(ctx);
        for (size_t i = 0; i < g->nps; i++) {
            size_t n;
            px_pool_counts(&g->ps[i].prefill, &n, NULL);
            pn += n;
            px_pool_counts(&g->ps[i].decode, &n, NULL);
            dn += n;
        }
        px_gen_release(g);
        char json[160];
        int n = snprintf(json, sizeof json,
                         "{\"status\":\"ok\",\"prefill_instances\":%zu,\"decode_instances\":%zu}",
                         pn, dn);
        reply_json(m, c, PX_EP_HEALTHCHECK, 200, json, (size_t)n);
    }
    return 1;
}

/* The --metrics-port listener, on the control thread: only the proxy's own
 * endpoints. */
void px_routes_dispatch_local(void *arg, px_conn *c, const px_http_head *h, px_buf *body) {
    if (!serve_local(arg, NULL, c, h, 1)) not_found(c, h, 0);
}

static int models_local(px_ctx *ctx) {
    px_gen *g = px_ctx_gen(ctx);
    int named = g->named;
    px_gen_release(g);
    return named;
}

/* Checks the method and the key, then serves the endpoint: a request
 * flow, or /v1/models from the named pools. */
static void serve_api(px_wctx *w, px_endpoint ep, px_conn *c, const px_http_head *h, px_buf *body) {
    const px_endpoint_def *d = &px_endpoints[ep];
    px_metrics *m = &w->metrics;
    int meth = px_endpoint_method(h);
    if (meth == PX_M_HEAD && ep == PX_EP_MODELS && models_local(w->ctx))
        meth = PX_M_GET; /* answered here like GET, without the body */
    if (!(meth & d->methods)) {
        reply_method(m, ep, c, h, d->name, d->allow, d->wrong_method);
    } else if (!px_ctx_authorized(w->ctx, h)) {
        reply_unauthorized(m, ep, c, h, d->name);
    } else if (ep == PX_EP_MODELS && models_local(w->ctx)) {
        reply_models(w->ctx, m, c, NULL, 0);
    } else {
        px_req_start(w, c, ep, h, body);
    }
}

/* /v1/models/{id} from the named pools. */
static void serve_model(px_wctx *w, px_conn *c, const px_http_head *h, const char *id,
                        size_t idlen) {
    const px_endpoint_def *d = &px_endpoints[PX_EP_MODELS];
    if (px_endpoint_method(h) != PX_M_GET) {
        reply_method(&w->metrics, PX_EP_MODELS, c, h, NULL, d->allow, d->wrong_method);
    } else if (!px_ctx_authorized(w->ctx, h)) {
        reply_unauthorized(&w->metrics, PX_EP_MODELS, c, h, NULL);
    } else {
        /* Ids may hold '/' as is or as %2F (meta-llama%2FLlama-3.1-8B). */
        char buf[512];
        size_t n = px_pct_decode(id, idlen, buf, sizeof buf);
        reply_models(w->ctx, &w->metrics, c, buf, n);
    }
}

void px_routes_dispatch(void *arg, px_conn *c, const px_http_head *h, px_buf *body) {
    px_wctx *w = arg;
    for (px_endpoint e = 0; e < PX_EP_COUNT; e++)
        if (px_endpoints[e].path && !px_endpoints[e].own &&
            px_http_path_is(h, px_endpoints[e].path)) {
            serve_api(w, e, c, h, body);
            return;
        }
    const char *path;
    size_t plen;
    px_http_path(h, &path, &plen);
    if (plen > 11 && !memcmp(path, "/v1/models/", 11) && models_local(w->ctx)) {
        serve_model(w, c, h, path + 11, plen - 11);
        return;
    }
    if (serve_local(w->ctx, &w->metrics, c, h, w->ctx->cfg->metrics_port == 0)) return;
    if (px_endpoint_passthrough_path(path, plen)) {
        serve_api(w, PX_EP_PASSTHROUGH, c, h, body);
        return;
    }
    px_metrics_count(&w->metrics, PX_EP_OTHER, 404);
    not_found(c, h, 1);
}
