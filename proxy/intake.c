/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/intake.h"

#include <arpa/inet.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "base/log.h"
#include "proxy/disagg.h"
#include "proxy/kvindex.h"
#include "proxy/tokenize.h"
#include "proxy/trace.h"

void px_intake_announce(void) {
    /* vLLM took kv_transfer_params on ResponsesRequest and returns them in
     * ResponsesResponse since PR #37424; the token-in generate endpoint
     * (GenerateRequest/GenerateResponse) always has. */
    PX_LOG(PX_LOG_INFO, "msg=\"/v1/responses, /v1/messages and /inference/v1/generate are "
                        "disaggregated like chat: vLLM accepts kv_transfer_params there\" "
                        "decision=disaggregated");
}

void px_intake_init(px_intake *in, px_wctx *w, px_gen *g, px_endpoint ep, const px_buf *body) {
    memset(in, 0, sizeof *in);
    in->w = w;
    in->ctx = w->ctx;
    in->g = g;
    in->ep = ep;
    in->body = body;
    in->ps = &g->ps[0];
}

void px_intake_body_gone(px_intake *in) {
    in->key = NULL;
    in->bx.ok = 0;
}

void px_intake_cleanup(px_intake *in) {
    px_backend_release(in->hb);
    in->hb = NULL;
    free(in->tok);
    in->tok = NULL;
}

void px_verdict_cleanup(px_verdict *v) {
    px_buf_cleanup(&v->body);
}

static int refuse(px_verdict *v, int status, const char *extra, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int refuse(px_verdict *v, int status, const char *extra, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v->msg, sizeof v->msg, fmt, ap);
    va_end(ap);
    v->status = status;
    v->extra = extra;
    return -1;
}

/* Named pools: the body's model chooses the pool; an unknown one gets
 * OpenAI's 404 model_not_found. */
static int choose_pool(px_intake *in, const char *lid, px_verdict *v) {
    if (!in->g->named) return 0;
    px_json_member m;
    char model[512];
    long n = -1;
    int str = px_body_idx_get(&in->bx, PX_BK_MODEL, in->body->data, in->body->len, &m) &&
              m.val_len >= 2 && m.val[0] == '"';
    if (str) n = px_json_str_decode(m.val + 1, m.val_len - 2, model, sizeof model);
    if (n < 0 && str && m.val_len >= sizeof model)
        return refuse(v, 400, NULL,
                      "the request's model name is longer than %zu bytes: no pool serves it",
                      sizeof model - 1);
    if (n < 0)
        return refuse(v, 400, NULL, "the request names no model (a string \"model\" member)");
    in->ps = px_gen_find(in->g, model, (size_t)n);
    if (in->ps) return 0;
    in->ps = &in->g->ps[0];
    px_intake_model_not_found(&v->body, model, (size_t)n);
    char q[600];
    PX_LOG(PX_LOG_INFO, "req=%s msg=\"unknown model\" model=%s status=404", lid,
           px_log_value(model, q, sizeof q));
    v->status = 404;
    return -1;
}

void px_intake_model_not_found(px_buf *b, const char *model, size_t n) {
    px_buf msg;
    px_buf_init(&msg);
    px_buf_printf(&msg, "The model `%.*s` does not exist.", (int)(n > 200 ? 200 : n), model);
    px_buf_appends(b, "{\"error\":{\"message\":");
    px_buf_append_json_str(b, msg.data, msg.len);
    px_buf_appends(b, ",\"type\":\"invalid_request_error\",\"param\":\"model\","
                      "\"code\":\"model_not_found\"}}");
    px_buf_cleanup(&msg);
}

/* --prefiller-from-header (llm-d's routing sidecar): x-prefiller-host-port
 * names the prefill, host:port; of several (header lines, or one line of
 * comma-separated values) the first counts; without it, decode alone. Its
 * host must be in --prefiller-allowlist, or the request is refused before
 * any backend sees it. */
