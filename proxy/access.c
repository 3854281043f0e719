/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/access.h"

#include <math.h>
#include <string.h>

#include "base/log.h"
#include "base/util.h"

int px_access_enabled = 1;

/* The line being built: pieces appended by hand, no printf (one line per
 * request), cut at the buffer's end as snprintf would cut it. */
typedef struct line {
    char buf[1024];
    size_t o;
} line;

static void put(line *l, const char *s, size_t n) {
    size_t room = sizeof l->buf - 1 - l->o;
    if (n > room) n = room;
    memcpy(l->buf + l->o, s, n);
    l->o += n;
}

static void puts_(line *l, const char *s) {
    put(l, s, strlen(s));
}

/* " key=" then the string s. */
static void kv(line *l, const char *key, const char *s) {
    puts_(l, key);
    puts_(l, s);
}

static void kv_u64(line *l, const char *key, uint64_t v) {
    char d[20], *s = px_u64_dec(d + sizeof d, v);
    puts_(l, key);
    put(l, s, (size_t)(d + sizeof d - s));
}

static void kv_int(line *l, const char *key, long v) {
    puts_(l, key);
    if (v < 0) put(l, "-", 1);
    char d[20], *s = px_u64_dec(d + sizeof d, v < 0 ? 0 - (uint64_t)v : (uint64_t)v);
    put(l, s, (size_t)(d + sizeof d - s));
}

/* Milliseconds as "%.2f". */
static void kv_ms(line *l, const char *key, double ms) {
    char t[32];
    size_t n = px_fmt_2dp(ms, t);
    puts_(l, key);
    put(l, t, n);
}

void px_access_write(const px_access *a) {
    if (!px_access_enabled) return;
    line l;
    char v[300];
    l.o = 0;
    kv(&l, "req=", a->req);
    puts_(&l, " msg=\"request\"");
    if (a->method && a->method[0]) kv(&l, " method=", a->method);
    kv(&l, " endpoint=", a->endpoint);
    if (a->client && a->client[0]) kv(&l, " client=", a->client);
    if (a->prefill) kv(&l, " prefill=", px_log_value(a->prefill, v, sizeof v));
    if (a->decode) kv(&l, " decode=", px_log_value(a->decode, v, sizeof v));
    kv_int(&l, " status=", a->status);
    if (a->prefill_ms >= 0) kv_ms(&l, " prefill_ms=", a->prefill_ms);
    if (a->ttfb_ms >= 0) kv_ms(&l, " ttfb_ms=", a->ttfb_ms);
    if (a->queued) kv_ms(&l, " queue_ms=", a->queue_ms);
    kv_ms(&l, " total_ms=", a->total_ms < 0 ? 0 : a->total_ms);
    kv_u64(&l, " bytes_out=", a->bytes_out);
    kv(&l, " outcome=", a->outcome);
    if (a->state) kv(&l, " state=", a->state);
    if (a->trace_id && a->trace_id[0]) kv(&l, " trace_id=", a->trace_id);
    if (a->decision) kv(&l, " decision=", a->decision);
    if (a->decision_reason) kv(&l, " decision_reason=", a->decision_reason);
    if (a->fallback) kv(&l, " fallback=", a->fallback);
    if (a->dispatch) kv(&l, " dispatch=", a->dispatch);
    if (a->kv_waited) kv_ms(&l, " kv_wait_ms=", a->kv_wait_ms);
    if (a->estimated) {
        kv_int(&l, " prompt_tokens_est=", a->prompt_tokens_est);
        kv_int(&l, " uncached_tokens_est=", a->uncached_tokens_est);
    }
    if (a->slo_ttft_ms > 0) kv_int(&l, " slo_ttft_ms=", lround(a->slo_ttft_ms));
    if (a->slo_tpot_ms > 0) kv_int(&l, " slo_tpot_ms=", lround(a->slo_tpot_ms));
    if (a->predicted) kv_ms(&l, " pred_ttft_ms=", a->pred_ttft_ms);
    if (a->slo) kv(&l, " slo=", a->slo);
    px_log_put_batched(PX_LOG_INFO, l.buf, l.o);
}
