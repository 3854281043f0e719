/* SPDX-License-Identifier: Apache-2.0 */
/* The live latency model (issue 42): what a request's time to first token
 * will be on each engine and each prefill-decode pair, learned online from
 * every answer the proxy relays; no training job, no sidecar.
 *
 * Per engine, four fits of y = a + b x, each an exponentially forgotten
 * least-squares line over (x, y) samples:
 *   prefill  y: seconds from sending prefill its request to its answer;
 *            x: the uncached prompt tokens queued or in flight on it when
 *            the request was routed, this one's included (b: seconds per
 *            token, a: its fixed cost);
 *   decode   y: seconds from sending decode its request to the first byte,
 *            less its KV wait (X-KV-Wait-Ms) and less what was left, when
 *            the KV landed, of the prompts it computes for decode-only
 *            requests (predicted apart: their uncached tokens at its local
 *            seconds per token); x: the requests in flight on it;
 *   local    y: a decode-only request's seconds to first byte; x: the
 *            uncached tokens queued on it plus this prompt's;
 *   tpot     y: seconds per output token of a stream after its first; x:
 *            the requests in flight on it.
 * Per prefill-decode pair, one more: kv, y: decode's X-KV-Wait-Ms in
 * seconds, x: the prompt's tokens (b: the pair's seconds per token, the
 * inverse of its observed rate; a: its fixed cost). A pooled fit of each
 * kind (every engine's samples) stands in for an engine or pair seen too
 * rarely: the prediction blends the two by how much the engine's own fit
 * holds (its decayed weight w: w^2 / (w^2 + 1) of its own, a half after
 * one sample, 0.9 after three).
 *
 * Forgetting: each new sample multiplies the old sums by `keep` (0.95: the
 * last ~20 samples matter) and by 2^(-seconds since the last / half-life)
 * (30 s), so an engine that changes (restarted, slowed by a neighbour, a
 * new model) is relearned within tens of samples, and one not used for a
 * while drifts back to the pooled fit and gets tried again.
 *
 * Memory is bounded: fixed tables of engines and pairs (open addressing, 8
 * probes; past them the stalest entry of the window is taken over).
 * Threads: every worker observes and predicts. Writers of one entry take
 * its spin flag (a few multiplications long); each entry publishes its
 * fitted lines under a sequence counter, so readers never wait: they copy
 * the lines and retry on the rare torn read. */
#ifndef PX_LATENCY_H
#define PX_LATENCY_H

#include <stddef.h>
#include <stdint.h>

struct px_buf;

/* ---------- one fit ---------- */

typedef struct px_lat_fit {
    double s0, sx, sy, sxx, sxy; /* forgotten sums of 1, x, y, x^2, xy */
    uint64_t t_ns;               /* the last sample's time; 0: none */
    uint64_t n;                  /* samples ever */
} px_lat_fit;

/* Adds (x, y) at `now_ns`, the old sums kept by keep * 2^(-dt/half_life). */
void px_lat_fit_add(px_lat_fit *f, double x, double y, uint64_t now_ns, double keep,
                    double half_life_s);
/* The line through the samples: *a >= 0 and *b >= 0 (a negative intercept
 * or slope is refitted with it held at 0). Where the samples' x hardly
 * vary, the slope leans on prior_b (a ridge toward it weighing 0.01 % of the
 * sum of x^2), so a burst of equal prompts does not make a slope up.
 * Returns the sum of the weights (0: no sample: *a 0, *b prior_b). */
double px_lat_fit_solve(const px_lat_fit *f, double prior_b, double *a, double *b);

/* ---------- the model ---------- */

typedef enum {
    PX_LAT_PREFILL = 0,
    PX_LAT_DECODE,
    PX_LAT_LOCAL,
    PX_LAT_TPOT,
    PX_LAT_KINDS
} px_lat_kind;

const char *px_lat_kind_name(px_lat_kind k);

typedef struct px_latmodel px_latmodel;

/* A model of at most `engines` engines and `pairs` pairs (rounded up to
 * powers of two). keep in (0, 1], half_life_s > 0. */
