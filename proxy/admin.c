/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/admin.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/conn.h"
#include "base/http.h"
#include "base/json.h"
#include "base/listen.h"
#include "base/log.h"
#include "proxy/admission.h"
#include "proxy/dp.h"
#include "proxy/kvevents.h"
#include "proxy/kvindex.h"
#include "proxy/latency.h"
#include "proxy/slo.h"

#define ADMIN_NOTE                                                                                 \
    "changes made through the admin API last until the next reload from the --config file"

struct px_admin {
    px_admin_host h;
    px_listener *lev;   /* owned */
    px_conn_list conns; /* owned */
    px_conn_cfg ccfg;
    unsigned char token[32]; /* SHA-256 of the token */
    char who[32];            /* "token:<8 hex>": names the token in logs, not its value */
    uint64_t refused_log_ns; /* when a refused call was last logged */
    unsigned long refused_quiet; /* refused calls not logged since */
};

/* ---------- replies and request bodies ---------- */

static void reply(px_conn *c, int status, px_buf *b) {
    px_conn_reply(c, status, "application/json", NULL, NULL, b->data, b->len);
}

static void reply_err(px_conn *c, int status, const char *msg) {
    px_conn_reply_error(c, status, NULL, status == 401 ? "WWW-Authenticate: Bearer\r\n" : NULL,
                        msg);
}

/* A string member of the JSON object body, decoded; NULL when absent or
 * not a string. */
static char *str_member(const px_buf *body, const char *key) {
    px_json_member m;
    if (!body->len || !px_json_find(body->data, body->len, key, &m)) return NULL;
    if (m.val_len < 2 || m.val[0] != '"') return NULL;
    char *out = px_xmalloc(m.val_len);
    long n = px_json_str_decode(m.val + 1, m.val_len - 2, out, m.val_len);
    /* A NUL inside ("a\u0000b") would cut the C string short: "a" is not
     * what was asked for, so the value is refused. */
    if (n < 0 || strlen(out) != (size_t)n) {
        free(out);
        return NULL;
    }
    return out;
}

static void json_str(px_buf *b, const char *s) {
    px_buf_append_json_str(b, s, strlen(s));
}

static int method_is(const px_http_head *h, const char *m) {
    return h->method_len == strlen(m) && !memcmp(h->method, m, h->method_len);
}

/* ---------- calls ---------- */

static void backend_json(px_buf *b, px_kvsub *kv, const px_pset *p, const char *role,
                         const px_backend *be) {
    px_buf_appends(b, "{\"pool\":");
    json_str(b, p->name);
    px_buf_printf(b, ",\"role\":\"%s\",\"backend\":", role);
    json_str(b, be->name);
    px_buf_appends(b, ",\"url\":");
    json_str(b, be->src);
    /* Where its KV events are read (null: not subscribed). */
    const char *ep = px_kvsub_endpoint(kv, be->name);
    px_buf_appends(b, ",\"kv_events_endpoint\":");
    if (ep)
        json_str(b, ep);
    else
        px_buf_appends(b, "null");
    int healthy = atomic_load(&be->healthy), drained = atomic_load(&be->drained);
    px_buf_printf(b,
                  ",\"healthy\":%s,\"ejected\":%s,\"ejected_by_check\":%s,\"ejections\":%d,"
                  "\"drained\":%s,\"inflight\":%d,\"consecutive_failures\":%d,\"requests\":{",
                  healthy ? "true" : "false", healthy ? "false" : "true",
                  !healthy && atomic_load(&be->ejected_by_check) ? "true" : "false",
                  atomic_load(&be->ejections), drained ? "true" : "false",
                  atomic_load(&be->inflight), atomic_load(&be->fails));
    for (int k = 0; k < PX_OUT_COUNT; k++)
        px_buf_printf(b, "%s\"%s\":%llu", k ? "," : "", px_outcome_name((px_outcome)k),
                      (unsigned long long)atomic_load(&((px_backend *)be)->outcomes[k]));
    px_buf_appends(b, "}}");
}

