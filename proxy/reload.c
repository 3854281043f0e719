/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/reload.h"

#include <arpa/inet.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/hash.h"
#include "base/log.h"
#include "proxy/admission.h"
#include "proxy/discovery.h"
#include "proxy/dispatch.h"
#include "proxy/dp.h"
#include "proxy/kvevents.h"
#include "proxy/slo.h"

/* ---------- the backends' URLs, for changes in place ---------- */

typedef struct url_ent {
    char *key; /* owned: "<pool index> <role> <px_config_url_key>"; NULL: free */
    char *src; /* owned: the URL as configured (members' src) */
    uint64_t h;
    int toy; /* from a --prefill-host style flag */
} url_ent;

struct url_set {
    url_ent *e; /* owned; open addressing, linear probing */
    size_t cap; /* a power of two, over twice n */
    size_t n;
    size_t (*count)[2]; /* owned: URLs per pool index and role (0 decode, 1 prefill) */
    size_t npools;
};

static int url_set_key(size_t pool, int prefill, const char *url, char *out, size_t cap) {
    int w = snprintf(out, cap, "%zu %d ", pool, prefill);
    return w > 0 && (size_t)w < cap ? px_config_url_key(url, out + w, cap - (size_t)w) : -1;
}

/* The slot of `key`, or the free slot where it would go. */
static size_t url_set_slot(const struct url_set *s, const char *key, uint64_t h) {
    size_t i = (size_t)h & (s->cap - 1);
    while (s->e[i].key && (s->e[i].h != h || strcmp(s->e[i].key, key)))
        i = (i + 1) & (s->cap - 1);
    return i;
}

static void url_set_put(struct url_set *s, const char *key, const char *src, int toy) {
    if (2 * (s->n + 1) > s->cap) {
        url_ent *old = s->e;
        size_t oc = s->cap;
        s->cap = oc ? oc * 2 : 64;
        s->e = px_xcalloc(s->cap, sizeof *s->e);
        for (size_t i = 0; i < oc; i++)
            if (old[i].key) s->e[url_set_slot(s, old[i].key, old[i].h)] = old[i];
        free(old);
    }
    uint64_t h = px_hash64(key, strlen(key));
    size_t i = url_set_slot(s, key, h);
    if (s->e[i].key) return; /* one spelling per backend: the first stays */
    s->e[i] = (url_ent){px_xstrdup(key), px_xstrdup(src), h, toy};
    s->n++;
}

static url_ent *url_set_get(struct url_set *s, const char *key) {
    if (!s->cap) return NULL;
    url_ent *e = &s->e[url_set_slot(s, key, px_hash64(key, strlen(key)))];
    return e->key ? e : NULL;
}

/* Deletion with backward shift: no tombstones, probes stay short. */
static void url_set_del(struct url_set *s, url_ent *e) {
    size_t i = (size_t)(e - s->e);
    free(e->key);
    free(e->src);
    s->e[i] = (url_ent){0};
    s->n--;
    for (size_t j = (i + 1) & (s->cap - 1); s->e[j].key; j = (j + 1) & (s->cap - 1)) {
        size_t home = (size_t)s->e[j].h & (s->cap - 1);
        /* Moves back when its home is not cyclically within (i, j]. */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            s->e[i] = s->e[j];
            s->e[j] = (url_ent){0};
            i = j;
        }
    }
}

static void url_set_free(struct url_set *s) {
    if (!s) return;
    for (size_t i = 0; i < s->cap; i++) {
        free(s->e[i].key);
        free(s->e[i].src);
    }
    free(s->e);
    free(s->count);
    free(s);
}

