/* SPDX-License-Identifier: Apache-2.0 */
/* Data-parallel ranks. A vLLM engine started with --data-parallel-size N
 * behind one API server runs N engine cores; a request names the core it
 * wants in the X-data-parallel-rank header (vLLM reads it in
 * OpenAIServing._get_data_parallel_rank, and its DP client then skips its
 * own load balancing). pdproxy chooses the rank itself: the least loaded
 * (pdproxy's requests in flight on that rank, corrected by the engine's own
 * per-rank figures where its /metrics has them), and counts each rank's
 * load for the metrics. One table per process (the registry, registry.h),
 * shared by the worker threads through atomics. */
#ifndef PX_DP_H
#define PX_DP_H

#include <stddef.h>
#include <stdint.h>

#include "base/util.h"
#include "proxy/config.h"

#define PX_DP_MAX 64 /* largest --prefill-dp-size / --decode-dp-size */

typedef enum { PX_DP_PREFILL = 0, PX_DP_DECODE = 1 } px_dp_role;

/* The ranks of the backends and the sizes they declared. */
typedef struct px_dp_table px_dp_table;
px_dp_table *px_dp_table_create(void);    /* empty; never NULL */
void px_dp_table_destroy(px_dp_table *t); /* NULL is a no-op */

/* The rank for a request to the backend `name` (the metrics label), of a
 * DP size `size` (2..PX_DP_MAX): the least loaded, the lowest on a tie;
 * its in-flight count is raised. Returns -1 for size < 2 (no header) or
 * when the table of backends is full (the engine balances itself). */
int px_dp_take(px_dp_table *t, px_dp_role role, const char *name, int size);

/* The request on `rank` (from px_dp_take, >= 0) of that backend ended. */
void px_dp_done(px_dp_table *t, px_dp_role role, const char *name, int rank);

/* Sums vllm:num_requests_running and vllm:num_requests_waiting of each
 * rank in a Prometheus page (`text`, n bytes) into load[K], K the value of
 * the series' `engine` label (vLLM's PrometheusStatLogger labels each DP
 * engine core's gauges so). Returns 1 + the highest rank seen, 0 when no
 * series had the label. */
int px_dp_parse_ranks(const char *text, size_t n, long load[PX_DP_MAX]);

/* A load probe of the backend `name` read its /metrics page (`text`, n
 * bytes; NULL: the probe failed). Per-rank figures, when the page has two
 * ranks or more, steer px_dp_take from then on: a rank's load is the
 * engine's running + waiting of that probe plus pdproxy's requests to it
 * since then, less those ended since (never below pdproxy's own count);
 * without them, pdproxy's own count alone. */
void px_dp_engine_load(px_dp_table *t, const char *name, const char *text, size_t n);

/* The DP size the backend configured as `url` (px_backend.src) declared,
 * the admin API's over the config file's; `fallback` (the role's
 * --prefill-dp-size / --decode-dp-size) when it declared none. Any thread. */
int px_dp_size(px_dp_table *t, const char *url, int fallback);

/* Whether any backend ever declared a size (a cheap test before lookups). */
int px_dp_declared(px_dp_table *t);

/* Control thread, once a configuration is accepted: its declarations
 * (px_config.backend_dp, items "N URL") replace the file layer's. Returns
 * -1 when some did not fit the table (4,096 URLs of < 512 bytes). */
int px_dp_declare_file(px_dp_table *t, const px_strlist *decl);

/* Control thread: POST /admin/backends with "dp_size" (size >= 1), or
 * DELETE (size 0: the admin layer forgets the URL). -1: no room. */
int px_dp_declare_admin(px_dp_table *t, const char *url, int size);

/* Control thread: a reload from the file dropped the admin API's changes,
 * and with them the sizes it declared. */
void px_dp_forget_admin(px_dp_table *t);

/* Appends the Prometheus series of every rank used so far:
 * pdproxy_dp_rank_in_flight and pdproxy_dp_rank_requests_total, labelled
 * role, backend and rank. */
void px_dp_render(px_dp_table *t, px_buf *out);

#endif
