/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/k8s.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "base/util.h"
#include "proxy/dp.h"
#include "proxy/k8s_creds.h"
#include "proxy/kvevents.h"
#include "proxy/route.h"
#include "proxy/upstream.h"

#define LIST_PAGE 500                 /* items per list page */
#define BODY_MAX (64u * 1024 * 1024)  /* a list page or one watch event */
#define WATCH_SECONDS 290             /* the server ends a watch after this */
#define IDLE_SECONDS (WATCH_SECONDS + 60)
#define BACKOFF_MIN 0.25
#define BACKOFF_MAX 30.0

/* One endpoint as a backend. */
typedef struct member {
    char *url;  /* owned: http://IP:PORT, the backend's src */
    int drained; /* terminating: no new request */
    int dp;      /* pdproxy.io/dp-size, 0: none */
    char *kv;    /* owned: tcp://IP:PORT of the "kv-events" port, or NULL */
    char *kvr;   /* owned: "kv-events-replay", or NULL */
} member;

typedef struct slice {
    char *name; /* owned */
    member *m;  /* owned */
    size_t n;
} slice;

typedef enum { S_IDLE, S_LIST, S_WATCH } phase_t;

typedef struct source {
    struct px_k8s *k;
    px_pool *pool; /* borrowed */
    char *url;     /* owned: the k8s:// URL */
    char ns[254];
    char *selector; /* owned: the label selector, decoded */
    char port[64];  /* port name or number, "" for the default */
    slice *s;       /* owned: the slices as last seen */
    size_t ns_;
    slice *page; /* owned: a list being read, page by page */
    size_t npage;
    member *cur; /* owned: members applied to the pool, sorted by url */
    size_t ncur;
    char rv[64];        /* resourceVersion to watch from */
    char cont[1024];    /* list continue token */
    phase_t phase;
    px_upstream *up;    /* the transfer in flight, or NULL */
    int status;
    int relist;         /* the watch said 410 Gone: list again */
    px_buf body;        /* a list page, or the watch's partial line */
    int too_big;
    struct event *timer; /* owned: back-off */
    double backoff;
    int listed;          /* a list completed once */
    int declared;        /* facts declared for every member since this source started */
} source;

struct px_k8s {
    struct event_base *base;
    px_uploop *loop;   /* owned: HTTP(S) to the API server on the control loop */
    px_backend *api;   /* owned */
    px_k8s_creds cr;   /* server, token file, CA, namespace */
    source *src;       /* owned */
    px_dp_table *dp;   /* borrowed: declared DP sizes (the registry's) */
    px_kv_decls *kv;   /* borrowed: declared KV-event endpoints (the registry's) */
    size_t n;
    int retired;
};

/* ---------- URLs ---------- */

/* ---------- members ---------- */

static void member_free(member *m) {
    free(m->url);
    free(m->kv);
    free(m->kvr);
}

static void slice_clear(slice *s) {
    for (size_t j = 0; j < s->n; j++)
        member_free(&s->m[j]);
    free(s->m);
    free(s->name);
}

static void slices_free(slice *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        slice_clear(&s[i]);
    free(s);
}

static int cmp_member(const void *a, const void *b) {
    return strcmp(((const member *)a)->url, ((const member *)b)->url);
}

static const char *jstr(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* The condition `k` of an endpoint: 1, 0, or `absent` when unset. */
static int cond(const cJSON *conds, const char *k, int absent) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(conds, k);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : absent;
}

/* The slice's port named `name` (or numbered), else 0. */
static int slice_port(const cJSON *ports, const char *name) {
    const cJSON *p;
    cJSON_ArrayForEach(p, ports) {
        const cJSON *num = cJSON_GetObjectItemCaseSensitive(p, "port");
        const char *pn = jstr(p, "name");
        if (!cJSON_IsNumber(num)) continue;
        if ((pn && !strcmp(pn, name)) || (isdigit((unsigned char)name[0]) && atoi(name) == num->valueint))
            return num->valueint;
    }
    return 0;
}

static char *host_port(const char *scheme, const char *ip, int port) {
    px_buf b;
    px_buf_init(&b);
    int v6 = strchr(ip, ':') != NULL;
    px_buf_printf(&b, "%s%s%s%s:%d", scheme, v6 ? "[" : "", ip, v6 ? "]" : "", port);
    return b.data;
}