static void list_backends(px_admin *a, px_conn *c) {
    px_gen *g = px_ctx_gen(a->h.ctx);
    px_buf b;
    px_buf_init(&b);
    px_buf_printf(&b, "{\"generation\":%llu,\"backends\":[", (unsigned long long)g->id);
    int first = 1;
    for (size_t i = 0; i < g->nps; i++)
        for (int r = 0; r < 2; r++) {
            px_pool *pool = r ? &g->ps[i].decode : &g->ps[i].prefill;
            size_t n;
            px_backend **m = px_pool_members(pool, &n);
            for (size_t j = 0; j < n; j++) {
                if (!first) px_buf_appends(&b, ",");
                first = 0;
                backend_json(&b, a->h.ctx->kvsub, &g->ps[i], pool->role, m[j]);
                px_backend_release(m[j]);
            }
            free(m);
        }
    size_t nops;
    a->h.changes(a->h.arg, &nops);
    px_buf_printf(&b, "],\"api_changes\":%zu,\"note\":\"%s\"}", nops, ADMIN_NOTE);
    px_gen_release(g);
    reply(c, 200, &b);
    px_buf_cleanup(&b);
}

/* The optional "dp_size" of POST /admin/backends: 0 when absent, the size
 * (1..64), or -1 when it is anything else. */
static int dp_size_member(const px_buf *body) {
    px_json_member m;
    if (!body->len || !px_json_find(body->data, body->len, "dp_size", &m)) return 0;
    if (m.type != PX_JSON_NUMBER || m.val_len > 2) return -1;
    int n = 0;
    for (size_t i = 0; i < m.val_len; i++) {
        if (m.val[i] < '0' || m.val[i] > '9') return -1;
        n = n * 10 + (m.val[i] - '0');
    }
    return n >= 1 && n <= 64 ? n : -1;
}

/* POST (add) and DELETE (remove) /admin/backends. */
static void change_backend(px_admin *a, px_conn *c, const px_buf *body, int add) {
    char *pool = str_member(body, "pool"), *role = str_member(body, "role"),
         *url = str_member(body, "url");
    char *ep[2] = {NULL, NULL};
    static const char *const epkey[2] = {"kv_events_endpoint", "kv_events_replay_endpoint"};
    char err[512];
    px_json_member pm;
    int pool_bad = body->len && px_json_find(body->data, body->len, "pool", &pm) && !pool;
    if (!role || !url || pool_bad || (strcmp(role, "prefill") && strcmp(role, "decode"))) {
        reply_err(c, 400,
                  "expected a JSON object {\"role\": \"prefill\"|\"decode\", \"url\": "
                  "\"http://host:port\", \"pool\": name (omit for the unnamed pool), "
                  "\"dp_size\": data-parallel ranks 1..64 (optional), "
                  "\"kv_events_endpoint\", \"kv_events_replay_endpoint\": tcp://HOST:PORT or "
                  "ipc://PATH (optional)}");
        goto out;
    }
    int dp_size = add ? dp_size_member(body) : 0;
    if (dp_size < 0) {
        reply_err(c, 400, "\"dp_size\" must be an integer in [1, 64] (data-parallel ranks)");
        goto out;
    }
    /* Where this engine publishes its KV events, over --kv-events-port. */
    for (int e = 0; e < 2 && add; e++) {
        px_json_member em;
        if (!body->len || !px_json_find(body->data, body->len, epkey[e], &em)) continue;
        char why[300];
        ep[e] = str_member(body, epkey[e]);
        if (!ep[e] || px_config_kv_endpoint_check(ep[e], why, sizeof why) < 0) {
            snprintf(err, sizeof err, "\"%s\": %s", epkey[e],
                     ep[e] ? why : "expected a string tcp://HOST:PORT or ipc://PATH");
            reply_err(c, 400, err);
            goto out;
        }
        if (!a->h.ctx->kvindex) {
            snprintf(err, sizeof err,
                     "\"%s\": KV events are off (start pdproxy with --kv-events-port or a "
                     "config entry declaring kv_events_endpoint)",
                     epkey[e]);
            reply_err(c, 400, err);
            goto out;
        }
    }
    /* The URL is checked as the flags check it. */
    char *argv[] = {"pdproxy", "--prefill", url, NULL};
    px_config tmp;
    FILE *devnull = fopen("/dev/null", "w");
    px_config_result r = px_config_load(&tmp, 3, argv, NULL, devnull, err, sizeof err);
    if (devnull) fclose(devnull);
    px_config_cleanup(&tmp);
    if (r != PX_CONFIG_RUN) {
        reply_err(c, 400, err);
        goto out;
    }
    px_api_op op = {.add = add, .prefill = role[0] == 'p', .pool = pool ? pool : "", .url = url};
    int rc = a->h.reload(a->h.arg, 0, &op, err, sizeof err);
    if (rc < 0) {
        reply_err(c, rc == -2 ? 404 : rc == -3 ? 409 : 400, err);
        goto out;
    }
    /* Its DP size, over the file's and the flags' (removal forgets it). */
    if ((dp_size || !add) && px_dp_declare_admin(a->h.ctx->reg->dp, url, dp_size) < 0)
        PX_LOG(PX_LOG_WARN, "msg=\"admin: dp_size ignored: no room\" url=\"%s\"", url);
    /* Its KV-event endpoints likewise (removal forgets them). */
    if (ep[0] || ep[1] || !add) px_kvsub_declare_admin(a->h.ctx->reg->kv_decls, url, ep[0], ep[1]);
    PX_LOG(PX_LOG_INFO, "msg=\"admin: backend %s\" who=%s pool=\"%s\" role=%s url=\"%s\"",
           add ? "added" : "removed (drains: requests on it finish)", a->who, op.pool, role, url);
    px_buf b;
    px_buf_init(&b);
    px_buf_printf(&b, "{\"status\":\"%s\",\"pool\":", add ? "added" : "removed");
    json_str(&b, op.pool);
    px_buf_printf(&b, ",\"role\":\"%s\",\"url\":", role);
    json_str(&b, url);
    px_buf_printf(&b, ",\"generation\":%llu,\"note\":\"%s\"}",
                  (unsigned long long)a->h.ctx->gen->id, ADMIN_NOTE);
    reply(c, add ? 201 : 200, &b);
    px_buf_cleanup(&b);
out:
    free(pool);
    free(role);
    free(url);
    free(ep[0]);
    free(ep[1]);
}

