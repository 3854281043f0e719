/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/metrics.h"

const double px_hist_bounds[PX_HIST_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                0.5,   1,      2.5,   5,    10,    30,   60,  300};
static const char *const dec_reasons[PX_DEC_COUNT] = {
    "always", "long_prompt", "short_prompt", "cached_prefix", "no_healthy_prefill", "endpoint",
    "no_prefiller_header", "predicted_faster"};
const char *const px_tokresult_names[PX_TOK_COUNT] = {"ok", "cached", "timeout", "error"};

static const char *const fb_names[PX_FB_COUNT] = {"no_healthy_prefill", "prefill_5xx",
                                                  "prefill_connection_error", "kv_load_failed",
                                                  "concurrent_prefill_failed"};

const char *px_decision_name(px_decision d) {
    return d <= PX_DEC_LONG_PROMPT ? "disaggregated" : "decode_only";
}

const char *px_decision_reason(px_decision d) {
    return dec_reasons[d];
}

const char *px_fallback_name(px_fallback f) {
    return fb_names[f];
}

void px_metrics_count(px_metrics *m, px_endpoint ep, int status) {
    if (status < 100 || status > 599) status = 599;
    px_m_inc(&m->requests[ep][status - 100]);
}

void px_hist_observe(px_hist *h, double seconds) {
    int i = 0;
    while (i < PX_HIST_BUCKETS && seconds > px_hist_bounds[i])
        i++;
    if (i < PX_HIST_BUCKETS) px_m_inc(&h->bucket[i]);
    px_m_inc(&h->count);
    atomic_store_explicit(&h->sum_us,
                          atomic_load_explicit(&h->sum_us, memory_order_relaxed) +
                              (unsigned long long)(seconds * 1e6),
                          memory_order_relaxed);
}

static const char *const adm_names[PX_ADM_M_COUNT] = {
    "queued", "dispatched", "queue_full", "queue_timeout", "client_left",
    "rate_limited_requests", "rate_limited_tokens", "engine_full", "woken", "requeued",
    "tenant_header_refused", "no_wait"};

const char *px_adm_event_name(px_adm_event e) {
    return adm_names[e];
}
