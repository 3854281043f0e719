/* SPDX-License-Identifier: Apache-2.0 */
/* --usage-from prefill: decode's answer with prefill's cached_tokens in
 * place of decode's (usage.prompt_tokens_details.cached_tokens), and
 * without the usage chunk the proxy asked for (px_usage_strip), as a byte
 * filter. Decode's bytes go in as they arrive; what comes out goes to the
 * caller's output callback, every byte as it was but that number. A JSON
 * answer is held whole, an SSE answer an event at a time; past the hold
 * limit the filter gives up and lets the rest pass untouched. Pure: no
 * loop, no request. */
#ifndef PX_USAGE_H
#define PX_USAGE_H

#include <stddef.h>

#include "base/json.h"
#include "base/util.h"

/* Receives the filter's output, n > 0 bytes at a time. */
typedef void (*px_usage_out)(void *arg, const char *p, size_t n);

typedef struct px_usage {
    char cached[24];  /* prefill's cached_tokens, as number text */
    int sse;          /* 1: text/event-stream, 0: one JSON document */
    int active;       /* 0: bytes pass as they come (not started, gave up or ended) */
    size_t max_hold;  /* most bytes held before giving up */
    px_buf held;      /* owned: bytes not yet passed on */
    px_usage_out out; /* borrowed, with arg */
    void *arg;
    int strip;          /* drop the usage chunk of an SSE answer (px_usage_strip) */
    unsigned stripped;  /* usage chunks dropped */
} px_usage;

/* Copies the number text of usage.prompt_tokens_details.cached_tokens in
 * the JSON object json[0..n) into out (NUL-terminated). Returns 1, or 0
 * when there is none or it does not fit (out untouched). */
int px_usage_cached_tokens(const char *json, size_t n, char out[24]);

/* The same, from the answer's usage member already found (its val NULL:
 * none). */
int px_usage_cached_tokens_in(const px_json_member *usage, char out[24]);

/* Starts filtering: `cached` is prefill's number text (from
 * px_usage_cached_tokens), `sse` says how decode answers. */
void px_usage_init(px_usage *u, const char *cached, int sse, size_t max_hold, px_usage_out out,
                   void *arg);

/* Also drops the SSE event that carries only usage (empty "choices", a
 * "usage" object): the one decode sends because the proxy asked for it
 * (stream_options.include_usage, to count a tenant's tokens) and the client
 * did not. Every other byte passes as it came. With `cached` "" only this. */
void px_usage_strip(px_usage *u);

/* Takes p[0..n) of decode's answer. Returns 0 when the filter took it
 * (held, complete events passed on), or -1 when it would pass the hold
 * limit: the filter has passed on what it held, as it was, and stopped;
 * p[0..n) is the caller's to pass on. */
int px_usage_feed(px_usage *u, const char *p, size_t n);

/* Decode's answer ended: `whole` when it arrived complete. What is held
 * goes out (fixed when whole, or event by event) and the filter stops. */
void px_usage_end(px_usage *u, int whole);

/* Bytes held now (for the memory budget). */
size_t px_usage_held(const px_usage *u);

/* Frees what is held, passing nothing on. */
void px_usage_cleanup(px_usage *u);

#endif