static int sidecar_prefill(px_intake *in, const px_http_head *h, const char *lid, px_verdict *v) {
    if (!in->ctx->cfg->prefiller_from_header) return 0;
    const px_http_header *x = px_http_find(h, "x-prefiller-host-port");
    const char *s = x ? x->value : "";
    size_t n = x ? x->value_len : 0;
    size_t l = 0;
    while (l < n && s[l] == ' ')
        s++, n--;
    while (l < n && s[l] != ',')
        l++;
    while (l && s[l - 1] == ' ')
        l--;
    if (!l) {
        in->no_prefill = 1;
        return 0;
    }
    char hp[300], host[260];
    int port = 0;
    char url[320];
    if (l >= sizeof hp) goto bad;
    memcpy(hp, s, l);
    hp[l] = '\0';
    snprintf(url, sizeof url, "http://%s", hp);
    int https;
    if (!strrchr(hp, ':') || (hp[0] == '[' && !strstr(hp, "]:")) ||
        px_url_split(url, host, sizeof host, &port, &https) < 0 || port < 1)
        goto bad;
    if (!px_target_allowed(&in->ctx->cfg->prefiller_allowlist, host, port)) {
        char q[700];
        PX_LOG(PX_LOG_WARN,
               "req=%s msg=\"x-prefiller-host-port outside --prefiller-allowlist: refused\" "
               "target=%s",
               lid, px_log_value(hp, q, sizeof q));
        return refuse(v, 400, NULL, "x-prefiller-host-port '%s' is not an allowed prefill target",
                      hp);
    }
    /* A configured prefill of that address keeps its health and counters. */
    size_t nm;
    px_backend **m = px_pool_members(&in->ps->prefill, &nm);
    for (size_t i = 0; i < nm; i++) {
        if (!in->hb && !strcmp(m[i]->name, hp))
            in->hb = m[i];
        else
            px_backend_release(m[i]);
    }
    free(m);
    if (!in->hb) {
        /* A name would be resolved here, blocking this worker's loop on
         * DNS: only an address (what an endpoint picker sends: the pod's)
         * or a configured prefill is taken. */
        unsigned char a[sizeof(struct in6_addr)];
        if (inet_pton(AF_INET, host, a) != 1 && inet_pton(AF_INET6, host, a) != 1)
            return refuse(v, 400, NULL,
                          "x-prefiller-host-port '%s': give the prefill's IP address (names are "
                          "taken only for prefills configured with --prefill)",
                          hp);
        in->hb = px_backend_create(url);
    }
    if (!in->hb) goto bad;
    return 0;
bad:
    return refuse(v, 400, NULL, "x-prefiller-host-port must be host:port");
}

int px_intake_admit(px_intake *in, const px_http_head *h, int *counted, px_verdict *v) {
    long max = in->ctx->cfg->max_inflight;
    long now = atomic_fetch_add(&in->ctx->inflight, 1) + 1;
    *counted = 1;
    if (max > 0 && now > max)
        return refuse(v, 503, "Retry-After: 1\r\n",
                      "too many requests in flight (--max-inflight %ld)", max);
    if (px_http_via_count(h) > in->ctx->cfg->loop_limit)
        return refuse(v, 508, NULL,
                      "loop detected: the request passed through this proxy %d times already "
                      "(--loop-limit %lld); a backend leads back to it",
                      px_http_via_count(h), (long long)in->ctx->cfg->loop_limit);
    return 0;
}

int px_intake_room(px_intake *in, int64_t *held, px_verdict *v) {
    int64_t need = (int64_t)in->body->len + 512;
    if (!px_budget_try(&in->ctx->shared, need)) {
        atomic_fetch_add_explicit(&in->ctx->shared.budget_rejected, 1, memory_order_relaxed);
        return refuse(v, 503, "Retry-After: 1\r\n",
                      "request refused: the proxy's memory budget for buffered bodies "
                      "(--max-buffered-bytes) is spent; retry later");
    }
    *held += need;
    return 0;
}

