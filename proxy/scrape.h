/* SPDX-License-Identifier: Apache-2.0 */
/* The /metrics page: every worker's counters summed, the backends' gauges,
 * the limits, trace export, build and process metrics, in Prometheus text
 * format 0.0.4. Any thread. */
#ifndef PX_SCRAPE_H
#define PX_SCRAPE_H

#include "base/util.h"
#include "proxy/ctx.h"

void px_scrape_render(px_ctx *ctx, px_buf *out);

#endif
