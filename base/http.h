/* HTTP/1.1 request parsing (RFC 9112), pure and incremental where bodies
 * are concerned. It is strict where leniency enables request smuggling:
 * Content-Length with Transfer-Encoding, conflicting lengths, obs-folded
 * lines and whitespace before a colon are all rejected. */
#ifndef PX_HTTP_H
#define PX_HTTP_H

#include <stddef.h>
#include <stdint.h>

#include "util.h"

#define PX_HTTP_MAX_HEADERS 100
#define PX_HTTP_MAX_HEAD_BYTES (64 * 1024)

typedef struct px_http_header {
    const char *name; /* borrowed: spans of the parsed buffer */
    size_t name_len;
    const char *value;
    size_t value_len;
} px_http_header;

typedef struct px_http_head {
    const char *method;
    size_t method_len;
    const char *target;
    size_t target_len;
    int minor; /* HTTP/1.<minor> */
    px_http_header headers[PX_HTTP_MAX_HEADERS];
    size_t nheaders;
    int64_t content_length; /* -1: none */
    int chunked;            /* Transfer-Encoding: chunked */
    int keep_alive;         /* after this request */
    int expect_continue;    /* Expect: 100-continue */
    int status;             /* responses: the status code */
} px_http_head;

/* Parses buf[0..n), which holds a request head through its final CRLFCRLF.
 * Header spans point into buf. Returns 0, or the status to answer (400,
 * 431, 501, 505) with *why set to a static reason. */
int px_http_parse_head(const char *buf, size_t n, px_http_head *h, const char **why);

/* Parses buf[0..n), a response head through its final CRLFCRLF, with the
 * request parser's strictness on header fields and framing (Content-Length
 * with Transfer-Encoding, conflicting lengths, obs-fold: refused). Sets
 * h->status, h->minor, headers, content_length, chunked, keep_alive. Whether
 * a body follows is the caller's call (HEAD, 1xx, 204, 304: none; neither
 * length nor chunked: until close). Returns 0, or 502 with *why. */
int px_http_parse_response(const char *buf, size_t n, px_http_head *h, const char **why);

/* The request's path: the target without its query, and without scheme and
 * authority when the client sent the absolute form (http://host/path). */
void px_http_path(const px_http_head *h, const char **path, size_t *len);

/* Whether the request's path is exactly `path`. */
int px_http_path_is(const px_http_head *h, const char *path);

/* First header named `name` (case-insensitive), or NULL. */
const px_http_header *px_http_find(const px_http_head *h, const char *name);
/* The request's id: the client's X-Request-Id when it is usable (1 to 128
 * bytes of visible ASCII without '"' or '\\': engines put it into their own
 * ids and log lines), copied to `out` with 1 returned; otherwise a fresh
 * UUIDv4 in `out` and 0. */
int px_http_request_id(const px_http_head *h, char out[129]);

int px_http_token_eq(const char *s, size_t n, const char *lit); /* case-insensitive */

/* Incremental decoder of a chunked body (requests and responses). */
typedef struct px_chunked {
    int state;
    uint64_t remaining; /* bytes left in the current chunk */
    int ndigits;        /* hex digits of the current size line */
    int done;
} px_chunked;

void px_chunked_init(px_chunked *c);

/* Consumes in[0..n), appending decoded bytes to out. Returns the number of
 * input bytes consumed (fewer than n once the body is complete, c->done set),
 * or -1 on malformed framing, -2 when the decoded body would exceed max. */
long px_chunked_feed(px_chunked *c, const char *in, size_t n, px_buf *out, size_t max);

/* The same without copying: consumes framing from in[0..n) up to and
 * including at most one run of body bytes, which is pointed to by *data
 * (*dlen bytes, inside `in`; 0 when this call met none). Returns the bytes
 * consumed, or -1 on malformed framing. Call again with the rest. */
long px_chunked_span(px_chunked *c, const char *in, size_t n, const char **data, size_t *dlen);

/* Reason phrase for a status code ("Unknown" when not listed). */
const char *px_http_reason(int status);

#endif
