/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/usage.h"

#include <stdio.h>
#include <string.h>

#include "base/json.h"

/* The number text of prompt_tokens_details.cached_tokens in the usage
 * member u: 1 with its span, else 0. */
static int cached_in(const px_json_member *u, const char **v, size_t *vl) {
    px_json_member d, c;
    if (!u->val || u->type != PX_JSON_OBJECT) return 0;
    if (!px_json_find(u->val, u->val_len, "prompt_tokens_details", &d) || d.type != PX_JSON_OBJECT)
        return 0;
    if (!px_json_find(d.val, d.val_len, "cached_tokens", &c) || c.type != PX_JSON_NUMBER) return 0;
    *v = c.val;
    *vl = c.val_len;
    return 1;
}

/* The number text of usage.prompt_tokens_details.cached_tokens in the JSON
 * object json[0..n): 1 with its span, else 0. */
static int cached_span(const char *json, size_t n, const char **v, size_t *vl) {
    px_json_member u;
    if (!px_json_find(json, n, "usage", &u) || u.type != PX_JSON_OBJECT) return 0;
    return cached_in(&u, v, vl);
}

/* Copies the number text v[0..vl) into out: 1, or 0 when it does not fit. */
static int cached_copy(const char *v, size_t vl, char out[24]) {
    if (vl >= 24) return 0;
    memcpy(out, v, vl);
    out[vl] = '\0';
    return 1;
}

int px_usage_cached_tokens(const char *json, size_t n, char out[24]) {
    const char *v;
    size_t vl;
    return json && cached_span(json, n, &v, &vl) && cached_copy(v, vl, out);
}

int px_usage_cached_tokens_in(const px_json_member *usage, char out[24]) {
    const char *v;
    size_t vl;
    return cached_in(usage, &v, &vl) && cached_copy(v, vl, out);
}

void px_usage_init(px_usage *u, const char *cached, int sse, size_t max_hold, px_usage_out out,
                   void *arg) {
    memset(u, 0, sizeof *u);
    snprintf(u->cached, sizeof u->cached, "%s", cached);
    u->sse = sse;
    u->active = 1;
    u->max_hold = max_hold;
    u->out = out;
    u->arg = arg;
    px_buf_init(&u->held);
}

static void emit(px_usage *u, const char *p, size_t n) {
    if (n) u->out(u->arg, p, n);
}

/* Whether an SSE event is the usage chunk a stream ends with when asked
 * for it (stream_options.include_usage): a data line holding a JSON object
 * with an empty "choices" array and a "usage" object. */
static int usage_only(const char *p, size_t n) {
    const char *d = n >= 5 && !memcmp(p, "data:", 5) ? p : memmem(p, n, "\ndata:", 6);
    if (!d) return 0;
    if (*d == '\n') d++;
    d += 5;
    const char *end = memchr(d, '\n', (size_t)(p + n - d));
    if (!end) end = p + n;
    px_json_member c, u;
    if (!px_json_find(d, (size_t)(end - d), "usage", &u) || u.type != PX_JSON_OBJECT ||
        !px_json_find(d, (size_t)(end - d), "choices", &c) || c.type != PX_JSON_ARRAY)
        return 0;
    for (size_t i = 1; i + 1 < c.val_len; i++)
        if (c.val[i] != ' ' && c.val[i] != '\t' && c.val[i] != '\r' && c.val[i] != '\n')
            return 0;
    return 1;
}

/* Passes on p[0..n), a JSON document or one SSE event, with prefill's
 * cached_tokens in place of decode's; every other byte as it is. The
 * usage chunk the proxy asked for is not passed on at all. */
static void emit_fixed(px_usage *u, const char *p, size_t n) {
    const char *json = p, *end = p + n, *v;
    size_t vl;
    if (u->sse && u->strip && usage_only(p, n)) {
        u->stripped++;
        return;
    }
    if (!u->cached[0]) {
        emit(u, p, n);
        return;
    }
    if (u->sse) {
        /* The event's data line that carries the usage. */
        const char *k = memmem(p, n, "\"cached_tokens\"", 15);
        if (!k) {
            emit(u, p, n);
            return;
        }
        json = k;
        while (json > p && json[-1] != '\n')
            json--;
        end = memchr(json, '\n', (size_t)(p + n - json));
        if (!end) end = p + n;
        if ((size_t)(end - json) < 5 || memcmp(json, "data:", 5) != 0) {
            emit(u, p, n);
            return;
        }
        json += 5;
        if (end > json && end[-1] == '\r') end--;
    }
    if (!cached_span(json, (size_t)(end - json), &v, &vl)) {
        emit(u, p, n);
        return;
    }
    emit(u, p, (size_t)(v - p));
    emit(u, u->cached, strlen(u->cached));
    emit(u, v + vl, (size_t)(p + n - (v + vl)));
}

/* The length of the first complete SSE event in b[0..n) (through the
 * blank line that ends it: LF LF or CRLF CRLF), or 0. */
static size_t event_len(const char *b, size_t n) {
    const char *lf = n ? memmem(b, n, "\n\n", 2) : NULL;
    const char *crlf = n ? memmem(b, n, "\r\n\r\n", 4) : NULL;
    if (lf && (!crlf || lf < crlf + 2)) return (size_t)(lf - b) + 2;
    if (crlf) return (size_t)(crlf - b) + 4;
    return 0;
}

/* Passes on every complete SSE event held (fixed), keeping a partial one;
 * with `all`, the rest too, as it is. */
static void flush_events(px_usage *u, int all) {
    size_t at = 0, n;
    if (!u->held.data) return;
    while ((n = event_len(u->held.data + at, u->held.len - at)) > 0) {
        emit_fixed(u, u->held.data + at, n);
        at += n;
    }
    if (all && at < u->held.len) {
        emit(u, u->held.data + at, u->held.len - at);
        at = u->held.len;
    }
    if (at) {
        memmove(u->held.data, u->held.data + at, u->held.len - at);
        u->held.len -= at;
    }
}

int px_usage_feed(px_usage *u, const char *p, size_t n) {
    if (u->held.len + n <= u->max_hold) {
        px_buf_append(&u->held, p, n);
        if (u->sse) flush_events(u, 0);
        return 0;
    }
    /* Gives up rewriting: what is held goes out as it is. */
    emit(u, u->held.data, u->held.len);
    px_usage_cleanup(u);
    return -1;
}

void px_usage_end(px_usage *u, int whole) {
    if (whole && !u->sse)
        emit_fixed(u, u->held.data ? u->held.data : "", u->held.len);
    else
        flush_events(u, 1);
    px_usage_cleanup(u);
}

void px_usage_strip(px_usage *u) {
    u->strip = 1;
}

size_t px_usage_held(const px_usage *u) {
    return u->held.len;
}

void px_usage_cleanup(px_usage *u) {
    px_buf_cleanup(&u->held);
    u->active = 0;
}
