/* SPDX-License-Identifier: Apache-2.0 */
/* Prometheus counters. Each worker thread owns a px_metrics and is its only
 * writer (plain relaxed stores, no lock, no shared cache line on the request
 * path); a scrape (scrape.c) sums every worker's at read time. */
#ifndef PX_METRICS_H
#define PX_METRICS_H

#include <stdatomic.h>
#include <stdint.h>

#include "base/util.h"
#include "proxy/dispatch.h"
#include "proxy/endpoint.h"

typedef enum { PX_PHASE_PREFILL = 0, PX_PHASE_DECODE, PX_PHASE_STREAM, PX_PHASE_COUNT } px_phase;

/* How a request is served, and why (pdproxy_disagg_decisions_total). */
typedef enum {
    PX_DEC_ALWAYS = 0,    /* disaggregated: --disagg-min-tokens 0 */
    PX_DEC_LONG_PROMPT,   /* disaggregated: uncached estimate at or over the threshold */
    PX_DEC_SHORT_PROMPT,  /* decode_only: the whole prompt is under the threshold */
    PX_DEC_CACHED_PREFIX, /* decode_only: what decode lacks of it is under the threshold */
    PX_DEC_NO_PREFILL,    /* decode_only: no prefill can take it (--fallback-decode-only) */
    PX_DEC_ENDPOINT,      /* decode_only: the engine takes no kv_transfer_params there */
    PX_DEC_NO_HEADER,     /* decode_only: sidecar mode, no x-prefiller-host-port */
    PX_DEC_PREDICTED,     /* decode_only: predicted faster than any prefill-decode pair
                           * (the latency policy, predict.h) */
    PX_DEC_COUNT
} px_decision;

/* Why a request fell back to decode alone (pdproxy_decode_only_fallbacks_total). */
typedef enum {
    PX_FB_NO_PREFILL = 0, /* no healthy prefill */
    PX_FB_PREFILL_5XX,    /* prefill answered 5xx, retries spent */
    PX_FB_PREFILL_CONN,   /* prefill refused or reset before answering, retries spent */
    PX_FB_KV_LOAD,        /* decode failed to load prefill's KV (vLLM kv_load_failure_policy
                           * fail): retried once without kv_transfer_params */
    PX_FB_CONC_PREFILL,   /* --dispatch concurrent: prefill failed while decode waited for its
                           * KV (decode's leg cancelled, nothing had reached the client) */
    PX_FB_COUNT
} px_fallback;

/* How a prompt's exact tokens were had (pdproxy_tokenize_total). */
typedef enum {
    PX_TOK_OK = 0, /* an engine's /tokenize answered */
    PX_TOK_CACHED, /* the worker's cache had them */
    PX_TOK_TIMEOUT, /* --tokenize-timeout passed: the byte estimate stands */
    PX_TOK_ERROR,   /* no engine, refused, not 200, no tokens: the byte estimate stands */
    PX_TOK_COUNT
} px_tokresult;
extern const char *const px_tokresult_names[PX_TOK_COUNT];

const char *px_decision_name(px_decision d);   /* "disaggregated" | "decode_only" */
const char *px_decision_reason(px_decision d); /* the reason label */
const char *px_fallback_name(px_fallback f);

/* Admission control (pdproxy_admission_total{event}). */
typedef enum {
    PX_ADM_M_QUEUED = 0,   /* waited for a saturated pool */
    PX_ADM_M_DISPATCHED,   /* left the queue for its pool */
    PX_ADM_M_QUEUE_FULL,   /* 429: saturated and no room in the queue */
    PX_ADM_M_TIMEOUT,      /* 503: its deadline passed while queued */
    PX_ADM_M_LEFT,         /* the client left while queued */
    PX_ADM_M_RATE_REQUESTS, /* 429: the tenant's requests per minute */
    PX_ADM_M_RATE_TOKENS,  /* 429: the tenant's tokens per minute */
    PX_ADM_M_ENGINE_FULL,  /* an engine answered 429/503: backed off, not failed */
    PX_ADM_M_WOKEN,        /* woken by another worker that freed a pool slot */
    PX_ADM_M_REQUEUED,     /* an engine answered 429/503: queued again, not failed */
    PX_ADM_M_TENANT_REFUSED, /* 403: a tenant header from a peer that is no trusted gateway */
    PX_ADM_M_NO_WAIT,      /* 429: saturated, and x-queue-timeout: 0 asked not to wait */
    PX_ADM_M_COUNT
} px_adm_event;

const char *px_adm_event_name(px_adm_event e);

#define PX_HIST_BUCKETS 16
/* Upper bounds of the histogram buckets, in seconds. */
extern const double px_hist_bounds[PX_HIST_BUCKETS];

typedef struct px_hist {
    atomic_ullong bucket[PX_HIST_BUCKETS]; /* non-cumulative counts per upper bound */
    atomic_ullong count;
    atomic_ullong sum_us;
} px_hist;

typedef struct px_metrics {
    atomic_ullong requests[PX_EP_COUNT][500]; /* by endpoint and status - 100 */
    px_hist duration;
    px_hist ttfb[2]; /* by stream label: [0] answered as a whole, [1] streamed (SSE) */
    px_hist prefill;
    atomic_ullong kvp_missing;
    atomic_ullong rrid_missing;
    atomic_ullong disconnects[PX_PHASE_COUNT];
    atomic_ullong retries[2]; /* prefill, decode */
    atomic_ullong stranded_released;
    atomic_ullong decisions[PX_DEC_COUNT];
    atomic_ullong fallbacks[PX_FB_COUNT];
    atomic_ullong answers_foreign; /* prefill answers refused: another request's */
    atomic_ullong adm[PX_ADM_M_COUNT];
    px_hist queue_wait; /* seconds queued, of requests that left the queue */
    atomic_ullong tokenize[PX_TOK_COUNT]; /* exact prompt tokens, by result */
    atomic_ullong dispatch[PX_DISP_COUNT]; /* disaggregated requests by how they were sent */
    px_hist kv_wait; /* decode's X-KV-Wait-Ms: how long it waited for prefill's KV */
} px_metrics;

/* The KV-event subscriber's totals (kvevents.c), for /metrics (any thread
 * reads). */
typedef struct px_kv_counters {
    atomic_ullong batches;     /* batches applied */
    atomic_ullong events;      /* events applied */
    atomic_ullong malformed;   /* batches or events refused */
    atomic_ullong gaps;        /* sequence gaps seen */
    atomic_ullong replays;     /* replay requests sent */
    atomic_ullong replay_fail; /* replays that timed out or could not fill the gap */
    atomic_ullong resets;      /* backend indexes dropped */
    atomic_ullong refused;     /* blocks not indexed: the bound was reached */
} px_kv_counters;

/* Single-writer increment: only the owning thread calls these. */
static inline void px_m_inc(atomic_ullong *c) {
    atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + 1,
                          memory_order_relaxed);
}

void px_metrics_count(px_metrics *m, px_endpoint ep, int status);
void px_hist_observe(px_hist *h, double seconds);

#endif