px_latmodel *px_latmodel_create(size_t engines, size_t pairs, double keep, double half_life_s);
void px_latmodel_destroy(px_latmodel *m); /* NULL is a no-op */

/* One sample of an engine (`key`: its backend's key_hash; `name` kept for
 * GET /admin/latency_model) or of a pair. Any thread. */
void px_lat_observe(px_latmodel *m, uint64_t key, const char *name, px_lat_kind k, double x,
                    double y_s, uint64_t now_ns);
void px_lat_observe_pair(px_latmodel *m, uint64_t pkey, uint64_t dkey, const char *pname,
                         const char *dname, double tokens, double y_s, uint64_t now_ns);

/* Predicted seconds: y at x for the engine (or its pooled stand-in), and
 * the KV wait of `tokens` for the pair. Any thread, never waits. */
double px_lat_predict(const px_latmodel *m, uint64_t key, px_lat_kind k, double x);
double px_lat_predict_pair(const px_latmodel *m, uint64_t pkey, uint64_t dkey, double tokens);
/* The engine's seconds per unit of x (its blended slope), for the part of
 * a prediction that is waiting behind others. */
double px_lat_slope(const px_latmodel *m, uint64_t key, px_lat_kind k);

/* A request's predicted and observed TTFT (seconds): the model's error
 * counts (|predicted - observed| / observed, bucketed) for the admin view
 * and /metrics. */
void px_lat_error(px_latmodel *m, double predicted_s, double observed_s);
/* The median of the relative errors counted so far (0.05 steps); -1: none. */
double px_lat_error_median(const px_latmodel *m);

/* GET /admin/latency_model: every engine's and pair's lines with their
 * weights and sample counts, the pooled lines, the error distribution. */
void px_lat_render_json(const px_latmodel *m, struct px_buf *o);
/* pdproxy_latency_model_* series for /metrics. */
void px_lat_render_metrics(const px_latmodel *m, struct px_buf *o);

/* ---------- a plan: the pair with the lowest predicted TTFT ---------- */

/* What a pool's eligible member offers a request (route.h's
 * px_pool_snapshot fills them). */
typedef struct px_lat_cand {
    uint64_t key;  /* the backend's key_hash */
    long tokens;   /* uncached prompt tokens queued or in flight on it */
    int inflight;  /* the proxy's requests on it */
    size_t cached; /* prompt tokens of this request it would reuse */
} px_lat_cand;

typedef struct px_lat_plan {
    int ok;                /* a prefill-decode pair was found */
    uint64_t pkey, dkey;   /* that pair */
    size_t p_cached;       /* the prefill's reusable tokens */
    double ttft;           /* its predicted TTFT, seconds */
    double pre, kv, dec;   /* the parts: prefill, KV wait, decode's first token */
    double wait;           /* of ttft, the waiting behind others' work */
    double tpot;           /* the decode's predicted time per output token */
    double score;          /* what the choice compared: ttft less the exploration
                              bonus of parts the model knows little of */
    double p_x, d_x, tp_x; /* the fits' x for the pair, kept for the observations */
    double d_backlog;      /* the decode's decode-only prompts, seconds of its compute */
    int local_ok;          /* a decode-only choice was found */
    uint64_t lkey;         /* its decode */
    size_t l_cached;
    double local;       /* its predicted TTFT */
    double local_score; /* and its score */
    double local_wait;
    double l_x, ltp_x;
} px_lat_plan;

/* The pair (p in P, d in D) with the lowest predicted TTFT among those
 * whose decode's predicted TPOT is at most tpot_s (0: any; when none is,
 * any), and the decode-only choice with the lowest predicted TTFT (among
 * decodes computing no other decode-only prompt), for a
 * prompt of ntok tokens (the first 64 of each pool). Compared on scores:
 * each part of a prediction made from little of its own evidence (weight
 * w) counts 0.5 / (1 + w) less, so that what was never tried is tried,
 * and what was not used for a while is tried again. Any thread; no
 * allocation. */
void px_lat_plan_make(const px_latmodel *m, const px_lat_cand *P, size_t np, const px_lat_cand *D,
                      size_t nd, size_t ntok, double tpot_s, px_lat_plan *out);

#endif