/* An EndpointSlice object as this source's members. */
static void slice_from_json(source *s, const cJSON *obj, slice *out) {
    memset(out, 0, sizeof *out);
    const cJSON *md = cJSON_GetObjectItemCaseSensitive(obj, "metadata");
    const char *name = jstr(md, "name");
    out->name = px_xstrdup(name ? name : "");
    const char *at = jstr(obj, "addressType");
    if (at && strcmp(at, "IPv4") && strcmp(at, "IPv6")) return; /* FQDN slices: not ours */
    const cJSON *ports = cJSON_GetObjectItemCaseSensitive(obj, "ports");
    int port = s->port[0] ? slice_port(ports, s->port) : slice_port(ports, "http");
    if (!port && !s->port[0] && cJSON_GetArraySize(ports) > 0) {
        const cJSON *num = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(ports, 0), "port");
        if (cJSON_IsNumber(num)) port = num->valueint;
    }
    if (port < 1 || port > 65535) return;
    int kvp = slice_port(ports, "kv-events"), kvrp = slice_port(ports, "kv-events-replay");
    const cJSON *labels = cJSON_GetObjectItemCaseSensitive(md, "labels");
    const char *dps = jstr(labels, "pdproxy.io/dp-size");
    int dp = dps ? atoi(dps) : 0;
    if (dp < 1 || dp > 64) dp = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(obj, "endpoints")) {
        const cJSON *conds = cJSON_GetObjectItemCaseSensitive(e, "conditions");
        /* Unset ready means ready (the API's rule); terminating endpoints
         * drain; the others are not members. */
        int terminating = cond(conds, "terminating", 0);
        int ready = cond(conds, "ready", 1);
        if (!ready && !terminating) continue;
        const cJSON *a = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(e, "addresses"), 0);
        if (!cJSON_IsString(a) || strlen(a->valuestring) > 45) continue;
        out->m = px_xrealloc(out->m, (out->n + 1) * sizeof *out->m);
        member *m = &out->m[out->n++];
        memset(m, 0, sizeof *m);
        m->url = host_port("http://", a->valuestring, port);
        m->drained = terminating;
        m->dp = dp;
        if (kvp) m->kv = host_port("tcp://", a->valuestring, kvp);
        if (kvrp) m->kvr = host_port("tcp://", a->valuestring, kvrp);
    }
}

static const char *nz(const char *s) {
    return s ? s : "";
}

/* Declares what the endpoint says of itself (px_dp, px_kvsub keyed by the
 * backend's src), or forgets it (gone). */
static void declare(px_k8s *k, const member *m, int gone) {
    if (gone || m->dp) px_dp_declare_admin(k->dp, m->url, gone ? 0 : m->dp);
    if (gone || m->kv || m->kvr)
        px_kvsub_declare_admin(k->kv, m->url, gone ? NULL : m->kv, gone ? NULL : m->kvr);
}

/* Applies the slices to the pool: the difference with what was applied
 * last, each change in place. */