/* The set of the pool specs a generation is built from (in its order). */
static struct url_set *url_set_of(const px_pool_spec *v, size_t n) {
    struct url_set *s = px_xcalloc(1, sizeof *s);
    s->npools = n;
    s->count = px_xcalloc(n ? n : 1, sizeof *s->count);
    char key[400];
    for (size_t i = 0; i < n; i++)
        for (int r = 0; r < 2; r++)
            for (int toy = 0; toy < 2; toy++) {
                const px_strlist *l = r ? (toy ? &v[i].prefill_toy : &v[i].prefill)
                                        : (toy ? &v[i].decode_toy : &v[i].decode);
                s->count[i][r] += l->n;
                for (size_t j = 0; j < l->n; j++) {
                    size_t before = s->n;
                    if (url_set_key(i, r, l->v[j], key, sizeof key) == 0)
                        url_set_put(s, key, l->v[j], toy);
                    if (s->n == before) { /* malformed, or two spellings of one backend */
                        url_set_free(s);
                        return NULL; /* every change rebuilds, as apply_op knows those */
                    }
                }
            }
    return s;
}

/* ---------- build ---------- */

/* A generation of pools from the settings and pool specs; its discovery
 * starts resolving (`wait`: until every name has an answer). */
static px_gen *build(px_reloader *rl, const px_config *cfg, const px_pool_spec *specs, size_t n,
                     px_gen *old, int wait, char *err, size_t errlen) {
    px_gen *g = px_xcalloc(1, sizeof *g);
    atomic_init(&g->refs, 1);
    g->named = cfg->npools > 0;
    g->nps = n;
    g->ps = px_xcalloc(n ? n : 1, sizeof *g->ps);
    px_pool_cfg pc = {
        .unhealthy_after = (int)cfg->unhealthy_after,
        .healthy_after = (int)cfg->healthy_after,
        .active_checks = rl->ctx->cfg->health_interval > 0, /* the checker's, set at start */
        .prefix_bytes = (size_t)cfg->prefix_bytes,
        .load_factor = cfg->prefix_load_factor,
        .kv_cache_weight = cfg->kv_cache_weight,
        .kv_load_weight = cfg->kv_load_weight,
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
        p->dispatch =
            px_dispatch_parse(specs[i].dispatch && specs[i].dispatch[0] ? specs[i].dispatch
                                                                         : cfg->dispatch);
        if (p->dispatch < 0) p->dispatch = PX_DISPATCH_SERIAL;
    }
    /* Read at start only: the Kubernetes API and its credentials. */
    const px_config *sc = rl->ctx->cfg;
    px_k8s_cfg kc = {sc->k8s_api,         sc->k8s_token_file,     sc->k8s_ca_file,
                     sc->kubeconfig,      rl->ctx->reg->dp,       rl->ctx->reg->kv_decls};
    g->disc = px_discovery_start(g, specs, old, cfg->dns_refresh, &kc, rl->base, wait, err, errlen);
    if (!g->disc) {
        px_gen_release(g);
        return NULL;
    }
    /* Backend entries' dp_size: this configuration's replace the last's. */
    if (px_dp_declare_file(rl->ctx->reg->dp, &cfg->backend_dp) < 0)
        PX_LOG(PX_LOG_WARN, "msg=\"some backends' dp_size ignored: more than 4096 URLs declare "
                            "one, or a URL is 512 bytes or longer\"");
    /* And their KV-event endpoints; the subscriber follows on its next sync. */
    px_kvsub_declare_file(rl->ctx->reg->kv_decls, &cfg->backend_kv);
    if (cfg->backend_kv.n && !rl->ctx->kvindex)
        PX_LOG(PX_LOG_WARN, "msg=\"backends' kv_events_endpoint ignored until a restart: KV "
                            "events were off at start (no --kv-events-port, no entry declaring "
                            "one)\"");
    return g;
}

/* The --config file and main's arguments read again. NULL with err when
 * they do not describe a run; logs the settings that changed but only take
 * effect at restart (those the option table does not mark as reloadable). */
/* Reads the settings: main's arguments again, or the --config file alone
 * (argv NULL). Touches nothing of the reloader: runs on the parse thread. */
