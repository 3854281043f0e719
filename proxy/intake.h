/* SPDX-License-Identifier: Apache-2.0 */
/* What the client sent, checked and read once, before any backend sees
 * it: the body is a JSON object, the model names a pool, a sidecar's
 * x-prefiller-host-port is allowed, a decode can take the request; the
 * session key; the prompt's routing key and token ids (one parse of the
 * body serves prefix_affinity and kv_aware); the header lines the
 * upstream requests carry; and what a pick brings to a pool. A failed
 * check is a verdict the caller answers. Calls back into nothing. */
#ifndef PX_INTAKE_H
#define PX_INTAKE_H

#include <stddef.h>
#include <stdint.h>

#include "base/http.h"
#include "base/util.h"
#include "proxy/ctx.h"
#include "proxy/bodyidx.h"
#include "proxy/disagg.h"
#include "proxy/endpoint.h"
#include "proxy/leg.h"
#include "proxy/predict.h"
#include "proxy/route.h"

/* One request's intake. */
typedef struct px_intake {
    px_ctx *ctx; /* borrowed */
    px_wctx *w;  /* borrowed: the worker (its token cache and prefix index) */
    px_gen *g;   /* borrowed: the request's generation */
    px_endpoint ep;
    const px_buf *body; /* borrowed: the client's body, while the request holds it */
    px_body_idx bx;     /* its members, found as px_intake_pd validated it */
    px_pset *ps;        /* borrowed from g: the pool of the request's model */
    px_backend *hb;     /* owned reference: the prefill named by the request's header */
    int no_prefill;     /* sidecar mode without the header: decode alone */
    uint64_t session;   /* --session-header's value or the body's "user", hashed; 0: none */
    const char *key;    /* borrowed from the body: prefix_affinity's bytes */
    size_t key_len;
    uint32_t *tok; /* owned: the prompt's exact tokens; NULL: unknown */
    size_t ntok;
    uint64_t tkey; /* the prompt's key in the worker's token cache */
    uint64_t salt; /* its cache_salt's key (admission.h px_adm_salt_key), 0: none */
    const px_lat_req *lat; /* borrowed, or NULL: its latency plan, which picks name (predict.h) */
} px_intake;

/* A refusal: status 0 lets the request go on. */
typedef struct px_verdict {
    int status;
    const char *extra; /* static: more header lines of the answer, or NULL */
    char msg[512];     /* the error's words (OpenAI error JSON), when body is empty */
    px_buf body;       /* owned: an answer of its own (404 model_not_found), JSON */
} px_verdict;

/* Logs at start-up how the endpoints whose P/D support depends on the
 * engine are served. */
void px_intake_announce(void);

void px_intake_init(px_intake *in, px_wctx *w, px_gen *g, px_endpoint ep, const px_buf *body);
void px_intake_cleanup(px_intake *in);
/* The client's body was let go: nothing points into it any more (the
 * prefix key, the members). */
void px_intake_body_gone(px_intake *in);
void px_verdict_cleanup(px_verdict *v);

/* The checks of every request: one of --max-inflight's slots taken
 * (*counted set: it must be given back), and no loop through proxies
 * (--loop-limit). Returns 0, or -1 with the verdict. */
int px_intake_admit(px_intake *in, const px_http_head *h, int *counted, px_verdict *v);

/* The client's body is held already (the connection counted it); the
 * prefill copy needs room in the memory budget too: taken, and added to
 * *held. Returns 0, or -1 with the verdict. */
int px_intake_room(px_intake *in, int64_t *held, px_verdict *v);

/* The checks of a P/D request (lid: its id for the logs): a JSON object
 * body, a pool serving its model, the sidecar's prefill, a decode that can
 * take it; then its session key. Returns 0, or -1 with the verdict. */
int px_intake_pd(px_intake *in, const px_http_head *h, const char *lid, px_verdict *v);