/* POST /admin/backends/drain and /undrain: {"backend": "host:port" or
 * "url": configured URL, optional "pool", "role"}. */
static void drain(px_admin *a, px_conn *c, const px_buf *body, int on) {
    char *id = str_member(body, "backend"), *url = str_member(body, "url"),
         *pool = str_member(body, "pool"), *role = str_member(body, "role");
    if (!id && !url) {
        reply_err(c, 400,
                  "expected a JSON object {\"backend\": \"host:port\"} or {\"url\": ...}, "
                  "with optional \"pool\" and \"role\"");
        goto out;
    }
    px_gen *g = px_ctx_gen(a->h.ctx);
    px_buf b;
    px_buf_init(&b);
    px_buf_appends(&b, "{\"status\":");
    px_buf_appends(&b, on ? "\"drained\"" : "\"undrained\"");
    px_buf_appends(&b, ",\"backends\":[");
    size_t hits = 0;
    for (size_t i = 0; i < g->nps; i++) {
        if (pool && strcmp(pool, g->ps[i].name)) continue;
        for (int r = 0; r < 2; r++) {
            px_pool *p = r ? &g->ps[i].decode : &g->ps[i].prefill;
            if (role && strcmp(role, p->role)) continue;
            size_t n;
            px_backend **m = px_pool_members(p, &n);
            for (size_t j = 0; j < n; j++) {
                if ((id && !strcmp(id, m[j]->name)) || (url && !strcmp(url, m[j]->src))) {
                    atomic_store(&m[j]->drained, on);
                    PX_LOG(PX_LOG_INFO,
                           "msg=\"admin: backend %s\" who=%s pool=\"%s\" role=%s "
                           "backend=%s inflight=%d",
                           on ? "drained" : "undrained", a->who, g->ps[i].name, p->role, m[j]->name,
                           atomic_load(&m[j]->inflight));
                    if (hits++) px_buf_appends(&b, ",");
                    backend_json(&b, a->h.ctx->kvsub, &g->ps[i], p->role, m[j]);
                }
                px_backend_release(m[j]);
            }
            free(m);
        }
    }
    px_gen_release(g);
    px_buf_printf(&b, "],\"note\":\"%s\"}", ADMIN_NOTE);
    if (!hits)
        reply_err(c, 404, "no backend matches");
    else
        reply(c, 200, &b);
    px_buf_cleanup(&b);
out:
    free(id);
    free(url);
    free(pool);
    free(role);
}

static void show_config(px_admin *a, px_conn *c) {
    const px_config *cfg = a->h.config(a->h.arg);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (f) {
        px_config_dump(cfg, f);
        fclose(f);
    }
    px_buf b;
    px_buf_init(&b);
    px_buf_printf(&b,
                  "{\"generation\":%llu,\"config_file\":", (unsigned long long)a->h.ctx->gen->id);
    json_str(&b, cfg->config_file);
    px_buf_appends(&b, ",\"api_changes\":[");
    size_t nops;
    const px_api_op *ops = a->h.changes(a->h.arg, &nops);
    for (size_t i = 0; i < nops; i++) {
        const px_api_op *o = &ops[i];
        px_buf_printf(&b, "%s{\"op\":\"%s\",\"role\":\"%s\",\"pool\":", i ? "," : "",
                      o->add ? "add" : "remove", o->prefill ? "prefill" : "decode");
        json_str(&b, o->pool);
        px_buf_appends(&b, ",\"url\":");
        json_str(&b, o->url);
        px_buf_appends(&b, "}");
    }
    px_buf_printf(&b, "],\"note\":\"%s\",\"yaml\":", ADMIN_NOTE);
    px_buf_append_json_str(&b, text ? text : "", text ? len : 0);
    px_buf_appends(&b, "}");
    free(text);
    reply(c, 200, &b);
    px_buf_cleanup(&b);
}