static px_config *parse(int argc, char **argv, char **envp, const char *file, char *err,
                        size_t errlen) {
    px_config *nc = px_xcalloc(1, sizeof *nc);
    FILE *devnull = fopen("/dev/null", "w");
    char *fallback[] = {"pdproxy", "--config", (char *)file, NULL};
    px_config_result r = argv ? px_config_load(nc, argc, argv, envp, devnull, err, errlen)
                              : px_config_load(nc, 3, fallback, NULL, devnull, err, errlen);
    if (devnull) fclose(devnull);
    if (r != PX_CONFIG_RUN) {
        if (r != PX_CONFIG_ERROR) snprintf(err, errlen, "the settings do not describe a run");
        px_config_cleanup(nc);
        free(nc);
        return NULL;
    }
    return nc;
}

/* Logs the settings that changed but only take effect at restart (those
 * the option table does not mark as reloadable). */
static void log_changed(px_reloader *rl, const px_config *nc) {
    char changed[512];
    px_config_changed(px_reload_config(rl), nc, changed, sizeof changed);
    if (changed[0])
        PX_LOG(PX_LOG_WARN,
               "msg=\"reload: these settings changed but take effect at restart only\" "
               "settings=%s",
               changed);
}

/* The --config file and main's arguments read again. NULL with err when
 * they do not describe a run. */
static px_config *load_file(px_reloader *rl, char *err, size_t errlen) {
    const px_config *cur = px_reload_config(rl);
    if (!cur->config_file[0]) {
        snprintf(err, errlen, "no --config file to reload");
        return NULL;
    }
    px_config *nc = parse(rl->argc, rl->argv, rl->envp, cur->config_file, err, errlen);
    if (nc) log_changed(rl, nc);
    return nc;
}

/* ---------- apply: the admin API's changes ---------- */

static px_pool_spec *spec_named(px_pool_spec *v, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(v[i].name, name)) return &v[i];
    return NULL;
}

