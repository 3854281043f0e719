/* One client request through the P/D flow, as a state machine:
 * NEW → PREFILL → DECODE → STREAM → DONE, with CLOSING from any state.
 * A px_req owns everything of its request; px_req_free() releases all. */
#ifndef PX_REQUEST_H
#define PX_REQUEST_H

#include "http.h"
#include "server.h"
#include "util.h"

typedef struct px_req px_req;

typedef enum { PX_EP_COMPLETIONS = 0, PX_EP_CHAT = 1 } px_endpoint;

/* Starts the flow for a parsed client request. `body` is moved into the
 * request (left empty). The request replies on `c` when done and binds
 * itself to the exchange to hear of disconnects and drains. Returns NULL
 * when it already answered (bad request, no upstream). */
px_req *px_req_start(px_worker *w, px_conn *c, px_endpoint ep, const px_http_head *h,
                     px_buf *body);

#endif
