/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/reqlog.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/json.h"
#include "base/log.h"
#include "proxy/access.h"
#include "proxy/dispatch.h"
#include "proxy/otlp.h"
#include "proxy/trace.h"

static const char *const outcome_names[PX_RO_COUNT] = {"ok",
                                                       "error",
                                                       "stream_failed",
                                                       "client_disconnected",
                                                       "model_not_found",
                                                       "prefill_rejected",
                                                       "stopped",
                                                       "refused"};

const char *px_req_outcome_name(px_req_outcome o) {
    return o < PX_RO_COUNT ? outcome_names[o] : "unknown";
}

static double secs(uint64_t from, uint64_t to) {
    return from && to ? (double)(to - from) / 1e9 : -1;
}

/* One trace for the request: the client's when it sent exactly one valid
 * traceparent, else a new one; the legs get child spans of it. */
static void start_trace(px_reqlog *lg, const px_http_head *h) {
    const px_http_header *tp = NULL;
    int ntp = 0;
    for (size_t i = 0; i < h->nheaders; i++)
        if (px_http_token_eq(h->headers[i].name, h->headers[i].name_len, "traceparent")) {
            tp = &h->headers[i];
            ntp++;
        }
    lg->traced =
        ntp == 1 && px_trace_parse(tp->value, tp->value_len, lg->trace_id, lg->trace_flags);
    if (!lg->traced) {
        px_trace_new(lg->trace_id);
        memcpy(lg->trace_flags, "01", 3);
    } else {
        memcpy(lg->parent_span, tp->value + 36, 16);
    }
    px_otlp_sample(lg->trace_id, lg->traced ? lg->trace_flags : NULL, lg->trace_flags);
    px_trace_span_new(lg->span_root);
}

void px_reqlog_start(px_reqlog *lg, px_conn *c, px_endpoint ep, const px_http_head *h,
                     char **target) {
    px_conn_peer(c, lg->client, sizeof lg->client);
    lg->ep = ep;
    lg->t0 = px_now_ns();
    lg->disp = -1;
    if (px_endpoint_passthrough(ep)) {
        /* The client's method, path and query as it sent them (an
         * absolute-form target loses its scheme and authority). */
        px_strncpyz(lg->method, sizeof lg->method, h->method, h->method_len);
        const char *path;
        size_t plen;
        px_http_path(h, &path, &plen);
        *target = px_xstrndup(path, (size_t)(h->target + h->target_len - path));
        char pbuf[256];
        snprintf(pbuf, sizeof pbuf, "%.*s", (int)(plen < 200 ? plen : 200), path);
        px_log_value(pbuf, lg->lpath, sizeof lg->lpath);
    } else {
        const char *m = ep == PX_EP_MODELS ? "GET" : "POST";
        px_strncpyz(lg->method, sizeof lg->method, m, strlen(m));
        px_strncpyz(lg->lpath, sizeof lg->lpath, px_endpoints[ep].path,
                    strlen(px_endpoints[ep].path));
    }
    lg->target = *target;
    px_http_request_id(h, lg->id);
    px_log_value(lg->id, lg->lid, sizeof lg->lid);
    start_trace(lg, h);
}

void px_reqlog_decided(px_reqlog *lg, px_metrics *m, px_decision d) {
    lg->decided = 1;
    lg->decision = d;
    px_m_inc(&m->decisions[d]);
}

void px_reqlog_fell_back(px_reqlog *lg, px_metrics *m, px_fallback why) {
    lg->fell_back = 1;
    lg->fallback = why;
    px_m_inc(&m->fallbacks[why]);
}

void px_reqlog_dispatched(px_reqlog *lg, px_metrics *m, int kind) {
    lg->disp = kind;
    px_m_inc(&m->dispatch[kind]);
}

void px_reqlog_answer(px_reqlog *lg, px_metrics *m, px_leg *dec, const char *ctype) {
    lg->t_first = px_now_ns();
    char w[32], *end;
    if (px_leg_header(dec, "x-kv-wait-ms", w, sizeof w)) {
        double ms = strtod(w, &end);
        if (end != w && ms >= 0 && ms < 1e9) {
            lg->kv_waited = 1;
            lg->kv_wait_ms = ms;
            px_hist_observe(&m->kv_wait, ms / 1e3);
        }
    }
    lg->streamed = ctype && !strncasecmp(ctype, "text/event-stream", 17);
}

