/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the proxy's HTTP/1.1 request-head parser, its target
 * normalisation and chunked body decoder (base/http.c), the first code
 * every client byte meets.
 *
 * Input: bytes up to and including the first CRLFCRLF are the head (when
 * there is none, CRLFCRLF is appended to the whole input); what follows is
 * a chunked body, decoded once in one piece and once in random splits. */
#include <stdlib.h>
#include <string.h>

#include "base/http.h"
#include "tests/fuzz/fuzz_common.h"

static int64_t cl_value(const px_http_header *hd) {
    int64_t x = 0;
    for (size_t i = 0; i < hd->value_len; i++)
        x = x * 10 + (hd->value[i] - '0');
    return x;
}

static int is_unreserved_or_slash(int c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '.' || c == '_' || c == '~' || c == '/';
}

static int hexval(char c);

/* The normalised path is what the engines route on once they decode it:
 * no escape of an unreserved character or '/' is left, no empty, "." or
 * ".." segment, and normalising again changes nothing. */
static void check_normalized(const char *buf, size_t n) {
    char *w = malloc(n ? n : 1), *again;
    memcpy(w, buf, n);
    px_http_head h;
    const char *why = NULL;
    if (px_http_parse_head(w, n, &h, &why) || px_http_normalize_target(w, &h, &why)) {
        free(w);
        return;
    }
    FZ_CHECK(fz_inside(h.target, h.target_len, w, n));
    const char *t = h.target;
    size_t plen = 0;
    while (plen < h.target_len && t[plen] != '?')
        plen++;
    if (t[0] == '/') {
        for (size_t i = 0; i < plen; i++) {
            if (t[i] == '%') {
                FZ_CHECK(i + 2 < plen && hexval(t[i + 1]) >= 0 && hexval(t[i + 2]) >= 0);
                FZ_CHECK(!is_unreserved_or_slash(hexval(t[i + 1]) * 16 + hexval(t[i + 2])));
            }
            if (t[i] == '/' && i + 1 < plen) FZ_CHECK(t[i + 1] != '/');
        }
        FZ_CHECK(plen == 1 || t[plen - 1] != '/');
        for (size_t i = 0; i < plen; i++)
            if (t[i] == '/') {
                size_t e = i + 1;
                while (e < plen && t[e] != '/')
                    e++;
                FZ_CHECK(!(e - i - 1 == 1 && t[i + 1] == '.'));
                FZ_CHECK(!(e - i - 1 == 2 && t[i + 1] == '.' && t[i + 2] == '.'));
            }
        /* Idempotent. */
        size_t tl = h.target_len;
        again = malloc(tl + 1);
        memcpy(again, t, tl);
        h.target = again;
        FZ_CHECK(px_http_normalize_target(again, &h, &why) == 0);
        FZ_CHECK(h.target_len == tl && !memcmp(h.target, t, tl));
        free(again);
    }
    free(w);
}