int px_intake_pd(px_intake *in, const px_http_head *h, const char *lid, px_verdict *v) {
    const px_buf *body = in->body;
    char err[128];
    /* One pass validates the body and finds the members read later; only
     * a bad body is scanned again, for the reason. */
    if (px_body_idx_build(&in->bx, body->data, body->len) < 0) {
        if (px_json_validate(body->data ? body->data : "", body->len, err, sizeof err) ==
            PX_JSON_INVALID)
            return refuse(v, 400, NULL, "request body is not valid JSON: %s", err);
        return refuse(v, 400, NULL, "request body must be a JSON object");
    }
    if (choose_pool(in, lid, v) < 0 || sidecar_prefill(in, h, lid, v) < 0) return -1;
    /* A prefill without a decode to hand its blocks to would strand them
     * until they expire: refuse before starting one. */
    const char *why;
    if (!px_pset_ready(in->ps, 1, &why)) /* 1: decode's side alone */
        return refuse(v, 503, "Retry-After: 1\r\n",
                      "no decode backend can take the request (%s%s%s%s); no prefill was started",
                      why, in->g->named ? " in pool '" : "", in->g->named ? in->ps->name : "",
                      in->g->named ? "'" : "");
    /* The session key comes from the client's head, which admission's
     * queue does not keep. */
    const px_config *cfg = in->ctx->cfg;
    const px_http_header *sh =
        cfg->session_header[0] && in->ctx->sessions ? px_http_find(h, cfg->session_header) : NULL;
    px_json_member user;
    if (sh && sh->value_len)
        in->session = px_hash64_seed(sh->value, sh->value_len, 1);
    else if (in->ctx->sessions &&
             px_body_idx_get(&in->bx, PX_BK_USER, body->data, body->len, &user) &&
             user.type == PX_JSON_STRING && user.val_len > 2)
        in->session = px_hash64_seed(user.val, user.val_len, 2);
    return 0;
}

int px_intake_prompt(px_intake *in) {
    /* One look at the prompt gives prefix_affinity its key and kv_aware
     * its token ids. */
    px_json_member pm;
    int has = px_body_idx_get(&in->bx, px_disagg_prompt_key(in->ep), in->body->data,
                              in->body->len, &pm);
    const px_pool_cfg *pc = &in->ps->prefill.cfg;
    px_policy pp = pc->policy;
    if (has && (pp == PX_POLICY_PREFIX_AFFINITY || pp == PX_POLICY_PREFIX_AFFINITY_BYTES)) {
        in->key = pm.val;
        in->key_len = pp == PX_POLICY_PREFIX_AFFINITY_BYTES && pm.val_len > pc->prefix_bytes
                          ? pc->prefix_bytes
                          : pm.val_len;
    }
    int kva = pp == PX_POLICY_KV_AWARE || in->ps->decode.cfg.policy == PX_POLICY_KV_AWARE ||
              px_lat_pool(in->ps);
    if (has && (kva || in->ctx->kvindex) && !in->tok)
        in->ntok = px_disagg_prompt_ids(in->ep, &pm, 1u << 20, &in->tok);
    return kva;
}

void px_intake_token_key(px_intake *in) {
    int kva = in->ps->prefill.cfg.policy == PX_POLICY_KV_AWARE ||
              in->ps->decode.cfg.policy == PX_POLICY_KV_AWARE || px_lat_pool(in->ps);
    if (kva && !in->key && in->tok) {
        in->key = (const char *)in->tok;
        in->key_len = in->ntok * sizeof *in->tok;
    }
}

uint64_t px_intake_kv_extra(const px_intake *in) {
    px_json_member m;
    const px_buf *body = in->body;
    if (!in->ctx->kvindex || !body->data ||
        !px_body_idx_get(&in->bx, PX_BK_MODEL, body->data, body->len, &m) ||
        m.type != PX_JSON_STRING || m.val_len < 2)
        return 0;
    return px_kvindex_request_extra(in->ctx->kvindex, m.val + 1, m.val_len - 2);
}

px_lat_verdict px_intake_lat_route(const px_intake *in, px_lat_req *lat, size_t tenant, uint64_t t0,
                                   uint64_t deadline_ns) {
    /* Without a latency pool only the targets are resolved: the prompt's
     * size and model are not looked for. */
    if (!px_lat_pool(in->ps) || !in->ctx->lat)
        return px_lat_req_route(lat, in->ctx, in->ps, tenant, NULL, 0, 0, t0, deadline_ns);
    long est =
        in->tok ? 0 : px_disagg_estimate(in->ctx->cfg, in->ep, in->body->data, in->body->len);
    return px_lat_req_route(lat, in->ctx, in->ps, tenant, in->tok,
                            in->tok ? in->ntok : (size_t)(est > 0 ? est : 0),
                            px_intake_kv_extra(in), t0, deadline_ns);
}

