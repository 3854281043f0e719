/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the upstream client's input path (base/http.c): the
 * response-head parser and the zero-copy chunked decoder that hands body
 * spans to the proxy.
 *
 * Input: bytes up to and including the first CRLFCRLF are a response head
 * (CRLFCRLF is appended when there is none); what follows is a chunked body,
 * decoded span by span in random splits and compared with the copying
 * decoder on the whole input. */
#include <string.h>

#include "base/http.h"
#include "tests/fuzz/fuzz_common.h"

static void check_head(const char *buf, size_t n) {
    px_http_head h;
    const char *why = NULL;
    int st = px_http_parse_response(buf, n, &h, &why);
    if (st != 0) {
        FZ_CHECK(st == 502);
        FZ_CHECK(why != NULL && why[0]);
        return;
    }
    FZ_CHECK(h.status >= 100 && h.status <= 999);
    FZ_CHECK(h.minor == 0 || h.minor == 1);
    FZ_CHECK(h.nheaders <= PX_HTTP_MAX_HEADERS);
    FZ_CHECK(h.content_length >= -1);
    /* Smuggling: never both framings; chunked only from HTTP/1.1. */
    if (h.chunked) FZ_CHECK(h.content_length == -1 && h.minor == 1);
    for (size_t i = 0; i < h.nheaders; i++) {
        const px_http_header *hd = &h.headers[i];
        FZ_CHECK(hd->name_len > 0 && fz_inside(hd->name, hd->name_len, buf, n));
        FZ_CHECK(fz_inside(hd->value, hd->value_len, buf, n));
        FZ_CHECK(!memchr(hd->value, '\r', hd->value_len) &&
                 !memchr(hd->value, '\n', hd->value_len));
    }
}

/* The span decoder in random splits: every span lies inside the piece it
 * came from, and the bytes add up to what the copying decoder produced. */
static void check_spans(const char *in, size_t n, uint64_t *rng) {
    px_buf whole;
    px_buf_init(&whole);
    px_chunked a;
    px_chunked_init(&a);
    long wr = px_chunked_feed(&a, in, n, &whole, (size_t)1 << 30);

    px_buf got;
    px_buf_init(&got);
    px_chunked c;
    px_chunked_init(&c);
    size_t off = 0;
    long status = 0;
    while (off < n && !c.done) {
        size_t piece = 1 + (size_t)(fz_next(rng) % 64);
        if (piece > n - off) piece = n - off;
        char *p = fz_dup(in + off, piece); /* exact size: ASan sees overreads */
        size_t used = 0;
        while (used < piece && !c.done) {
            const char *d;
            size_t dn;
            long r = px_chunked_span(&c, p + used, piece - used, &d, &dn);
            if (r < 0) {
                status = r;
                break;
            }
            FZ_CHECK(r > 0 || c.done);
            if (dn) {
                FZ_CHECK(fz_inside(d, dn, p + used, (size_t)r));
                px_buf_append(&got, d, dn);
            }
            used += (size_t)r;
        }
        free(p);
        if (status < 0) break;
        off += used;
    }
    if (wr >= 0 && status == 0) {
        FZ_CHECK(c.done == a.done);
        FZ_CHECK(got.len == whole.len && (!got.len || !memcmp(got.data, whole.data, got.len)));
        if (a.done) FZ_CHECK((long)off == wr);
    }
    if (wr < 0) FZ_CHECK(status < 0 || !c.done);
    px_buf_cleanup(&whole);
    px_buf_cleanup(&got);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *d = (const char *)data;
    const char *end = NULL;
    for (size_t i = 0; i + 3 < size && !end; i++)
        if (!memcmp(d + i, "\r\n\r\n", 4)) end = d + i + 4;
    size_t hlen = end ? (size_t)(end - d) : size;
    char *head = malloc(hlen + 4);
    if (!head) abort();
    if (hlen) memcpy(head, d, hlen);
    if (!end) memcpy(head + hlen, "\r\n\r\n", 4);
    check_head(head, end ? hlen : hlen + 4);
    free(head);
    uint64_t rng = fz_seed(data, size);
    if (end) check_spans(end, size - hlen, &rng);
    return 0;
}
