/* SPDX-License-Identifier: Apache-2.0 */
/* W3C Trace Context (traceparent) for the upstream legs: parsing the
 * client's header, new trace and span ids, the child header each leg
 * carries. */
#include "proxy/trace.h"

#include <stdint.h>
#include <string.h>

#include "base/util.h"

static int lowhex(const char *s, size_t n, int nonzero) {
    int nz = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return 0;
        nz |= c != '0';
    }
    return !nonzero || nz;
}

int px_trace_parse(const char *tp, size_t n, char trace[33], char flags[3]) {
    /* version "-" trace-id "-" parent-id "-" flags (W3C Trace Context):
     * version 00 is exactly 55 characters; later versions may append
     * "-..." fields, which a version-00 reader ignores; ff is invalid. */
    if (!tp || n < 55 || tp[2] != '-' || tp[35] != '-' || tp[52] != '-') return 0;
    if (!lowhex(tp, 2, 0) || !memcmp(tp, "ff", 2)) return 0;
    if (!memcmp(tp, "00", 2) ? n != 55 : (n > 55 && tp[55] != '-')) return 0;
    if (!lowhex(tp + 3, 32, 1) || !lowhex(tp + 36, 16, 1) || !lowhex(tp + 53, 2, 0)) return 0;
    memcpy(trace, tp + 3, 32);
    trace[32] = '\0';
    memcpy(flags, tp + 53, 2);
    flags[2] = '\0';
    return 1;
}

void px_trace_new(char trace[33]) {
    px_hex64(trace, px_rand64() | 1);
    px_hex64(trace + 16, px_rand64());
    trace[32] = '\0';
}

/* A new span id: 16 hex digits, never all zero. */
void px_trace_span_new(char sp[17]) {
    px_hex64(sp, px_rand64() | 1);
    sp[16] = '\0';
}

/* A child span of the request's trace: same trace id and flags, the span
 * of the upstream leg (prefill or decode) as parent id. */
void px_trace_child(const char *trace, const char *span, const char *flags, char out[56]) {
    /* 00-<32 hex>-<16 hex>-<2 hex>: fixed widths, copied in place. */
    memcpy(out, "00-", 3);
    memcpy(out + 3, trace, 32);
    out[35] = '-';
    memcpy(out + 36, span, 16);
    out[52] = '-';
    memcpy(out + 53, flags, 2);
    out[55] = '\0';
}