long px_intake_kv_cached(const px_intake *in, const char *name) {
    px_kvindex *kv = in->ctx->kvindex;
    int slot = kv && in->tok ? px_kvindex_slot(kv, name, 0) : -1;
    size_t bs = px_kvindex_block_size(kv, slot);
    if (slot < 0 || !bs) return -1;
    size_t cap = in->ntok / bs + 1;
    uint64_t *keys = px_xmalloc(cap * sizeof *keys);
    size_t nk =
        px_kv_salted_keys(in->tok, in->ntok, bs, px_intake_kv_extra(in), in->salt, keys, cap);
    size_t cached = px_kv_reusable(px_kvindex_match(kv, slot, keys, nk), bs, in->ntok);
    free(keys);
    return (long)cached;
}

px_pick px_intake_pick(const px_intake *in, px_pool *p, px_pick k) {
    if (p == &in->ps->decode && in->session) { /* a conversation stays on its decode */
        k.sessions = in->ctx->sessions;
        k.session = in->session;
    }
    if (p->cfg.policy != PX_POLICY_KV_AWARE && p->cfg.policy != PX_POLICY_LATENCY) return k;
    k.kv = in->ctx->kvindex;
    k.tok = in->tok;
    k.ntok = in->ntok;
    k.kv_extra = px_intake_kv_extra(in);
    k.kv_salt = in->salt;
    /* Tokens unknown (the engine's /tokenize did not answer in time): no
     * cache to match, but the engine chosen computes the whole prompt, and
     * the load others see must say so. */
    if (!in->tok) {
        long est = px_disagg_estimate(in->ctx->cfg, in->ep, in->body->data, in->body->len);
        k.ntok = est > 0 ? (size_t)est : 0;
    }
    if (in->lat) px_lat_req_prefer(in->lat, p == &in->ps->decode, &k);
    return k;
}

void px_intake_headers(const px_ctx *ctx, px_endpoint ep, const px_http_head *h, const char *id,
                       const char *trace_id, const char *flags, int traced, const char *span,
                       px_buf *l) {
    if (px_endpoint_passthrough(ep)) {
        for (size_t i = 0; i < h->nheaders; i++)
            if (px_http_forwarded_header(&h->headers[i])) {
                px_buf_append(l, h->headers[i].name, h->headers[i].name_len);
                px_buf_append(l, ": ", 2);
                px_buf_append(l, h->headers[i].value, h->headers[i].value_len);
                px_buf_append(l, "\r\n", 2);
            }
    } else if (ep != PX_EP_MODELS) {
        px_buf_appends(l, "Content-Type: application/json\r\n");
    }
    px_http_via_append(h, l); /* loops through proxies end in 508 (px_req_start) */
    /* Appended piece by piece, no printf: built twice per request. */
    px_buf_appends(l, "X-Request-Id: ");
    px_buf_appends(l, id);
    px_buf_append(l, "\r\n", 2);
    const px_http_header *auth = px_http_find(h, "authorization");
    if (ctx->upstream_auth_forced || !auth) {
        if (ctx->upstream_auth) {
            px_buf_appends(l, ctx->upstream_auth);
            px_buf_append(l, "\r\n", 2);
        }
    } else {
        px_buf_appends(l, "Authorization: ");
        px_buf_append(l, auth->value, auth->value_len);
        px_buf_append(l, "\r\n", 2);
    }
    char child[56];
    px_trace_child(trace_id, span, flags, child);
    px_buf_appends(l, "traceparent: ");
    px_buf_appends(l, child);
    px_buf_append(l, "\r\n", 2);
    /* tracestate belongs to the client's trace: dropped when that was
     * unusable and a new trace started. */
    const px_http_header *ts = traced ? px_http_find(h, "tracestate") : NULL;
    if (ts && ts->value_len <= 512)
        px_buf_printf(l, "tracestate: %.*s\r\n", (int)ts->value_len, ts->value);
}

