/* SPDX-License-Identifier: Apache-2.0 */
/* What is written about a client request: its record (id, client, method
 * and path, trace, times, bytes, how it was served), filled as it runs;
 * its trace context; and at its end, once, its access line (access.h),
 * its spans (otlp.h) and the request metrics. Calls back into nothing. */
#ifndef PX_REQLOG_H
#define PX_REQLOG_H

#include <stddef.h>
#include <stdint.h>

#include "base/conn.h"
#include "base/http.h"
#include "proxy/admission.h"
#include "proxy/disagg.h"
#include "proxy/endpoint.h"
#include "proxy/leg.h"
#include "proxy/metrics.h"
#include "proxy/predict.h"

/* How a request ended (the access line's outcome). Never renumbered. */
typedef enum {
    PX_RO_OK = 0,              /* answered (or streamed) in full */
    PX_RO_ERROR,               /* failed before an answer started: an OpenAI error */
    PX_RO_STREAM_FAILED,       /* failed mid-answer: the stream was cut */
    PX_RO_CLIENT_DISCONNECTED, /* the client left */
    PX_RO_MODEL_NOT_FOUND,     /* no pool serves its model */
    PX_RO_PREFILL_REJECTED,    /* prefill's 4xx, passed on */
    PX_RO_STOPPED,             /* the worker stopped */
    PX_RO_REFUSED,             /* refused before the flow (401, 404, 405) */
    PX_RO_COUNT
} px_req_outcome;

const char *px_req_outcome_name(px_req_outcome o);

/* A request's record. */
typedef struct px_reqlog {
    char id[129];  /* the client's X-Request-Id or a fresh one */
    char lid[300]; /* id as a logfmt value: every log line's req= */
    char method[16];
    char client[48]; /* the client's IP address */
    char lpath[300]; /* the path as a logfmt value */
    px_endpoint ep;
    const char *target; /* borrowed: the path and query sent to decode; NULL: the endpoint's */
    /* Its trace: the client's when it sent exactly one valid traceparent
     * (traced), else a new one; the client's span id ("" when new). */
    char trace_id[33], trace_flags[3], parent_span[17], span_root[17];
    int traced;
    uint64_t t0;      /* its start */
    uint64_t t_first; /* decode's first answer byte; 0: none */
    size_t bytes_out;
    int streamed; /* decode answered text/event-stream */
    int decided;  /* decision is set */
    px_decision decision;
    int fell_back; /* fallback is set: it overrides the decision */
    px_fallback fallback;
    int disp;      /* px_dispatch_kind (dispatch.h); -1: no prefill leg */
    int kv_waited; /* decode sent X-KV-Wait-Ms: */
    double kv_wait_ms;
    /* What the end reads (px_reqlog_sources); NULL: nothing of it. */
    const px_leg *pre, *dec; /* borrowed: prefill's and decode's legs */
    const px_disagg *dis;    /* borrowed: conditional disaggregation's estimate */
    const px_adm_req *adm;   /* borrowed: its time in the admission queue */
    const px_lat_req *lat;   /* borrowed: its latency targets and prediction (predict.h) */
    int https;               /* the client came over TLS */
} px_reqlog;

/* Starts the record of a request to `ep` on connection c with head h: its
 * id, method, path (passed-through endpoints: the client's, whose path and
 * query are put in *target, owned by the caller), client and trace. */
void px_reqlog_start(px_reqlog *lg, px_conn *c, px_endpoint ep, const px_http_head *h,
                     char **target);

/* Decode's answer head arrived on the leg `dec` with Content-Type `ctype`:
 * the first byte's time, whether it streams, and decode's wait for the KV
 * (X-KV-Wait-Ms, observed in m). From inside the leg's head callback. */
void px_reqlog_answer(px_reqlog *lg, px_metrics *m, px_leg *dec, const char *ctype);

/* How the request is served, noted in its record and counted in m: the
 * decision (through a prefill, or decode alone, and why), a fall back to
 * decode alone (it overrides the decision), the dispatch of its prefill
 * leg (a px_dispatch_kind, dispatch.h). */
void px_reqlog_decided(px_reqlog *lg, px_metrics *m, px_decision d);
void px_reqlog_fell_back(px_reqlog *lg, px_metrics *m, px_fallback why);
void px_reqlog_dispatched(px_reqlog *lg, px_metrics *m, int kind);

/* Where the end reads the request's legs, estimate and queue time, all
 * borrowed until px_reqlog_finish; cfg says whether clients come over
 * TLS. */
void px_reqlog_sources(px_reqlog *lg, const px_leg *pre, const px_leg *dec, const px_disagg *dis,
                       const px_adm_req *adm, const px_config *cfg);

/* Once per request: the request metrics, the access line, the spans,
 * with its status, outcome, the state it ended in and the body it held
 * last (the model's name). */
/* The answer's samples into the latency model (predict.h) through lat
 * (the request's, lg->lat) for pool `pool`: the legs' times and backends,
 * once per request. */
void px_reqlog_latency(const px_reqlog *lg, px_lat_req *lat, px_ctx *ctx, const char *pool,
                       int status, int disagg);
void px_reqlog_finish(const px_reqlog *lg, px_metrics *m, int status, px_req_outcome outcome,
                      const char *state, const px_buf *body);

/* Whether spans are exported (otlp.h): prefill's answer is kept for them. */
int px_reqlog_traced(void);

/* Answers a request refused before the flow started (401, 404, 405) with
 * an OpenAI error (extra: more header lines, or NULL) and writes its
 * access line: one line per request, whatever its fate, with its request
 * id (the client's or a fresh one, echoed in the answer). */
void px_reqlog_refuse(px_conn *c, const px_http_head *h, const char *endpoint, int status,
                      const char *extra, const char *msg);

#endif
