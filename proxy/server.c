#include "server.h"

#include <errno.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "admin.h"
#include "ctx.h"
#include "discovery.h"
#include "health.h"
#include "http.h"
#include "listen.h"
#include "log.h"
#include "request.h"
#include "scrape.h"

/* Commands the control thread posts to workers. */
enum { PX_CMD_DRAIN = 1, PX_CMD_STOP = 2, PX_CMD_RETIRE = 4 };

/* A worker thread: its loop, listener and client connections; what its
 * requests see of it is wc. */
typedef struct px_worker {
    px_wctx wc;
    px_server *srv;           /* borrowed: outlives the worker */
    px_listener *lev;         /* owned; NULL once draining */
    struct event *wake;       /* owned: commands from the control thread */
    int wake_fd;              /* owned eventfd */
    atomic_int cmd;           /* PX_CMD_* bits */
    struct event *drain_poll; /* owned: while draining, exits when idle */
    px_conn_list conns;       /* owned: open client connections */
    px_conn_cfg conn_cfg;
    pthread_t thread;
} px_worker;

struct px_server {
    px_ctx ctx;        /* what requests, health, metrics and the admin API see */
    uint64_t last_gen; /* control thread */
    /* Reloading: the command line and environment to merge over the file
     * again, the file's last good settings and the admin API's changes
     * since (control thread). */
    int argc;
    char **argv;         /* borrowed: main's */
    char **envp;         /* borrowed: main's */
    px_config *file_cfg; /* owned: the last reload's, or NULL: ctx.cfg */
    px_api_op *ops;      /* owned: admin API changes since the last file reload */
    size_t nops;
    struct px_discovery **retired; /* owned: replaced generations' discoveries whose
                                       cancelled lookups may still call back */
    size_t nretired;
    px_admin *admin;    /* owned, or NULL */
    SSL_CTX *tls;       /* owned, or NULL */
    px_worker *workers; /* owned array */
    int nworkers;
    struct event_base *ctl_base; /* owned: the control loop (signals, DNS, health) */
    px_listener *mlev;           /* owned: --metrics-port listener, or NULL */
    px_conn_list mconns;         /* owned: its connections (control thread) */
    px_conn_cfg mconn_cfg;
    atomic_int draining; /* SIGTERM: readiness says no */
    atomic_int workers_running;
};

/* ---------- routing ---------- */

/* The 405 for a method the route does not take: counted, logged (when
 * `epname`) and answered with its Allow header. */
static void reply_method(px_metrics *m, px_metric_endpoint mep, px_conn *c, const px_http_head *h,
                         const char *epname, const char *allow, const char *msg) {
    px_metrics_count(m, mep, 405);
    if (epname)
        px_req_refuse(c, h, epname, 405, allow, msg);
    else
        px_conn_reply_error(c, 405, NULL, allow, msg);
}

/* The 401 for a request without a valid key: counted (when `m`), logged
 * (when `epname`) and answered. */
static void reply_unauthorized(px_metrics *m, px_metric_endpoint mep, px_conn *c,
                               const px_http_head *h, const char *epname) {
    if (m) px_metrics_count(m, mep, 401);
    static const char msg[] = "invalid or missing API key: send Authorization: Bearer <key>";
    if (epname)
        px_req_refuse(c, h, epname, 401, "WWW-Authenticate: Bearer\r\n", msg);
    else
        px_conn_reply_error(c, 401, NULL, "WWW-Authenticate: Bearer\r\n", msg);
}

