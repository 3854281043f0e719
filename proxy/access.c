/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/access.h"

#include <stdio.h>

#include "base/log.h"

int px_access_enabled = 1;

void px_access_write(const px_access *a) {
    if (!px_access_enabled) return;
    char line[1024], v1[300], v2[300];
    size_t o = 0;
#define ADD(...)                                                                                   \
    do {                                                                                           \
        int k_ = snprintf(line + o, sizeof line - o, __VA_ARGS__);                                 \
        if (k_ > 0) o = o + (size_t)k_ < sizeof line ? o + (size_t)k_ : sizeof line - 1;           \
    } while (0)
    ADD("req=%s msg=\"request\"", a->req);
    if (a->method && a->method[0]) ADD(" method=%s", a->method);
    ADD(" endpoint=%s", a->endpoint);
    if (a->client && a->client[0]) ADD(" client=%s", a->client);
    if (a->prefill) ADD(" prefill=%s", px_log_value(a->prefill, v1, sizeof v1));
    if (a->decode) ADD(" decode=%s", px_log_value(a->decode, v2, sizeof v2));
    ADD(" status=%d", a->status);
    if (a->prefill_ms >= 0) ADD(" prefill_ms=%.2f", a->prefill_ms);
    if (a->ttfb_ms >= 0) ADD(" ttfb_ms=%.2f", a->ttfb_ms);
    if (a->queued) ADD(" queue_ms=%.2f", a->queue_ms);
    ADD(" total_ms=%.2f bytes_out=%zu outcome=%s", a->total_ms < 0 ? 0 : a->total_ms, a->bytes_out,
        a->outcome);
    if (a->state) ADD(" state=%s", a->state);
    if (a->trace_id && a->trace_id[0]) ADD(" trace_id=%s", a->trace_id);
    if (a->decision) ADD(" decision=%s", a->decision);
    if (a->decision_reason) ADD(" decision_reason=%s", a->decision_reason);
    if (a->fallback) ADD(" fallback=%s", a->fallback);
    if (a->dispatch) ADD(" dispatch=%s", a->dispatch);
    if (a->kv_waited) ADD(" kv_wait_ms=%.2f", a->kv_wait_ms);
    if (a->estimated)
        ADD(" prompt_tokens_est=%ld uncached_tokens_est=%ld", a->prompt_tokens_est,
            a->uncached_tokens_est);
    if (a->slo_ttft_ms > 0) ADD(" slo_ttft_ms=%.0f", a->slo_ttft_ms);
    if (a->slo_tpot_ms > 0) ADD(" slo_tpot_ms=%.0f", a->slo_tpot_ms);
    if (a->predicted) ADD(" pred_ttft_ms=%.2f", a->pred_ttft_ms);
    if (a->slo) ADD(" slo=%s", a->slo);
#undef ADD
    px_log_write_batched(PX_LOG_INFO, "%s", line);
}
