/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/otlp.h"

#include "proxy/curlx.h"
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "base/json.h"
#include "base/log.h"
#include "base/util.h"

#define MAX_ATTRS 22 /* the server span: HTTP, GenAI and pdproxy.* ones */
#define ATTR_LEN 136

typedef enum { A_STR, A_INT, A_BOOL } attr_type;

typedef struct attr {
    const char *key; /* static */
    attr_type type;
    long long i;
    char s[ATTR_LEN];
} attr;

/* One span, copied by value into the queue: no pointer into a request. */
typedef struct span {
    char trace_id[33], span_id[17], parent_id[17];
    char name[48];
    int kind;                  /* OTLP SpanKind: 2 server, 3 client */
    int error;                 /* OTLP Status: 2 error, else unset */
    uint64_t start_ns, end_ns; /* Unix time */
    int nattrs;
    attr attrs[MAX_ATTRS];
} span;

typedef enum { S_ALWAYS_ON, S_ALWAYS_OFF, S_RATIO } sampler_kind;

static struct {
    int on;
    char url[1024];
    char service[128];
    int nres; /* OTEL_RESOURCE_ATTRIBUTES, service.name left out */
    char res_key[16][64], res_val[16][128];
    struct curl_slist *headers; /* owned */
    long timeout_ms;
    size_t cap, batch;
    long delay_ms;
    sampler_kind root;  /* for traces this request starts */
    int parent_based;   /* follow the client's sampled flag */
    uint64_t threshold; /* S_RATIO: sampled when the id's low 64 bits < this */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    span *q; /* owned: ring of cap spans */
    size_t head, len;
    int stop;
    uint64_t stop_deadline; /* px_now_ns(): past it, stop exporting what is left */
    /* Read by the transfer's progress callback without the lock: stopping
     * cuts an export in flight at the deadline, so exit waits at most the
     * export timeout in all (it waited for the export in flight, then a
     * whole timeout more for the last batch). */
    atomic_int stopping;
    atomic_ullong deadline_ns;
    size_t answer_bytes; /* of the collector's answer to the export in flight */
    pthread_t th;
    atomic_ullong exported, dropped_full, dropped_error;
} X = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* ---------- configuration ---------- */

static const char *env(const char *k) {
    const char *v = getenv(k);
    return v && *v ? v : NULL;
}

