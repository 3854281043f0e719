/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/predict.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "base/log.h"
#include "base/util.h"
#include "proxy/admission.h"
#include "proxy/kvindex.h"
#include "proxy/route.h"

/* Decode alone only when predicted this much faster than the best pair:
 * its prompt delays the first tokens of the requests disaggregated to
 * that decode, which its own prediction does not count. */
#define LOCAL_MARGIN 0.8

/* Members looked at per pool (a larger pool: its first ones). */
#define CANDS 64
/* A request let out of its wait when the best choice's waiting is under
 * this share of its target: the engines are about idle, so it takes
 * nothing from requests that could still meet theirs. */
#define IDLE_SHARE 0.1

static double header_ms(const px_http_head *h, const char *name) {
    const px_http_header *x = px_http_find(h, name);
    char num[32];
    if (!x || !x->value_len || x->value_len >= sizeof num) return 0;
    memcpy(num, x->value, x->value_len);
    num[x->value_len] = 0;
    char *end;
    double v = strtod(num, &end);
    return *end || !(v > 0) || v > 3600000 ? 0 : v;
}

void px_lat_req_headers(px_lat_req *l, px_ctx *c, const px_http_head *h, const char *body,
                        size_t blen) {
    l->hdr_ttft_ms = header_ms(h, "x-slo-ttft-ms");
    l->hdr_tpot_ms = header_ms(h, "x-slo-tpot-ms");
    /* The class names the request's targets (--slo class=) and its SLO
     * counts: without any target (no x-slo-* header, no --slo-ttft-ms or
     * --slo-tpot-ms, no --slo map) it is never read, and its body is not
     * searched for it. (A map a reload brings in the microseconds before
     * this request resolves sees it as class 0.) */
    const px_config *cfg = c->cfg;
    l->cls = 0;
    l->cls_name[0] = 0;
    if (!(l->hdr_ttft_ms > 0) && !(l->hdr_tpot_ms > 0) && !(cfg->slo_ttft_ms > 0) &&
        !(cfg->slo_tpot_ms > 0) && !px_slo_current(c->slo)->n)
        return;
    l->cls = px_adm_request_class(c, h, body, blen);
    const px_prio_map *m = px_adm_classes(c);
    if (m && (size_t)l->cls < m->n)
        snprintf(l->cls_name, sizeof l->cls_name, "%s", m->c[l->cls].name);
    else
        snprintf(l->cls_name, sizeof l->cls_name, "%d", l->cls);
}

int px_lat_pool(const px_pset *ps) {
    return ps->prefill.cfg.policy == PX_POLICY_LATENCY ||
           ps->decode.cfg.policy == PX_POLICY_LATENCY;
}

/* Headers first, then the tenant's, the class's, the pool's, every pool's
 * (pool=*), the flags'. */
static void resolve(px_lat_req *l, px_ctx *c, px_pset *ps, size_t tenant) {
    const px_config *cfg = c->cfg;
    px_slo_target t = {0};
    if (l->hdr_ttft_ms > 0) {
        t.ttft_ms = l->hdr_ttft_ms;
        t.set |= PX_SLO_HAS_TTFT;
    }
    if (l->hdr_tpot_ms > 0) {
        t.tpot_ms = l->hdr_tpot_ms;
        t.set |= PX_SLO_HAS_TPOT;
    }
    const px_slo_map *m = px_slo_current(c->slo);
    if (m->n) {
        const char *tn = c->tenants.v ? c->tenants.v[tenant].name : NULL;
        if (tn && tn[0]) px_slo_merge(&t, px_slo_find(m, 't', tn, strlen(tn)));
        px_slo_merge(&t, px_slo_find(m, 'c', l->cls_name, strlen(l->cls_name)));
        char num[16];
        snprintf(num, sizeof num, "%d", l->cls);
        px_slo_merge(&t, px_slo_find(m, 'c', num, strlen(num)));
        px_slo_merge(&t, px_slo_find(m, 'p', ps->name, strlen(ps->name)));
        px_slo_merge(&t, px_slo_find(m, 'p', "*", 1));
    }
    px_slo_target def = {.ttft_ms = cfg->slo_ttft_ms,
                         .tpot_ms = cfg->slo_tpot_ms,
                         .miss = px_slo_miss_parse(cfg->slo_miss, strlen(cfg->slo_miss)),
                         .status = atoi(cfg->slo_refuse_status),
                         .set = PX_SLO_HAS_MISS | PX_SLO_HAS_STATUS};
    if (def.ttft_ms > 0) def.set |= PX_SLO_HAS_TTFT;
    if (def.tpot_ms > 0) def.set |= PX_SLO_HAS_TPOT;
    if (def.miss < 0) def.miss = PX_SLO_SEND;
    px_slo_merge(&t, &def);
    l->t = t;
    l->resolved = 1;
}