static void check_head(const char *buf, size_t n) {
    check_normalized(buf, n);
    px_http_head h;
    const char *why = NULL;
    int st = px_http_parse_head(buf, n, &h, &why);
    if (st != 0) {
        FZ_CHECK(why != NULL && why[0]);
        FZ_CHECK(st == 400 || st == 417 || st == 431 || st == 501 || st == 505);
        FZ_CHECK(strcmp(px_http_reason(st), "Unknown") != 0);
        return;
    }
    FZ_CHECK(h.method_len > 0 && fz_inside(h.method, h.method_len, buf, n));
    FZ_CHECK(h.target_len > 0 && fz_inside(h.target, h.target_len, buf, n));
    FZ_CHECK(h.minor == 0 || h.minor == 1);
    FZ_CHECK(h.nheaders <= PX_HTTP_MAX_HEADERS);
    FZ_CHECK(h.content_length >= -1);
    int ncl = 0, nte = 0;
    for (size_t i = 0; i < h.nheaders; i++) {
        const px_http_header *hd = &h.headers[i];
        FZ_CHECK(hd->name_len > 0 && fz_inside(hd->name, hd->name_len, buf, n));
        FZ_CHECK(fz_inside(hd->value, hd->value_len, buf, n));
        /* Nothing that could end a line or fold one survives into a value. */
        FZ_CHECK(!memchr(hd->value, '\r', hd->value_len) &&
                 !memchr(hd->value, '\n', hd->value_len));
        FZ_CHECK(!memchr(hd->value, '\0', hd->value_len));
        if (hd->value_len) {
            FZ_CHECK(hd->value[0] != ' ' && hd->value[0] != '\t');
            FZ_CHECK(hd->value[hd->value_len - 1] != ' ' && hd->value[hd->value_len - 1] != '\t');
        }
        FZ_CHECK(!memchr(hd->name, ':', hd->name_len) && !memchr(hd->name, ' ', hd->name_len));
        if (px_http_token_eq(hd->name, hd->name_len, "content-length")) {
            ncl++;
            /* Smuggling: every Content-Length agrees with the one kept. */
            FZ_CHECK(cl_value(hd) == h.content_length);
        }
        if (px_http_token_eq(hd->name, hd->name_len, "transfer-encoding")) nte++;
        /* Lookup by name finds a header of that name. */
        char name[64];
        if (hd->name_len < sizeof name) {
            memcpy(name, hd->name, hd->name_len);
            name[hd->name_len] = '\0';
            const px_http_header *f = px_http_find(&h, name);
            FZ_CHECK(f != NULL && f <= hd);
        }
    }
    FZ_CHECK((ncl > 0) == (h.content_length >= 0));
    /* Smuggling: never both framings; chunked only from HTTP/1.1. */
    FZ_CHECK(nte <= 1);
    FZ_CHECK(h.chunked == (nte == 1));
    if (h.chunked) FZ_CHECK(h.content_length == -1 && h.minor == 1);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The chunked framing the proxy means to accept (RFC 9112 section 7.1, as
 * strict as the header parser), written plainly as a reference:
 *   chunk      = 1*HEXDIG [ (SP / HTAB / ";") *<any byte but CR, LF> ] CRLF
 *                data CRLF
 *   last-chunk = 1*"0" [ ext ] CRLF *( 1*<any byte but CR, LF> CRLF ) CRLF
 * Sizes stop growing past 2^40 (the decoder refuses more digits). Returns
 * the bytes consumed (all of them while incomplete), -1 or -2 (over max),
 * with *done set once the body is complete. */
static long ref_chunked(const char *in, size_t n, size_t max, px_buf *out, int *done) {
    size_t i = 0;
    *done = 0;
    for (;;) {
        uint64_t size = 0;
        int nd = 0;
        for (; i < n && hexval(in[i]) >= 0; i++, nd++) {
            if (size > (UINT64_C(1) << 40)) return -1;
            size = size * 16 + (uint64_t)hexval(in[i]);
        }
        if (i == n) return (long)i;
        if (!nd) {
            if (in[i] != '\r') return -1;
            return i + 1 == n ? (long)n : -1;
        }
        if (in[i] == ' ' || in[i] == '\t' || in[i] == ';')
            while (i < n && in[i] != '\r' && in[i] != '\n')
                i++;
        if (i == n) return (long)i;
        if (in[i++] != '\r') return -1;
        if (i == n) return (long)i;
        if (in[i++] != '\n') return -1;
        if (size == 0) break;
        size_t take = n - i < size ? n - i : (size_t)size;
        if (out->len + take > max) return -2;
        px_buf_append(out, in + i, take);
        i += take;
        if (take < size || i == n) return (long)i;
        if (in[i++] != '\r') return -1;
        if (i == n) return (long)i;
        if (in[i++] != '\n') return -1;
    }
    for (;;) { /* trailer lines, then the final CRLF */
        if (i == n) return (long)i;
        if (in[i] == '\r') {
            if (++i == n) return (long)i;
            if (in[i++] != '\n') return -1;
            *done = 1;
            return (long)i;
        }
        while (i < n && in[i] != '\r' && in[i] != '\n')
            i++;
        if (i == n) return (long)i;
        if (in[i++] != '\r') return -1; /* a bare LF */
        if (i == n) return (long)i;
        if (in[i++] != '\n') return -1;
    }
}

/* Decodes in[0..n) with pieces of random length. Returns the feed's final
 * status (consumed total, -1 or -2) and leaves the output in out. */
static long decode_split(const char *in, size_t n, size_t max, uint64_t *rng, px_buf *out) {
    px_chunked c;
    px_chunked_init(&c);
    size_t off = 0;
    while (off < n && !c.done) {
        size_t piece = 1 + (size_t)(fz_next(rng) % 17);
        if (fz_next(rng) % 4 == 0) piece = 1 + (size_t)(fz_next(rng) % (n - off));
        if (piece > n - off) piece = n - off;
        char *p = fz_dup(in + off, piece); /* exact size: overreads trip ASan */
        size_t before = out->len;
        long r = px_chunked_feed(&c, p, piece, out, max);
        free(p);
        if (r < 0) return r;
        FZ_CHECK((size_t)r <= piece);
        FZ_CHECK(out->len - before <= (size_t)r);
        FZ_CHECK((size_t)r == piece || c.done);
        off += (size_t)r;
    }
    FZ_CHECK(out->len <= max);
    return (long)off;
}

static void check_chunked(const char *in, size_t n, uint64_t seed) {
    size_t max = (seed >> 8) % 2 ? (size_t)(seed >> 16) % 4096 : 1u << 20;
    px_chunked c;
    px_chunked_init(&c);
    px_buf whole, split;
    px_buf_init(&whole);
    px_buf_init(&split);
    char *p = fz_dup(in, n);
    long r1 = px_chunked_feed(&c, p, n, &whole, max);
    free(p);
    FZ_CHECK(r1 >= -2);
    if (r1 >= 0) {
        FZ_CHECK((size_t)r1 <= n);
        FZ_CHECK(whole.len <= (size_t)r1); /* decoded never longer than consumed */
        FZ_CHECK(whole.len <= max);
        FZ_CHECK((size_t)r1 == n || c.done);
    }
    /* The decoder frames the body exactly as the reference grammar does:
     * any leniency is a place where a front proxy and pdproxy could
     * disagree on where a request ends. */
    px_buf ref;
    px_buf_init(&ref);
    int ref_done;
    long r0 = ref_chunked(in, n, max, &ref, &ref_done);
    FZ_CHECK(r0 == r1);
    if (r1 >= 0) {
        FZ_CHECK(ref_done == c.done);
        FZ_CHECK(ref.len == whole.len && (!ref.len || memcmp(ref.data, whole.data, ref.len) == 0));
    }
    px_buf_cleanup(&ref);

    uint64_t rng = seed;
    long r2 = decode_split(in, n, max, &rng, &split);
    /* Framing does not depend on how the bytes were split. */
    FZ_CHECK(r1 == r2);
    if (r1 >= 0) {
        FZ_CHECK(whole.len == split.len);
        FZ_CHECK(whole.len == 0 || memcmp(whole.data, split.data, whole.len) == 0);
    }
    px_buf_cleanup(&whole);
    px_buf_cleanup(&split);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *d = (const char *)data;
    const char *eoh = size >= 4 ? memmem(d, size, "\r\n\r\n", 4) : NULL;
    size_t head_len;
    char *head;
    if (eoh) {
        head_len = (size_t)(eoh - d) + 4;
        head = fz_dup(d, head_len);
    } else {
        head_len = size + 4;
        head = malloc(head_len);
        if (!head) abort();
        if (size) memcpy(head, d, size);
        memcpy(head + size, "\r\n\r\n", 4);
    }
    if (head_len <= PX_HTTP_MAX_HEAD_BYTES) check_head(head, head_len);
    free(head);

    /* The body after the head; without a head, the whole input. */
    const char *body = eoh ? d + head_len : d;
    size_t blen = eoh ? size - head_len : size;
    check_chunked(body, blen, fz_seed(data, size));
    return 0;
}
