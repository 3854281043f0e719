/* SPDX-License-Identifier: Apache-2.0 */
/* What a request to the proxy is for: the route table (px_endpoints)
 * checked for method and key, then the P/D flow (request.c) or one of the
 * proxy's own endpoints (/v1/models from named pools, /healthcheck,
 * /health, /ready, /metrics), answered here. Both dispatchers are
 * px_conn_cfg dispatch functions. */
#ifndef PX_ROUTES_H
#define PX_ROUTES_H

#include "base/conn.h"
#include "base/http.h"
#include "proxy/ctx.h"

/* A worker's listener: `wctx` is the worker's px_wctx. */
void px_routes_dispatch(void *wctx, px_conn *c, const px_http_head *h, px_buf *body);

/* The --metrics-port listener on the control thread: only the proxy's own
 * endpoints; `ctx` is the px_ctx. */
void px_routes_dispatch_local(void *ctx, px_conn *c, const px_http_head *h, px_buf *body);

#endif