/* GET /admin/admission: each tenant's weight and rate limits with what is
 * left of them now, and each pool's admitted requests and back-off. */
static void show_admission(px_admin *a, px_conn *c) {
    px_ctx *x = a->h.ctx;
    uint64_t now = px_now_ns();
    px_buf b;
    px_buf_init(&b);
    px_buf_appends(&b, "{\"tenants\":[");
    size_t nt = x->tenants.v ? atomic_load(&x->tenants.n) : 0, shown = 0;
    for (size_t k = 0; x->tenants.v && k <= nt; k++) {
        /* The live tenants, then the default one. */
        size_t i = k == nt ? x->tenants.cap : k;
        px_tenant *t = &x->tenants.v[i];
        if (k < nt && !atomic_load(&t->live)) continue;
        px_buf_appends(&b, shown++ ? ",{\"name\":" : "{\"name\":");
        json_str(&b, k == nt ? "(default)" : t->name);
        px_buf_printf(&b,
                      ",\"weight\":%u,\"rpm\":%llu,\"remaining_requests\":%llu,\"tpm\":%llu,"
                      "\"remaining_tokens\":%llu}",
                      t->weight, (unsigned long long)t->rpm.limit,
                      (unsigned long long)px_bucket_remaining(&t->rpm, now),
                      (unsigned long long)t->tpm.limit,
                      (unsigned long long)px_bucket_remaining(&t->tpm, now));
    }
    px_buf_appends(&b, "],\"priority_classes\":[");
    const px_prio_map *pm = px_adm_classes(x);
    for (size_t i = 0; pm && i < pm->n; i++) {
        px_buf_appends(&b, i ? ",{\"name\":" : "{\"name\":");
        json_str(&b, pm->c[i].name);
        px_buf_printf(&b, ",\"min\":%lld,\"max\":%lld}", pm->c[i].lo, pm->c[i].hi);
    }
    px_buf_appends(&b, "],\"pools\":[");
    px_gen *g = px_ctx_gen(x);
    for (size_t i = 0; i < g->nps; i++) {
        px_pset *p = &g->ps[i];
        unsigned long long until = atomic_load(&p->backoff_until_ns);
        px_buf_appends(&b, i ? ",{\"name\":" : "{\"name\":");
        json_str(&b, p->name);
        unsigned why = px_pool_saturation(x, p, now);
        px_buf_printf(&b, ",\"admitted\":%ld,\"saturated\":%s,\"backoff_ms\":%.0f,"
                      "\"ttfb_ewma_ms\":%.3f,\"signals\":[",
                      (long)atomic_load(&p->admitted), why ? "true" : "false",
                      until > now ? (double)(until - now) / 1e6 : 0.0,
                      (double)atomic_load(&p->ttfb_ewma_us) / 1e3);
        for (int s = 0, k = 0; s < PX_SAT_SIGNALS; s++)
            if (why >> s & 1) px_buf_printf(&b, "%s\"%s\"", k++ ? "," : "", px_sat_signal_name(s));
        px_buf_appends(&b, "]}");
    }
    px_gen_release(g);
    px_buf_appends(&b, "]}");
    reply(c, 200, &b);
    px_buf_cleanup(&b);
}

/* POST /admin/admission: {"tenants": "NAME[:weight=W][:rpm=N][:tpm=N] ...",
 * "pool_max_inflight": N, "priority_classes": "NAME:LO..HI ..."}, any of
 * them: the tenants as --tenant gives them (space or comma separated; the
 * whole set), --pool-max-inflight, --priority-class ("" for none).
 * Applied at once, queued requests included, until the next reload from
 * the file; answered with GET's document. */
