/* SPDX-License-Identifier: Apache-2.0 */
/* HTTP/1.1 request parsing (RFC 9112), pure and incremental where bodies
 * are concerned. It is strict where leniency enables request smuggling:
 * Content-Length with Transfer-Encoding, conflicting lengths, obs-folded
 * lines and whitespace before a colon are all rejected. */
#ifndef PX_HTTP_H
#define PX_HTTP_H

#include <stddef.h>
#include <stdint.h>

#include "base/util.h"

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

/* Normalises a parsed request's target in place (buf is the buffer the
 * head was parsed from; h->target points into it), the way the engines'
 * frameworks read it before routing (uvicorn percent-decodes the whole
 * path, '/' included, and Starlette routes on that): escapes of unreserved
 * characters and of '/' are decoded, other escapes are kept with upper-case
 * hex (so an engine decoding once sees what the proxy routed on), dot
 * segments are resolved (never above the root), and empty segments (a
 * doubled or trailing '/') are dropped. An absolute-form target becomes its
 * origin form; the query is kept as sent; "*" and authority forms are left
 * alone. Returns 0, or 400 with *why set for a malformed escape. */
int px_http_normalize_target(char *buf, px_http_head *h, const char **why);

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

/* The one rule for the client's own header fields on a route passed through
 * to an engine: only Content-Type (a multipart body needs its boundary) and
 * Accept are forwarded. The P/D routes send none of them (the proxy writes
 * their Content-Type). On every route the proxy adds X-Request-Id,
 * Authorization, traceparent and tracestate itself; everything else the
 * client sent (cookies, X-Forwarded-*, hop-by-hop fields and the fields
 * Connection names, x-prefiller-host-port, Via) stays here. */
int px_http_forwarded_header(const px_http_header *x);

/* The Via hop marker (RFC 9110 §7.6.3) of this process: "1.1 pdproxy-"
 * and 16 random hex digits, drawn on the first call (make it before
 * threads start). */
const char *px_http_via_marker(void);

/* How many times the request's Via fields name this process's marker. */
int px_http_via_count(const px_http_head *h);

/* Appends "Via: <the request's Via values>, <marker>\r\n" (values joined
 * with ", " in order; just the marker when there are none). */
void px_http_via_append(const px_http_head *h, px_buf *out);

int px_http_token_eq(const char *s, size_t n, const char *lit); /* case-insensitive */
/* Whether a header belongs to the connection it came on, not to the
 * message: hop by hop (RFC 9110 §7.6.1: Connection, Keep-Alive,
 * Proxy-Connection, Proxy-Authorization, TE, Trailer, Upgrade) or the
 * message's framing on that connection (Host, Content-Length,
 * Transfer-Encoding, Expect). A proxy forwarding a message sets these
 * itself. */
int px_http_hop_by_hop(const px_http_header *x);

struct evbuffer;

/* Where the head at the start of `in` ends: its length through the blank
 * line ("\r\n\r\n"), 0 when it has not all arrived, or -1 when the first
 * max + 4 bytes hold no end (the head is too large). Only what is new since
 * the last call (and the 3 bytes before it) is searched: *searched keeps
 * that between calls (start at 0; back to 0 once the end is found), so a
 * head trickled in byte by byte does not cost a search of all of it per
 * byte. */
long px_http_head_end(struct evbuffer *in, size_t max, size_t *searched);

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
