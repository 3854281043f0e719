/* SPDX-License-Identifier: Apache-2.0 */
/* The proxy's endpoints, in one table: each one's path, the label its
 * requests are counted and logged under, the methods it takes and its
 * 405. The enum is the metric slot (pdproxy_requests_total's endpoint
 * label, in this order) and the request flow's endpoint at once. */
#ifndef PX_ENDPOINT_H
#define PX_ENDPOINT_H

#include <stddef.h>

#include "base/http.h"

typedef enum {
    PX_EP_COMPLETIONS = 0,
    PX_EP_CHAT,
    PX_EP_MODELS,
    PX_EP_HEALTHCHECK,
    PX_EP_HEALTH,
    PX_EP_READY,
    PX_EP_METRICS,
    PX_EP_OTHER,       /* no endpoint: the 404 */
    PX_EP_MESSAGES,    /* Anthropic Messages: P/D, as chat */
    PX_EP_RESPONSES,   /* POST /v1/responses: P/D (vLLM takes kv_transfer_params there) */
    PX_EP_PASSTHROUGH, /* any other engine endpoint: passed to decode unchanged */
    PX_EP_GENERATE,    /* vLLM's token-in /inference/v1/generate: P/D */
    PX_EP_COUNT
} px_endpoint;

/* Method bits. PX_M_OTHER: PUT, PATCH, DELETE. */
enum { PX_M_GET = 1, PX_M_POST = 2, PX_M_OTHER = 4, PX_M_HEAD = 8 };

typedef struct px_endpoint_def {
    const char *path;         /* exact path; NULL: matched otherwise (other, passthrough) */
    const char *name;         /* the endpoint in metrics' labels and the access line */
    int methods;              /* PX_M_* it takes */
    const char *allow;        /* the 405's header line */
    const char *wrong_method; /* the 405's message */
    int own;                  /* the proxy answers it itself (health, readiness, metrics) */
} px_endpoint_def;

/* Indexed by px_endpoint. */
extern const px_endpoint_def px_endpoints[PX_EP_COUNT];

/* The request's method as a PX_M_* bit; 0 for any other method. */
int px_endpoint_method(const px_http_head *h);

/* Whether a request for this path (without its query) is one of the
 * engine endpoints passed through to decode: everything under /v1/ but the
 * P/D ones, and vLLM's /tokenize, /detokenize, /pooling, /score, /rerank,
 * /classify, /v2/rerank. */
int px_endpoint_passthrough_path(const char *path, size_t len);

/* Whether the endpoint is served by the P/D flow with the client's method,
 * target and body as they are (decode alone). */
int px_endpoint_passthrough(px_endpoint ep);

#endif