static void change_admission(px_admin *a, px_conn *c, const px_buf *body) {
    px_json_member m;
    char *specs = str_member(body, "tenants");
    char *classes = str_member(body, "priority_classes");
    int has_c = body->len && px_json_find(body->data, body->len, "priority_classes", &m);
    int has_t = body->len && px_json_find(body->data, body->len, "tenants", &m);
    int has_max = body->len && px_json_find(body->data, body->len, "pool_max_inflight", &m);
    long long max = -1;
    char num[32], err[512], note[256];
    if (has_max) {
        char *end = NULL;
        if (m.type == PX_JSON_NUMBER && m.val_len < sizeof num) {
            memcpy(num, m.val, m.val_len);
            num[m.val_len] = 0;
            max = strtoll(num, &end, 10);
        }
        if (!end || *end || max < 0 || max > 100000000) has_max = -1;
    }
    const char *bad = NULL;
    if (has_t && !specs)
        bad = "\"tenants\" must be a JSON string (without NUL characters) of specs "
              "NAME[:weight=W][:rpm=N][:tpm=N][:floor=P], space or comma separated";
    else if (has_c && !classes)
        bad = "\"priority_classes\" must be a JSON string (without NUL characters) of specs "
              "NAME:LO..HI[:share=N]";
    else if (has_max < 0)
        bad = "\"pool_max_inflight\" must be an integer 0..100000000";
    else if (!has_t && !has_max && !has_c)
        bad = "expected a JSON object {\"tenants\": \"NAME[:weight=W][:rpm=N][:tpm=N] ...\", "
              "\"pool_max_inflight\": 0..100000000, \"priority_classes\": \"NAME:LO..HI "
              "...\"}, any of them";
    if (bad) {
        reply_err(c, 400, bad);
        free(specs);
        free(classes);
        return;
    }
    px_strlist words = {0}, cw = {0};
    for (char *save = NULL, *w = specs ? strtok_r(specs, " ,\t", &save) : NULL; w;
         w = strtok_r(NULL, " ,\t", &save))
        px_strlist_push(&words, w);
    for (char *save = NULL, *w = classes ? strtok_r(classes, " ,\t", &save) : NULL; w;
         w = strtok_r(NULL, " ,\t", &save))
        px_strlist_push(&cw, w);
    /* The classes checked first, applied last: a bad part changes nothing. */
    px_prio_map pm;
    int rc = has_c ? px_prio_map_parse(cw.v, cw.n, &pm, err, sizeof err) : 0;
    if (rc == 0 && (has_t || has_max))
        rc = px_adm_reconfigure(a->h.ctx, has_t ? words.v : NULL, words.n, max, note,
                                sizeof note, err, sizeof err);
    else
        note[0] = 0;
    if (rc == 0 && has_c) rc = px_adm_set_classes(a->h.ctx, cw.v, cw.n, err, sizeof err);
    for (size_t i = 0; i < words.n; i++)
        free(words.v[i]);
    free(words.v);
    for (size_t i = 0; i < cw.n; i++)
        free(cw.v[i]);
    free(cw.v);
    free(specs);
    free(classes);
    if (rc < 0) {
        reply_err(c, 400, err);
        return;
    }
    PX_LOG(PX_LOG_INFO, "msg=\"admin: admission settings changed\" who=%s%s%s%s", a->who,
           note[0] ? " " : "", note, has_c ? " priority_classes=changed" : "");
    show_admission(a, c);
}

/* GET /admin/latency_model: the live latency model (latency.h). */
static void latency_model(px_admin *a, px_conn *c) {
    px_buf b;
    px_buf_init(&b);
    px_lat_render_json(a->h.ctx->lat, &b);
    reply(c, 200, &b);
    px_buf_cleanup(&b);
}

/* GET /admin/slo: the --slo specs in effect. POST {"slo": "KIND=NAME:ttft=MS ..."}
 * replaces them (space or comma separated; "" for none) until the next
 * reload from the file. */
static void slo(px_admin *a, px_conn *c, const px_buf *body, int post) {
    px_buf b;
    px_buf_init(&b);
    if (post) {
        char *specs = str_member(body, "slo");
        if (!specs) {
            reply_err(c, 400, "expected a JSON object {\"slo\": \"KIND=NAME:key=value[:...] ...\"}");
            px_buf_cleanup(&b);
            return;
        }
        px_strlist w = {0};
        for (char *save = NULL, *t = strtok_r(specs, " ,\t", &save); t;
             t = strtok_r(NULL, " ,\t", &save))
            px_strlist_push(&w, t);
        char err[512];
        int rc = px_slo_publish(a->h.ctx->slo, w.v, w.n, err, sizeof err);
        px_strlist_clear(&w);
        free(specs);
        if (rc < 0) {
            reply_err(c, 400, err);
            px_buf_cleanup(&b);
            return;
        }
        PX_LOG(PX_LOG_INFO, "msg=\"admin: latency targets changed\" who=%s specs=%zu", a->who,
               px_slo_current(a->h.ctx->slo)->n);
    }
    px_slo_render_json(a->h.ctx->slo, &b);
    reply(c, 200, &b);
    px_buf_cleanup(&b);
}