/* What the end adds to the record. */
typedef struct end {
    int status;
    px_req_outcome outcome;
    const char *state;  /* the request's state when it ended */
    const px_buf *body; /* the body last held, for the model's name */
    /* Its latency targets, prediction and result (px_lat_req_report),
     * read once for the access line and the spans. */
    double slo_t, slo_p, pred;
    const char *slo;
} end;

/* The end of the request whose record is lg: its latency report read. */
static end end_of(const px_reqlog *lg, int status, px_req_outcome outcome, const char *state,
                  const px_buf *body) {
    end e = {status, outcome, state, body, 0, 0, -1, NULL};
    if (lg->lat) px_lat_req_report(lg->lat, &e.slo_t, &e.slo_p, &e.pred, &e.slo);
    return e;
}

/* The one access-line writer: what the request does not know yet (no
 * backend, no answer, no decision) is left out of the line. */
static void write_access(const px_reqlog *lg, const end *e, uint64_t now) {
    const px_leg *pre = lg->pre, *dec = lg->dec;
    px_access a = {.slo_ttft_ms = e->slo_t,
                   .slo_tpot_ms = e->slo_p,
                   .predicted = e->pred >= 0,
                   .pred_ttft_ms = e->pred,
                   .slo = e->slo,
                   .req = lg->lid,
                   .client = lg->client,
                   .method = lg->method,
                   .endpoint = lg->lpath,
                   .prefill = pre && pre->name[0] ? pre->name : NULL,
                   .decode = dec && dec->name[0] ? dec->name : NULL,
                   .status = e->status,
                   .prefill_ms = pre && pre->t_end ? secs(lg->t0, pre->t_end) * 1e3 : -1.0,
                   .ttfb_ms = lg->t_first ? secs(lg->t0, lg->t_first) * 1e3 : -1.0,
                   .total_ms = secs(lg->t0, now) * 1e3,
                   .bytes_out = lg->bytes_out,
                   .outcome = px_req_outcome_name(e->outcome),
                   .state = e->state,
                   .trace_id = lg->trace_id,
                   /* A fallback overrides the decision made before prefill failed. */
                   .decision = lg->fell_back ? "decode_only"
                               : lg->decided ? px_decision_name(lg->decision)
                                             : NULL,
                   .decision_reason = lg->fell_back ? px_fallback_name(lg->fallback)
                                      : lg->decided ? px_decision_reason(lg->decision)
                                                    : NULL,
                   .fallback = lg->fell_back ? px_fallback_name(lg->fallback) : NULL,
                   .dispatch =
                       lg->disp >= 0 ? px_dispatch_kind_mode((px_dispatch_kind)lg->disp) : NULL,
                   .kv_waited = lg->kv_waited,
                   .kv_wait_ms = lg->kv_wait_ms,
                   .estimated = lg->dis && lg->dis->estimated,
                   .prompt_tokens_est = lg->dis ? lg->dis->tokens : 0,
                   .uncached_tokens_est = lg->dis ? lg->dis->uncached : 0,
                   .queued = lg->adm && lg->adm->t_enq != 0,
                   .queue_ms = lg->adm ? (double)lg->adm->wait_ns / 1e6 : 0};
    px_access_write(&a);
}