/* The plan for the request's prompt now. 0 when no pool member can be
 * looked at. */
static int plan(px_lat_req *l) {
    px_lat_cand P[CANDS], D[CANDS];
    px_kvindex *kv = l->c->kvindex;
    px_pick k = {.kv = kv, .tok = l->tok, .ntok = l->ntok, .kv_extra = l->kv_extra};
    px_kv_prompt pr;
    px_kv_prompt_init(&pr, l->tok, l->tok ? l->ntok : 0, l->kv_extra);
    size_t np = px_pool_snapshot(&l->ps->prefill, &k, &pr, P, CANDS);
    size_t nd = px_pool_snapshot(&l->ps->decode, &k, &pr, D, CANDS);
    px_kv_prompt_cleanup(&pr);
    px_lat_plan_make(l->c->lat, P, np, D, nd, l->ntok, l->t.tpot_ms / 1e3, &l->plan);
    l->t_plan = px_now_ns();
    /* Without a pair (no usable prefill) the request goes the usual way:
     * --fallback-decode-only, or an error. Decode alone when that is
     * predicted faster: conditional disaggregation by prediction, not by
     * a token threshold. */
    l->planned = l->plan.ok;
    l->local = l->plan.ok && l->plan.local_ok && l->c->cfg->latency_decode_only &&
               l->plan.local_score < LOCAL_MARGIN * l->plan.score;
    l->predicted = l->local ? l->plan.local : l->plan.ttft;
    return l->planned;
}

static double waiting(const px_lat_req *l) {
    return l->local ? l->plan.local_wait : l->plan.wait;
}

px_lat_verdict px_lat_req_route(px_lat_req *l, px_ctx *c, px_pset *ps, size_t tenant,
                                const uint32_t *tok, size_t ntok, uint64_t kv_extra, uint64_t t0,
                                uint64_t deadline_ns) {
    if (!l->resolved) resolve(l, c, ps, tenant);
    if (!px_lat_pool(ps) || !c->lat) return PX_LATV_NONE;
    l->c = c;
    l->ps = ps;
    l->tok = tok;
    l->ntok = ntok;
    l->kv_extra = kv_extra;
    l->t0 = t0;
    if (!plan(l)) return PX_LATV_NONE;
    px_lat_verdict go = l->local ? PX_LATV_LOCAL : PX_LATV_PAIR;
    if (l->released || !(l->t.set & PX_SLO_HAS_TTFT) || l->t.miss == PX_SLO_SEND) return go;
    uint64_t now = l->t_plan;
    double elapsed = (double)(now - t0) / 1e9, target = l->t.ttft_ms / 1e3;
    if (elapsed + l->predicted <= target) return go;
    /* Predicted to miss: what is ahead of it on the best choice has to
     * drain before it could be served in time. */
    double wait = waiting(l);
    if (wait < elapsed + l->predicted - target) wait = elapsed + l->predicted - target;
    l->wait_s = wait;
    PX_LOG(PX_LOG_DEBUG,
           "msg=\"predicted to miss its TTFT target\" predicted_ms=%.1f elapsed_ms=%.1f "
           "target_ms=%.1f wait_ms=%.1f miss=%s",
           l->predicted * 1e3, elapsed * 1e3, l->t.ttft_ms, wait * 1e3,
           px_slo_miss_name((px_slo_miss)l->t.miss));
    if (l->t.miss == PX_SLO_QUEUE && now + (uint64_t)(wait * 1e9) < deadline_ns) {
        l->waited = 1;
        return PX_LATV_WAIT;
    }
    l->refused = 1;
    return PX_LATV_REFUSE;
}