/* m: the worker's metrics, or NULL on the control thread's listener. */
static void reply_json(px_metrics *m, px_conn *c, px_metric_endpoint ep, int status,
                       const char *json, size_t n) {
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
static void reply_ready(px_server *s, px_metrics *m, px_conn *c) {
    px_gen *g = px_ctx_gen(&s->ctx);
    int draining = atomic_load(&s->draining);
    /* The sidecar's prefills come with the requests: decode alone decides. */
    int decode_alone = s->ctx.cfg->fallback_decode_only || s->ctx.cfg->prefiller_from_header;
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
    pthread_mutex_lock(&s->ctx.gen_mu);
    px_discovery_ready_json(s->ctx.gen->disc, &b);
    pthread_mutex_unlock(&s->ctx.gen_mu);
    px_buf_appends(&b, "}");
    reply_json(m, c, PX_MEP_READY, ready ? 200 : 503, b.data, b.len);
    px_buf_cleanup(&b);
    px_buf_cleanup(&pools);
    px_gen_release(g);
}

/* Named pools: /v1/models lists their models (each once, in the order
 * configured) and /v1/models/{id} answers from that list. id: NULL for the
 * list. */
static void reply_models(px_server *s, px_metrics *m, px_conn *c, const char *id, size_t idlen) {
    px_gen *g = px_ctx_gen(&s->ctx);
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
        px_req_model_not_found(&b, id, idlen);
        reply_json(m, c, PX_MEP_MODELS, 404, b.data, b.len);
    } else {
        reply_json(m, c, PX_MEP_MODELS, 200, b.data, b.len);
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
        px_req_refuse(c, h, "other", 404, NULL, m.data);
    else
        px_conn_reply_error(c, 404, NULL, NULL, m.data);
    px_buf_cleanup(&m);
}

/* The proxy's own GET endpoints (HEAD answers as GET, without the body).
 * `metrics_here`: /metrics is served on this listener. Returns 0 when the
 * path is none of them. */
static int serve_local(px_server *s, px_metrics *m, px_conn *c, const px_http_head *h,
                       int metrics_here) {
    int is_get = (h->method_len == 3 && memcmp(h->method, "GET", 3) == 0) ||
                 (h->method_len == 4 && memcmp(h->method, "HEAD", 4) == 0);
    int healthcheck = px_http_path_is(h, "/healthcheck"), health = px_http_path_is(h, "/health");
    int ready = px_http_path_is(h, "/ready"), metrics = px_http_path_is(h, "/metrics");
    if (metrics && !metrics_here) return 0;
    if (!(healthcheck || health || ready || metrics)) return 0;
    px_metric_endpoint mep = healthcheck ? PX_MEP_HEALTHCHECK
                             : health    ? PX_MEP_HEALTH
                             : ready     ? PX_MEP_READY
                                         : PX_MEP_METRICS;
    if (!is_get) {
        if (m) px_metrics_count(m, mep, 405);
        px_conn_reply_error(c, 405, NULL, "Allow: GET, HEAD\r\n", "method not allowed: use GET");
        return 1;
    }
    if (metrics && s->ctx.cfg->metrics_auth && !px_ctx_authorized(&s->ctx, h)) {
        reply_unauthorized(m, mep, c, h, NULL);
        return 1;
    }
    if (ready) {
        reply_ready(s, m, c);
    } else if (metrics) {
        if (m) px_metrics_count(m, PX_MEP_METRICS, 200);
        px_buf b;
        px_buf_init(&b);
        px_scrape_render(&s->ctx, &b);
        px_conn_reply(c, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, NULL, b.data,
                      b.len);
        px_buf_cleanup(&b);
    } else if (health) {
        reply_json(m, c, PX_MEP_HEALTH, 200, "{\"status\":\"ok\"}", 15);
    } else {
        size_t pn = 0, dn = 0;
        px_gen *g = px_ctx_gen(&s->ctx);
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
        reply_json(m, c, PX_MEP_HEALTHCHECK, 200, json, (size_t)n);
    }
    return 1;
}

/* The --metrics-port listener, on the control thread: only the proxy's own
 * endpoints. */
static void dispatch_metrics(void *ctx, px_conn *c, const px_http_head *h, px_buf *body) {
    px_server *s = ctx;
    if (!serve_local(s, NULL, c, h, 1)) not_found(c, h, 0);
}

static int models_local(px_server *s) {
    px_gen *g = px_ctx_gen(&s->ctx);
    int named = g->named;
    px_gen_release(g);
    return named;
}

/* The engine API's routes: what each takes, how it is counted and logged. */
enum { M_GET = 1, M_POST = 2, M_OTHER = 4 }; /* M_OTHER: PUT, PATCH, DELETE */

typedef struct api_route {
    const char *path; /* exact; NULL: every other passed-through path */
    px_endpoint ep;
    px_metric_endpoint mep;
    const char *name; /* the access line's endpoint */
    int methods;      /* M_* */
    const char *allow;
    const char *wrong_method;
} api_route;

static const api_route api_routes[] = {
    {"/v1/completions", PX_EP_COMPLETIONS, PX_MEP_COMPLETIONS, "/v1/completions", M_POST,
     "Allow: POST\r\n", "method not allowed: use POST"},
    {"/v1/chat/completions", PX_EP_CHAT, PX_MEP_CHAT, "/v1/chat/completions", M_POST,
     "Allow: POST\r\n", "method not allowed: use POST"},
    {"/v1/models", PX_EP_MODELS, PX_MEP_MODELS, "/v1/models", M_GET, "Allow: GET\r\n",
     "method not allowed: use GET"},
    /* The engine's other endpoints: /v1/messages disaggregated, the rest
     * (vLLM's /v1/responses included) passed to a decode as they are. */
    {"/v1/messages", PX_EP_MESSAGES, PX_MEP_MESSAGES, "/v1/messages", M_POST, "Allow: POST\r\n",
     "method not allowed"},
    {"/v1/responses", PX_EP_RESPONSES, PX_MEP_RESPONSES, "/v1/responses", M_GET | M_POST | M_OTHER,
     "Allow: GET, POST, PUT, PATCH, DELETE\r\n", "method not allowed"},
    {NULL, PX_EP_PASSTHROUGH, PX_MEP_PASSTHROUGH, "passthrough", M_GET | M_POST | M_OTHER,
     "Allow: GET, POST, PUT, PATCH, DELETE\r\n", "method not allowed"},
};

static int method_of(const px_http_head *h) {
    static const struct {
        const char *name;
        size_t len;
        int bit;
    } m[] = {{"GET", 3, M_GET},
             {"POST", 4, M_POST},
             {"PUT", 3, M_OTHER},
             {"PATCH", 5, M_OTHER},
             {"DELETE", 6, M_OTHER}};
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
        if (h->method_len == m[i].len && !memcmp(h->method, m[i].name, m[i].len)) return m[i].bit;
    return 0;
}

/* Checks the method and the key, then serves the route: a request flow,
 * or /v1/models from the named pools. */
static void serve_api(px_worker *w, const api_route *rt, px_conn *c, const px_http_head *h,
                      px_buf *body) {
    px_server *s = w->srv;
    px_metrics *m = &w->wc.metrics;
    if (!(method_of(h) & rt->methods)) {
        reply_method(m, rt->mep, c, h, rt->name, rt->allow, rt->wrong_method);
    } else if (!px_ctx_authorized(&s->ctx, h)) {
        reply_unauthorized(m, rt->mep, c, h, rt->name);
    } else if (rt->ep == PX_EP_MODELS && models_local(s)) {
        reply_models(s, m, c, NULL, 0);
    } else {
        px_req_start(&w->wc, c, rt->ep, h, body);
    }
}

static void dispatch(void *ctx, px_conn *c, const px_http_head *h, px_buf *body) {
    px_worker *w = ctx;
    px_server *s = w->srv;
    size_t nroutes = sizeof api_routes / sizeof api_routes[0];
    for (size_t i = 0; i + 1 < nroutes; i++)
        if (px_http_path_is(h, api_routes[i].path)) {
            serve_api(w, &api_routes[i], c, h, body);
            return;
        }
    const char *path;
    size_t plen;
    px_http_path(h, &path, &plen);
    if (plen > 11 && !memcmp(path, "/v1/models/", 11) && models_local(s)) {
        if (method_of(h) != M_GET) {
            reply_method(&w->wc.metrics, PX_MEP_MODELS, c, h, NULL, "Allow: GET\r\n",
                         "method not allowed: use GET");
        } else if (!px_ctx_authorized(&s->ctx, h)) {
            reply_unauthorized(&w->wc.metrics, PX_MEP_MODELS, c, h, NULL);
        } else {
            /* Ids may hold '/' as is or as %2F (meta-llama%2FLlama-3.1-8B). */
            char id[512];
            size_t n = px_pct_decode(path + 11, plen - 11, id, sizeof id);
            reply_models(s, &w->wc.metrics, c, id, n);
        }
        return;
    }
    if (serve_local(s, &w->wc.metrics, c, h, s->ctx.cfg->metrics_port == 0)) return;
    if (px_req_passthrough_path(path, plen)) {
        serve_api(w, &api_routes[nroutes - 1], c, h, body);
        return;
    }
    px_metrics_count(&w->wc.metrics, PX_MEP_OTHER, 404);
    not_found(c, h, 1);
}

/* ---------- workers ---------- */

static void on_drain_poll(evutil_socket_t fd, short what, void *arg) {
    px_worker *w = arg;
    /* Requests whose client left may still be releasing prefill's blocks. */
    if (w->conns.n == 0 && w->wc.nreqs == 0) event_base_loopbreak(w->wc.base);
}

/* Whether an address belongs to a backend of generation `ctx`. */
static int is_backend_addr(void *ctx, const struct sockaddr *sa, socklen_t salen) {
    px_gen *g = ctx;
    int found = 0;
    for (size_t i = 0; i < g->nps && !found; i++)
        for (int role = 0; role < 2 && !found; role++) {
            px_pool *p = role ? &g->ps[i].decode : &g->ps[i].prefill;
            size_t n;
            px_backend **m = px_pool_members(p, &n);
            for (size_t j = 0; j < n; j++) {
                if (!found && m[j]->addrlen == salen && !memcmp(&m[j]->addr, sa, salen)) found = 1;
                px_backend_release(m[j]);
            }
            free(m);
        }
    return found;
}

static void on_wake(evutil_socket_t fd, short what, void *arg) {
    px_worker *w = arg;
    uint64_t v;
    if (read(fd, &v, sizeof v) < 0 && errno != EAGAIN) return;
    int cmd = atomic_exchange(&w->cmd, 0);
    if (cmd & PX_CMD_STOP) {
        event_base_loopbreak(w->wc.base);
        return;
    }
    if (cmd & PX_CMD_RETIRE) {
        /* The backends changed: connections to those gone close after
         * their last request. */
        px_gen *g = px_ctx_gen(&w->srv->ctx);
        px_uploop_retire(w->wc.up, is_backend_addr, g);
        px_gen_release(g);
    }
    if ((cmd & PX_CMD_DRAIN) && w->lev) {
        /* Stop accepting, answer what is in flight with Connection: close,
         * and leave once no connection is left. */
        px_listener_free(w->lev);
        w->lev = NULL;
        w->conn_cfg.draining = 1;
        px_conn_list_close_idle(&w->conns);
        struct timeval tv = {0, 50000};
        w->drain_poll = event_new(w->wc.base, -1, EV_PERSIST, on_drain_poll, w);
        event_add(w->drain_poll, &tv);
        on_drain_poll(-1, 0, w);
    }
}

static void *worker_main(void *arg) {
    px_worker *w = arg;
    event_base_dispatch(w->wc.base);
    atomic_fetch_sub(&w->srv->workers_running, 1);
    return NULL;
}

static void worker_cleanup(px_worker *w) {
    px_conn_list_close_all(&w->conns);
    px_req_free_all(&w->wc);
    px_listener_free(w->lev);
    if (w->drain_poll) event_free(w->drain_poll);
    px_uploop_destroy(w->wc.up);
    if (w->wake) event_free(w->wake);
    if (w->wake_fd >= 0) close(w->wake_fd);
    if (w->wc.base) event_base_free(w->wc.base);
}

static void post_cmd(px_server *s, int cmd) {
    for (int i = 0; i < s->nworkers; i++) {
        uint64_t one = 1;
        atomic_fetch_or(&s->workers[i].cmd, cmd);
        if (write(s->workers[i].wake_fd, &one, sizeof one) < 0) continue;
    }
}

/* ---------- setup ---------- */

static int setup_tls(px_server *s, char *err, size_t errlen) {
    const px_config *c = s->ctx.cfg;
    if (!c->tls_cert[0]) return 0;
    s->tls = SSL_CTX_new(TLS_server_method());
    if (!s->tls) goto fail;
    SSL_CTX_set_min_proto_version(s->tls, TLS1_2_VERSION);
    SSL_CTX_set_options(s->tls, SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE);
    if (SSL_CTX_use_certificate_chain_file(s->tls, c->tls_cert) != 1) {
        snprintf(err, errlen, "--tls-cert '%s': %s", c->tls_cert,
                 ERR_reason_error_string(ERR_get_error()));
        return -1;
    }
    if (SSL_CTX_use_PrivateKey_file(s->tls, c->tls_key, SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(s->tls) != 1) {
        snprintf(err, errlen, "--tls-key '%s': %s", c->tls_key,
                 ERR_reason_error_string(ERR_get_error()));
        return -1;
    }
    return 0;
fail:
    snprintf(err, errlen, "cannot create the TLS context");
    return -1;
}

/* --metrics-port: /metrics, /health and /ready on a listener of their own,
 * served by the control thread (so a busy worker does not delay a scrape). */
static int setup_metrics_listener(px_server *s, char *err, size_t errlen) {
    const px_config *cfg = s->ctx.cfg;
    if (!cfg->metrics_port) return 0;
    const char *host = cfg->metrics_host[0] ? cfg->metrics_host : cfg->host;
    if (px_listen_port_free(host, (int)cfg->metrics_port, "--metrics-port", err, errlen) < 0)
        return -1;
    s->mconn_cfg = (px_conn_cfg){
        .max_body_bytes = 65536,
        .header_timeout = cfg->client_header_timeout,
        .keepalive_timeout = cfg->keepalive_timeout,
        .send_timeout = cfg->send_timeout,
        .dispatch = dispatch_metrics,
        .ctx = s,
    };
    s->mlev = px_listen(s->ctl_base, host, (int)cfg->metrics_port, 0, "--metrics-port",
                        &s->mconn_cfg, &s->mconns, err, errlen);
    return s->mlev ? 0 : -1;
}

/* ---------- generations ---------- */

static px_gen *gen_build(px_server *s, const px_config *cfg, const px_pool_spec *specs, size_t n,
                         px_gen *old, int wait, char *err, size_t errlen) {
    px_gen *g = px_xcalloc(1, sizeof *g);
    atomic_init(&g->refs, 1);
    g->named = cfg->npools > 0;
    g->nps = n;
    g->ps = px_xcalloc(n ? n : 1, sizeof *g->ps);
    px_pool_cfg pc = {
        .unhealthy_after = (int)cfg->unhealthy_after,
        .healthy_after = (int)cfg->healthy_after,
        .active_checks = s->ctx.cfg->health_interval > 0, /* the checker's, set at start */
        .prefix_bytes = (size_t)cfg->prefix_bytes,
        .load_factor = cfg->prefix_load_factor,
    };
    for (size_t i = 0; i < n; i++) {
        px_pset *p = &g->ps[i];
        p->name = px_xstrdup(specs[i].name);
        for (size_t j = 0; j < specs[i].models.n; j++)
            px_strlist_push(&p->models, specs[i].models.v[j]);
        pc.policy = (px_policy)px_policy_parse(specs[i].prefill_policy[0] ? specs[i].prefill_policy
                                                                          : cfg->prefill_policy);
        px_pool_init(&p->prefill, "prefill", &pc);
        pc.policy = (px_policy)px_policy_parse(specs[i].decode_policy[0] ? specs[i].decode_policy
                                                                         : cfg->decode_policy);
        px_pool_init(&p->decode, "decode", &pc);
    }
    g->disc = px_discovery_start(g, specs, old, cfg->dns_refresh, s->ctl_base, wait, err, errlen);
    if (!g->disc) {
        px_gen_release(g);
        return NULL;
    }
    return g;
}

static px_pool *pset_pool(px_pset *p, int prefill) {
    return prefill ? &p->prefill : &p->decode;
}

/* Logs what a swap changed: backends that joined, and those that left
 * (their connections close once their last request is done). */
static void log_changes(px_gen *old, px_gen *g) {
    for (int side = 0; side < 2; side++) {
        px_gen *a = side ? old : g, *b = side ? g : old;
        for (size_t i = 0; i < a->nps; i++)
            for (int r = 0; r < 2; r++) {
                size_t n;
                px_backend **m = px_pool_members(pset_pool(&a->ps[i], r), &n);
                px_pool *other = NULL;
                for (size_t j = 0; j < b->nps && !other; j++)
                    if (!strcmp(b->ps[j].name, a->ps[i].name)) other = pset_pool(&b->ps[j], r);
                size_t on = 0;
                px_backend **om = other ? px_pool_members(other, &on) : NULL;
                for (size_t k = 0; k < n; k++) {
                    int kept = 0;
                    for (size_t l = 0; l < on && !kept; l++)
                        kept = om[l] == m[k];
                    if (!kept)
                        PX_LOG(PX_LOG_INFO, "msg=\"%s\" pool=\"%s\" role=%s backend=%s inflight=%d",
                               side ? "backend removed by reload; its connections close after "
                                      "its last request"
                                    : "backend added by reload",
                               a->ps[i].name, r ? "prefill" : "decode", m[k]->name,
                               atomic_load(&m[k]->inflight));
                }
                for (size_t k = 0; k < n; k++)
                    px_backend_release(m[k]);
                for (size_t l = 0; l < on; l++)
                    px_backend_release(om[l]);
                free(m);
                free(om);
            }
    }
}

static px_pool_spec *spec_named(px_pool_spec *v, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(v[i].name, name)) return &v[i];
    return NULL;
}

static int list_find(const px_strlist *l, const char *s) {
    for (size_t i = 0; i < l->n; i++)
        if (!strcmp(l->v[i], s)) return (int)i;
    return -1;
}

static void list_remove(px_strlist *l, size_t i) {
    free(l->v[i]);
    memmove(&l->v[i], &l->v[i + 1], (l->n - i - 1) * sizeof *l->v);
    l->n--;
}

/* Returns 0, -2 (no such pool or backend) or -3 (already there). */
static int apply_op(px_pool_spec *v, size_t n, const px_api_op *op, char *err, size_t errlen) {
    px_pool_spec *p = spec_named(v, n, op->pool);
    const char *role = op->prefill ? "prefill" : "decode";
    if (!p) {
        snprintf(err, errlen, "no pool named '%s'", op->pool);
        return -2;
    }
    px_strlist *l = op->prefill ? &p->prefill : &p->decode;
    px_strlist *toy = op->prefill ? &p->prefill_toy : &p->decode_toy;
    int at = list_find(l, op->url), tat = list_find(toy, op->url);
    if (op->add) {
        if (at >= 0 || tat >= 0) {
            snprintf(err, errlen, "%s is a %s backend of pool '%s' already", op->url, role,
                     p->name);
            return -3;
        }
        px_strlist_push(l, op->url);
        return 0;
    }
    if (at < 0 && tat < 0) {
        snprintf(err, errlen, "%s is not a %s backend of pool '%s'", op->url, role, p->name);
        return -2;
    }
    if (at >= 0)
        list_remove(l, (size_t)at);
    else
        list_remove(toy, (size_t)tat);
    return 0;
}

static const px_config *server_config(px_server *s) {
    return s->file_cfg ? s->file_cfg : s->ctx.cfg;
}

static void op_free(px_api_op *o) {
    free(o->pool);
    free(o->url);
}

static int reload(px_server *s, int from_file, const px_api_op *op, char *err, size_t errlen) {
    uint64_t t0 = px_now_ns();
    px_config *nc = NULL;
    const px_config *base = server_config(s);
    if (from_file) {
        if (!base->config_file[0]) {
            snprintf(err, errlen, "no --config file to reload");
            return -1;
        }
        nc = px_xcalloc(1, sizeof *nc);
        FILE *devnull = fopen("/dev/null", "w");
        char *fallback[] = {"pdproxy", "--config", base->config_file, NULL};
        px_config_result r =
            s->argv ? px_config_load(nc, s->argc, s->argv, s->envp, devnull, err, errlen)
                    : px_config_load(nc, 3, fallback, NULL, devnull, err, errlen);
        if (devnull) fclose(devnull);
        if (r != PX_CONFIG_RUN) {
            if (r != PX_CONFIG_ERROR) snprintf(err, errlen, "the settings do not describe a run");
            px_config_cleanup(nc);
            free(nc);
            return -1;
        }
        /* What a generation is made of; the rest is read at start. */
        static const char *const reloadable[] = {
            "config",        "prefiller-hosts",    "prefiller-ports",
            "decoder-hosts", "decoder-ports",      "prefill",
            "decode",        "dns-refresh",        "unhealthy-after",
            "healthy-after", "prefill-policy",     "decode-policy",
            "prefix-bytes",  "prefix-load-factor", NULL};
        char changed[512];
        px_config_changed(server_config(s), nc, reloadable, changed, sizeof changed);
        if (changed[0])
            PX_LOG(PX_LOG_WARN,
                   "msg=\"reload: these settings changed but take effect at restart only\" "
                   "settings=%s",
                   changed);
        base = nc;
    }
    size_t n;
    px_pool_spec *specs = px_config_effective_pools(base, &n);
    int rc = 0;
    for (size_t i = 0; !from_file && i < s->nops && rc == 0; i++)
        rc = apply_op(specs, n, &s->ops[i], err, errlen);
    if (rc == 0 && op) rc = apply_op(specs, n, op, err, errlen);
    px_gen *g = NULL;
    if (rc == 0) {
        g = gen_build(s, base, specs, n, s->ctx.gen, 0, err, errlen);
        if (!g) rc = -1;
    }
    px_pool_specs_free(specs, n);
    if (rc < 0) {
        if (nc) {
            px_config_cleanup(nc);
            free(nc);
        }
        return rc;
    }
    if (from_file) /* The admin API's drains last until the next reload from the file. */
        for (size_t i = 0; i < g->nps; i++)
            for (int r = 0; r < 2; r++) {
                size_t k;
                px_backend **m = px_pool_members(pset_pool(&g->ps[i], r), &k);
                for (size_t j = 0; j < k; j++) {
                    atomic_store(&m[j]->drained, 0);
                    px_backend_release(m[j]);
                }
                free(m);
            }
    pthread_mutex_lock(&s->ctx.gen_mu);
    px_gen *old = s->ctx.gen;
    g->id = ++s->last_gen;
    s->ctx.gen = g;
    pthread_mutex_unlock(&s->ctx.gen_mu);
    /* A replaced discovery may have lookups whose cancellation calls back on
     * a later turn of this loop: it is freed by a later reload, once idle. */
    size_t keep = 0;
    for (size_t i = 0; i < s->nretired; i++) {
        if (px_discovery_idle(s->retired[i]))
            px_discovery_stop(s->retired[i]);
        else
            s->retired[keep++] = s->retired[i];
    }
    s->nretired = keep;
    px_discovery_retire(old->disc);
    s->retired = px_xrealloc(s->retired, (s->nretired + 1) * sizeof *s->retired);
    s->retired[s->nretired++] = old->disc;
    old->disc = NULL;
    log_changes(old, g);
    px_gen_release(old); /* requests on it keep it until they end */
    post_cmd(s, PX_CMD_RETIRE);
    if (from_file) {
        if (s->file_cfg) {
            px_config_cleanup(s->file_cfg);
            free(s->file_cfg);
        }
        s->file_cfg = nc;
        for (size_t i = 0; i < s->nops; i++)
            op_free(&s->ops[i]);
        free(s->ops);
        s->ops = NULL;
        s->nops = 0;
    } else if (op) {
        s->ops = px_xrealloc(s->ops, (s->nops + 1) * sizeof *s->ops);
        s->ops[s->nops++] = (px_api_op){.add = op->add,
                                        .prefill = op->prefill,
                                        .pool = px_xstrdup(op->pool),
                                        .url = px_xstrdup(op->url)};
    }
    PX_LOG(PX_LOG_INFO, "msg=\"configuration swapped\" generation=%llu source=%s pools=%zu ms=%.3f",
           (unsigned long long)g->id,
           from_file ? "file"
           : op      ? "admin_api"
                     : "current",
           g->nps, (double)(px_now_ns() - t0) / 1e6);
    return 0;
}

/* The admin API's view of the control plane (admin.h). */
static int admin_reload(void *arg, int from_file, const px_api_op *op, char *err, size_t errlen) {
    return reload(arg, from_file, op, err, errlen);
}

static const px_config *admin_config(void *arg) {
    return server_config(arg);
}

static const px_api_op *admin_changes(void *arg, size_t *n) {
    px_server *s = arg;
    *n = s->nops;
    return s->ops;
}

void px_server_set_args(px_server *s, int argc, char **argv, char **envp) {
    s->argc = argc;
    s->argv = argv;
    s->envp = envp;
}

px_server *px_server_create(const px_config *cfg, char *err, size_t errlen) {
    px_server *s = px_xcalloc(1, sizeof *s);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    s->nworkers = cfg->threads > 0 ? (int)cfg->threads : (ncpu > 0 ? (int)ncpu : 1);
    s->workers = px_xcalloc((size_t)s->nworkers, sizeof *s->workers);
    s->ctx.workers = px_xcalloc((size_t)s->nworkers, sizeof *s->ctx.workers);
    s->ctx.nworkers = s->nworkers;
    for (int i = 0; i < s->nworkers; i++) {
        s->workers[i].wake_fd = -1;
        s->workers[i].wc.s = &s->ctx;
        s->ctx.workers[i] = &s->workers[i].wc;
    }
    if (px_ctx_init(&s->ctx, cfg, err, errlen) < 0 || setup_tls(s, err, errlen) < 0) goto err;
    s->ctl_base = event_base_new();
    if (!s->ctl_base) {
        snprintf(err, errlen, "cannot create an event loop");
        goto err;
    }
    if (!cfg->reuse_port &&
        px_listen_port_free(cfg->host, (int)cfg->port, "--port", err, errlen) < 0)
        goto err;
    if (setup_metrics_listener(s, err, errlen) < 0) goto err;
    size_t nspecs;
    px_pool_spec *specs = px_config_effective_pools(cfg, &nspecs);
    s->ctx.gen = gen_build(s, cfg, specs, nspecs, NULL, 1, err, errlen);
    px_pool_specs_free(specs, nspecs);
    if (!s->ctx.gen) goto err;
    s->ctx.gen->id = s->last_gen = 1;
    px_admin_host ah = {.ctx = &s->ctx,
                        .base = s->ctl_base,
                        .arg = s,
                        .reload = admin_reload,
                        .config = admin_config,
                        .changes = admin_changes};
    if (px_admin_start(&ah, cfg, &s->admin, err, errlen) < 0) goto err;
    for (int i = 0; i < s->nworkers; i++) {
        px_worker *w = &s->workers[i];
        w->srv = s;
        w->conn_cfg = (px_conn_cfg){
            .max_body_bytes = cfg->max_body_bytes,
            .header_timeout = cfg->client_header_timeout,
            .keepalive_timeout = cfg->keepalive_timeout,
            .send_timeout = cfg->send_timeout,
            .shared = &s->ctx.shared,
            .dispatch = dispatch,
            .ctx = w,
            .tls = s->tls,
        };
        struct event_config *ec = event_config_new();
        event_config_set_flag(ec, EVENT_BASE_FLAG_NOLOCK);
        w->wc.base = event_base_new_with_config(ec);
        event_config_free(ec);
        if (!w->wc.base) {
            snprintf(err, errlen, "cannot create an event loop");
            goto err;
        }
        /* Without --reuse-port the workers still share the port among
         * themselves: px_listen_port_free() checked that no one else serves
         * it. */
        w->lev = px_listen(w->wc.base, cfg->host, (int)cfg->port, 1, "--port", &w->conn_cfg,
                           &w->conns, err, errlen);
        if (!w->lev) goto err;
        w->wc.up = px_uploop_create(w->wc.base, (int)cfg->upstream_keepalive);
        w->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (!w->wc.up || w->wake_fd < 0) {
            snprintf(err, errlen, "cannot create the upstream loop");
            goto err;
        }
        w->wake = event_new(w->wc.base, w->wake_fd, EV_READ | EV_PERSIST, on_wake, w);
        event_add(w->wake, NULL);
    }
    return s;
err:
    px_server_destroy(s);
    return NULL;
}

/* ---------- the control loop ---------- */

typedef struct control {
    px_server *s;
    struct event_base *base;
    struct event *drain_timer; /* drain-delay, then drain-timeout */
    struct event *exit_poll;
    int phase; /* 0 running, 1 not ready, 2 draining, 3 stopping */
} control;

static void arm(struct event *ev, double seconds) {
    struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
    event_add(ev, &tv);
}

static void on_drain_timer(evutil_socket_t fd, short what, void *arg) {
    control *k = arg;
    if (k->phase == 1) {
        PX_LOG(PX_LOG_INFO,
               "msg=\"drain: no new connections; waiting for requests in flight\" "
               "timeout_s=%g inflight=%ld",
               k->s->ctx.cfg->drain_timeout, atomic_load(&k->s->ctx.inflight));
        k->phase = 2;
        post_cmd(k->s, PX_CMD_DRAIN);
        arm(k->drain_timer, k->s->ctx.cfg->drain_timeout);
    } else if (k->phase == 2) {
        PX_LOG(PX_LOG_WARN, "msg=\"drain timeout: closing what is left\" inflight=%ld",
               atomic_load(&k->s->ctx.inflight));
        k->phase = 3;
        post_cmd(k->s, PX_CMD_STOP);
    }
}

static void on_exit_poll(evutil_socket_t fd, short what, void *arg) {
    control *k = arg;
    if (atomic_load(&k->s->workers_running) == 0) event_base_loopbreak(k->base);
}

/* Reads the --config file again; on any error the running configuration
 * stays and the log says what is wrong (file, line, key). */
static void on_sighup(evutil_socket_t sig, short what, void *arg) {
    control *k = arg;
    if (!server_config(k->s)->config_file[0]) {
        PX_LOG(PX_LOG_INFO, "msg=\"SIGHUP received: nothing to reload (no --config file); "
                            "ignored\"");
        return;
    }
    char err[512], q[1100];
    if (reload(k->s, 1, NULL, err, sizeof err) < 0)
        PX_LOG(PX_LOG_ERROR,
               "msg=\"reload on SIGHUP failed; the running configuration stays\" "
               "error=%s",
               px_log_value(err, q, sizeof q));
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    control *k = arg;
    if (sig == SIGTERM && k->phase == 0) {
        /* Readiness turns 503 at once; load balancers get drain-delay to
         * notice before the listeners close. */
        PX_LOG(PX_LOG_INFO, "msg=\"SIGTERM: draining\" drain_delay_s=%g drain_timeout_s=%g",
               k->s->ctx.cfg->drain_delay, k->s->ctx.cfg->drain_timeout);
        atomic_store(&k->s->draining, 1);
        k->phase = 1;
        arm(k->drain_timer, k->s->ctx.cfg->drain_delay);
        return;
    }
    PX_LOG(PX_LOG_INFO, "msg=\"stopping now\" signal=%d", (int)sig);
    atomic_store(&k->s->draining, 1);
    k->phase = 3;
    post_cmd(k->s, PX_CMD_STOP);
}

int px_server_run(px_server *s) {
    control k = {.s = s};
    k.base = s->ctl_base;
    struct event *sigterm = evsignal_new(k.base, SIGTERM, on_signal, &k);
    struct event *sigint = evsignal_new(k.base, SIGINT, on_signal, &k);
    struct event *sighup = evsignal_new(k.base, SIGHUP, on_sighup, &k);
    event_add(sigterm, NULL);
    event_add(sigint, NULL);
    event_add(sighup, NULL);
    k.drain_timer = evtimer_new(k.base, on_drain_timer, &k);
    k.exit_poll = event_new(k.base, -1, EV_PERSIST, on_exit_poll, &k);
    arm(k.exit_poll, 0.05);
    /* Workers must not take the signals: the control loop handles them. */
    sigset_t set, old;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, &old);
    atomic_store(&s->workers_running, s->nworkers);
    for (int i = 0; i < s->nworkers; i++)
        pthread_create(&s->workers[i].thread, NULL, worker_main, &s->workers[i]);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    px_health *h = px_health_start(&s->ctx, k.base);
    size_t pn = 0, dn = 0;
    for (size_t i = 0; i < s->ctx.gen->nps; i++) {
        size_t n;
        px_pool_counts(&s->ctx.gen->ps[i].prefill, &n, NULL);
        pn += n;
        px_pool_counts(&s->ctx.gen->ps[i].decode, &n, NULL);
        dn += n;
    }
    PX_LOG(PX_LOG_INFO,
           "msg=\"listening\" addr=%s:%lld tls=%s threads=%d pools=%zu prefill_backends=%zu "
           "decode_backends=%zu "
           "prefill_policy=%s decode_policy=%s",
           s->ctx.cfg->host, (long long)s->ctx.cfg->port, s->tls ? "on" : "off", s->nworkers,
           s->ctx.gen->nps, pn, dn, s->ctx.cfg->prefill_policy, s->ctx.cfg->decode_policy);
    px_req_announce();
    event_base_dispatch(k.base);
    px_health_stop(h);
    for (int i = 0; i < s->nworkers; i++)
        pthread_join(s->workers[i].thread, NULL);
    event_free(sigterm);
    event_free(sigint);
    event_free(sighup);
    event_free(k.drain_timer);
    event_free(k.exit_poll);
    PX_LOG(PX_LOG_INFO, "msg=\"stopped\"");
    return 0;
}

void px_server_destroy(px_server *s) {
    if (!s) return;
    for (int i = 0; i < s->nworkers; i++)
        worker_cleanup(&s->workers[i]);
    free(s->workers);
    px_admin_stop(s->admin);
    if (s->ctx.gen) {
        px_discovery_stop(s->ctx.gen->disc);
        s->ctx.gen->disc = NULL;
        px_gen_release(s->ctx.gen);
    }
    for (size_t i = 0; i < s->nretired; i++)
        px_discovery_stop(s->retired[i]);
    free(s->retired);
    if (s->file_cfg) {
        px_config_cleanup(s->file_cfg);
        free(s->file_cfg);
    }
    for (size_t i = 0; i < s->nops; i++)
        op_free(&s->ops[i]);
    free(s->ops);
    px_conn_list_close_all(&s->mconns);
    px_listener_free(s->mlev);
    if (s->ctl_base) event_base_free(s->ctl_base);
    if (s->tls) SSL_CTX_free(s->tls);
    px_ctx_cleanup(&s->ctx);
    free(s);
}
