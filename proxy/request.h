/* SPDX-License-Identifier: Apache-2.0 */
/* One client request through the P/D flow, as a state machine (its states
 * and their transitions are one table in request.c): INTAKE → ADMIT →
 * TOKENIZE → PREFILL (RETRY_WAIT between attempts) → DECODE (HOLD while
 * its answer may be a failed KV load) → STREAM, with DONE reachable from
 * any state through the one exit (req_finish: logs, answers once, frees
 * on the next loop turn) and RELEASING when the client left while prefill
 * may hold blocks for it (prefill is let answer, then decode is sent the
 * request and aborted, so that prefill frees the blocks at once). With
 * --dispatch concurrent (dispatch.h) PREFILL is passed through: decode's
 * leg runs as DECODE while prefill's runs beside it, and AWAIT_PREFILL
 * lets it end after decode answered. The request's upstream exchanges
 * are legs (leg.h: tokenize, prefill, decode); what the client sent is
 * checked by intake.h, what is written about it by reqlog.h. A px_req
 * owns everything of its request; req_free() releases all. */
#ifndef PX_REQUEST_H
#define PX_REQUEST_H

#include "base/http.h"
#include "base/util.h"
#include "proxy/ctx.h"
#include "proxy/endpoint.h"

typedef struct px_req px_req;

/* Starts the flow for a parsed client request (for PX_EP_MODELS: a GET
 * answered by a healthy decode; PX_EP_RESPONSES and PX_EP_PASSTHROUGH: the
 * client's method, target, headers and body to a decode). `body` is moved
 * into the request. The request replies on `c` when done and binds itself
 * to the exchange to hear of disconnects and drains. */
void px_req_start(px_wctx *w, px_conn *c, px_endpoint ep, const px_http_head *h, px_buf *body);

/* Frees every request of the worker (its loop has stopped): transfers are
 * cancelled, backend references dropped. */
void px_req_free_all(px_wctx *w);

#endif