static void apply(source *s) {
    size_t n = 0;
    for (size_t i = 0; i < s->ns_; i++)
        n += s->s[i].n;
    member *v = px_xcalloc(n ? n : 1, sizeof *v);
    size_t k = 0;
    for (size_t i = 0; i < s->ns_; i++)
        for (size_t j = 0; j < s->s[i].n; j++)
            v[k++] = s->s[i].m[j]; /* shallow: borrowed from the slices */
    qsort(v, n, sizeof *v, cmp_member);
    /* One endpoint in two slices (a move between them): ready wins. */
    size_t u = 0;
    for (size_t i = 0; i < n; i++) {
        if (u && !strcmp(v[u - 1].url, v[i].url)) {
            v[u - 1].drained &= v[i].drained;
            continue;
        }
        v[u++] = v[i];
    }
    n = u;
    size_t added = 0, removed = 0, drained = 0, i = 0, j = 0;
    int redeclare = !s->declared;
    while (i < s->ncur || j < n) {
        int c = i == s->ncur ? 1 : j == n ? -1 : strcmp(s->cur[i].url, v[j].url);
        if (c < 0) { /* gone */
            px_pool_remove_src(s->pool, s->cur[i].url);
            declare(s->k, &s->cur[i], 1);
            PX_LOG(PX_LOG_DEBUG, "msg=\"kubernetes: backend removed\" role=%s url=%s",
                   s->pool->role, s->cur[i].url);
            removed++;
            i++;
            continue;
        }
        if (c > 0) { /* new */
            px_backend *b = px_pool_insert(s->pool, v[j].url);
            if (b && v[j].drained) atomic_store(&b->drained, 1);
            declare(s->k, &v[j], 0);
            PX_LOG(PX_LOG_DEBUG, "msg=\"kubernetes: backend added\" role=%s url=%s drained=%d",
                   s->pool->role, v[j].url, v[j].drained);
            added++;
            j++;
            continue;
        }
        if (s->cur[i].drained != v[j].drained) {
            px_pool_set_drained_src(s->pool, v[j].url, v[j].drained);
            drained += v[j].drained;
        }
        if (redeclare || s->cur[i].dp != v[j].dp || strcmp(nz(s->cur[i].kv), nz(v[j].kv)) ||
            strcmp(nz(s->cur[i].kvr), nz(v[j].kvr)))
            declare(s->k, &v[j], 0);
        i++;
        j++;
    }
    s->declared = 1;
    /* cur becomes a deep copy of v */
    for (size_t x = 0; x < s->ncur; x++)
        member_free(&s->cur[x]);
    free(s->cur);
    s->cur = px_xcalloc(n ? n : 1, sizeof *s->cur);
    for (size_t x = 0; x < n; x++) {
        s->cur[x] = v[x];
        s->cur[x].url = px_xstrdup(v[x].url);
        s->cur[x].kv = v[x].kv ? px_xstrdup(v[x].kv) : NULL;
        s->cur[x].kvr = v[x].kvr ? px_xstrdup(v[x].kvr) : NULL;
    }
    s->ncur = n;
    free(v);
    if (added || removed || drained)
        PX_LOG(PX_LOG_INFO,
               "msg=\"kubernetes: backends changed\" source=\"%s\" role=%s added=%zu removed=%zu "
               "drained=%zu members=%zu",
               s->url, s->pool->role, added, removed, drained, n);
}

/* ---------- requests to the API server ---------- */

static void start(source *s);

static void on_timer(evutil_socket_t fd, short what, void *arg) {
    start(arg);
}

/* Tries again after the back-off (doubling, up to BACKOFF_MAX, jittered). */
static void retry_later(source *s, const char *why) {
    s->backoff = s->backoff < BACKOFF_MIN ? BACKOFF_MIN : s->backoff * 2;
    if (s->backoff > BACKOFF_MAX) s->backoff = BACKOFF_MAX;
    double t = s->backoff * (0.75 + 0.5 * ((double)(px_now_ns() % 1000) / 1000.0));
    PX_LOG(PX_LOG_WARN,
           "msg=\"kubernetes: %s failed; trying again\" source=\"%s\" error=\"%s\" retry_s=%.2f",
           s->phase == S_WATCH ? "watch" : "list", s->url, why, t);
    s->phase = S_IDLE;
    struct timeval tv = {(time_t)t, (suseconds_t)((t - (double)(time_t)t) * 1e6)};
    evtimer_add(s->timer, &tv);
}

static void append_query(px_buf *b, const char *k, const char *v) {
    px_buf_printf(b, "&%s=", k);
    for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
        if (isalnum(*p) || strchr("-._~", *p))
            px_buf_append(b, p, 1);
        else
            px_buf_printf(b, "%%%02X", *p);
    }
}

static void on_headers(void *arg, int status, const char *ctype) {
    ((source *)arg)->status = status;
}

static int handle_event(source *s, const char *line, size_t n);

static int on_data(void *arg, const char *p, size_t n) {
    source *s = arg;
    if (s->status != 200 || s->phase == S_LIST) {
        if (s->body.len + n > BODY_MAX) {
            s->too_big = 1;
            return -1;
        }
        px_buf_append(&s->body, p, n);
        return 0;
    }
    /* A watch: one JSON event per line. */
    while (n) {
        const char *nl = memchr(p, '\n', n);
        size_t take = nl ? (size_t)(nl - p) : n;
        if (s->body.len + take > BODY_MAX) {
            s->too_big = 1;
            return -1;
        }
        px_buf_append(&s->body, p, take);
        if (!nl) break;
        int rc = handle_event(s, s->body.data, s->body.len);
        px_buf_reset(&s->body);
        if (rc < 0) return -1; /* 410 Gone: list again */
        p = nl + 1;
        n -= take + 1;
    }
    return 0;
}