px_lat_verdict px_lat_req_refuse(px_lat_req *l) {
    l->refused = 1;
    return PX_LATV_REFUSE;
}

int px_lat_req_refusal(const px_lat_req *l, char *extra, size_t extra_cap, char *msg,
                       size_t msg_cap) {
    double w = l->wait_s;
    snprintf(extra, extra_cap, "Retry-After: %d\r\n", w < 1 ? 1 : w > 60 ? 60 : (int)(w + 0.999));
    snprintf(msg, msg_cap,
             "predicted time to first token %.0f ms misses the target of %.0f ms on every engine; "
             "retry later",
             l->predicted * 1e3, l->t.ttft_ms);
    return l->t.status == 429 ? 429 : 503;
}

int px_lat_req_ready(px_lat_req *l) {
    if (!l->c || !plan(l)) return 1;
    double elapsed = (double)(l->t_plan - l->t0) / 1e9, target = l->t.ttft_ms / 1e3;
    int ok = elapsed + l->predicted <= target || waiting(l) <= IDLE_SHARE * target;
    if (ok) l->released = 1;
    return ok;
}

void px_lat_req_prefer(const px_lat_req *l, int decode, px_pick *k) {
    if (!l->planned) return;
    if (!decode) {
        if (l->local || !l->plan.ok) return;
        k->prefer = l->plan.pkey;
        k->prefer_cached = l->plan.p_cached;
    } else if (l->local) {
        k->prefer = l->plan.lkey;
        k->prefer_cached = l->plan.l_cached;
    } else if (l->plan.ok) {
        /* It receives the prompt's KV and computes none of it: no load
         * charged (px_pool_pick charges the tokens it does not reuse). */
        k->prefer = l->plan.dkey;
        k->prefer_cached = k->ntok;
    }
}

void px_lat_req_answer(px_lat_req *l, const char *p, size_t n) {
    if (!l->planned && !(l->t.set & PX_SLO_HAS_TPOT)) return;
    unsigned k = 0;
    for (const char *s = p, *end = p + n; s < end;) {
        const char *d = memmem(s, (size_t)(end - s), "data: {", 7);
        if (!d) break;
        k++;
        s = d + 7;
    }
    if (!k) return;
    uint64_t now = px_now_ns();
    if (!l->events) l->t_ev0 = now;
    l->events += k;
    l->t_ev1 = now;
}

static uint64_t key_of(const char *name) {
    return px_hash64(name, strlen(name));
}

static double span(uint64_t a, uint64_t b) {
    return a && b && b >= a ? (double)(b - a) / 1e9 : -1;
}

/* The answer's samples: each fit only from the plan's own choice, sent
 * once, so that its x is what the plan saw. */
