/* SPDX-License-Identifier: Apache-2.0 */
/* Trace export over OTLP/HTTP with the JSON encoding: one server span per
 * request and a client span for each of its prefill and decode legs, whose
 * ids are the ones sent to the engines in `traceparent`, so the engines'
 * spans nest under the proxy's.
 *
 * Configured by the standard OpenTelemetry environment variables, read once
 * by px_otlp_start():
 *   OTEL_EXPORTER_OTLP_TRACES_ENDPOINT  full URL, used as is; else
 *   OTEL_EXPORTER_OTLP_ENDPOINT         base URL, "/v1/traces" appended.
 *                                       Neither set: no export at all.
 *   OTEL_EXPORTER_OTLP_HEADERS          "k=v,k2=v2" added to each export
 *   OTEL_EXPORTER_OTLP_TIMEOUT          ms per export request (10000)
 *   OTEL_SERVICE_NAME                   resource service.name ("pdproxy")
 *   OTEL_RESOURCE_ATTRIBUTES            "k=v,..." more resource attributes
 *   OTEL_TRACES_SAMPLER[_ARG]           always_on, always_off, traceidratio,
 *                                       parentbased_* (default
 *                                       parentbased_always_on)
 *   OTEL_SDK_DISABLED=true, OTEL_TRACES_EXPORTER=none   no export
 *   OTEL_BSP_MAX_QUEUE_SIZE (2048), OTEL_BSP_MAX_EXPORT_BATCH_SIZE (512),
 *   OTEL_BSP_SCHEDULE_DELAY (5000 ms)   the batch processor
 *
 * Threads: worker threads call px_otlp_sample() and px_otlp_submit(), which
 * only copy the spans into a bounded queue under a short lock; a background
 * thread batches and POSTs them with libcurl. When the queue is full (the
 * collector is slow or down), new spans are dropped and counted, so memory
 * stays bounded and requests never wait for the collector. */
#ifndef PX_OTLP_H
#define PX_OTLP_H

#include <stddef.h>
#include <stdint.h>

/* Reads the environment and starts the export thread when an endpoint is
 * set. Returns 0 (export on or off), or -1 with a message in err for a bad
 * setting. Call once, after curl_global_init, before any worker runs. */
int px_otlp_start(char *err, size_t errlen);

/* Exports what is queued (bounded by the export timeout) and stops the
 * thread. A no-op when export is off. */
void px_otlp_stop(void);

/* Whether spans are exported at all. */
int px_otlp_enabled(void);

/* The sampling decision for a request's trace, written as its trace-flags
 * ("01" sampled, "00" not) into flags. parent_flags: the client's flags, or
 * NULL when the request starts a new trace. With export off, flags is left
 * as it is (the client's decision, or sampled for a new trace). */
void px_otlp_sample(const char trace_id[33], const char *parent_flags, char flags[3]);

/* What one finished request was, for its spans. Times are px_now_ns()
 * (monotonic); 0: that step did not happen. Strings are borrowed for the
 * call only; NULL: unknown or none. */
typedef struct px_otlp_req {
    const char *trace_id;    /* 32 hex */
    const char *flags;       /* 2 hex: nothing is exported unless sampled */
    const char *parent_span; /* the client's span id (16 hex), or NULL */
    const char *span_root, *span_prefill, *span_decode; /* 16 hex each */
    const char *method, *route, *request_id, *outcome;
    int status; /* the client's status */
    uint64_t t_start, t_end;
    const char *prefill; /* backend name; NULL: no prefill chosen */
    int prefill_status, prefill_attempts;
    uint64_t t_prefill_start, t_prefill_end;
    const char *decode; /* backend name; NULL: no decode chosen */
    int decode_status, decode_attempts, streamed;
    int queued;             /* waited in the admission queue (admission.h) ... */
    uint64_t queue_wait_ns; /* ... this long */
    uint64_t t_decode_start;
    const char *presp; /* prefill's answer (kv_transfer_params, usage), or NULL */
    size_t presp_len;
    /* For the HTTP and GenAI semantic conventions: */
    const char *scheme;        /* the client's: "http" or "https" */
    const char *path;          /* url.path the client asked for (no query) */
    size_t path_len;           /* bytes of path */
    int templated;             /* route is an endpoint the proxy knows (http.route) */
    int prefill_https, decode_https;
    const char *operation;     /* gen_ai.operation.name, or NULL: not a GenAI call */
    const char *model;         /* the body's "model" as raw JSON string bytes, or NULL */
    size_t model_len;
    /* Latency targets (ms, 0: none), the predicted TTFT when `predicted`,
     * and the result against the targets (NULL: none); predict.h. */
    double slo_ttft_ms, slo_tpot_ms;
    int predicted;
    double pred_ttft_ms;
    const char *slo;
} px_otlp_req;

/* Queues the request's spans when it is sampled and export is on. */
void px_otlp_submit(const px_otlp_req *q);

typedef struct px_otlp_stats {
    unsigned long long exported;      /* spans the collector accepted */
    unsigned long long dropped_full;  /* spans dropped: queue full */
    unsigned long long dropped_error; /* spans dropped: export failed */
    unsigned long long queued;        /* spans waiting now */
} px_otlp_stats;

void px_otlp_get_stats(px_otlp_stats *st);

#endif
