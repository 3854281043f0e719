/* SPDX-License-Identifier: Apache-2.0 */
#include "base/http.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <event2/buffer.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* RFC 9110's token characters, looked up once per byte of every header
 * name (a table, not strchr per byte). */
static const unsigned char tchar[256] = {
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 0,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0,
    0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 1, 0,
    /* 0x80-0xff: none */
};

static int is_tchar(unsigned char c) {
    return tchar[c];
}

/* Whether c may stand in a header value: no control character but tab,
 * no DEL (CR and LF end the value). */
static int value_byte(unsigned char c) {
    return c >= 0x20 ? c != 0x7f : c == '\t';
}

/* The first byte of p[0..end) that may not stand in a header value (end
 * when none): sixteen bytes at a time where SSE2 is (every x86-64), since
 * values are most of a head's bytes. A control byte is one whose unsigned
 * minimum with 0x1f is itself; obs-text (0x80-0xff) passes. */
static const char *value_end(const char *p, const char *end) {
#ifdef __SSE2__
    const __m128i lim = _mm_set1_epi8(0x1f), tab = _mm_set1_epi8('\t');
    const __m128i del = _mm_set1_epi8(0x7f);
    while (end - p >= 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)(const void *)p);
        __m128i ctl = _mm_cmpeq_epi8(_mm_min_epu8(v, lim), v);
        __m128i bad =
            _mm_or_si128(_mm_andnot_si128(_mm_cmpeq_epi8(v, tab), ctl), _mm_cmpeq_epi8(v, del));
        unsigned m = (unsigned)_mm_movemask_epi8(bad);
        if (m) return p + __builtin_ctz(m);
        p += 16;
    }
#endif
    while (p < end && value_byte((unsigned char)*p))
        p++;
    return p;
}

/* Whether a[0..n) and b[0..n) are equal but for the case of letters: a
 * byte equal to its peer costs one compare, and one that differs matches
 * only as the other case of the same letter (they differ in bit 5 alone). */
static int ieq(const char *a, const char *b, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char x = (unsigned char)a[i], y = (unsigned char)b[i];
        if (x != y && ((x ^ y) != 0x20 || (unsigned)((x | 0x20) - 'a') >= 26u)) return 0;
    }
    return 1;
}

int px_http_token_eq(const char *s, size_t n, const char *lit) {
    return strnlen(lit, n + 1) == n && ieq(s, lit, n);
}

/* Whether s[0..n) is the token lit (lit_len bytes) in any case: the length
 * first, so most names are told apart without a byte compared. */
static int name_is(const char *s, size_t n, const char *lit, size_t lit_len) {
    return n == lit_len && ieq(s, lit, n);
}
#define NAME_IS(s, n, lit) name_is((s), (n), (lit), sizeof(lit) - 1)

void px_http_path(const px_http_head *h, const char **path, size_t *len) {
    const char *t = h->target;
    size_t n = h->target_len;
    size_t skip = 0;
    if (n > 7 && px_http_token_eq(t, 7, "http://"))
        skip = 7;
    else if (n > 8 && px_http_token_eq(t, 8, "https://"))
        skip = 8;
    if (skip) {
        const char *slash = memchr(t + skip, '/', n - skip);
        size_t off = slash ? (size_t)(slash - t) : n;
        t += off;
        n -= off;
    }
    const char *q = memchr(t, '?', n);
    if (q) n = (size_t)(q - t);
    *path = n ? t : "/";
    *len = n ? n : 1;
}

