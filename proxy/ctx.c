/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/ctx.h"

#include <errno.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "proxy/prio.h"
#include "proxy/kvindex.h"
#include "proxy/latency.h"
#include "proxy/slo.h"
#include "proxy/tenant.h"

/* ---------- generations ---------- */

void px_gen_release(px_gen *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    for (size_t i = 0; i < g->nps; i++) {
        free(g->ps[i].name);
        px_strlist_clear(&g->ps[i].models);
        px_pool_cleanup(&g->ps[i].prefill);
        px_pool_cleanup(&g->ps[i].decode);
    }
    free(g->ps);
    free(g);
}

px_pset *px_gen_find(px_gen *g, const char *model, size_t n) {
    if (!g->named) return g->nps ? &g->ps[0] : NULL;
    for (size_t i = 0; i < g->nps; i++)
        for (size_t j = 0; j < g->ps[i].models.n; j++)
            if (strlen(g->ps[i].models.v[j]) == n && !memcmp(g->ps[i].models.v[j], model, n))
                return &g->ps[i];
    return NULL;
}

int px_pset_ready(const px_pset *cp, int fallback_decode_only, const char **why) {
    px_pset *p = (px_pset *)cp; /* the pools' locks */
    size_t pn, dn;
    px_pool_counts(&p->prefill, &pn, NULL);
    px_pool_counts(&p->decode, &dn, NULL);
    /* Backends ejected for failed requests still take traffic when all of
     * their role are (panic routing): readiness follows what can serve. */
    if (!px_pool_usable(&p->decode)) {
        *why = dn ? "every decode backend is ejected or drained" : "no decode backend";
        return 0;
    }
    if (!fallback_decode_only && !px_pool_usable(&p->prefill)) {
        *why = pn ? "every prefill backend is ejected or drained" : "no prefill backend";
        return 0;
    }
    *why = NULL;
    return 1;
}

px_gen *px_ctx_gen(px_ctx *c) {
    pthread_mutex_lock(&c->gen_mu);
    px_gen *g = c->gen;
    atomic_fetch_add(&g->refs, 1);
    pthread_mutex_unlock(&c->gen_mu);
    return g;
}

/* ---------- credentials ---------- */

int px_bearer_matches(const px_http_head *h, const unsigned char (*keys)[32], size_t n) {
    unsigned char d[32];
    return px_bearer_digest(h, d) && px_digest_in(d, keys, n);
}

int px_ctx_authorized(const px_ctx *c, const px_http_head *h) {
    if (!c->napi_keys) return 1;
    unsigned char d[32]; /* the token hashed once for both lists */
    return px_bearer_digest(h, d) &&
           (px_digest_in(d, (const unsigned char(*)[32])c->api_keys, c->napi_keys) ||
            px_tkeys_find_digest(c->tkeys, d) >= 0);
}

static void add_api_key(px_ctx *c, const char *k, size_t n) {
    while (n && (k[n - 1] == '\r' || k[n - 1] == ' ' || k[n - 1] == '\t'))
        n--;
    while (n && (*k == ' ' || *k == '\t'))
        k++, n--;
    if (!n || *k == '#') return;
    c->api_keys = px_xrealloc(c->api_keys, (c->napi_keys + 1) * sizeof *c->api_keys);
    SHA256((const unsigned char *)k, n, c->api_keys[c->napi_keys++]);
}

int px_cred_path(const char *path, const char *what, char *out, size_t cap, char *err,
                 size_t errlen) {
    static const char *const vars[] = {"${CREDENTIALS_DIRECTORY}/", "$CREDENTIALS_DIRECTORY/"};
    for (size_t i = 0; i < 2; i++) {
        size_t n = strlen(vars[i]);
        if (strncmp(path, vars[i], n)) continue;
        const char *dir = getenv("CREDENTIALS_DIRECTORY");
        if (!dir || !*dir) {
            snprintf(err, errlen,
                     "%s '%s': CREDENTIALS_DIRECTORY is not set (systemd sets it for a unit with "
                     "LoadCredential=)",
                     what, path);
            return -1;
        }
        if ((size_t)snprintf(out, cap, "%s/%s", dir, path + n) >= cap) {
            snprintf(err, errlen, "%s '%s': path too long", what, path);
            return -1;
        }
        return 0;
    }
    if ((size_t)snprintf(out, cap, "%s", path) >= cap) {
        snprintf(err, errlen, "%s '%s': path too long", what, path);
        return -1;
    }
    return 0;
}

static int load_api_keys(px_ctx *c, const px_config *cfg, char *err, size_t errlen) {
    if (cfg->api_key[0]) add_api_key(c, cfg->api_key, strlen(cfg->api_key));
    if (!cfg->api_key_file[0]) return 0;
    char path[4096];
    if (px_cred_path(cfg->api_key_file, "--api-key-file", path, sizeof path, err, errlen) < 0)
        return -1;
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "--api-key-file '%s': %s", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t cap = 0, before = c->napi_keys;
    while (getline(&line, &cap, f) >= 0)
        add_api_key(c, line, strcspn(line, "\n"));
    free(line);
    fclose(f);
    if (c->napi_keys == before) {
        snprintf(err, errlen, "--api-key-file '%s': no key in the file", path);
        return -1;
    }
    return 0;
}

