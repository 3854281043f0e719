/* SPDX-License-Identifier: Apache-2.0 */
/* Active checks of the engines, on the control thread's event loop: health
 * checks (GET /health) and, for load_aware routing, load probes (GET of each
 * engine's /metrics, read for its queue and KV-cache figures). */
#ifndef PX_HEALTH_H
#define PX_HEALTH_H

#include <event2/event.h>
#include <stddef.h>

struct px_ctx;
typedef struct px_health px_health;

/* Starts the timers on `base`. Returns NULL when nothing is to be done
 * (checks disabled and no load_aware pool). */
px_health *px_health_start(struct px_ctx *ctx, struct event_base *base);
/* Cancels checks in flight and frees. NULL is a no-op. */
void px_health_stop(px_health *h);

/* Reads vLLM's load figures from a Prometheus text page: the sums of
 * vllm:num_requests_waiting and vllm:num_requests_running over their label
 * sets, and the largest vllm:kv_cache_usage_perc (or the older
 * vllm:gpu_cache_usage_perc). Returns how many of the three were found. */
int px_parse_engine_load(const char *text, size_t n, double *waiting, double *running,
                         double *kv_usage);

#endif
