/* SPDX-License-Identifier: Apache-2.0 */
/* Latency targets per request (issue 42): time to first token and time per
 * output token, from the request's headers (x-slo-ttft-ms, x-slo-tpot-ms),
 * else its tenant's, else its priority class's, else its pool's (--slo
 * specs, a reload or POST /admin/slo), else --slo-ttft-ms/--slo-tpot-ms;
 * and what to do with a request predicted to miss its TTFT target
 * (--slo-miss, or a spec's miss=): send it anyway, hold it in the
 * admission queue until the prediction fits (or the engines are idle), or
 * refuse it at once with 503 (or 429) and Retry-After. Parsing and the
 * attainment counters only; latency.h predicts, predict.h applies. */
#ifndef PX_SLO_H
#define PX_SLO_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

struct px_buf;

typedef enum { PX_SLO_SEND = 0, PX_SLO_QUEUE, PX_SLO_REFUSE } px_slo_miss;
const char *px_slo_miss_name(px_slo_miss m);
/* "send" | "queue" | "refuse": 0.., or -1. */
int px_slo_miss_parse(const char *s, size_t n);

/* A target; each part is set or not (bits of `set`). */
enum { PX_SLO_HAS_TTFT = 1, PX_SLO_HAS_TPOT = 2, PX_SLO_HAS_MISS = 4, PX_SLO_HAS_STATUS = 8 };
typedef struct px_slo_target {
    double ttft_ms; /* 0: none */
    double tpot_ms; /* 0: none */
    int miss;       /* px_slo_miss */
    int status;     /* of a refusal: 503 or 429 */
    unsigned set;
} px_slo_target;

/* --slo specs: KIND=NAME:key=value[:key=value...], KIND one of tenant,
 * class (a --priority-class name, or a priority number), pool (a pool's
 * name, "" for the unnamed pool written pool=, or * for every pool); keys
 * ttft and tpot (milliseconds, 0 < v <= 3600000), miss (send, queue,
 * refuse), status (503, 429). */
#define PX_SLO_MAX_SPECS 64
#define PX_SLO_NAME_MAX 64
typedef struct px_slo_map {
    size_t n;
    struct {
        char kind; /* 't', 'c', 'p' */
        char name[PX_SLO_NAME_MAX];
        px_slo_target t;
    } v[PX_SLO_MAX_SPECS];
} px_slo_map;

/* 0, or -1 with err naming the spec (m untouched). */
int px_slo_map_parse(char *const *specs, size_t n, px_slo_map *m, char *err, size_t errlen);
int px_slo_spec_check(const char *spec, char *err, size_t errlen);

/* Fills the unset parts of *t from `from`. */
void px_slo_merge(px_slo_target *t, const px_slo_target *from);
/* The spec of kind (and name[0..len)) in m, NULL when none. */
const px_slo_target *px_slo_find(const px_slo_map *m, char kind, const char *name, size_t len);

/* The targets in use, published newest first and kept until the end (as
 * prio.h's classes: workers load the pointer once per request), and the
 * attainment counters pdproxy_slo_attained_total{pool,class,result}. */
typedef struct px_slo px_slo;
px_slo *px_slo_create(void);
void px_slo_destroy(px_slo *s); /* no reader may be left; NULL is a no-op */
/* Parses specs and publishes them. 0, or -1 with err (nothing changes). */
int px_slo_publish(px_slo *s, char *const *specs, size_t n, char *err, size_t errlen);
/* The specs in effect; never NULL. Any thread. */
const px_slo_map *px_slo_current(px_slo *s);

typedef enum {
    PX_SLO_MET = 0, /* answered within its targets */
    PX_SLO_MISSED,  /* answered, a target missed */
    PX_SLO_REFUSED, /* refused by prediction, before any engine saw it */
    PX_SLO_FAILED,  /* not answered (an error, the client left) */
    PX_SLO_RESULTS
} px_slo_result;
const char *px_slo_result_name(px_slo_result r);
/* Counts one request of pool `pool` and class `cls` (0..15; its label is
 * `cls_name`). Any thread. */
void px_slo_count(px_slo *s, const char *pool, int cls, const char *cls_name, px_slo_result r);
void px_slo_render_metrics(px_slo *s, struct px_buf *o);
/* The specs as JSON ({"specs":[...]}), for GET /admin/slo. */
void px_slo_render_json(px_slo *s, struct px_buf *o);

#endif
