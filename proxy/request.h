/* One client request through the P/D flow, as a state machine:
 * NEW → PREFILL → DECODE → STREAM → DONE, with CLOSING from any state and
 * RELEASING when the client left after prefill answered (decode is sent the
 * request and aborted, so that prefill frees the blocks at once). A px_req
 * owns everything of its request; req_free() releases all. */
#ifndef PX_REQUEST_H
#define PX_REQUEST_H

#include "http.h"
#include "server.h"
#include "util.h"

typedef struct px_req px_req;

typedef enum { PX_EP_COMPLETIONS = 0, PX_EP_CHAT = 1, PX_EP_MODELS = 2 } px_endpoint;

/* Starts the flow for a parsed client request (for PX_EP_MODELS: a GET
 * answered by a healthy decode). `body` is moved into the request. The
 * request replies on `c` when done and binds itself to the exchange to hear
 * of disconnects and drains. */
void px_req_start(px_worker *w, px_conn *c, px_endpoint ep, const px_http_head *h, px_buf *body);

/* Builds the W3C traceparent for a child span of the client's (or of a new
 * trace when the client sent none or a malformed one). out: 56 bytes. */
void px_trace_child(const char *client_tp, size_t n, char out[56]);

#endif
