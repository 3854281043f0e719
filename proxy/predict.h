/* SPDX-License-Identifier: Apache-2.0 */
/* A request's part in routing and admission by predicted latency (issue
 * 42): its targets (slo.h), its plan (latency.h: the prefill-decode pair,
 * or the decode alone, with the lowest predicted TTFT), what is done when
 * no choice meets its TTFT target, and what its answer teaches the model.
 * Embedded in the request (px_req.lat); the request's state machine calls
 * these at fixed points and keeps the decisions' effects (queueing,
 * refusing, picking) its own. */
#ifndef PX_PREDICT_H
#define PX_PREDICT_H

#include <stddef.h>
#include <stdint.h>

#include "base/http.h"
#include "proxy/ctx.h"
#include "proxy/latency.h"
#include "proxy/prio.h"
#include "proxy/slo.h"

typedef enum {
    PX_LATV_NONE = 0, /* no pool of the request routes by latency: as before */
    PX_LATV_PAIR,     /* disaggregated, on the plan's pair */
    PX_LATV_LOCAL,    /* decode alone, on the plan's decode: predicted faster */
    PX_LATV_WAIT,     /* predicted to miss its TTFT target: wait in the admission queue */
    PX_LATV_REFUSE,   /* predicted to miss its TTFT target: refuse it now */
} px_lat_verdict;

typedef struct px_lat_req {
    double hdr_ttft_ms, hdr_tpot_ms; /* x-slo-ttft-ms, x-slo-tpot-ms; 0: none */
    int cls;                         /* its priority class */
    char cls_name[PX_PRIO_NAME_MAX];
    px_slo_target t; /* resolved: the targets and what a miss does */
    int resolved;
    int planned;  /* plan is set */
    int local;    /* the plan sent it to decode alone */
    int waited;   /* it waited in the admission queue for its prediction */
    int released; /* let out of that wait: goes on without waiting again */
    px_lat_plan plan;
    uint64_t t_plan;
    double predicted; /* the chosen option's predicted TTFT, seconds */
    /* What a new plan needs, borrowed from the request. */
    px_ctx *c;
    px_pset *ps;
    const uint32_t *tok;
    size_t ntok;
    uint64_t kv_extra;
    uint64_t t0;
    /* Its stream: events seen, the first and the last one's time. */
    unsigned events;
    uint64_t t_ev0, t_ev1;
    int refused;
    double wait_s; /* a refused or waiting request's predicted wait */
    int result; /* px_slo_result + 1 once counted; 0: not */
} px_lat_req;

/* The request's head: x-slo-* headers and its priority class. */
void px_lat_req_headers(px_lat_req *l, px_ctx *c, const px_http_head *h, const char *body,
                        size_t blen);

/* Whether a pool of ps routes by latency. */
int px_lat_pool(const px_pset *ps);

/* Resolves the targets (headers, tenant `tenant`, class, pool, defaults)
 * and, when a pool of ps routes by latency, plans: the verdict. The prompt
 * (tok/ntok, NULL tokens: ntok estimated) and t0 (the request's arrival)
 * are kept for later plans. WAIT and REFUSE come only for a request whose
 * best prediction misses its TTFT target (counted from t0): by its miss
 * action, WAIT when the queue's deadline (`deadline_ns`) leaves time for
 * the predicted wait. */
px_lat_verdict px_lat_req_route(px_lat_req *l, px_ctx *c, px_pset *ps, size_t tenant,
                                const uint32_t *tok, size_t ntok, uint64_t kv_extra, uint64_t t0,
                                uint64_t deadline_ns);
/* A WAIT that found no room in the queue: REFUSE, counted so. */
px_lat_verdict px_lat_req_refuse(px_lat_req *l);
/* A refusal's status (the target's: 503 or 429), its header lines
 * (Retry-After: the predicted wait, 1..60 s) and message. */
int px_lat_req_refusal(const px_lat_req *l, char *extra, size_t extra_cap, char *msg,
                       size_t msg_cap);

/* For a request waiting after WAIT: plans again; 1 when it may go (its
 * prediction fits what is left of its target, or the engines are about
 * idle: the best choice waits for under a tenth of the target). */
int px_lat_req_ready(px_lat_req *l);

/* The plan's member of the prefill pool (decode 0) or decode pool, for
 * px_pool_pick. No-op without a plan. */
void px_lat_req_prefer(const px_lat_req *l, int decode, px_pick *k);

/* Decode's bytes to the client: stream events counted, for TPOT. */
void px_lat_req_answer(px_lat_req *l, const char *p, size_t n);

/* What the request's end tells: its timestamps (0: did not happen). */
typedef struct px_lat_obs {
    int status;
    uint64_t t0; /* the request's arrival: TTFT is counted from it */
    uint64_t t_pstart, t_prefill, t_dstart, t_first, now;
    int kv_waited;
    double kv_wait_ms;
    const char *pname, *dname; /* the backends' names; NULL or "": none */
    int disagg;                /* decode got prefill's KV */
    int serial;                /* prefill answered before decode was sent */
    size_t tries_p, tries_d;
} px_lat_obs;

/* The answer's samples into the model (only for the plan's own choice,
 * tried once), the prediction's error, and the request's result against
 * its targets, counted once under `pool` (the pool's name). Once per
 * request. */
void px_lat_req_finish(px_lat_req *l, px_ctx *c, const char *pool, const px_lat_obs *o);

/* For the access line and the span: the TTFT target (ms, 0: none), the
 * predicted TTFT (ms, < 0: none), the result (NULL: no target). */
void px_lat_req_report(const px_lat_req *l, double *target_ms, double *tpot_ms, double *pred_ms,
                       const char **result);

#endif
