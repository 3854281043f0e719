/* SPDX-License-Identifier: Apache-2.0 */
/* --fallback-decode-only with prefill's KV: decode's answer is held until
 * it shows whether decode failed to load the KV (vLLM's
 * kv_load_failure_policy fail: a 500 whose JSON error is an
 * InternalServerError, or a stream whose first event is that error); the
 * request is then retried once without kv_transfer_params, or the held
 * bytes go to the client as they came. A byte filter: decode's bytes go
 * in as they arrive, the verdict comes out. Pure: no loop, no request. */
#ifndef PX_KVHOLD_H
#define PX_KVHOLD_H

#include <stddef.h>

#include "base/util.h"

/* The most of a decode answer held to tell. */
#define PX_KVHOLD_MAX 65536

typedef struct px_kvhold {
    int active;  /* bytes are held in `held` */
    int sse;     /* the held answer is text/event-stream */
    px_buf held; /* owned */
    int retried; /* the retry without KV was sent: nothing is held again */
    int failed;  /* the held answer was a failed KV load */
} px_kvhold;

void px_kvhold_init(px_kvhold *k);
void px_kvhold_cleanup(px_kvhold *k);

/* Whether an answer of `status` (sse: an event stream) is held: one that
 * could be a failed KV load, while the retry is still to come. */
int px_kvhold_wanted(const px_kvhold *k, int status, int sse);
/* Starts holding an answer (sse: an event stream). */
void px_kvhold_start(px_kvhold *k, int sse);

/* Takes p[0..n) of the answer. Returns 1 when the held answer is a failed
 * KV load (failed is set: stop the transfer), 0 when it is not (pass the
 * held bytes on: px_kvhold_take), -1 when more is needed to tell. */
int px_kvhold_feed(px_kvhold *k, const char *p, size_t n);
/* The answer ended (`whole`: complete) while held: 1 when it is a failed
 * KV load, else 0. */
int px_kvhold_end(const px_kvhold *k, int whole);

/* Stops holding and moves the held bytes into *out (initialised here). */
void px_kvhold_take(px_kvhold *k, px_buf *out);
/* The retry without KV is sent: what was held is dropped. */
void px_kvhold_retry(px_kvhold *k);

/* Whether a JSON object p[0..n) is vLLM's GenerationError: what its
 * OpenAI front answers for a request that finished with finish_reason
 * "error", as a failed KV load under kv_load_failure_policy fail does. */
int px_kvhold_is_generation_error(const char *p, size_t n);

#endif