static int hexval(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int is_unreserved(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '.' || c == '_' || c == '~';
}

/* Resolves dot and empty segments of p[0..n) in place; returns the new
 * length (at least 1: "/"). Each step writes no more than it has read. */
static size_t squash_segments(char *p, size_t n) {
    size_t w = 0, i = 0;
    while (i < n) {
        while (i < n && p[i] == '/')
            i++;
        size_t s = i;
        while (i < n && p[i] != '/')
            i++;
        size_t len = i - s;
        if (len == 0 || (len == 1 && p[s] == '.')) continue;
        if (len == 2 && p[s] == '.' && p[s + 1] == '.') {
            while (w > 0 && p[w - 1] != '/')
                w--;
            if (w > 0) w--; /* the '/' before the dropped segment */
            continue;
        }
        p[w++] = '/';
        memmove(p + w, p + s, len);
        w += len;
    }
    if (w == 0) p[w++] = '/';
    return w;
}

int px_http_normalize_target(char *buf, px_http_head *h, const char **why) {
    char *t = buf + (h->target - buf);
    size_t n = h->target_len, from = 0;
    /* A fragment is not part of a request target (RFC 9112 §3.2): a server
     * behind the proxy may drop it and route by the rest, so the target the
     * proxy routes by would not be the one the engine serves. */
    if (memchr(t, '#', n)) return *why = "a '#' fragment is not part of a request target", 400;
    if (n > 7 && px_http_token_eq(t, 7, "http://"))
        from = 7;
    else if (n > 8 && px_http_token_eq(t, 8, "https://"))
        from = 8;
    if (from) {
        while (from < n && t[from] != '/' && t[from] != '?')
            from++;
    } else if (!n || t[0] != '/') {
        return 0;
    }
    /* The path is t[from..pend), the query t[pend..n). Decoding writes at
     * w <= r, so it runs in place. */
    size_t pend = from;
    while (pend < n && t[pend] != '?')
        pend++;
    size_t w = 0;
    if (from == pend || t[from] != '/') t[w++] = '/'; /* from >= 7 here: room */
    for (size_t r = from; r < pend;) {
        unsigned char c = (unsigned char)t[r];
        if (c != '%') {
            t[w++] = (char)c;
            r++;
            continue;
        }
        int hi = r + 2 < pend ? hexval((unsigned char)t[r + 1]) : -1;
        int lo = hi >= 0 ? hexval((unsigned char)t[r + 2]) : -1;
        if (lo < 0) return *why = "malformed percent-encoding in the request target", 400;
        unsigned char v = (unsigned char)(hi * 16 + lo);
        if (is_unreserved(v) || v == '/') {
            t[w++] = (char)v;
        } else {
            static const char hex[] = "0123456789ABCDEF";
            t[w++] = '%';
            t[w++] = hex[v >> 4];
            t[w++] = hex[v & 15];
        }
        r += 3;
    }
    w = squash_segments(t, w);
    memmove(t + w, t + pend, n - pend);
    h->target = t;
    h->target_len = w + (n - pend);
    return 0;
}

int px_http_path_is(const px_http_head *h, const char *path) {
    const char *p;
    size_t n;
    px_http_path(h, &p, &n);
    return strlen(path) == n && memcmp(p, path, n) == 0;
}

int px_http_forwarded_header(const px_http_header *x) {
    return px_http_token_eq(x->name, x->name_len, "content-type") ||
           px_http_token_eq(x->name, x->name_len, "accept");
}

const char *px_http_via_marker(void) {
    static char marker[32];
    if (!marker[0]) {
        unsigned char r[8] = {0};
        FILE *f = fopen("/dev/urandom", "rb");
        if (!f || fread(r, 1, sizeof r, f) != sizeof r) {
            uint64_t t = px_now_ns() ^ (uint64_t)getpid() << 32;
            memcpy(r, &t, sizeof r);
        }
        if (f) fclose(f);
        snprintf(marker, sizeof marker, "1.1 pdproxy-%02x%02x%02x%02x%02x%02x%02x%02x", r[0],
                 r[1], r[2], r[3], r[4], r[5], r[6], r[7]);
    }
    return marker;
}

int px_http_via_count(const px_http_head *h) {
    const char *m = px_http_via_marker() + 4; /* "pdproxy-..." */
    size_t ml = strlen(m);
    int n = 0;
    for (size_t i = 0; i < h->nheaders; i++) {
        const px_http_header *x = &h->headers[i];
        if (!px_http_token_eq(x->name, x->name_len, "via")) continue;
        for (size_t j = 0; j + ml <= x->value_len; j++)
            if (!memcmp(x->value + j, m, ml)) n++;
    }
    return n;
}

void px_http_via_append(const px_http_head *h, px_buf *out) {
    px_buf_appends(out, "Via: ");
    for (size_t i = 0; i < h->nheaders; i++) {
        const px_http_header *x = &h->headers[i];
        if (!px_http_token_eq(x->name, x->name_len, "via") || !x->value_len) continue;
        px_buf_append(out, x->value, x->value_len);
        px_buf_appends(out, ", ");
    }
    px_buf_appends(out, px_http_via_marker());
    px_buf_appends(out, "\r\n");
}

const px_http_header *px_http_find(const px_http_head *h, const char *name) {
    size_t n = strlen(name);
    for (size_t i = 0; i < h->nheaders; i++)
        if (name_is(h->headers[i].name, h->headers[i].name_len, name, n)) return &h->headers[i];
    return NULL;
}

int px_http_request_id(const px_http_head *h, char out[129]) {
    const px_http_header *x = px_http_find(h, "x-request-id");
    int ok = x && x->value_len > 0 && x->value_len <= 128;
    for (size_t i = 0; ok && i < x->value_len; i++) {
        unsigned char c = (unsigned char)x->value[i];
        ok = c > 0x20 && c <= 0x7e && c != '"' && c != '\\';
    }
    if (!ok) {
        px_uuid4(out);
        return 0;
    }
    memcpy(out, x->value, x->value_len);
    out[x->value_len] = '\0';
    return 1;
}

/* Calls fn for each comma-separated, trimmed element of a header value. */
static int has_token(const char *v, size_t n, const char *tok) {
    size_t i = 0;
    while (i < n) {
        while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ','))
            i++;
        size_t s = i;
        while (i < n && v[i] != ',')
            i++;
        size_t e = i;
        while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t'))
            e--;
        if (e > s && px_http_token_eq(v + s, e - s, tok)) return 1;
    }
    return 0;
}