static int list_find(const px_strlist *l, const char *s) {
    for (size_t i = 0; i < l->n; i++)
        if (px_config_url_same(l->v[i], s)) return (int)i; /* one backend, one spelling */
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

/* The pool specs of `cfg` with the admin API's changes since the last file
 * reload (`keep_ops`) and `op` applied, built into a generation. */
static px_gen *build_with_ops(px_reloader *rl, const px_config *cfg, int keep_ops,
                              const px_api_op *op, struct url_set **urls, int *rc, char *err,
                              size_t errlen) {
    size_t n;
    px_pool_spec *specs = px_config_effective_pools(cfg, &n);
    *rc = 0;
    for (size_t i = 0; keep_ops && i < rl->nops && *rc == 0; i++)
        *rc = apply_op(specs, n, &rl->ops[i], err, errlen);
    if (*rc == 0 && op) *rc = apply_op(specs, n, op, err, errlen);
    if (*rc == 0) *rc = px_config_check_pools(cfg, specs, n, 1, err, errlen);
    px_gen *g = NULL;
    if (*rc == 0) {
        g = build(rl, cfg, specs, n, rl->ctx->gen, 0, err, errlen);
        if (!g) *rc = -1;
        else if (!keep_ops) {
            px_dp_forget_admin(rl->ctx->reg->dp); /* the API's dp_size goes with its changes */
            px_kvsub_forget_admin(rl->ctx->reg->kv_decls);
        }
    }
    *urls = g ? url_set_of(specs, n) : NULL;
    px_pool_specs_free(specs, n);
    return g;
}

static px_pool *pset_pool(px_pset *p, int prefill) {
    return prefill ? &p->prefill : &p->decode;
}

/* The admin API's drains last until the next reload from the file. */
static void undrain(px_gen *g) {
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
}

/* ---------- swap, diff, retire ---------- */

/* Makes g the generation new requests use; returns the one it replaced. */
static px_gen *swap(px_reloader *rl, px_gen *g) {
    pthread_mutex_lock(&rl->ctx->gen_mu);
    px_gen *old = rl->ctx->gen;
    g->id = ++rl->last_gen;
    rl->ctx->gen = g;
    pthread_mutex_unlock(&rl->ctx->gen_mu);
    return old;
}

/* Logs what a swap changed: backends that joined, and those that left
 * (their connections close once their last request is done). */
static int cmp_ptr(const void *a, const void *b) {
    uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
    return x < y ? -1 : x > y;
}

static void diff(px_gen *old, px_gen *g) {
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
                if (om) qsort(om, on, sizeof *om, cmp_ptr); /* n log n, not n * n */
                for (size_t k = 0; k < n; k++) {
                    int kept = om && bsearch(&m[k], om, on, sizeof *om, cmp_ptr) != NULL;
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

/* The replaced generation goes: requests on it keep it until they end. A
 * replaced discovery may have lookups whose cancellation calls back on a
 * later turn of this loop: it is freed by a later reload, once idle. */
static void retire(px_reloader *rl, px_gen *old) {
    size_t keep = 0;
    for (size_t i = 0; i < rl->nretired; i++) {
        if (px_discovery_idle(rl->retired_disc[i]))
            px_discovery_stop(rl->retired_disc[i]);
        else
            rl->retired_disc[keep++] = rl->retired_disc[i];
    }
    rl->nretired = keep;
    px_discovery_retire(old->disc);
    rl->retired_disc = px_xrealloc(rl->retired_disc, (rl->nretired + 1) * sizeof *rl->retired_disc);
    rl->retired_disc[rl->nretired++] = old->disc;
    old->disc = NULL;
    px_gen_release(old);
    if (rl->retired) rl->retired(rl->arg);
}

static void ops_clear(px_reloader *rl) {
    for (size_t i = 0; i < rl->nops; i++) {
        free(rl->ops[i].pool);
        free(rl->ops[i].url);
    }
    free(rl->ops);
    rl->ops = NULL;
    rl->nops = 0;
}

/* What the next reload starts from: the file's settings (the API's changes
 * dropped), or one more API change. */
static void remember(px_reloader *rl, px_config *nc, const px_api_op *op) {
    if (nc) {
        if (rl->file_cfg) {
            px_config_cleanup(rl->file_cfg);
            free(rl->file_cfg);
        }
        rl->file_cfg = nc;
        ops_clear(rl);
    } else if (op) {
        rl->ops = px_xrealloc(rl->ops, (rl->nops + 1) * sizeof *rl->ops);
        rl->ops[rl->nops++] = (px_api_op){.add = op->add,
                                          .prefill = op->prefill,
                                          .pool = px_xstrdup(op->pool),
                                          .url = px_xstrdup(op->url)};
    }
}

/* ---------- one admin API change in place ---------- */

static int literal_host(const char *url) {
    char host[256];
    int port, https;
    unsigned char a[16];
    return px_url_split(url, host, sizeof host, &port, &https) == 0 &&
           (inet_pton(AF_INET, host, a) == 1 || inet_pton(AF_INET6, host, a) == 1);
}

/* px_config_check_pools on one pool whose lists hold `url` where `has`
 * says (the same rules and messages as a rebuild's). */
static int check_one(const px_config *cfg, const char *pool, const char *url, int has_prefill,
                     int has_decode, int reloading, char *err, size_t errlen) {
    char *one[1] = {(char *)url};
    px_pool_spec sp = {.name = (char *)pool};
    if (has_prefill) sp.prefill = (px_strlist){.v = one, .n = 1};
    if (has_decode) sp.decode = (px_strlist){.v = one, .n = 1};
    return px_config_check_pools(cfg, &sp, 1, reloading, err, errlen);
}

/* An add or remove of one backend with an address for a host, applied to
 * the running generation in place: its duplicate, own-address and
 * empty-pool checks against rl->urls in O(1), then one member more or
 * less (px_pool_insert / px_pool_remove_src). Everything else (a host
 * name that DNS follows, a toy flag's backend, a pool that is not there)
 * takes a rebuild: returns 0 then. Returns 1 when done (*rc 0) or refused
 * (*rc < 0 with err; nothing changed). */
static int change_in_place(px_reloader *rl, const px_api_op *op, int *rc, char *err,
                           size_t errlen) {
    struct url_set *s = rl->urls;
    px_gen *g = rl->ctx->gen;
    if (!s || s->npools != g->nps) return 0;
    size_t pi = 0;
    while (pi < g->nps && strcmp(g->ps[pi].name, op->pool))
        pi++;
    char key[400];
    int pre = op->prefill;
    if (pi == g->nps || url_set_key(pi, pre, op->url, key, sizeof key) < 0) return 0;
    url_ent *e = url_set_get(s, key);
    const char *role = pre ? "prefill" : "decode", *name = g->ps[pi].name;
    const px_config *cfg = px_reload_config(rl);
    px_pool *pool = pset_pool(&g->ps[pi], pre);
    size_t *cnt = s->count[pi];
    if (op->add) {
        if (!e && !literal_host(op->url)) return 0;
        *rc = e ? -3 : check_one(cfg, name, op->url, pre, !pre, 0, err, errlen);
        if (e)
            snprintf(err, errlen, "%s is a %s backend of pool '%s' already", op->url, role, name);
        if (*rc) return 1;
    } else {
        if (!e) {
            snprintf(err, errlen, "%s is not a %s backend of pool '%s'", op->url, role, name);
            *rc = -2;
            return 1;
        }
        if (e->toy || !literal_host(e->src)) return 0;
    }
    /* As a rebuild checks every pool after the change: none left without
     * a role it needs (O(pools), from the counts). */
    for (size_t j = 0; j < g->nps; j++) {
        long d = j != pi ? 0 : op->add ? 1 : -1;
        long left_p = (long)s->count[j][1] + (pre ? d : 0),
             left_d = (long)s->count[j][0] + (pre ? 0 : d);
        if ((*rc = check_one(cfg, g->ps[j].name, op->url, left_p > 0, left_d > 0, 1, err, errlen)))
            return 1;
    }
    if (op->add) {
        if (!px_pool_insert(pool, op->url)) return 0;
        url_set_put(s, key, op->url, 0);
        cnt[pre]++;
    } else {
        px_pool_remove_src(pool, e->src);
        url_set_del(s, e);
        cnt[pre]--;
    }
    atomic_store(&g->id, ++rl->last_gen);
    PX_LOG(PX_LOG_INFO, "msg=\"%s\" pool=\"%s\" role=%s url=\"%s\"",
           op->add ? "backend added by the admin API"
                   : "backend removed by the admin API; its connections close after its last "
                     "request",
           name, role, op->url);
    return 1;
}

/* ---------- entry points ---------- */

int px_reload_start(px_reloader *rl, char *err, size_t errlen) {
    size_t n;
    px_pool_spec *specs = px_config_effective_pools(rl->ctx->cfg, &n);
    if (px_config_check_pools(rl->ctx->cfg, specs, n, 0, err, errlen) == 0)
        rl->ctx->gen = build(rl, rl->ctx->cfg, specs, n, NULL, 1, err, errlen);
    if (rl->ctx->gen) rl->urls = url_set_of(specs, n);
    px_pool_specs_free(specs, n);
    if (!rl->ctx->gen) return -1;
    rl->ctx->gen->id = rl->last_gen = 1;
    return 0;
}

static int apply(px_reloader *rl, int from_file, px_config *nc, const px_api_op *op, uint64_t t0,
                 char *err, size_t errlen);

/* A reload of the file ended: counted for /metrics. */
static int file_reload_done(px_reloader *rl, int rc) {
    atomic_fetch_add(rc < 0 ? &rl->ctx->reloads_failed : &rl->ctx->reloads_ok, 1);
    atomic_store(&rl->ctx->last_reload_failed, rc < 0);
    return rc;
}

int px_reload(px_reloader *rl, int from_file, const px_api_op *op, char *err, size_t errlen) {
    uint64_t t0 = px_now_ns();
    px_config *nc = NULL;
    int rc;
    if (!from_file && op && change_in_place(rl, op, &rc, err, errlen)) {
        if (rc < 0) return rc;
        remember(rl, NULL, op);
        if (!op->add && rl->retired) rl->retired(rl->arg);
        PX_LOG(PX_LOG_INFO,
               "msg=\"configuration swapped\" generation=%llu source=admin_api in_place=1 "
               "pools=%zu ms=%.3f",
               (unsigned long long)rl->ctx->gen->id, rl->ctx->gen->nps,
               (double)(px_now_ns() - t0) / 1e6);
        return 0;
    }
    if (!from_file) return apply(rl, 0, NULL, op, t0, err, errlen);
    if (!(nc = load_file(rl, err, errlen))) return file_reload_done(rl, -1);
    return file_reload_done(rl, apply(rl, 1, nc, op, t0, err, errlen));
}

/* The rest of a reload, once the settings are read (nc, owned; NULL: the
 * current ones with `op`). */
static int apply(px_reloader *rl, int from_file, px_config *nc, const px_api_op *op, uint64_t t0,
                 char *err, size_t errlen) {
    int rc;
    struct url_set *urls = NULL;
    px_gen *g =
        build_with_ops(rl, nc ? nc : px_reload_config(rl), !from_file, op, &urls, &rc, err, errlen);
    if (rc < 0) {
        url_set_free(urls);
        if (nc) {
            px_config_cleanup(nc);
            free(nc);
        }
        return rc;
    }
    url_set_free(rl->urls);
    rl->urls = urls;
    if (from_file) undrain(g);
    px_gen *old = swap(rl, g);
    diff(old, g);
    retire(rl, old);
    if (nc) {
        /* The file's admission settings, for the requests queued too. */
        char note[256], aerr[256];
        if (px_adm_reconfigure(rl->ctx, nc->tenants.v, nc->tenants.n, nc->pool_max_inflight,
                               note, sizeof note, aerr, sizeof aerr) < 0)
            PX_LOG(PX_LOG_WARN, "msg=\"reload: admission settings kept\" error=\"%s\"", aerr);
        if (px_adm_set_classes(rl->ctx, nc->priority_classes.v, nc->priority_classes.n, aerr,
                               sizeof aerr) < 0)
            PX_LOG(PX_LOG_WARN, "msg=\"reload: priority classes kept\" error=\"%s\"", aerr);
        if (px_slo_publish(rl->ctx->slo, nc->slo.v, nc->slo.n, aerr, sizeof aerr) < 0)
            PX_LOG(PX_LOG_WARN, "msg=\"reload: latency targets kept\" error=\"%s\"", aerr);
    }
    remember(rl, nc, op);
    PX_LOG(PX_LOG_INFO, "msg=\"configuration swapped\" generation=%llu source=%s pools=%zu ms=%.3f",
           (unsigned long long)g->id,
           from_file ? "file"
           : op      ? "admin_api"
                     : "current",
           g->nps, (double)(px_now_ns() - t0) / 1e6);
    return 0;
}

/* ---------- reloads from the file, parsed off the control thread ---------- */

typedef struct waiter {
    uint64_t seq; /* answered by the first result of this request or a newer one */
    px_reload_done_fn done;
    void *arg;
    struct waiter *next;
} waiter;

/* Shared by the control thread and the parse threads, freed by the last of
 * them (parse threads are detached: an exit never waits for a read). */
struct px_reload_async {
    pthread_mutex_t mu;
    int refs;
    int stop;
    uint64_t want;    /* the newest request */
    uint64_t started; /* the newest request a thread has started reading */
    int nthreads;     /* reading now, at most READERS */
    /* Inputs, copied at each request (the file's name may change). */
    int argc;
    char **argv, **envp; /* borrowed: main's */
    char *file;          /* owned */
    /* The newest result, not yet applied: its request, settings or error. */
    uint64_t done_seq;
    px_config *result; /* owned */
    char err[512];
    int has_result;
    int efd;          /* eventfd the control loop watches (control side owns it) */
    struct event *ev; /* owned by the control side */
    waiter *waiters;  /* control thread only */
    uint64_t t0;      /* control thread: when the newest request came */
};

/* A newer request does not wait for an older read to end (a huge file may
 * take long): it starts a reader of its own, up to this many at once; the
 * older read's result is dropped when it ends. */
#define READERS 2

static void async_unref(struct px_reload_async *as) {
    pthread_mutex_lock(&as->mu);
    int last = --as->refs == 0;
    pthread_mutex_unlock(&as->mu);
    if (!last) return;
    if (as->result) {
        px_config_cleanup(as->result);
        free(as->result);
    }
    free(as->file);
    pthread_mutex_destroy(&as->mu);
    free(as);
}

typedef struct reader {
    struct px_reload_async *as;
    uint64_t seq;
} reader;

/* A parse thread: reads for its request; a result overtaken by a newer
 * request is dropped, and the newest read again unless a reader has it. */
static void *parse_main(void *arg) {
    reader *r = arg;
    struct px_reload_async *as = r->as;
    uint64_t seq = r->seq;
    free(r);
    pthread_mutex_lock(&as->mu);
    while (!as->stop) {
        char *file = px_xstrdup(as->file);
        pthread_mutex_unlock(&as->mu);
        PX_LOG(PX_LOG_INFO, "msg=\"reload: reading the configuration\" request=%llu",
               (unsigned long long)seq);
        char err[512] = "";
        px_config *nc = parse(as->argc, as->argv, as->envp, file, err, sizeof err);
        free(file);
        pthread_mutex_lock(&as->mu);
        if (as->stop || seq != as->want) {
            if (!as->stop)
                PX_LOG(PX_LOG_INFO,
                       "msg=\"reload superseded by a newer request; its read is dropped\" "
                       "request=%llu newest=%llu",
                       (unsigned long long)seq, (unsigned long long)as->want);
            if (nc) {
                px_config_cleanup(nc);
                free(nc);
            }
            if (as->stop || as->started == as->want) break; /* a reader has the newest */
            seq = as->started = as->want;
            continue;
        }
        if (as->result) { /* an older one the control loop did not take yet */
            px_config_cleanup(as->result);
            free(as->result);
        }
        as->result = nc;
        snprintf(as->err, sizeof as->err, "%s", err);
        as->done_seq = seq;
        as->has_result = 1;
        uint64_t one = 1;
        if (write(as->efd, &one, sizeof one) < 0) {
            /* the counter is full: the control loop is awake already */
        }
        break;
    }
    as->nthreads--;
    pthread_mutex_unlock(&as->mu);
    async_unref(as);
    return NULL;
}

/* Under as->mu: a reader for the newest request. 0, or -1. */
static int start_reader(struct px_reload_async *as) {
    reader *r = px_xcalloc(1, sizeof *r);
    *r = (reader){as, as->want};
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &at, parse_main, r);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        free(r);
        return -1;
    }
    as->started = as->want;
    as->nthreads++;
    as->refs++;
    return 0;
}

/* Control loop: a result is in. Applied when it answers the newest request
 * (else a newer one is being read), then every waiter it covers answered. */
static void on_parsed(evutil_socket_t fd, short what, void *arg) {
    px_reloader *rl = arg;
    struct px_reload_async *as = rl->async;
    uint64_t v;
    if (read(fd, &v, sizeof v) < 0) {
        /* nothing to read: a spurious wake-up */
    }
    pthread_mutex_lock(&as->mu);
    if (!as->has_result || as->done_seq != as->want) {
        pthread_mutex_unlock(&as->mu);
        return;
    }
    px_config *nc = as->result;
    uint64_t seq = as->done_seq;
    char err[512];
    snprintf(err, sizeof err, "%s", as->err);
    as->result = NULL;
    as->has_result = 0;
    pthread_mutex_unlock(&as->mu);
    int rc = -1;
    if (nc) {
        log_changed(rl, nc);
        rc = apply(rl, 1, nc, NULL, as->t0, err, sizeof err);
    }
    file_reload_done(rl, rc);
    double ms = (double)(px_now_ns() - as->t0) / 1e6;
    waiter **pw = &as->waiters;
    while (*pw) {
        waiter *w = *pw;
        if (w->seq > seq) {
            pw = &w->next;
            continue;
        }
        *pw = w->next;
        if (w->done) w->done(w->arg, rc, err, rl->ctx->gen->id, ms);
        free(w);
    }
}

int px_reload_request(px_reloader *rl, px_reload_done_fn done, void *arg) {
    const px_config *cur = px_reload_config(rl);
    if (!cur->config_file[0]) return -1;
    struct px_reload_async *as = rl->async;
    if (!as) {
        as = px_xcalloc(1, sizeof *as);
        pthread_mutex_init(&as->mu, NULL);
        as->refs = 1;
        as->argc = rl->argc;
        as->argv = rl->argv;
        as->envp = rl->envp;
        as->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (as->efd < 0) {
            async_unref(as);
            return -1;
        }
        as->ev = event_new(rl->base, as->efd, EV_READ | EV_PERSIST, on_parsed, rl);
        event_add(as->ev, NULL);
        rl->async = as;
    }
    pthread_mutex_lock(&as->mu);
    uint64_t seq = ++as->want;
    free(as->file);
    as->file = px_xstrdup(cur->config_file);
    /* With READERS reading already, the first to end reads the newest. */
    int rc = as->nthreads < READERS ? start_reader(as) : 0;
    if (rc < 0) as->want--;
    pthread_mutex_unlock(&as->mu);
    if (rc < 0) return -1;
    as->t0 = px_now_ns();
    waiter *w = px_xcalloc(1, sizeof *w);
    *w = (waiter){.seq = seq, .done = done, .arg = arg, .next = as->waiters};
    as->waiters = w;
    return 0;
}

void px_reload_forget(px_reloader *rl, void *arg) {
    for (waiter *w = rl->async ? rl->async->waiters : NULL; w; w = w->next)
        if (w->arg == arg) w->done = NULL;
}

static void async_stop(px_reloader *rl) {
    struct px_reload_async *as = rl->async;
    if (!as) return;
    rl->async = NULL;
    char err[] = "pdproxy is stopping";
    while (as->waiters) {
        waiter *w = as->waiters;
        as->waiters = w->next;
        if (w->done) w->done(w->arg, -1, err, 0, 0);
        free(w);
    }
    event_free(as->ev);
    pthread_mutex_lock(&as->mu);
    as->stop = 1;
    close(as->efd); /* readers write it only under mu, and never once stopped */
    as->efd = -1;
    pthread_mutex_unlock(&as->mu);
    async_unref(as);
}

const px_config *px_reload_config(const px_reloader *rl) {
    return rl->file_cfg ? rl->file_cfg : rl->ctx->cfg;
}

static int admin_reload(void *arg, int from_file, const px_api_op *op, char *err, size_t errlen) {
    return px_reload(arg, from_file, op, err, errlen);
}

static const px_config *admin_config(void *arg) {
    return px_reload_config(arg);
}

static const px_api_op *admin_changes(void *arg, size_t *n) {
    px_reloader *rl = arg;
    *n = rl->nops;
    return rl->ops;
}

static int admin_reload_async(void *arg, px_reload_done_fn done, void *done_arg) {
    return px_reload_request(arg, done, done_arg);
}

static void admin_forget(void *arg, void *done_arg) {
    px_reload_forget(arg, done_arg);
}

void px_reload_admin_calls(px_reloader *rl, px_admin_host *h) {
    h->arg = rl;
    h->reload = admin_reload;
    h->reload_async = admin_reload_async;
    h->forget = admin_forget;
    h->config = admin_config;
    h->changes = admin_changes;
}

void px_reload_cleanup(px_reloader *rl) {
    async_stop(rl);
    if (rl->ctx && rl->ctx->gen) {
        px_discovery_stop(rl->ctx->gen->disc);
        rl->ctx->gen->disc = NULL;
        px_gen_release(rl->ctx->gen);
        rl->ctx->gen = NULL;
    }
    for (size_t i = 0; i < rl->nretired; i++)
        px_discovery_stop(rl->retired_disc[i]);
    free(rl->retired_disc);
    rl->retired_disc = NULL;
    rl->nretired = 0;
    if (rl->file_cfg) {
        px_config_cleanup(rl->file_cfg);
        free(rl->file_cfg);
        rl->file_cfg = NULL;
    }
    ops_clear(rl);
    url_set_free(rl->urls);
    rl->urls = NULL;
}
