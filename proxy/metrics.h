/* Prometheus metrics. Each worker thread owns a px_metrics and is its only
 * writer (plain relaxed stores, no lock, no shared cache line on the request
 * path); a scrape sums every worker's at read time. */
#ifndef PX_METRICS_H
#define PX_METRICS_H

#include <stdatomic.h>
#include <stdint.h>

#include "util.h"

typedef enum {
    PX_MEP_COMPLETIONS = 0,
    PX_MEP_CHAT,
    PX_MEP_MODELS,
    PX_MEP_HEALTHCHECK,
    PX_MEP_HEALTH,
    PX_MEP_READY,
    PX_MEP_METRICS,
    PX_MEP_OTHER,
    PX_MEP_COUNT
} px_metric_endpoint;

typedef enum { PX_PHASE_PREFILL = 0, PX_PHASE_DECODE, PX_PHASE_STREAM, PX_PHASE_COUNT } px_phase;

#define PX_HIST_BUCKETS 16

typedef struct px_hist {
    atomic_ullong bucket[PX_HIST_BUCKETS]; /* non-cumulative counts per upper bound */
    atomic_ullong count;
    atomic_ullong sum_us;
} px_hist;

typedef struct px_metrics {
    atomic_ullong requests[PX_MEP_COUNT][500]; /* by endpoint and status - 100 */
    px_hist duration;
    px_hist ttfb[2]; /* by stream label: [0] answered as a whole, [1] streamed (SSE) */
    px_hist prefill;
    atomic_ullong kvp_missing;
    atomic_ullong rrid_missing;
    atomic_ullong disconnects[PX_PHASE_COUNT];
    atomic_ullong retries[2]; /* prefill, decode */
    atomic_ullong stranded_released;
} px_metrics;

/* Single-writer increment: only the owning thread calls these. */
static inline void px_m_inc(atomic_ullong *c) {
    atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + 1,
                          memory_order_relaxed);
}

void px_metrics_count(px_metrics *m, px_metric_endpoint ep, int status);
void px_hist_observe(px_hist *h, double seconds);

struct px_server;
/* Writes the whole exposition (text format 0.0.4): every worker's counters
 * summed, backend gauges, process metrics. */
void px_metrics_render(struct px_server *s, px_buf *out);

#endif