/* Admitted: the prompt's routing key and, where kv_aware or the KV index
 * uses them, its token ids. Returns whether exact tokens are wanted (a
 * kv_aware pool). */
int px_intake_prompt(px_intake *in);

/* The prompt's exact tokens where kv_aware (`kva`) or the KV index would
 * use them: from the worker's cache (0), else 1 with the body to ask an
 * engine's POST /tokenize with appended to *body; 0 too when there is
 * nothing to tokenize. */
int px_intake_tokens(px_intake *in, int kva, px_buf *body);
/* Sends the tokenize leg `t` (its body set) to an engine of the pool, with
 * the header lines `hdrs`, within --tokenize-timeout. Returns 1 when it
 * was sent: px_intake_tokens_done follows from its done callback; else 0
 * (counted as a tokenize error: the byte estimate stands). */
int px_intake_tokens_ask(px_intake *in, px_leg *t, const px_buf *hdrs);
/* The tokenize leg ended (rc, why: its transfer's): the tokens taken and
 * cached, counted, the engine handed back. */
void px_intake_tokens_done(px_intake *in, px_leg *t, px_up_result rc, const char *why,
                           const char *lid);

/* The worker's caches that intake made on first use (the token cache,
 * the prefix index) are freed: its loop has stopped. */
void px_intake_worker_cleanup(px_wctx *w);

/* Whether the request goes through a prefill (1) or to decode alone (0),
 * and why, in *dis: conditional disaggregation (disagg.h), the decode
 * chosen first on the leg `dec` so that what it caches counts (the prefix
 * index of the leg's worker; the engine's own KV events, exactly, when
 * they know the prompt's tokens), a request through a prefill taking back
 * that decode's kv_aware charge (decode computes none of the prompt); then
 * a sidecar request without its header, or --fallback-decode-only with no
 * usable prefill, goes to decode alone. */
int px_intake_decide(px_intake *in, px_leg *dec, px_disagg *dis);

/* Routing and admission by predicted latency (predict.h) of the prompt
 * read: px_lat_req_route's verdict for `lat`, with its exact tokens or,
 * without them, the body's estimate (disagg.h), for `tenant`, from t0 (the
 * request's arrival) within the admission queue's deadline_ns. */
px_lat_verdict px_intake_lat_route(const px_intake *in, px_lat_req *lat, size_t tenant, uint64_t t0,
                                   uint64_t deadline_ns);

/* Makes tok (when set) the routing key of a kv_aware pool that has none:
 * its tie-break spreads by prompt. */
void px_intake_token_key(px_intake *in);

/* What a request brings to a pick from pool p (one of in->ps's): `k` with
 * kv_aware's prompt tokens and index, and a decode's session. */
px_pick px_intake_pick(const px_intake *in, px_pool *p, px_pick k);

/* The LoRA key of the prompt's blocks: its model when that names an
 * adapter the engines' KV events stored blocks under; 0 otherwise. */
uint64_t px_intake_kv_extra(const px_intake *in);

/* Of the prompt's exact tokens, how many the engine `name` caches by its
 * own KV events (kvindex.h: whole blocks, as the engine reuses them); -1
 * when that is not known (no tokens, no index, an engine it has no
 * events of). */
long px_intake_kv_cached(const px_intake *in, const char *name);

/* The header lines an upstream request carries ("Name: value\r\n" each):
 * the client's (passed-through endpoints), Via, X-Request-Id `id`, the
 * Authorization, traceparent (a child span `span` of the trace) and,
 * when the client's trace is kept (`traced`), tracestate. Host and the
 * body's framing are the transport's. */
void px_intake_headers(const px_ctx *ctx, px_endpoint ep, const px_http_head *h, const char *id,
                       const char *trace_id, const char *flags, int traced, const char *span,
                       px_buf *out);

/* OpenAI's 404 body for a model no pool serves (n bytes of its name), as
 * vLLM words it. */
void px_intake_model_not_found(px_buf *b, const char *model, size_t n);

#endif