/* What the proxy sends upstream: --upstream-api-key always, else the
 * environment's OPENAI_API_KEY when the client sent none (request.c). */
static void setup_upstream_auth(px_ctx *c, const px_config *cfg) {
    const char *key = cfg->upstream_api_key[0] ? cfg->upstream_api_key : getenv("OPENAI_API_KEY");
    c->upstream_auth_forced = cfg->upstream_api_key[0] != 0;
    if (key && *key) {
        px_buf b;
        px_buf_init(&b);
        px_buf_printf(&b, "Authorization: Bearer %s", key);
        c->upstream_auth = b.data;
        px_buf_printf(&c->health_hdrs, "%s\r\n", c->upstream_auth);
    }
}

int px_ctx_init(px_ctx *c, const px_config *cfg, char *err, size_t errlen) {
    c->cfg = cfg;
    pthread_mutex_init(&c->gen_mu, NULL);
    c->shared.max_buffered = cfg->max_buffered_bytes;
    c->shared.max_conns = (long)cfg->max_connections;
    setup_upstream_auth(c, cfg);
    /* The index and its subscriber: with --kv-events-port, or when a
     * backend entry declares its endpoint (kvevents.h). */
    if ((cfg->kv_events_port || cfg->backend_kv.n) &&
        !(c->kvindex = px_kvindex_create_bounded((size_t)cfg->kv_index_max_blocks,
                                                 (size_t)cfg->kv_index_max_bytes, 4096))) {
        snprintf(err, errlen, "out of memory for the KV index");
        return -1;
    }
    if (cfg->session_ttl > 0) c->sessions = px_sessions_create(65536, cfg->session_ttl);
    if (load_api_keys(c, cfg, err, errlen) < 0) return -1;
    if (px_tkeys_load(cfg->tenant_keys, &c->tkeys, err, errlen) < 0) return -1;
    if (px_tcerts_load(cfg->tenant_certs, &c->tcerts, err, errlen) < 0) return -1;
    if (px_cidrs_parse(cfg->tenant_header_from.v, cfg->tenant_header_from.n, &c->trusted, err,
                       errlen) < 0)
        return -1;
    c->ntrusted = cfg->tenant_header_from.n;
    /* Admission control's tenants (ratelimit.h), shared by the workers. */
    if (px_tenants_parse(cfg->tenants.v, cfg->tenants.n, &c->tenants, err, errlen) < 0) return -1;
    size_t nt = atomic_load(&c->tenants.n);
    if (nt && !c->tkeys && !c->tcerts && !cfg->tenant_header_from.n)
        PX_LOG(PX_LOG_WARN, "msg=\"tenants are configured but no request can name one: give "
                            "--tenant-keys (API keys of tenants), --tenant-certs (client "
                            "certificates) or --tenant-header-from (trusted gateways); every "
                            "request is the default tenant's\" tenants=%zu", nt);
    px_tenants_reserve(&c->tenants, 2 * nt > PX_TENANT_SLOTS ? 2 * nt : PX_TENANT_SLOTS);
    c->tenant_weights = px_xcalloc(c->tenants.cap + 1, sizeof *c->tenant_weights);
    for (size_t i = 0; i <= c->tenants.cap; i++)
        c->tenant_weights[i] = i < nt || i == c->tenants.cap ? c->tenants.v[i].weight : 1;
    atomic_init(&c->pool_max_inflight, cfg->pool_max_inflight);
    if (px_prio_publish(&c->prio, cfg->priority_classes.v, cfg->priority_classes.n, err, errlen) < 0)
        return -1;
    /* Routing and admission by predicted latency (predict.h). */
    c->lat = px_latmodel_create(256, 1024, cfg->latency_keep, cfg->latency_half_life);
    c->slo = px_slo_create();
    if (px_slo_publish(c->slo, cfg->slo.v, cfg->slo.n, err, errlen) < 0) return -1;
    return 0;
}

void px_ctx_cleanup(px_ctx *c) {
    free(c->upstream_auth);
    px_buf_cleanup(&c->health_hdrs);
    free(c->api_keys);
    px_tkeys_destroy(c->tkeys);
    px_tcerts_destroy(c->tcerts);
    free(c->trusted);
    px_tenants_cleanup(&c->tenants);
    free(c->tenant_weights);
    px_prio_cleanup(&c->prio);
    free(c->workers);
    px_kvindex_destroy(c->kvindex);
    px_sessions_destroy(c->sessions);
    px_latmodel_destroy(c->lat);
    px_slo_destroy(c->slo);
    pthread_mutex_destroy(&c->gen_mu);
}

px_conn_cfg px_ctx_control_conn_cfg(const px_config *cfg,
                                    void (*dispatch)(void *arg, px_conn *c, const px_http_head *h,
                                                     px_buf *body),
                                    void *arg) {
    return (px_conn_cfg){
        .max_body_bytes = 65536,
        .header_timeout = cfg->client_header_timeout,
        .keepalive_timeout = cfg->keepalive_timeout,
        .send_timeout = cfg->send_timeout,
        .dispatch = dispatch,
        .ctx = arg,
    };
}