/* POST /admin/reload answered once the file was read (on a helper thread)
 * and the generation swapped, or a newer reload superseded this one. */
typedef struct pending_reload {
    px_conn *c; /* borrowed; NULL once the client left */
    char who[32];
} pending_reload;

static void reload_gone(void *arg) {
    pending_reload *p = arg;
    p->c = NULL;
}

static const px_exchange_cbs reload_cbs = {reload_gone, NULL};

static void reload_reply(px_conn *c, const char *who, int rc, const char *err, uint64_t gen,
                         double ms) {
    char q[1100];
    if (rc < 0) {
        PX_LOG(PX_LOG_ERROR,
               "msg=\"admin: reload failed; the running configuration stays\" who=%s error=%s", who,
               px_log_value(err, q, sizeof q));
        if (c) reply_err(c, 400, err);
        return;
    }
    PX_LOG(PX_LOG_INFO, "msg=\"admin: reloaded from file\" who=%s generation=%llu", who,
           (unsigned long long)gen);
    if (!c) return;
    px_buf b;
    px_buf_init(&b);
    px_buf_printf(&b, "{\"status\":\"reloaded\",\"generation\":%llu,\"ms\":%.3f}",
                  (unsigned long long)gen, ms);
    reply(c, 200, &b);
    px_buf_cleanup(&b);
}

static void reload_done(void *arg, int rc, const char *err, uint64_t gen, double ms) {
    pending_reload *p = arg;
    if (p->c) px_conn_bind(p->c, NULL, NULL);
    reload_reply(p->c, p->who, rc, err, gen, ms);
    free(p);
}

static void reload(px_admin *a, px_conn *c) {
    char err[512];
    pending_reload *p = px_xcalloc(1, sizeof *p);
    p->c = c;
    snprintf(p->who, sizeof p->who, "%s", a->who);
    px_conn_bind(c, &reload_cbs, p);
    if (a->h.reload_async && a->h.reload_async(a->h.arg, reload_done, p) == 0) return;
    px_conn_bind(c, NULL, NULL);
    free(p);
    uint64_t t0 = px_now_ns();
    int rc = a->h.reload(a->h.arg, 1, NULL, err, sizeof err);
    reload_reply(c, a->who, rc, err, a->h.ctx->gen->id, (double)(px_now_ns() - t0) / 1e6);
}

/* The value of `key` in the target's query (percent escapes not decoded:
 * backend names and token lists need none), copied into out. */
static int query_arg(const px_http_head *h, const char *key, char *out, size_t cap) {
    const char *q = memchr(h->target, '?', h->target_len);
    if (!q) return 0;
    const char *end = h->target + h->target_len;
    size_t kl = strlen(key);
    for (const char *p = q + 1; p < end;) {
        const char *amp = memchr(p, '&', (size_t)(end - p));
        if (!amp) amp = end;
        if ((size_t)(amp - p) > kl && !memcmp(p, key, kl) && p[kl] == '=') {
            size_t n = (size_t)(amp - p) - kl - 1;
            if (n >= cap) return -1;
            memcpy(out, p + kl + 1, n);
            out[n] = 0;
            return 1;
        }
        p = amp + 1;
    }
    return 0;
}

/* GET /admin/kv_index[?backend=NAME][&tokens=T1,T2,...][&model=NAME]: the
 * KV-event subscriptions and index sizes; with tokens, how many leading full
 * blocks of that prompt (for that model: a LoRA adapter's blocks are its
 * own) each backend holds (the figure kv-aware routing reads). */