/* The request's spans for trace export (otlp.h). */
static void submit_spans(const px_reqlog *lg, const end *e, uint64_t now) {
    /* url.path: the client's path without its query (passed-through
     * requests), else the endpoint's; the model for the GenAI attributes. */
    px_endpoint ep = lg->ep;
    const char *ep_path = px_endpoints[ep].path;
    const char *path = lg->target ? lg->target : ep_path ? ep_path : "";
    size_t plen = strcspn(path, "?");
    const char *op = ep == PX_EP_COMPLETIONS || ep == PX_EP_GENERATE ? "text_completion"
                     : ep == PX_EP_CHAT || ep == PX_EP_MESSAGES || ep == PX_EP_RESPONSES ? "chat"
                                                                                         : NULL;
    px_json_member mm;
    const px_buf *body = e->body;
    int has_model = op && body && body->data && px_json_find(body->data, body->len, "model", &mm) &&
                    mm.type == PX_JSON_STRING && mm.val_len >= 2;
    const px_leg *pre = lg->pre, *dec = lg->dec;
    px_otlp_req q = {.slo_ttft_ms = e->slo_t,
                     .slo_tpot_ms = e->slo_p,
                     .predicted = e->pred >= 0,
                     .pred_ttft_ms = e->pred,
                     .slo = e->slo,
                     .trace_id = lg->trace_id,
                     .flags = lg->trace_flags,
                     .parent_span = lg->parent_span[0] ? lg->parent_span : NULL,
                     .span_root = lg->span_root,
                     .span_prefill = pre->span,
                     .span_decode = dec->span,
                     .method = lg->method,
                     .route = ep_path ? ep_path : "passthrough",
                     .request_id = lg->id,
                     .outcome = px_req_outcome_name(e->outcome),
                     .status = e->status,
                     .t_start = lg->t0,
                     .t_end = now,
                     .prefill = pre->name[0] ? pre->name : NULL,
                     .prefill_status = pre->status,
                     .prefill_attempts = (int)pre->ntried,
                     .t_prefill_start = pre->t_start,
                     .t_prefill_end = pre->t_end,
                     .decode = dec->name[0] ? dec->name : NULL,
                     .decode_status = dec->status,
                     .decode_attempts = (int)dec->ntried,
                     .streamed = lg->streamed,
                     .queued = lg->adm->t_enq != 0,
                     .queue_wait_ns = lg->adm->wait_ns,
                     .t_decode_start = dec->t_start,
                     .presp = pre->resp.data,
                     .presp_len = pre->resp.len,
                     .scheme = lg->https ? "https" : "http",
                     .path = path,
                     .path_len = plen,
                     .templated = ep_path != NULL && ep != PX_EP_PASSTHROUGH,
                     .prefill_https = pre->https,
                     .decode_https = dec->https,
                     .operation = op,
                     .model = has_model ? mm.val + 1 : NULL,
                     .model_len = has_model ? mm.val_len - 2 : 0};
    px_otlp_submit(&q);
}

void px_reqlog_sources(px_reqlog *lg, const px_leg *pre, const px_leg *dec, const px_disagg *dis,
                       const px_adm_req *adm, const px_config *cfg) {
    lg->pre = pre;
    lg->dec = dec;
    lg->dis = dis;
    lg->adm = adm;
    lg->https = cfg->tls_cert && cfg->tls_cert[0];
}

void px_reqlog_latency(const px_reqlog *lg, px_lat_req *lat, px_ctx *ctx, const char *pool,
                       int status, int disagg) {
    const px_leg *p = lg->pre, *d = lg->dec;
    px_lat_obs o = {.status = status,
                    .t0 = lg->t0,
                    .t_pstart = p->t_start,
                    .t_prefill = p->t_end,
                    .t_dstart = d->t_start,
                    .t_first = lg->t_first,
                    .now = px_now_ns(),
                    .kv_waited = lg->kv_waited,
                    .kv_wait_ms = lg->kv_wait_ms,
                    .pname = p->name,
                    .dname = d->name,
                    .disagg = disagg,
                    .serial = lg->disp == PX_DISP_SERIAL,
                    .tries_p = p->ntried,
                    .tries_d = d->ntried};
    px_lat_req_finish(lat, ctx, pool, &o);
}

void px_reqlog_finish(const px_reqlog *lg, px_metrics *m, int status, px_req_outcome outcome,
                      const char *state, const px_buf *body) {
    uint64_t now = px_now_ns();
    const end ended = end_of(lg, status, outcome, state, body), *e = &ended;
    px_metrics_count(m, lg->ep, e->status);
    px_hist_observe(&m->duration, secs(lg->t0, now));
    if (lg->t_first) px_hist_observe(&m->ttfb[lg->streamed], secs(lg->t0, lg->t_first));
    write_access(lg, e, now);
    if (px_otlp_enabled()) submit_spans(lg, e, now);
}

int px_reqlog_traced(void) {
    return px_otlp_enabled();
}

/* A refused request is a record that knows only its id, path, method and
 * client. Its id is the client's X-Request-Id or a fresh one, echoed in
 * the answer as for every other request. */
void px_reqlog_refuse(px_conn *c, const px_http_head *h, const char *endpoint, int status,
                      const char *extra, const char *msg) {
    px_reqlog v = {.disp = -1};
    char id[129], m[20];
    if (!px_http_request_id(h, id)) px_uuid4(id);
    px_log_value(id, v.lid, sizeof v.lid);
    snprintf(v.lpath, sizeof v.lpath, "%s", endpoint);
    snprintf(m, sizeof m, "%.*s", (int)(h->method_len < 16 ? h->method_len : 16), h->method);
    px_log_value(m, v.method, sizeof v.method);
    px_conn_peer(c, v.client, sizeof v.client);
    v.bytes_out = px_conn_reply_error(c, status, id, extra, msg);
    end e = end_of(&v, status, PX_RO_REFUSED, NULL, NULL);
    write_access(&v, &e, px_now_ns());
}