static void list_done(source *s);
static void on_done(void *arg, px_up_result r, const char *why, int connected);
static const px_upstream_cbs cbs = {on_headers, on_data, on_done};

/* Starts the next request: a list page, or a watch from s->rv. */
static void start(source *s) {
    px_k8s *k = s->k;
    if (k->retired) return;
    char token[8192], err[256];
    if (px_k8s_creds_token(&k->cr, token, sizeof token, err, sizeof err) < 0) {
        s->phase = S_LIST;
        retry_later(s, err);
        return;
    }
    s->phase = s->listed && s->rv[0] && !s->relist ? S_WATCH : S_LIST;
    if (s->phase == S_LIST && !s->cont[0]) {
        slices_free(s->page, s->npage);
        s->page = NULL;
        s->npage = 0;
    }
    px_buf path, hdr;
    px_buf_init(&path);
    px_buf_init(&hdr);
    px_buf_printf(&path, "/apis/discovery.k8s.io/v1/namespaces/%s/endpointslices?",
                  s->ns[0] ? s->ns : k->cr.ns);
    append_query(&path, "labelSelector", s->selector);
    if (s->phase == S_WATCH) {
        px_buf_appends(&path, "&watch=1&allowWatchBookmarks=true");
        append_query(&path, "resourceVersion", s->rv);
        px_buf_printf(&path, "&timeoutSeconds=%d", WATCH_SECONDS);
    } else {
        px_buf_printf(&path, "&limit=%d", LIST_PAGE);
        if (s->cont[0]) append_query(&path, "continue", s->cont);
    }
    px_buf_appends(&hdr, "Accept: application/json\r\n");
    if (token[0]) px_buf_printf(&hdr, "Authorization: Bearer %s\r\n", token);
    memset(token, 0, sizeof token);
    px_upstream_req q = {
        .backend = k->api,
        .method = "GET",
        .path = path.data,
        .headers = &hdr,
        .connect_timeout = 5,
        .total_timeout = s->phase == S_WATCH ? 0 : 60,
        .idle_timeout = s->phase == S_WATCH ? IDLE_SECONDS : 30,
        .ca_file = k->cr.ca_file[0] ? k->cr.ca_file : NULL,
        .insecure = k->cr.insecure,
    };
    s->status = 0;
    s->too_big = 0;
    s->relist = 0;
    px_buf_reset(&s->body);
    s->up = px_upstream_start(k->loop, &q, &cbs, s);
    px_buf_cleanup(&path);
    px_buf_cleanup(&hdr);
    if (!s->up) retry_later(s, "cannot start the request");
}

/* The status line of a failed answer, with the API's message. */
static void api_error(source *s, char *out, size_t cap) {
    cJSON *st = s->body.len ? cJSON_ParseWithLength(s->body.data, s->body.len) : NULL;
    const char *msg = jstr(st, "message");
    snprintf(out, cap, "HTTP %d%s%.200s", s->status, msg ? ": " : "", msg ? msg : "");
    cJSON_Delete(st);
}

static void on_done(void *arg, px_up_result r, const char *why, int connected) {
    source *s = arg;
    s->up = NULL;
    char e[300];
    if (s->phase == S_WATCH) {
        if (s->relist || s->status == 410) { /* Gone: the version is too old */
            PX_LOG(PX_LOG_INFO, "msg=\"kubernetes: watch expired (410 Gone); listing again\" "
                                "source=\"%s\"", s->url);
            s->relist = 1;
            s->cont[0] = '\0';
            start(s);
            return;
        }
        if (r == PX_UP_OK && s->status == 200) { /* the server's timeout: watch again */
            s->backoff = 0;
            start(s);
            return;
        }
        if (s->status && s->status != 200) api_error(s, e, sizeof e);
        else snprintf(e, sizeof e, "%s", s->too_big ? "event too large" : why);
        retry_later(s, e);
        return;
    }
    if (r != PX_UP_OK || s->status != 200) {
        if (s->status == 410) s->cont[0] = '\0'; /* the continue token expired */
        if (s->status) api_error(s, e, sizeof e);
        else snprintf(e, sizeof e, "%s", s->too_big ? "answer too large" : why);
        retry_later(s, e);
        return;
    }
    list_done(s);
}