static int env_long(const char *k, long def, long lo, long hi, long *out, char *err, size_t n) {
    const char *v = env(k);
    if (!v) {
        *out = def;
        return 0;
    }
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || x < lo || x > hi) {
        snprintf(err, n, "%s=%s: expected an integer in [%ld, %ld]", k, v, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

static int parse_sampler(char *err, size_t n) {
    const char *s = env("OTEL_TRACES_SAMPLER");
    if (!s) s = "parentbased_always_on";
    X.parent_based = !strncmp(s, "parentbased_", 12);
    const char *base = X.parent_based ? s + 12 : s;
    if (!strcmp(base, "always_on")) {
        X.root = S_ALWAYS_ON;
    } else if (!strcmp(base, "always_off")) {
        X.root = S_ALWAYS_OFF;
    } else if (!strcmp(base, "traceidratio")) {
        X.root = S_RATIO;
        const char *a = env("OTEL_TRACES_SAMPLER_ARG");
        char *end = NULL;
        double r = a ? strtod(a, &end) : 1.0;
        if (a && (*end || r < 0 || r > 1)) {
            snprintf(err, n, "OTEL_TRACES_SAMPLER_ARG=%s: expected a ratio in [0, 1]", a);
            return -1;
        }
        X.threshold = r >= 1.0 ? UINT64_MAX : (uint64_t)(r * 18446744073709551616.0);
    } else {
        snprintf(err, n,
                 "OTEL_TRACES_SAMPLER=%s: expected always_on, always_off, traceidratio or "
                 "parentbased_ one of them",
                 s);
        return -1;
    }
    return 0;
}

/* OTEL_RESOURCE_ATTRIBUTES: "k=v,k2=v2", values percent-decoded; at most
 * 16 attributes. service.name there is used when OTEL_SERVICE_NAME is not
 * set. */
static int parse_resource(char *err, size_t n) {
    const char *r = env("OTEL_RESOURCE_ATTRIBUTES");
    if (!r) return 0;
    char *copy = px_xstrdup(r), *save = NULL;
    int rc = 0;
    for (char *kv = strtok_r(copy, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
        while (*kv == ' ')
            kv++;
        char *eq = strchr(kv, '=');
        if (!eq || eq == kv || (size_t)(eq - kv) >= sizeof X.res_key[0]) {
            snprintf(err, n, "OTEL_RESOURCE_ATTRIBUTES: %s is not key=value", kv);
            rc = -1;
            break;
        }
        *eq = '\0';
        char val[128];
        px_pct_decode(eq + 1, strlen(eq + 1), val, sizeof val);
        if (!strcmp(kv, "service.name")) {
            if (!env("OTEL_SERVICE_NAME")) snprintf(X.service, sizeof X.service, "%s", val);
            continue;
        }
        if (X.nres == 16) {
            snprintf(err, n, "OTEL_RESOURCE_ATTRIBUTES: more than 16 attributes");
            rc = -1;
            break;
        }
        snprintf(X.res_key[X.nres], sizeof X.res_key[0], "%s", kv);
        snprintf(X.res_val[X.nres], sizeof X.res_val[0], "%s", val);
        X.nres++;
    }
    free(copy);
    return rc;
}

/* "k=v,k2=v2" (values percent-decoded, as the specification asks). */
static int parse_headers(char *err, size_t n) {
    const char *h = env("OTEL_EXPORTER_OTLP_TRACES_HEADERS");
    if (!h) h = env("OTEL_EXPORTER_OTLP_HEADERS");
    X.headers = curl_slist_append(NULL, "Content-Type: application/json");
    X.headers = curl_slist_append(X.headers, "Expect:");
    if (!h) return 0;
    char *copy = px_xstrdup(h), *save = NULL;
    for (char *kv = strtok_r(copy, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(kv, '=');
        if (!eq || eq == kv) {
            snprintf(err, n, "OTEL_EXPORTER_OTLP_HEADERS: %s is not key=value", kv);
            free(copy);
            return -1;
        }
        *eq = '\0';
        char line[512], val[384];
        px_pct_decode(eq + 1, strlen(eq + 1), val, sizeof val);
        while (*kv == ' ')
            kv++;
        snprintf(line, sizeof line, "%s: %s", kv, val);
        if (strpbrk(line, "\r\n")) {
            snprintf(err, n, "OTEL_EXPORTER_OTLP_HEADERS: control character in %s", kv);
            free(copy);
            return -1;
        }
        X.headers = curl_slist_append(X.headers, line);
    }
    free(copy);
    return 0;
}

static void *export_main(void *arg);

int px_otlp_start(char *err, size_t errlen) {
    const char *disabled = env("OTEL_SDK_DISABLED");
    const char *exporter = env("OTEL_TRACES_EXPORTER");
    const char *full = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    const char *base = env("OTEL_EXPORTER_OTLP_ENDPOINT");
    if ((disabled && !strcasecmp(disabled, "true")) || (exporter && !strcmp(exporter, "none")) ||
        (!full && !base))
        return 0;
    if (exporter && strcmp(exporter, "otlp")) {
        snprintf(err, errlen, "OTEL_TRACES_EXPORTER=%s: only otlp (or none) is supported",
                 exporter);
        return -1;
    }
    const char *proto = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL");
    if (!proto) proto = env("OTEL_EXPORTER_OTLP_PROTOCOL");
    if (proto && strcmp(proto, "http/json")) {
        snprintf(err, errlen, "OTEL_EXPORTER_OTLP_PROTOCOL=%s: pdproxy exports http/json only",
                 proto);
        return -1;
    }
    if (full) {
        snprintf(X.url, sizeof X.url, "%s", full);
    } else {
        size_t n = strlen(base);
        while (n && base[n - 1] == '/')
            n--;
        snprintf(X.url, sizeof X.url, "%.*s/v1/traces", (int)n, base);
    }
    if (strncmp(X.url, "http://", 7) && strncmp(X.url, "https://", 8)) {
        snprintf(err, errlen, "OTLP endpoint %s: expected an http:// or https:// URL", X.url);
        return -1;
    }
    if (!px_curl()) { /* loaded here: export is libcurl's job */
        snprintf(err, errlen, "trace export needs libcurl, which cannot be loaded");
        return -1;
    }
    snprintf(X.service, sizeof X.service, "%s",
             env("OTEL_SERVICE_NAME") ? env("OTEL_SERVICE_NAME") : "pdproxy");
    long cap, batch, delay, timeout;
    if (env_long("OTEL_BSP_MAX_QUEUE_SIZE", 2048, 1, 1 << 20, &cap, err, errlen) ||
        env_long("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512, 1, 1 << 20, &batch, err, errlen) ||
        env_long("OTEL_BSP_SCHEDULE_DELAY", 5000, 1, 3600000, &delay, err, errlen) ||
        env_long("OTEL_EXPORTER_OTLP_TIMEOUT", 10000, 1, 3600000, &timeout, err, errlen) ||
        parse_sampler(err, errlen) || parse_resource(err, errlen) || parse_headers(err, errlen)) {
        curl_slist_free_all(X.headers);
        X.headers = NULL;
        return -1;
    }
    X.cap = (size_t)cap;
    X.batch = (size_t)(batch < cap ? batch : cap);
    X.delay_ms = delay;
    X.timeout_ms = timeout;
    X.q = px_xcalloc(X.cap, sizeof *X.q);
    X.stop = 0;
    atomic_store(&X.stopping, 0);
    X.on = 1;
    if (pthread_create(&X.th, NULL, export_main, NULL)) {
        snprintf(err, errlen, "cannot start the trace export thread");
        X.on = 0;
        free(X.q);
        X.q = NULL;
        return -1;
    }
    PX_LOG(PX_LOG_INFO, "msg=\"exporting traces\" endpoint=%s service=%s sampler=%s", X.url,
           X.service,
           env("OTEL_TRACES_SAMPLER") ? env("OTEL_TRACES_SAMPLER") : "parentbased_always_on");
    return 0;
}

int px_otlp_enabled(void) {
    return X.on;
}

/* ---------- sampling ---------- */

static uint64_t low64(const char *hex) {
    uint64_t v = 0;
    for (int i = 16; i < 32; i++) {
        char c = hex[i];
        v = v << 4 | (uint64_t)(c <= '9' ? c - '0' : c - 'a' + 10);
    }
    return v;
}

void px_otlp_sample(const char trace_id[33], const char *parent_flags, char flags[3]) {
    if (!X.on) return;
    int sampled;
    if (parent_flags && X.parent_based) {
        sampled = (int)(strtoul(parent_flags, NULL, 16) & 1);
    } else if (X.root == S_ALWAYS_ON) {
        sampled = 1;
    } else if (X.root == S_ALWAYS_OFF) {
        sampled = 0;
    } else {
        sampled = X.threshold == UINT64_MAX || low64(trace_id) < X.threshold;
    }
    /* Keep the other flag bits of the client's flags; set or clear "sampled". */
    static const char hex[] = "0123456789abcdef";
    unsigned v = 0;
    if (parent_flags) sscanf(parent_flags, "%2x", &v);
    v = sampled ? (v | 1u) : (v & ~1u);
    flags[0] = hex[(v >> 4) & 15];
    flags[1] = hex[v & 15];
    flags[2] = '\0';
}

/* ---------- building spans ---------- */

/* Copies at most cap-1 bytes of src and a NUL. */
static void copy(char *dst, const char *src, size_t cap) {
    size_t n = strnlen(src, cap - 1);
    memcpy(dst, src, n);
    dst[n] = '\0';
}

static void add_str(span *s, const char *k, const char *v) {
    if (!v || s->nattrs >= MAX_ATTRS) return;
    attr *a = &s->attrs[s->nattrs++];
    a->key = k;
    a->type = A_STR;
    copy(a->s, v, sizeof a->s);
}

static void add_int(span *s, const char *k, long long v) {
    if (s->nattrs >= MAX_ATTRS) return;
    attr *a = &s->attrs[s->nattrs++];
    a->key = k;
    a->type = A_INT;
    a->i = v;
}

static void add_bool(span *s, const char *k, int v) {
    if (s->nattrs >= MAX_ATTRS) return;
    attr *a = &s->attrs[s->nattrs++];
    a->key = k;
    a->type = A_BOOL;
    a->i = !!v;
}

/* remote_request_id and prompt tokens from prefill's answer, when there. */
static void from_prefill_answer(const px_otlp_req *q, char rrid[ATTR_LEN], long long *tokens,
                                int *kvp) {
    rrid[0] = '\0';
    *tokens = -1;
    *kvp = 0;
    if (!q->presp || !q->presp_len) return;
    /* One pass over the top level (the last of duplicate keys wins, as in
     * px_json_find); this runs on the worker thread. */
    px_json_iter it;
    px_json_member cur, kv = {0}, usage = {0}, k;
    if (px_json_iter_init(&it, q->presp, q->presp_len) < 0) return;
    int r;
    while ((r = px_json_iter_next(&it, &cur)) == 1) {
        if (px_json_str_eq(cur.key, cur.key_len, "kv_transfer_params"))
            kv = cur;
        else if (px_json_str_eq(cur.key, cur.key_len, "usage"))
            usage = cur;
    }
    if (r < 0) return;
    if (kv.val && kv.type == PX_JSON_OBJECT) {
        *kvp = 1;
        if (px_json_find(kv.val, kv.val_len, "remote_request_id", &k) && k.type == PX_JSON_STRING &&
            px_json_str_decode(k.val + 1, k.val_len - 2, rrid, ATTR_LEN) < 0)
            rrid[0] = '\0';
    }
    if (usage.val && usage.type == PX_JSON_OBJECT &&
        px_json_find(usage.val, usage.val_len, "prompt_tokens", &k) && k.type == PX_JSON_NUMBER)
        *tokens = strtoll(k.val, NULL, 10);
}

static void span_init(span *s, const px_otlp_req *q, const char *id, const char *parent,
                      const char *name, int kind, uint64_t start, uint64_t end, int64_t off) {
    memset(s, 0, offsetof(span, attrs));
    copy(s->trace_id, q->trace_id, sizeof s->trace_id);
    copy(s->span_id, id, sizeof s->span_id);
    copy(s->parent_id, parent ? parent : "", sizeof s->parent_id);
    copy(s->name, name, sizeof s->name);
    s->kind = kind;
    s->start_ns = (uint64_t)((int64_t)start + off);
    s->end_ns = (uint64_t)((int64_t)(end >= start ? end : start) + off);
}

static void enqueue(const span *spans, int n) {
    pthread_mutex_lock(&X.mu);
    int room = (int)(X.cap - X.len);
    int take = n < room ? n : room;
    for (int i = 0; i < take; i++) {
        X.q[(X.head + X.len) % X.cap] = spans[i];
        X.len++;
    }
    int wake = X.len >= X.batch;
    pthread_mutex_unlock(&X.mu);
    if (take < n) atomic_fetch_add(&X.dropped_full, (unsigned long long)(n - take));
    if (wake) pthread_cond_signal(&X.cv);
}

/* error.type for a failed answer: its status code as text. */
static const char *status_text(int status) {
    static const char *const t[] = {"500", "501", "502", "503", "504"};
    return status >= 500 && status <= 504 ? t[status - 500] : "_OTHER";
}

/* The HTTP client attributes of a leg to `backend` ("host:port", an IPv6
 * host in brackets): server.address is the host alone, server.port a number,
 * url.full the URL requested. */
static void client_attrs(span *s, const char *method, const char *backend, int https,
                         const char *path, int status) {
    char host[ATTR_LEN], url[ATTR_LEN];
    const char *colon = strrchr(backend, ':');
    size_t hl = colon ? (size_t)(colon - backend) : strlen(backend);
    const char *h = backend;
    if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') {
        h++;
        hl -= 2;
    }
    snprintf(host, sizeof host, "%.*s", (int)hl, h);
    snprintf(url, sizeof url, "%s://%s%s", https ? "https" : "http", backend, path ? path : "");
    add_str(s, "http.request.method", method);
    add_str(s, "server.address", host);
    if (colon) add_int(s, "server.port", strtol(colon + 1, NULL, 10));
    add_str(s, "url.full", url);
    if (status) add_int(s, "http.response.status_code", status);
    if (!status || status >= 500) add_str(s, "error.type", status ? status_text(status) : "_OTHER");
}

void px_otlp_submit(const px_otlp_req *q) {
    if (!X.on || !q->flags || !(strtoul(q->flags, NULL, 16) & 1)) return;
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    int64_t off = (int64_t)((uint64_t)rt.tv_sec * 1000000000ull + (uint64_t)rt.tv_nsec) -
                  (int64_t)px_now_ns();
    char rrid[ATTR_LEN];
    long long tokens;
    int kvp;
    from_prefill_answer(q, rrid, &tokens, &kvp);
    /* What the proxy decided: a prefill was chosen (whatever came of it),
     * decode alone (no prefill could serve), or neither (/v1/models, or
     * refused before any backend). */
    const char *decision = q->prefill ? "prefill_decode"
                           : q->decode && q->route && strcmp(q->route, "/v1/models") ? "decode_only"
                                                                                     : "none";
    span sp[3];
    int n = 0;
    /* Server span: named "METHOD route" (HTTP semantic conventions), or the
     * method alone when the path is not one of the proxy's routes. */
    char name[48];
    const char *method = q->method ? q->method : "POST";
    if (q->templated)
        snprintf(name, sizeof name, "%s %s", method, q->route ? q->route : "");
    else
        snprintf(name, sizeof name, "%s", method);
    char path[ATTR_LEN];
    snprintf(path, sizeof path, "%.*s", (int)(q->path ? q->path_len : 0), q->path ? q->path : "");
    char model[ATTR_LEN] = "";
    if (q->model && px_json_str_decode(q->model, q->model_len, model, sizeof model) < 0)
        model[0] = '\0';
    span *r = &sp[n++];
    span_init(r, q, q->span_root, q->parent_span, name, 2, q->t_start, q->t_end, off);
    add_str(r, "http.request.method", method);
    if (q->templated) add_str(r, "http.route", q->route);
    add_str(r, "url.scheme", q->scheme ? q->scheme : "http");
    add_str(r, "url.path", path[0] ? path : q->route);
    add_int(r, "http.response.status_code", q->status);
    if (q->status >= 500) add_str(r, "error.type", status_text(q->status));
    if (q->operation) {
        add_str(r, "gen_ai.operation.name", q->operation);
        if (model[0]) add_str(r, "gen_ai.request.model", model);
        if (tokens >= 0) add_int(r, "gen_ai.usage.input_tokens", tokens);
    }
    add_str(r, "pdproxy.request_id", q->request_id);
    add_str(r, "pdproxy.outcome", q->outcome);
    add_str(r, "pdproxy.disaggregation", decision);
    add_str(r, "pdproxy.prefill.backend", q->prefill);
    add_str(r, "pdproxy.decode.backend", q->decode);
    if (rrid[0]) add_str(r, "pdproxy.remote_request_id", rrid);
    if (q->decode) add_bool(r, "pdproxy.stream", q->streamed);
    if (q->queued) add_int(r, "pdproxy.queue.wait_us", (long long)(q->queue_wait_ns / 1000));
    if (q->slo_ttft_ms > 0) add_int(r, "pdproxy.slo.ttft_ms", (long long)q->slo_ttft_ms);
    if (q->slo_tpot_ms > 0) add_int(r, "pdproxy.slo.tpot_ms", (long long)q->slo_tpot_ms);
    if (q->predicted) add_int(r, "pdproxy.predicted_ttft_us", (long long)(q->pred_ttft_ms * 1e3));
    if (q->slo) add_str(r, "pdproxy.slo.result", q->slo);
    r->error = q->status >= 500;

    /* Client spans, one per leg: named by the method, with the backend's
     * host and port apart and the full URL (HTTP semantic conventions). The
     * prefill leg is always a POST of the client's endpoint. */
    if (q->prefill && q->t_prefill_start) {
        span *p = &sp[n++];
        span_init(p, q, q->span_prefill, q->span_root, "POST", 3, q->t_prefill_start,
                  q->t_prefill_end ? q->t_prefill_end : q->t_end, off);
        client_attrs(p, "POST", q->prefill, q->prefill_https, path[0] ? path : q->route,
                     q->prefill_status);
        add_str(p, "pdproxy.role", "prefill");
        add_int(p, "pdproxy.attempts", q->prefill_attempts);
        add_bool(p, "pdproxy.kv_transfer_params", kvp);
        if (rrid[0]) add_str(p, "pdproxy.remote_request_id", rrid);
        if (q->operation) {
            add_str(p, "gen_ai.operation.name", q->operation);
            if (model[0]) add_str(p, "gen_ai.request.model", model);
            if (tokens >= 0) add_int(p, "gen_ai.usage.input_tokens", tokens);
        }
        p->error = !q->t_prefill_end || q->prefill_status < 200 || q->prefill_status >= 300;
    }
    if (q->decode && q->t_decode_start) {
        span *d = &sp[n++];
        span_init(d, q, q->span_decode, q->span_root, method, 3, q->t_decode_start, q->t_end, off);
        client_attrs(d, method, q->decode, q->decode_https, path[0] ? path : q->route,
                     q->decode_status);
        add_str(d, "pdproxy.role", "decode");
        add_int(d, "pdproxy.attempts", q->decode_attempts);
        add_bool(d, "pdproxy.stream", q->streamed);
        if (rrid[0]) add_str(d, "pdproxy.remote_request_id", rrid);
        if (q->operation) {
            add_str(d, "gen_ai.operation.name", q->operation);
            if (model[0]) add_str(d, "gen_ai.request.model", model);
        }
        d->error = q->decode_status == 0 || q->decode_status >= 500;
    }
    enqueue(sp, n);
}

/* ---------- export ---------- */

/* Appends v in decimal; printf costs more than the rest of a span. */
static void put_u64(px_buf *b, unsigned long long v) {
    char d[24];
    int i = sizeof d;
    do {
        d[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    px_buf_append(b, d + i, sizeof d - (size_t)i);
}

static void put_i64(px_buf *b, long long v) {
    if (v < 0) {
        px_buf_append(b, "-", 1);
        put_u64(b, 0ull - (unsigned long long)v);
    } else {
        put_u64(b, (unsigned long long)v);
    }
}

/* A JSON string; most values need no escape and go in one append. */
static void put_str(px_buf *b, const char *v) {
    size_t n = strlen(v), i = 0;
    while (i < n && (unsigned char)v[i] >= 0x20 && v[i] != '"' && v[i] != '\\')
        i++;
    if (i < n) {
        px_buf_append_json_str(b, v, n);
        return;
    }
    px_buf_reserve(b, n + 2);
    px_buf_append(b, "\"", 1);
    px_buf_append(b, v, n);
    px_buf_append(b, "\"", 1);
}

static void put_span(px_buf *b, const span *s) {
    px_buf_appends(b, "{\"traceId\":\"");
    px_buf_append(b, s->trace_id, 32);
    px_buf_appends(b, "\",\"spanId\":\"");
    px_buf_append(b, s->span_id, 16);
    if (s->parent_id[0]) {
        px_buf_appends(b, "\",\"parentSpanId\":\"");
        px_buf_append(b, s->parent_id, 16);
    }
    px_buf_appends(b, "\",\"name\":");
    put_str(b, s->name);
    px_buf_appends(b, s->kind == 2 ? ",\"kind\":2" : ",\"kind\":3");
    px_buf_appends(b, ",\"startTimeUnixNano\":\"");
    put_u64(b, s->start_ns);
    px_buf_appends(b, "\",\"endTimeUnixNano\":\"");
    put_u64(b, s->end_ns);
    px_buf_appends(b, "\",\"attributes\":[");
    for (int i = 0; i < s->nattrs; i++) {
        const attr *a = &s->attrs[i];
        /* Keys are this file's literals: no escaping needed. */
        px_buf_appends(b, i ? ",{\"key\":\"" : "{\"key\":\"");
        px_buf_appends(b, a->key);
        if (a->type == A_STR) {
            px_buf_appends(b, "\",\"value\":{\"stringValue\":");
            put_str(b, a->s);
            px_buf_appends(b, "}}");
        } else if (a->type == A_INT) {
            px_buf_appends(b, "\",\"value\":{\"intValue\":\"");
            put_i64(b, a->i);
            px_buf_appends(b, "\"}}");
        } else {
            px_buf_appends(b, a->i ? "\",\"value\":{\"boolValue\":true}}"
                                   : "\",\"value\":{\"boolValue\":false}}");
        }
    }
    px_buf_appends(b, s->error ? "],\"status\":{\"code\":2}}" : "],\"status\":{\"code\":0}}");
}

static void serialize(px_buf *b, const span *spans, size_t n) {
    px_buf_reset(b);
    px_buf_reserve(b, 512 + n * 1200);
    px_buf_appends(b, "{\"resourceSpans\":[{\"resource\":{\"attributes\":["
                      "{\"key\":\"service.name\",\"value\":{\"stringValue\":");
    px_buf_append_json_str(b, X.service, strlen(X.service));
    px_buf_printf(b, "}},{\"key\":\"service.version\",\"value\":{\"stringValue\":\"%s\"}}",
                  PDPROXY_VERSION);
    for (int i = 0; i < X.nres; i++) {
        px_buf_appends(b, ",{\"key\":");
        px_buf_append_json_str(b, X.res_key[i], strlen(X.res_key[i]));
        px_buf_appends(b, ",\"value\":{\"stringValue\":");
        px_buf_append_json_str(b, X.res_val[i], strlen(X.res_val[i]));
        px_buf_appends(b, "}}");
    }
    px_buf_printf(b,
                  "]},"
                  "\"scopeSpans\":[{\"scope\":{\"name\":\"pdproxy\",\"version\":\"%s\"},"
                  "\"spans\":[",
                  PDPROXY_VERSION);
    for (size_t i = 0; i < n; i++) {
        if (i) px_buf_append(b, ",", 1);
        put_span(b, &spans[i]);
    }
    px_buf_appends(b, "]}]}]}");
}

/* The collector's answer is not read, only counted: past 64 KiB the
 * transfer is cut (a collector sending an endless body kept the exporter
 * busy until the timeout). */
#define ANSWER_MAX (64 * 1024)

static size_t discard(char *p, size_t size, size_t n, void *arg) {
    (void)p;
    (void)arg;
    X.answer_bytes += size * n;
    return X.answer_bytes > ANSWER_MAX ? 0 : size * n;
}

static int progress(void *arg, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un) {
    (void)arg, (void)dt, (void)dn, (void)ut, (void)un;
    return atomic_load(&X.stopping) && px_now_ns() >= atomic_load(&X.deadline_ns);
}

/* POSTs one batch; the collector's answer decides whether it counts as
 * exported. Failed batches are dropped (counted), not retried: a retry
 * queue would grow without bound behind a collector that is down. */
static void post(CURL *c, px_buf *b, size_t n) {
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, b->data);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)b->len);
    long timeout = X.timeout_ms;
    if (atomic_load(&X.stopping)) { /* what is left of the exit's budget */
        uint64_t now = px_now_ns(), end = atomic_load(&X.deadline_ns);
        if (now >= end) {
            atomic_fetch_add(&X.dropped_error, n);
            return;
        }
        timeout = (long)((end - now) / 1000000u) + 1;
    }
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout);
    X.answer_bytes = 0;
    CURLcode rc = curl_easy_perform(c);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    if (rc == CURLE_WRITE_ERROR && X.answer_bytes > ANSWER_MAX) rc = CURLE_OK; /* cut by us */
    if (rc == CURLE_OK && code >= 200 && code < 300) {
        atomic_fetch_add(&X.exported, n);
        return;
    }
    atomic_fetch_add(&X.dropped_error, n);
    PX_LOG(
        PX_LOG_WARN,
        "msg=\"trace export failed; spans dropped\" endpoint=%s spans=%zu status=%ld error=\"%s\"",
        X.url, n, code, rc == CURLE_OK ? "" : curl_easy_strerror(rc));
}

static void *export_main(void *arg) {
    (void)arg;
    CURL *c = curl_easy_init();
    if (!c) return NULL;
    curl_easy_setopt(c, CURLOPT_URL, X.url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, X.headers);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, X.timeout_ms);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, X.timeout_ms);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, discard);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, progress);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    span *batch = px_xcalloc(X.batch, sizeof *batch);
    px_buf b;
    px_buf_init(&b);
    pthread_mutex_lock(&X.mu);
    for (;;) {
        if (!X.stop && X.len < X.batch) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            long long ns = (long long)ts.tv_nsec + X.delay_ms * 1000000ll;
            ts.tv_sec += (time_t)(ns / 1000000000ll);
            ts.tv_nsec = (long)(ns % 1000000000ll);
            pthread_cond_timedwait(&X.cv, &X.mu, &ts);
        }
        size_t n = X.len < X.batch ? X.len : X.batch;
        for (size_t i = 0; i < n; i++)
            batch[i] = X.q[(X.head + i) % X.cap];
        X.head = (X.head + n) % X.cap;
        X.len -= n;
        int stop = X.stop;
        pthread_mutex_unlock(&X.mu);
        if (n) {
            serialize(&b, batch, n);
            post(c, &b, n);
        }
        pthread_mutex_lock(&X.mu);
        if (stop && X.len && px_now_ns() > X.stop_deadline) {
            /* Shutting down behind a slow collector: what is left is dropped. */
            atomic_fetch_add(&X.dropped_error, X.len);
            X.len = 0;
        }
        if (stop && X.len == 0) break;
    }
    pthread_mutex_unlock(&X.mu);
    px_buf_cleanup(&b);
    free(batch);
    curl_easy_cleanup(c);
    return NULL;
}

void px_otlp_stop(void) {
    if (!X.on) return;
    pthread_mutex_lock(&X.mu);
    X.stop = 1;
    X.stop_deadline = px_now_ns() + (uint64_t)X.timeout_ms * 1000000u;
    atomic_store(&X.deadline_ns, X.stop_deadline);
    atomic_store(&X.stopping, 1);
    pthread_cond_signal(&X.cv);
    pthread_mutex_unlock(&X.mu);
    pthread_join(X.th, NULL);
    X.on = 0;
    free(X.q);
    X.q = NULL;
    curl_slist_free_all(X.headers);
    X.headers = NULL;
}

void px_otlp_get_stats(px_otlp_stats *st) {
    st->exported = atomic_load(&X.exported);
    st->dropped_full = atomic_load(&X.dropped_full);
    st->dropped_error = atomic_load(&X.dropped_error);
    pthread_mutex_lock(&X.mu);
    st->queued = X.len;
    pthread_mutex_unlock(&X.mu);
}
