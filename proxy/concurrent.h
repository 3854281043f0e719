/* SPDX-License-Identifier: Apache-2.0 */
/* --dispatch concurrent (dispatch.h): the prefill leg that runs beside
 * decode's. Decides whether a request goes concurrent (the prefill's
 * identity known, and it pushes) and builds both legs' bodies; then takes
 * over the prefill leg's callbacks and reads its answer only for its
 * status and identity (learned into the identity cache, forgotten when
 * decode could not load from it). What the leg's end means for the
 * request it tells its owner (request.c) through a table: the owner
 * changes the request's state, this module never does. */
#ifndef PX_CONCURRENT_H
#define PX_CONCURRENT_H

#include "proxy/dispatch.h"
#include "proxy/leg.h"
#include "proxy/reqlog.h"

typedef struct px_conc_ops {
    void (*account)(void *owner); /* the memory budget's count is brought up to date */
    /* Decode had answered in full and the prefill leg is over (it answered,
     * or its grace passed): the request ends (may free it). */
    void (*over)(void *owner);
    /* The prefill failed while decode waited for its KV; decode's leg is
     * cancelled, nothing reached the client. rejected: prefill answered
     * 4xx, its answer kept in the leg's resp, to go to the client as
     * prefill said it. failed: any other failure (rc and why: the
     * transfer's), its answer dropped. */
    void (*rejected)(void *owner);
    void (*failed)(void *owner, px_up_result rc, const char *why);
} px_conc_ops;

typedef struct px_conc {
    const px_conc_ops *ops; /* borrowed */
    void *owner;            /* borrowed */
    px_leg *pre, *dec;      /* borrowed: the request's legs */
    const px_reqlog *log;   /* borrowed: the request's start and decode's first byte */
    char *cached;           /* borrowed: --usage-from prefill's cached_tokens (reply.h) */
    int awaiting;           /* decode answered in full: only the prefill leg is waited for */
} px_conc;

/* cached: the reply's 24 bytes for prefill's cached_tokens. */
void px_conc_init(px_conc *c, const px_conc_ops *ops, void *owner, px_leg *pre, px_leg *dec,
                  const px_reqlog *log, char *cached);

/* Dispatches toward the prefill the leg holds (pre->b), the pool's mode
 * `mode`: prefill is told to publish under an id and token minted here,
 * decode is told where to register for them (px_handoff_concurrent, from
 * the client's `body` and the request's transfer_id). A prefill whose
 * identity is not known yet, or that does not push, is sent serial
 * (px_dispatch_decide): its answer teaches it (px_handoff_serial).
 * Logged. Returns the kind; for PX_DISP_CONCURRENT both
 * bodies are built and the prefill leg reports here from now on: the
 * caller sends both legs. */
px_dispatch_kind px_conc_dispatch(px_conc *c, px_dispatch_mode mode, const char *transfer_id,
                                  const px_buf *body);

/* Decode answered in full while the prefill leg still runs (decode loaded
 * the KV as prefill published it, or computed the prompt itself). The
 * client has its answer; prefill is let answer, so that a publication
 * being made is not cut half-way (it would wait for expiry) and its
 * answer refreshes the identity, but not for longer than a grace; then
 * ops->over. */
void px_conc_await(px_conc *c);

/* Decode could not load from the prefill it was pointed at: that identity
 * is not trusted again until the prefill answers anew, and decode no
 * longer waits for the leg. */
void px_conc_distrust(px_conc *c);

#endif