/* A list page arrived: its slices kept; the last page replaces the view. */
static void list_done(source *s) {
    cJSON *doc = cJSON_ParseWithLength(s->body.data, s->body.len);
    const cJSON *md = cJSON_GetObjectItemCaseSensitive(doc, "metadata");
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(doc, "items");
    if (!cJSON_IsArray(items)) {
        cJSON_Delete(doc);
        s->cont[0] = '\0';
        retry_later(s, "the list answer is not an EndpointSliceList");
        return;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, items) {
        s->page = px_xrealloc(s->page, (s->npage + 1) * sizeof *s->page);
        slice_from_json(s, it, &s->page[s->npage++]);
    }
    const char *cont = jstr(md, "continue"), *rv = jstr(md, "resourceVersion");
    snprintf(s->cont, sizeof s->cont, "%s", cont ? cont : "");
    if (rv && !s->cont[0]) snprintf(s->rv, sizeof s->rv, "%s", rv);
    cJSON_Delete(doc);
    if (s->cont[0]) { /* the next page */
        start(s);
        return;
    }
    slices_free(s->s, s->ns_);
    s->s = s->page;
    s->ns_ = s->npage;
    s->page = NULL;
    s->npage = 0;
    if (!s->listed)
        PX_LOG(PX_LOG_INFO, "msg=\"kubernetes: listed\" source=\"%s\" slices=%zu", s->url, s->ns_);
    s->listed = 1;
    s->backoff = 0;
    apply(s);
    start(s); /* watch from the list's version */
}

/* One watch event. -1: the watch must end and a list follow. */
static int handle_event(source *s, const char *line, size_t n) {
    if (!n) return 0;
    cJSON *ev = cJSON_ParseWithLength(line, n);
    const char *type = jstr(ev, "type");
    const cJSON *obj = cJSON_GetObjectItemCaseSensitive(ev, "object");
    if (!type || !cJSON_IsObject(obj)) {
        cJSON_Delete(ev);
        PX_LOG(PX_LOG_WARN, "msg=\"kubernetes: malformed watch event ignored\" source=\"%s\"",
               s->url);
        return 0;
    }
    if (!strcmp(type, "ERROR")) {
        const cJSON *code = cJSON_GetObjectItemCaseSensitive(obj, "code");
        int c = cJSON_IsNumber(code) ? code->valueint : 0;
        PX_LOG(PX_LOG_INFO, "msg=\"kubernetes: watch error\" source=\"%s\" code=%d message=\"%.200s\"",
               s->url, c, nz(jstr(obj, "message")));
        cJSON_Delete(ev);
        s->relist = 1; /* 410 Gone, or anything else: the view may be stale */
        s->cont[0] = '\0';
        return -1;
    }
    const cJSON *md = cJSON_GetObjectItemCaseSensitive(obj, "metadata");
    const char *rv = jstr(md, "resourceVersion"), *name = jstr(md, "name");
    if (rv) snprintf(s->rv, sizeof s->rv, "%s", rv);
    if (!strcmp(type, "BOOKMARK") || !name) {
        cJSON_Delete(ev);
        return 0;
    }
    size_t i = 0;
    while (i < s->ns_ && strcmp(s->s[i].name, name))
        i++;
    if (!strcmp(type, "DELETED")) {
        if (i < s->ns_) {
            slice_clear(&s->s[i]);
            s->s[i] = s->s[--s->ns_];
        }
    } else if (!strcmp(type, "ADDED") || !strcmp(type, "MODIFIED")) {
        slice sl;
        slice_from_json(s, obj, &sl);
        if (i == s->ns_) {
            s->s = px_xrealloc(s->s, (s->ns_ + 1) * sizeof *s->s);
            s->s[s->ns_++] = sl;
        } else {
            slice_clear(&s->s[i]);
            s->s[i] = sl;
        }
    }
    cJSON_Delete(ev);
    apply(s);
    return 0;
}

/* ---------- the client ---------- */

