/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/reload.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "proxy/discovery.h"
#include "proxy/dispatch.h"

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
    g->disc = px_discovery_start(g, specs, old, cfg->dns_refresh, rl->base, wait, err, errlen);
    if (!g->disc) {
        px_gen_release(g);
        return NULL;
    }
    return g;
}

/* The --config file and main's arguments read again. NULL with err when
 * they do not describe a run; logs the settings that changed but only take
 * effect at restart (those the option table does not mark as reloadable). */
static px_config *load_file(px_reloader *rl, char *err, size_t errlen) {
    const px_config *cur = px_reload_config(rl);
    if (!cur->config_file[0]) {
        snprintf(err, errlen, "no --config file to reload");
        return NULL;
    }
    px_config *nc = px_xcalloc(1, sizeof *nc);
    FILE *devnull = fopen("/dev/null", "w");
    char *fallback[] = {"pdproxy", "--config", (char *)cur->config_file, NULL};
    px_config_result r =
        rl->argv ? px_config_load(nc, rl->argc, rl->argv, rl->envp, devnull, err, errlen)
                 : px_config_load(nc, 3, fallback, NULL, devnull, err, errlen);
    if (devnull) fclose(devnull);
    if (r != PX_CONFIG_RUN) {
        if (r != PX_CONFIG_ERROR) snprintf(err, errlen, "the settings do not describe a run");
        px_config_cleanup(nc);
        free(nc);
        return NULL;
    }
    char changed[512];
    px_config_changed(cur, nc, changed, sizeof changed);
    if (changed[0])
        PX_LOG(PX_LOG_WARN,
               "msg=\"reload: these settings changed but take effect at restart only\" "
               "settings=%s",
               changed);
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
                              const px_api_op *op, int *rc, char *err, size_t errlen) {
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
    }
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

/* ---------- entry points ---------- */

int px_reload_start(px_reloader *rl, char *err, size_t errlen) {
    size_t n;
    px_pool_spec *specs = px_config_effective_pools(rl->ctx->cfg, &n);
    if (px_config_check_pools(rl->ctx->cfg, specs, n, 0, err, errlen) == 0)
        rl->ctx->gen = build(rl, rl->ctx->cfg, specs, n, NULL, 1, err, errlen);
    px_pool_specs_free(specs, n);
    if (!rl->ctx->gen) return -1;
    rl->ctx->gen->id = rl->last_gen = 1;
    return 0;
}

int px_reload(px_reloader *rl, int from_file, const px_api_op *op, char *err, size_t errlen) {
    uint64_t t0 = px_now_ns();
    px_config *nc = NULL;
    if (from_file && !(nc = load_file(rl, err, errlen))) return -1;
    int rc;
    px_gen *g =
        build_with_ops(rl, nc ? nc : px_reload_config(rl), !from_file, op, &rc, err, errlen);
    if (rc < 0) {
        if (nc) {
            px_config_cleanup(nc);
            free(nc);
        }
        return rc;
    }
    if (from_file) undrain(g);
    px_gen *old = swap(rl, g);
    diff(old, g);
    retire(rl, old);
    remember(rl, nc, op);
    PX_LOG(PX_LOG_INFO, "msg=\"configuration swapped\" generation=%llu source=%s pools=%zu ms=%.3f",
           (unsigned long long)g->id,
           from_file ? "file"
           : op      ? "admin_api"
                     : "current",
           g->nps, (double)(px_now_ns() - t0) / 1e6);
    return 0;
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

void px_reload_admin_calls(px_reloader *rl, px_admin_host *h) {
    h->arg = rl;
    h->reload = admin_reload;
    h->config = admin_config;
    h->changes = admin_changes;
}

void px_reload_cleanup(px_reloader *rl) {
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
}