static void kv_index(px_admin *a, px_conn *c, const px_http_head *h) {
    px_ctx *ctx = a->h.ctx;
    if (!ctx->kvindex) {
        reply_err(c, 404, "the KV index is off: start pdproxy with --kv-events-port");
        return;
    }
    static char name[512], toks[65536], model[512];
    int hb = query_arg(h, "backend", name, sizeof name);
    int ht = query_arg(h, "tokens", toks, sizeof toks);
    int hm = query_arg(h, "model", model, sizeof model);
    if (hb < 0 || ht < 0 || hm < 0) {
        reply_err(c, 400, "query argument too long");
        return;
    }
    px_buf b = {0};
    px_buf_appends(&b, "{\"backends\":");
    size_t n = px_kvsub_json(ctx->kvsub, hb ? name : NULL, &b);
    if (hb && !n) {
        px_buf_cleanup(&b);
        reply_err(c, 404, "no KV-event subscription for that backend");
        return;
    }
    if (ht) {
        size_t ntok = 0;
        uint32_t *tok = px_xmalloc(sizeof *tok * (strlen(toks) / 2 + 1));
        for (char *p = toks, *e; *p; p = *e ? e + 1 : e) {
            unsigned long v = strtoul(p, &e, 10);
            if (e == p || (*e && *e != ',') || v > UINT32_MAX) {
                free(tok);
                px_buf_cleanup(&b);
                reply_err(c, 400, "tokens: a comma-separated list of token ids");
                return;
            }
            tok[ntok++] = (uint32_t)v;
        }
        px_buf_appends(&b, ",\"match\":{");
        uint64_t *keys = px_xmalloc(sizeof *keys * (ntok + 1));
        px_gen *g = px_ctx_gen(ctx);
        int first = 1;
        for (size_t i = 0; i < g->nps; i++)
            for (int r = 0; r < 2; r++) {
                size_t nm;
                px_backend **m = px_pool_members(r ? &g->ps[i].decode : &g->ps[i].prefill, &nm);
                for (size_t j = 0; j < nm; j++) {
                    int slot = px_kvindex_slot(ctx->kvindex, m[j]->name, 0);
                    size_t bs = px_kvindex_block_size(ctx->kvindex, slot);
                    size_t nk = px_kv_prompt_keys(
                        tok, ntok, bs,
                        hm ? px_kvindex_request_extra(ctx->kvindex, model, strlen(model)) : 0,
                        keys, ntok + 1);
                    if (!first) px_buf_appends(&b, ",");
                    first = 0;
                    px_buf_append_json_str(&b, m[j]->name, strlen(m[j]->name));
                    px_buf_printf(&b, ":%zu", px_kvindex_match(ctx->kvindex, slot, keys, nk));
                    px_backend_release(m[j]);
                }
                free(m);
            }
        px_gen_release(g);
        free(keys);
        free(tok);
        px_buf_appends(&b, "}");
    }
    px_buf_appends(&b, "}");
    reply(c, 200, &b);
    px_buf_cleanup(&b);
}

static void dispatch(void *ctx, px_conn *c, const px_http_head *h, px_buf *body) {
    px_admin *a = ctx;
    if (!px_bearer_matches(h, (const unsigned char(*)[32]) & a->token, 1)) {
        char q[300];
        const char *p;
        size_t n;
        px_http_path(h, &p, &n);
        char path[200];
        snprintf(path, sizeof path, "%.*s", (int)(n < 190 ? n : 190), p);
        /* At most one line a second: a token guesser must not flood the log. */
        uint64_t now = px_now_ns();
        if (now - a->refused_log_ns >= 1000000000ull) {
            PX_LOG(PX_LOG_WARN,
                   "msg=\"admin call refused: missing or wrong token\" path=%s "
                   "refused_not_logged=%lu",
                   px_log_value(path, q, sizeof q), a->refused_quiet);
            a->refused_log_ns = now;
            a->refused_quiet = 0;
        } else {
            a->refused_quiet++;
        }
        reply_err(c, 401,
                  "invalid or missing admin token: send Authorization: Bearer <token of "
                  "--admin-token-file>");
        return;
    }
    int get = method_is(h, "GET"), post = method_is(h, "POST"), del = method_is(h, "DELETE");
    if (px_http_path_is(h, "/admin/backends")) {
        if (get)
            list_backends(a, c);
        else if (post || del)
            change_backend(a, c, body, post);
        else
            px_conn_reply_error(c, 405, NULL, "Allow: GET, POST, DELETE\r\n",
                                "method not allowed: use GET, POST or DELETE");
    } else if (px_http_path_is(h, "/admin/backends/drain") ||
               px_http_path_is(h, "/admin/backends/undrain")) {
        if (post)
            drain(a, c, body, px_http_path_is(h, "/admin/backends/drain"));
        else
            px_conn_reply_error(c, 405, NULL, "Allow: POST\r\n", "method not allowed: use POST");
    } else if (px_http_path_is(h, "/admin/config")) {
        if (get)
            show_config(a, c);
        else
            px_conn_reply_error(c, 405, NULL, "Allow: GET\r\n", "method not allowed: use GET");
    } else if (px_http_path_is(h, "/admin/admission")) {
        if (get)
            show_admission(a, c);
        else if (post)
            change_admission(a, c, body);
        else
            px_conn_reply_error(c, 405, NULL, "Allow: GET, POST\r\n",
                                "method not allowed: use GET or POST");
    } else if (px_http_path_is(h, "/admin/kv_index")) {
        if (get)
            kv_index(a, c, h);
        else
            px_conn_reply_error(c, 405, NULL, "Allow: GET\r\n", "method not allowed: use GET");
    } else if (px_http_path_is(h, "/admin/latency_model")) {
        if (get)
            latency_model(a, c);
        else
            px_conn_reply_error(c, 405, NULL, "Allow: GET\r\n", "method not allowed: use GET");
    } else if (px_http_path_is(h, "/admin/slo")) {
        if (get || post)
            slo(a, c, body, post);
        else
            px_conn_reply_error(c, 405, NULL, "Allow: GET, POST\r\n",
                                "method not allowed: use GET or POST");
    } else if (px_http_path_is(h, "/admin/reload")) {
        if (post)
            reload(a, c);
        else
            px_conn_reply_error(c, 405, NULL, "Allow: POST\r\n", "method not allowed: use POST");
    } else {
        reply_err(c, 404,
                  "not found: the admin API serves /admin/backends, "
                  "/admin/backends/drain, /admin/backends/undrain, /admin/config, "
                  "/admin/admission, /admin/kv_index, /admin/latency_model, /admin/slo and "
                  "/admin/reload");
    }
}