static void observe(px_lat_req *l, const px_lat_obs *o) {
    px_latmodel *m = l->c->lat;
    int ok = o->status >= 200 && o->status < 300 && o->t_first;
    if (!l->planned || !ok || o->tries_p > 1 || o->tries_d > 1 || !o->dname || !o->dname[0]) return;
    uint64_t dk = key_of(o->dname);
    double ttfb_d = span(o->t_dstart, o->t_first);
    if (l->local) {
        if (dk != l->plan.lkey || o->disagg) return;
        px_lat_observe(m, dk, o->dname, PX_LAT_LOCAL, l->plan.l_x, ttfb_d, o->now);
        px_lat_error(m, l->plan.local, span(l->t_plan, o->t_first));
    } else {
        if (!o->pname || !o->pname[0] || !o->disagg) return;
        uint64_t pk = key_of(o->pname);
        if (pk != l->plan.pkey || dk != l->plan.dkey) return;
        double pre = span(o->t_pstart, o->t_prefill);
        if (pre >= 0) px_lat_observe(m, pk, o->pname, PX_LAT_PREFILL, l->plan.p_x, pre, o->now);
        /* Serial only: with both legs at once decode's wait holds the
         * prefill too. */
        if (o->serial && ttfb_d >= 0) {
            double kv = o->kv_waited ? o->kv_wait_ms / 1e3 : 0;
            if (o->kv_waited)
                px_lat_observe_pair(m, pk, dk, o->pname, o->dname, (double)l->ntok, kv, o->now);
            /* What was left of decode's decode-only prompts when the KV
             * landed is predicted apart (the plan's backlog). */
            double held = l->plan.d_backlog - span(l->t_plan, o->t_dstart) - kv;
            double y = ttfb_d - kv - (held > 0 ? held : 0);
            px_lat_observe(m, dk, o->dname, PX_LAT_DECODE, l->plan.d_x, y > 0 ? y : 0, o->now);
        }
        px_lat_error(m, l->plan.ttft, span(l->t_plan, o->t_first));
    }
    if (l->events >= 2)
        px_lat_observe(m, dk, o->dname, PX_LAT_TPOT, l->local ? l->plan.ltp_x : l->plan.tp_x,
                       (double)(l->t_ev1 - l->t_ev0) / 1e9 / (l->events - 1), o->now);
}

static px_slo_result result_of(const px_lat_req *l, const px_lat_obs *o) {
    if (l->refused) return PX_SLO_REFUSED;
    if (o->status < 200 || o->status >= 300 || !o->t_first) return PX_SLO_FAILED;
    if ((l->t.set & PX_SLO_HAS_TTFT) && span(o->t0, o->t_first) > l->t.ttft_ms / 1e3)
        return PX_SLO_MISSED;
    if ((l->t.set & PX_SLO_HAS_TPOT) && l->events >= 2 &&
        (double)(l->t_ev1 - l->t_ev0) / 1e9 / (l->events - 1) > l->t.tpot_ms / 1e3)
        return PX_SLO_MISSED;
    return PX_SLO_MET;
}

void px_lat_req_finish(px_lat_req *l, px_ctx *c, const char *pool, const px_lat_obs *o) {
    if (l->c && l->c->lat) observe(l, o);
    if (!l->resolved) { /* ended before routing: the headers' targets only */
        if (l->hdr_ttft_ms > 0) l->t.set |= PX_SLO_HAS_TTFT, l->t.ttft_ms = l->hdr_ttft_ms;
        if (l->hdr_tpot_ms > 0) l->t.set |= PX_SLO_HAS_TPOT, l->t.tpot_ms = l->hdr_tpot_ms;
    }
    if (!(l->t.set & (PX_SLO_HAS_TTFT | PX_SLO_HAS_TPOT))) return;
    l->result = result_of(l, o) + 1;
    px_slo_count(c->slo, pool, l->cls, l->cls_name, (px_slo_result)(l->result - 1));
}

void px_lat_req_report(const px_lat_req *l, double *target_ms, double *tpot_ms, double *pred_ms,
                       const char **result) {
    *target_ms = l->t.set & PX_SLO_HAS_TTFT ? l->t.ttft_ms : 0;
    *tpot_ms = l->t.set & PX_SLO_HAS_TPOT ? l->t.tpot_ms : 0;
    *pred_ms = l->planned ? l->predicted * 1e3 : -1;
    *result = l->result ? px_slo_result_name((px_slo_result)(l->result - 1)) : NULL;
}