static int parse_content_length(const char *v, size_t n, int64_t *out) {
    if (n == 0 || n > 18) return -1;
    int64_t x = 0;
    for (size_t i = 0; i < n; i++) {
        if (v[i] < '0' || v[i] > '9') return -1;
        x = x * 10 + (v[i] - '0');
    }
    *out = x;
    return 0;
}

/* The header fields from p up to and including the blank line: the same
 * strictness for requests and responses. Returns 0, or the status to
 * answer with *why set. Framing facts land in h; the rest in *f. */
typedef struct fields {
    int have_te, conn_close, conn_keep, nhost;
} fields;

static int parse_fields(const char *p, const char *end, px_http_head *h, fields *f,
                        const char **why) {
    for (;;) {
        if (end - p < 2) return *why = "truncated header block", 400;
        if (p[0] == '\r' && p[1] == '\n') break;
        if (*p == ' ' || *p == '\t') return *why = "obsolete line folding", 400;
        const char *s = p;
        while (p < end && is_tchar((unsigned char)*p))
            p++;
        if (p == s || p >= end || *p != ':') return *why = "malformed header field", 400;
        if (h->nheaders == PX_HTTP_MAX_HEADERS) return *why = "too many header fields", 431;
        px_http_header *hd = &h->headers[h->nheaders++];
        hd->name = s;
        hd->name_len = (size_t)(p - s);
        p++;
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        s = p;
        p = value_end(p, end);
        if (p < end && *p != '\r' && *p != '\n') return *why = "invalid header value", 400;
        if (end - p < 2 || p[0] != '\r' || p[1] != '\n') return *why = "bare CR or LF", 400;
        const char *e = p;
        while (e > s && (e[-1] == ' ' || e[-1] == '\t'))
            e--;
        hd->value = s;
        hd->value_len = (size_t)(e - s);
        p += 2;

        /* The framing headers, told apart by length first (NAME_IS). */
        const char *nm = hd->name;
        size_t nl = hd->name_len;
        if (NAME_IS(nm, nl, "content-length")) {
            int64_t cl;
            if (parse_content_length(hd->value, hd->value_len, &cl) < 0)
                return *why = "invalid Content-Length", 400;
            if (h->content_length >= 0 && h->content_length != cl)
                return *why = "conflicting Content-Length headers", 400;
            h->content_length = cl;
        } else if (NAME_IS(nm, nl, "transfer-encoding")) {
            if (f->have_te || !px_http_token_eq(hd->value, hd->value_len, "chunked"))
                return *why = "unsupported Transfer-Encoding", 501;
            f->have_te = 1;
        } else if (NAME_IS(nm, nl, "connection")) {
            if (has_token(hd->value, hd->value_len, "close")) f->conn_close = 1;
            if (has_token(hd->value, hd->value_len, "keep-alive")) f->conn_keep = 1;
        } else if (NAME_IS(nm, nl, "host")) {
            f->nhost++;
        } else if (NAME_IS(nm, nl, "expect")) {
            if (!px_http_token_eq(hd->value, hd->value_len, "100-continue"))
                return *why = "unsupported Expect", 417;
            h->expect_continue = 1;
        }
    }
    if (f->have_te) {
        if (h->content_length >= 0) return *why = "both Content-Length and Transfer-Encoding", 400;
        if (h->minor == 0) return *why = "Transfer-Encoding in HTTP/1.0", 400;
        h->chunked = 1;
    }
    h->keep_alive = h->minor == 1 ? !f->conn_close : (f->conn_keep && !f->conn_close);
    return 0;
}