int px_intake_tokens(px_intake *in, int kva, px_buf *body) {
    const px_config *cfg = in->ctx->cfg;
    px_wctx *w = in->w;
    if (in->tok || cfg->tokenize_timeout <= 0 ||
        !(kva || (in->ctx->kvindex && cfg->disagg_min_tokens > 0)))
        return 0;
    int k = px_tokenize_lookup(&w->tokcache, (size_t)cfg->tokenize_cache_entries, in->ep,
                               in->body->data, in->body->len, body, &in->tkey, &in->tok, &in->ntok);
    if (k > 0) px_m_inc(&w->metrics.tokenize[PX_TOK_CACHED]);
    if (k != 0) px_buf_cleanup(body);
    return k == 0;
}

int px_intake_tokens_ask(px_intake *in, px_leg *t, const px_buf *hdrs) {
    /* Any healthy engine of the pool tokenizes alike: the one the prompt's
     * key names, so that its answers stay warm in one place. */
    px_pset *ps = in->ps;
    if (px_leg_pick_any(t, px_pool_usable(&ps->prefill) ? &ps->prefill : &ps->decode, in->tkey)) {
        t->max_resp = PX_TOKENIZE_MAX_ANSWER;
        if (px_leg_send(t, "POST", "/tokenize", &t->body, hdrs, in->ctx->cfg->tokenize_timeout) ==
            0)
            return 1;
        px_leg_done(t, PX_OUT_CANCELLED);
    }
    px_m_inc(&in->w->metrics.tokenize[PX_TOK_ERROR]);
    px_buf_cleanup(&t->body);
    return 0;
}

void px_intake_tokens_done(px_intake *in, px_leg *t, px_up_result rc, const char *why,
                           const char *lid) {
    px_tokresult res =
        px_tokenize_answer(t->w->tokcache, in->tkey, rc == PX_UP_OK, rc == PX_UP_TIMEOUT, t->status,
                           &t->resp, &in->tok, &in->ntok);
    px_m_inc(&t->w->metrics.tokenize[res]);
    if (res != PX_TOK_OK)
        PX_LOG(PX_LOG_DEBUG,
               "req=%s msg=\"no exact tokens: the byte estimate stands\" engine=%s "
               "status=%d result=%s",
               lid, t->name, t->status, why);
    px_leg_done(t, PX_OUT_OK);
    px_buf_cleanup(&t->body);
    px_buf_cleanup(&t->resp);
}

int px_intake_decide(px_intake *in, px_leg *dec, px_disagg *dis) {
    const px_config *cfg = in->ctx->cfg;
    px_wctx *w = in->w;
    if (cfg->disagg_min_tokens > 0) {
        size_t nd;
        px_pick k = {.key = in->key, .key_len = in->key_len};
        px_leg_pick(dec, px_intake_pick(in, dec->pool, k), &nd);
        if (!w->pindex) w->pindex = px_pindex_create((size_t)cfg->disagg_index_blocks);
    }
    px_backend *db = dec->b;
    px_disagg_decide(cfg, in->ep, in->body->data, in->body->len, w->pindex,
                     db ? &db->key_hash : NULL, dis);
    /* The engine's own KV events know what it holds: the exact remainder. */
    long cached = db ? px_intake_kv_cached(in, db->name) : -1;
    if (cached >= 0) px_disagg_exact(cfg, (long)in->ntok, cached, dis);
    /* Through a prefill, the decode receives the prompt's KV and computes
     * none of it: not load in kv_aware's tokens. */
    if (dis->disagg) px_leg_uncharge(dec);
    int disagg = dis->disagg;
    if (in->no_prefill) { /* sidecar without the header: decode alone, said so */
        disagg = 0;
        dis->decision = PX_DEC_NO_HEADER;
    }
    if (disagg && !in->hb && cfg->fallback_decode_only && px_pool_usable(&in->ps->prefill) == 0) {
        disagg = 0;
        dis->decision = PX_DEC_NO_PREFILL;
    }
    return disagg;
}

void px_intake_worker_cleanup(px_wctx *w) {
    px_pindex_destroy(w->pindex);
    px_tokcache_destroy(w->tokcache);
    w->tokcache = NULL;
    w->pindex = NULL;
}
