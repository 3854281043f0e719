/* SPDX-License-Identifier: Apache-2.0 */
/* The access log: one line per client request, whatever its fate, in the
 * log's format (log.h). */
#ifndef PX_ACCESS_H
#define PX_ACCESS_H

#include <stddef.h>

/* One request's access-log line. What is not known is left out of the line
 * rather than written as a placeholder: NULL strings, negative times. */
typedef struct px_access {
    const char *req;      /* borrowed: the request id, already a logfmt value */
    const char *client;   /* borrowed: the client's IP address; NULL or "": unknown */
    const char *method;   /* borrowed: the request's method, already a logfmt value */
    const char *endpoint; /* borrowed */
    const char *prefill;  /* borrowed: backend name; NULL: none was chosen */
    const char *decode;   /* borrowed: backend name; NULL: none was chosen */
    int status;
    double prefill_ms; /* < 0: no prefill answered */
    double ttfb_ms;    /* < 0: no byte of an answer from decode */
    double total_ms;
    int queued;      /* waited in the admission queue, queue_ms long */
    double queue_ms;
    size_t bytes_out;
    const char *outcome;  /* borrowed */
    const char *state;    /* borrowed: the request's state when it ended; NULL: left out */
    const char *trace_id; /* borrowed; NULL: none */
    /* How the request was served: "disaggregated" or "decode_only", why,
     * and the decode-only fallback taken after prefill failed (NULL:
     * left out of the line). */
    const char *decision;
    const char *decision_reason;
    const char *fallback;
    const char *dispatch; /* "serial" | "concurrent" (--dispatch); NULL: no prefill leg */
    int kv_waited;        /* decode sent X-KV-Wait-Ms (0: left out of the line): */
    double kv_wait_ms;    /* its value */
    int estimated; /* the two estimates below are set */
    long prompt_tokens_est;
    long uncached_tokens_est;
    /* Latency targets and prediction (predict.h): targets in ms (0: none),
     * the predicted TTFT when `predicted`, and the result ("met",
     * "missed", "refused", "failed"; NULL: no target). */
    double slo_ttft_ms, slo_tpot_ms;
    int predicted;
    double pred_ttft_ms;
    const char *slo;
} px_access;

/* Writes the access line, at level info but whatever --log-level says:
 * --access-log (px_access_enabled) turns access lines on and off on its own. */
void px_access_write(const px_access *a);
extern int px_access_enabled; /* 1 (the default): access lines are written */

#endif