static void head_reset(px_http_head *h) {
    memset(h, 0, offsetof(px_http_head, headers));
    h->nheaders = 0;
    h->content_length = -1;
    h->chunked = 0;
    h->keep_alive = 0;
    h->expect_continue = 0;
}

int px_http_parse_head(const char *buf, size_t n, px_http_head *h, const char **why) {
    const char *p = buf, *end = buf + n;
    head_reset(h);

    /* Request line: method SP target SP HTTP/1.x CRLF */
    const char *s = p;
    while (p < end && is_tchar((unsigned char)*p))
        p++;
    if (p == s || p >= end || *p != ' ') return *why = "malformed request line", 400;
    h->method = s;
    h->method_len = (size_t)(p - s);
    s = ++p;
    while (p < end && (unsigned char)*p > 0x20 && (unsigned char)*p < 0x7f)
        p++;
    if (p == s || p >= end || *p != ' ') return *why = "malformed request target", 400;
    h->target = s;
    h->target_len = (size_t)(p - s);
    p++;
    if (end - p < 10 || memcmp(p, "HTTP/1.", 7) != 0) {
        if (end - p >= 5 && memcmp(p, "HTTP/", 5) == 0)
            return *why = "unsupported HTTP version", 505;
        return *why = "malformed HTTP version", 400;
    }
    if (p[7] != '0' && p[7] != '1') return *why = "unsupported HTTP version", 505;
    h->minor = p[7] - '0';
    p += 8;
    if (p[0] != '\r' || p[1] != '\n') return *why = "malformed request line", 400;
    p += 2;

    fields f = {0};
    int st = parse_fields(p, end, h, &f, why);
    if (st) return st;
    /* RFC 9112 §3.2: an HTTP/1.1 request carries exactly one Host (it may be
     * empty); two could be read differently by two hops. */
    if (f.nhost > 1) return *why = "more than one Host header", 400;
    if (h->minor == 1 && f.nhost == 0)
        return *why = "missing Host header (required in HTTP/1.1)", 400;
    return 0;
}

int px_http_parse_response(const char *buf, size_t n, px_http_head *h, const char **why) {
    const char *p = buf, *end = buf + n;
    head_reset(h);
    /* Status line: HTTP/1.x SP 3DIGIT SP reason CRLF (an empty reason, and
     * no SP before it, are tolerated as most clients do). */
    if (end - p < 12 || memcmp(p, "HTTP/1.", 7) != 0 || (p[7] != '0' && p[7] != '1') || p[8] != ' ')
        return *why = "malformed status line", 502;
    h->minor = p[7] - '0';
    p += 9;
    int st = 0;
    for (int i = 0; i < 3; i++, p++) {
        if (*p < '0' || *p > '9') return *why = "malformed status code", 502;
        st = st * 10 + (*p - '0');
    }
    if (st < 100 || st > 599) return *why = "status code outside 100-599", 502;
    if (*p == ' ') {
        while (p < end && *p != '\r' && *p != '\n') {
            unsigned char c = (unsigned char)*p;
            if ((c < 0x20 && c != '\t') || c == 0x7f) return *why = "malformed status line", 502;
            p++;
        }
    }
    if (end - p < 2 || p[0] != '\r' || p[1] != '\n') return *why = "malformed status line", 502;
    p += 2;
    h->status = st;
    fields f = {0};
    int rc = parse_fields(p, end, h, &f, why);
    return rc ? 502 : 0;
}

