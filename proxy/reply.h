/* SPDX-License-Identifier: Apache-2.0 */
/* A request's one answer to its client: a body of its own, an OpenAI
 * error, or decode's answer relayed as it arrives — held first while it
 * may be a failed KV load (kvhold.h), through the --usage-from prefill
 * filter (usage.h), paused while the client's queue is full — with the
 * bytes that left counted. Knows the client's connection and the request's
 * admission entry (the answer's tokens, its rate-limit headers), nothing
 * of the request. */
#ifndef PX_REPLY_H
#define PX_REPLY_H

#include <stddef.h>

#include "base/conn.h"
#include "proxy/admission.h"
#include "proxy/predict.h"
#include "proxy/kvhold.h"
#include "proxy/usage.h"

typedef struct px_reply {
    px_conn *conn;     /* borrowed: NULL once the answer ended or the client left */
    const char *id;    /* borrowed: the request id the answer echoes */
    px_ctx *ctx;       /* borrowed */
    px_adm_req *adm;   /* borrowed: the request's admission entry */
    px_lat_req *lat;   /* borrowed, or NULL: its latency targets (TPOT counted, predict.h) */
    size_t *bytes_out; /* borrowed: where the bytes sent are counted */
    int started;       /* decode's answer has begun to go out: errors cut it */
    int paused;        /* decode waits for the client to drain its queue */
    char cached[24];   /* --usage-from prefill: prefill's cached_tokens, as number text */
    px_usage usage;    /* owned: the filter that puts them into decode's usage */
    px_kvhold hold;    /* owned: decode's answer held to tell a failed KV load */
} px_reply;

void px_reply_init(px_reply *o, px_conn *c, px_ctx *ctx, px_adm_req *adm, const char *id,
                   size_t *bytes_out);
void px_reply_cleanup(px_reply *o);
/* Bytes held for the answer (the memory budget's count). */
size_t px_reply_held(const px_reply *o);

/* Answers with a body of its own and lets the client go. */
void px_reply_body(px_reply *o, int status, const char *ctype, const char *body, size_t n);
/* The request failed: `msg` in an OpenAI error (extra: more header lines,
 * or NULL) when nothing went out yet, else the stream is cut (msg NULL:
 * cut whatever went out). Lets the client go. */
void px_reply_fail(px_reply *o, int status, const char *extra, const char *msg);

/* Decode's answer head goes out: `status`, `ctype`, `sse` (an event
 * stream); prefill's cached_tokens are put into its usage when `kv` (it
 * had prefill's KV) and --usage-from prefill says so. */
void px_reply_start(px_reply *o, int status, const char *ctype, int sse, int kv);
/* Decode's bytes to the client (through the usage filter when active).
 * Returns 0, or 1 when the client's queue is full: decode pauses (paused
 * is set) and delivers them again. */
int px_reply_pass(px_reply *o, const char *p, size_t n);
/* The held answer is not a failed KV load: its head (status, ctype) and
 * its bytes go out as they came. */
void px_reply_release(px_reply *o, int status, const char *ctype, int kv);
/* Decode's answer ended (`whole`: complete): what the usage filter holds
 * goes out; a whole answer ends the stream and lets the client go. */
void px_reply_end(px_reply *o, int whole);

#endif
