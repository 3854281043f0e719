/* SPDX-License-Identifier: Apache-2.0 */
/* The client left while prefill may hold KV blocks for it (vLLM's
 * stranded-blocks release): the request keeps running only to let them
 * go. A prefill in flight is let answer within a grace; then decode is
 * sent the request and aborted once it has it, so that it tells prefill to
 * free the blocks at once instead of at their expiry. Works on the
 * request's two legs, whose callbacks it takes over; asks its owner
 * (request.c) through a table for what only the request knows. */
#ifndef PX_RELEASE_H
#define PX_RELEASE_H

#include "proxy/intake.h"
#include "proxy/leg.h"

typedef struct px_release_ops {
    void (*account)(void *owner); /* the memory budget's count is brought up to date */
    /* Prefill answered 2xx: decode's body is built from its answer.
     * Returns 1 when it carries prefill's kv_transfer_params (there are
     * blocks to release), else 0. */
    int (*handoff)(void *owner);
    int (*send)(void *owner);  /* decode's leg sends the request; -1: the request ended */
    void (*over)(void *owner); /* nothing is left to do: the request ends (may free it) */
} px_release_ops;

typedef struct px_release {
    const px_release_ops *ops; /* borrowed */
    void *owner;               /* borrowed */
    px_leg *pre, *dec;         /* borrowed: the request's legs */
    px_intake *in;             /* borrowed: what a decode pick brings */
    int half_closed;           /* prefill was told the client left; its answer is still read */
} px_release;

void px_release_init(px_release *rl, const px_release_ops *ops, void *owner, px_leg *pre,
                     px_leg *dec, px_intake *in);

/* The client left during prefill. Prefill publishes its blocks just before
 * its answer leaves: a client leaving near that moment would strand them
 * if the connection were cut. So prefill gets a short grace (well inside
 * the 100 ms in which a cancelled upstream must close) to answer, longer
 * when it has started answering; an answer goes on to the release through
 * decode. Silence gets prefill told the client left (its write side shut,
 * so an engine aborts a request it has not finished) and its answer read
 * a while longer; then it is cut. */
void px_release_prefill(px_release *rl);

/* The client left before decode received the request (abort after upload
 * is armed): the body is let reach decode, then the transfer is aborted. */
void px_release_decode(px_release *rl);

#endif