px_k8s *px_k8s_create(struct event_base *base, const px_k8s_cfg *cfg, char *err, size_t errlen) {
    px_k8s *k = px_xcalloc(1, sizeof *k);
    k->base = base;
    k->dp = cfg->dp;
    k->kv = cfg->kv_decls;
    if (px_k8s_creds_load(&k->cr, cfg, err, errlen) < 0) {
        free(k);
        return NULL;
    }
    k->api = px_backend_create(k->cr.server);
    k->loop = px_uploop_create(base, 2);
    if (!k->api || !k->loop) {
        snprintf(err, errlen, "Kubernetes API server '%s': not a usable http(s)://host:port URL",
                 k->cr.server);
        px_k8s_destroy(k);
        return NULL;
    }
    return k;
}

int px_k8s_watch(px_k8s *k, px_pool *pool, const char *url, px_k8s *old, char *err, size_t errlen) {
    char ns[254], sel[1024], port[64];
    if (px_k8s_url_parse(url, ns, sizeof ns, sel, sizeof sel, port, sizeof port, err, errlen) < 0)
        return -1;
    k->src = px_xrealloc(k->src, (k->n + 1) * sizeof *k->src);
    source *s = &k->src[k->n++];
    memset(s, 0, sizeof *s);
    s->pool = pool;
    s->url = px_xstrdup(url);
    snprintf(s->ns, sizeof s->ns, "%s", ns);
    s->selector = px_xstrdup(sel);
    snprintf(s->port, sizeof s->port, "%s", port);
    px_buf_init(&s->body);
    /* The replaced generation's members of this source: the caller adopted
     * them; they stay this source's until its first list. */
    for (size_t i = 0; old && i < old->n; i++) {
        source *o = &old->src[i];
        if (strcmp(o->url, url) || o->pool == pool) continue;
        s->cur = px_xcalloc(o->ncur ? o->ncur : 1, sizeof *s->cur);
        for (size_t j = 0; j < o->ncur; j++) {
            s->cur[j] = o->cur[j];
            s->cur[j].url = px_xstrdup(o->cur[j].url);
            s->cur[j].kv = o->cur[j].kv ? px_xstrdup(o->cur[j].kv) : NULL;
            s->cur[j].kvr = o->cur[j].kvr ? px_xstrdup(o->cur[j].kvr) : NULL;
        }
        s->ncur = o->ncur;
        break;
    }
    return 0;
}

const char *const *px_k8s_members(px_k8s *k, const char *url, size_t *n) {
    static __thread const char **v; /* control thread only; grown as needed */
    static __thread size_t cap;
    *n = 0;
    for (size_t i = 0; k && i < k->n; i++) {
        source *s = &k->src[i];
        if (strcmp(s->url, url)) continue;
        if (cap < s->ncur) {
            v = px_xrealloc(v, s->ncur * sizeof *v);
            cap = s->ncur;
        }
        for (size_t j = 0; j < s->ncur; j++)
            v[j] = s->cur[j].url;
        *n = s->ncur;
        return v;
    }
    return NULL;
}

void px_k8s_start(px_k8s *k) {
    for (size_t i = 0; k && i < k->n; i++) {
        source *s = &k->src[i];
        s->k = k;
        if (!s->timer) s->timer = evtimer_new(k->base, on_timer, s);
        start(s);
    }
}

size_t px_k8s_unlisted(const px_k8s *k) {
    size_t n = 0;
    for (size_t i = 0; k && i < k->n; i++)
        n += !k->src[i].listed;
    return n;
}

void px_k8s_retire(px_k8s *k) {
    if (!k) return;
    k->retired = 1;
    for (size_t i = 0; i < k->n; i++) {
        source *s = &k->src[i];
        if (s->up) px_upstream_cancel(s->up);
        s->up = NULL;
        if (s->timer) event_del(s->timer);
    }
}

void px_k8s_destroy(px_k8s *k) {
    if (!k) return;
    px_k8s_retire(k);
    for (size_t i = 0; i < k->n; i++) {
        source *s = &k->src[i];
        if (s->timer) event_free(s->timer);
        slices_free(s->s, s->ns_);
        slices_free(s->page, s->npage);
        for (size_t j = 0; j < s->ncur; j++)
            member_free(&s->cur[j]);
        free(s->cur);
        free(s->url);
        free(s->selector);
        px_buf_cleanup(&s->body);
    }
    free(k->src);
    px_uploop_destroy(k->loop);
    px_backend_release(k->api);
    px_k8s_creds_cleanup(&k->cr);
    free(k);
}