enum {
    CK_SIZE,
    CK_EXT,
    CK_SIZE_LF,
    CK_DATA,
    CK_DATA_CR,
    CK_DATA_LF,
    CK_TRAILER,
    CK_TRAILER_LINE,
    CK_FINAL_LF,
    CK_TRAILER_LF
};

void px_chunked_init(px_chunked *c) {
    memset(c, 0, sizeof *c);
    c->state = CK_SIZE;
}

long px_chunked_feed(px_chunked *c, const char *in, size_t n, px_buf *out, size_t max) {
    size_t used = 0;
    while (used < n && !c->done) {
        const char *d;
        size_t dn;
        long r = px_chunked_span(c, in + used, n - used, &d, &dn);
        if (r < 0) return r;
        if (dn) {
            if (out->len + dn > max) return -2;
            px_buf_append(out, d, dn);
        }
        used += (size_t)r;
    }
    return (long)used;
}

long px_chunked_span(px_chunked *c, const char *in, size_t n, const char **data, size_t *dlen) {
    size_t i = 0;
    *data = NULL;
    *dlen = 0;
    while (i < n && !c->done) {
        char ch = in[i];
        switch (c->state) {
        case CK_SIZE: {
            int v = (ch >= '0' && ch <= '9')   ? ch - '0'
                    : (ch >= 'a' && ch <= 'f') ? ch - 'a' + 10
                    : (ch >= 'A' && ch <= 'F') ? ch - 'A' + 10
                                               : -1;
            if (v >= 0) {
                if (c->remaining > (UINT64_C(1) << 40)) return -1;
                c->remaining = c->remaining * 16 + (uint64_t)v;
                c->ndigits++;
                i++;
            } else if (c->ndigits && (ch == ';' || ch == ' ' || ch == '\t')) {
                c->state = CK_EXT;
                i++;
            } else if (ch == '\r') {
                c->state = CK_SIZE_LF;
                i++;
            } else {
                return -1;
            }
            break;
        }
        case CK_EXT:
            if (ch == '\r')
                c->state = CK_SIZE_LF;
            else if (ch == '\n')
                return -1;
            i++;
            break;
        case CK_SIZE_LF:
            if (ch != '\n' || c->ndigits == 0) return -1;
            c->ndigits = 0;
            i++;
            c->state = c->remaining ? CK_DATA : CK_TRAILER;
            break;
        case CK_DATA: {
            size_t take = n - i;
            if (take > c->remaining) take = (size_t)c->remaining;
            *data = in + i;
            *dlen = take;
            i += take;
            c->remaining -= take;
            if (!c->remaining) c->state = CK_DATA_CR;
            return (long)i; /* one span per call: the caller takes it */
        }
        case CK_DATA_CR:
            if (ch != '\r') return -1;
            i++;
            c->state = CK_DATA_LF;
            break;
        case CK_DATA_LF:
            if (ch != '\n') return -1;
            i++;
            c->state = CK_SIZE;
            break;
        case CK_TRAILER: /* start of a trailer line, or the final CRLF */
            /* A bare LF is refused here as in the header block: a front
             * proxy that ends the body at "0\r\n\n" would see the bytes
             * this decoder takes for trailers as the next request. */
            if (ch == '\n') return -1;
            if (ch == '\r') {
                c->state = CK_FINAL_LF;
            } else {
                c->state = CK_TRAILER_LINE;
            }
            i++;
            break;
        case CK_TRAILER_LINE:
            if (ch == '\n') return -1;
            if (ch == '\r') c->state = CK_TRAILER_LF;
            i++;
            break;
        case CK_TRAILER_LF:
            if (ch != '\n') return -1;
            i++;
            c->state = CK_TRAILER;
            break;
        case CK_FINAL_LF:
            if (ch != '\n') return -1;
            i++;
            c->done = 1;
            break;
        }
    }
    return (long)i;
}