/* ---------- setup ---------- */

/* The token: one line of 16 to 1023 visible ASCII characters in a regular
 * file (a longer one was cut silently, a device like /dev/zero read as a
 * token of NULs). */
static int read_token(px_admin *a, const char *named, char *err, size_t errlen) {
    char path[4096];
    if (px_cred_path(named, "--admin-token-file", path, sizeof path, err, errlen) < 0) return -1;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "--admin-token-file '%s': %s", path,
                 fd < 0 ? strerror(errno) : "not a regular file");
        if (fd >= 0) close(fd);
        return -1;
    }
    char buf[1026];
    size_t n = 0;
    for (ssize_t r; n < sizeof buf - 1; n += (size_t)r) {
        r = read(fd, buf + n, sizeof buf - 1 - n);
        if (r < 0 && errno == EINTR) {
            r = 0;
            continue;
        }
        if (r <= 0) break;
    }
    close(fd);
    buf[n] = '\0';
    while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' '))
        buf[--n] = '\0';
    int visible = n >= 16 && n <= 1023;
    for (size_t i = 0; visible && i < n; i++)
        visible = buf[i] > 0x20 && buf[i] < 0x7f;
    if (!visible) {
        snprintf(err, errlen,
                 "--admin-token-file '%s': expected one token of 16 to 1023 visible ASCII "
                 "characters",
                 path);
        return -1;
    }
    SHA256((const unsigned char *)buf, n, a->token);
    snprintf(a->who, sizeof a->who, "token:%02x%02x%02x%02x", a->token[0], a->token[1], a->token[2],
             a->token[3]);
    return 0;
}

int px_admin_start(const px_admin_host *host, const px_config *cfg, px_admin **out, char *err,
                   size_t errlen) {
    *out = NULL;
    if (!cfg->admin_port) return 0;
    px_admin *a = px_xcalloc(1, sizeof *a);
    a->h = *host;
    if (read_token(a, cfg->admin_token_file, err, errlen) < 0) {
        free(a);
        return -1;
    }
    a->ccfg = px_ctx_control_conn_cfg(cfg, dispatch, a);
    a->lev = px_listen(host->base, cfg->admin_host, (int)cfg->admin_port, 0, "--admin-port",
                       &a->ccfg, &a->conns, err, errlen);
    if (!a->lev) {
        free(a);
        return -1;
    }
    *out = a;
    PX_LOG(PX_LOG_INFO, "msg=\"admin API listening\" addr=%s:%d", cfg->admin_host,
           (int)cfg->admin_port);
    return 0;
}

int px_admin_check(const px_config *cfg, char *err, size_t errlen) {
    if (!cfg->admin_port) return 0;
    px_admin a;
    memset(&a, 0, sizeof a);
    if (read_token(&a, cfg->admin_token_file, err, errlen) < 0) return -1;
    return px_listen_port_free(cfg->admin_host, (int)cfg->admin_port, "--admin-port", err, errlen);
}

void px_admin_stop(px_admin *a) {
    if (!a) return;
    px_conn_list_close_all(&a->conns);
    px_listener_free(a->lev);
    free(a);
}
