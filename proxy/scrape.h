/* The /metrics page: every worker's counters summed, the backends' gauges,
 * the limits, trace export, build and process metrics, in Prometheus text
 * format 0.0.4. Any thread. */
#ifndef PX_SCRAPE_H
#define PX_SCRAPE_H

#include "ctx.h"
#include "util.h"

void px_scrape_render(px_ctx *s, px_buf *out);

#endif