const char *px_http_reason(int status) {
    switch (status) {
    case 100:
        return "Continue";
    case 200:
        return "OK";
    case 201:
        return "Created";
    case 202:
        return "Accepted";
    case 204:
        return "No Content";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 409:
        return "Conflict";
    case 411:
        return "Length Required";
    case 413:
        return "Content Too Large";
    case 415:
        return "Unsupported Media Type";
    case 417:
        return "Expectation Failed";
    case 422:
        return "Unprocessable Content";
    case 429:
        return "Too Many Requests";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 502:
        return "Bad Gateway";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    case 505:
        return "HTTP Version Not Supported";
    case 508:
        return "Loop Detected";
    default:
        return "Unknown";
    }
}

int px_http_hop_by_hop(const px_http_header *x) {
    static const char *const names[] = {"host",
                                        "content-length",
                                        "transfer-encoding",
                                        "connection",
                                        "keep-alive",
                                        "proxy-connection",
                                        "expect",
                                        "proxy-authorization",
                                        "te",
                                        "trailer",
                                        "upgrade"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (px_http_token_eq(x->name, x->name_len, names[i])) return 1;
    return 0;
}

/* The offset in s[0, n) of the first "\r\n\r\n", or -1. */
static long blank_line(const char *s, size_t n) {
    size_t i = 0;
#ifdef __SSE2__
    /* Sixteen starting points at a time: byte i is '\r', i+1 '\n', i+2 '\r'
     * and i+3 '\n' (a head is ~10 lines, each with a CR that would send a
     * byte-wise search into a 4-byte compare). */
    const __m128i cr = _mm_set1_epi8('\r'), lf = _mm_set1_epi8('\n');
    for (; i + 19 <= n; i += 16) {
        const char *p = s + i;
        __m128i a = _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(const void *)p), cr);
        __m128i b = _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(const void *)(p + 1)), lf);
        __m128i c = _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(const void *)(p + 2)), cr);
        __m128i d = _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)(const void *)(p + 3)), lf);
        unsigned m = (unsigned)_mm_movemask_epi8(_mm_and_si128(_mm_and_si128(a, b), _mm_and_si128(c, d)));
        if (m) return (long)(i + (size_t)__builtin_ctz(m));
    }
#endif
    for (; i + 4 <= n; i++)
        if (s[i] == '\r' && s[i + 1] == '\n' && s[i + 2] == '\r' && s[i + 3] == '\n') return (long)i;
    return -1;
}

long px_http_head_end(struct evbuffer *in, size_t max, size_t *searched) {
    size_t len = evbuffer_get_length(in);
    size_t limit = len < max + 4 ? len : max + 4;
    size_t from = *searched > 3 ? *searched - 3 : 0;
    long at = -1;
    struct evbuffer_iovec v;
    /* The range is nearly always in the buffer's first chain: searched in
     * place there; across chains, by libevent's search. */
    if (limit > from && evbuffer_peek(in, (ev_ssize_t)limit, NULL, &v, 1) == 1 && v.iov_len >= limit) {
        at = blank_line((const char *)v.iov_base + from, limit - from);
        if (at >= 0) at += (long)from;
    } else if (limit > from) {
        struct evbuffer_ptr start, end;
        evbuffer_ptr_set(in, &start, from, EVBUFFER_PTR_SET);
        evbuffer_ptr_set(in, &end, limit, EVBUFFER_PTR_SET);
        at = (long)evbuffer_search_range(in, "\r\n\r\n", 4, &start, &end).pos;
    }
    if (at < 0) {
        *searched = limit;
        return len >= max + 4 ? -1 : 0;
    }
    *searched = 0;
    return at + 4;
}
