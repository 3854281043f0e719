/* SPDX-License-Identifier: Apache-2.0 */
/* One client request through the P/D flow, as a state machine:
 * NEW → PREFILL → DECODE → STREAM → DONE, with DONE reachable from any state
 * through the one exit (req_finish: logs, answers once, frees on the next
 * loop turn) and RELEASING when the client left while prefill may hold
 * blocks for it (prefill is let answer, then decode is sent the request and
 * aborted, so that prefill frees the blocks at once). With --dispatch
 * concurrent (dispatch.h) PREFILL is skipped: decode's leg runs as DECODE
 * while prefill's runs beside it on a second transfer. A px_req owns
 * everything of its request; req_free() releases all. */
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

/* Logs at start-up how the endpoints whose P/D support depends on the
 * engine are served. */
void px_req_announce(void);

/* Frees every request of the worker (its loop has stopped): transfers are
 * cancelled, backend references dropped. */
void px_req_free_all(px_wctx *w);

/* OpenAI's 404 body for a model no pool serves (n bytes of its name), as
 * vLLM words it. */
void px_req_model_not_found(px_buf *b, const char *model, size_t n);

/* Answers a request refused before the flow started (401, 404, 405) with an
 * OpenAI error (extra: more header lines, or NULL) and writes its access
 * line: one line per request, whatever its fate, with its request id (the
 * client's or a fresh one, echoed in the answer). */
void px_req_refuse(px_conn *c, const px_http_head *h, const char *endpoint, int status,
                   const char *extra, const char *msg);

#endif
