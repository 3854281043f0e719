/* SPDX-License-Identifier: Apache-2.0 */
/* What passes from one leg of a request to the next: decode's body, built
 * from the client's body and prefill's answer (its kv_transfer_params as
 * they are), from the client's alone (decode alone), or, under --dispatch
 * concurrent, both legs' bodies at once; the cached_tokens of prefill's
 * answer that --usage-from prefill puts into decode's; the prefill
 * identity that concurrent dispatch learns from prefill's answers. Calls
 * back into nothing. */
#ifndef PX_HANDOFF_H
#define PX_HANDOFF_H

#include <stddef.h>

#include "base/util.h"
#include "proxy/dispatch.h"
#include "proxy/endpoint.h"
#include "proxy/metrics.h"
#include "proxy/rewrite.h"

/* Prefill's body (appended to *out): the client's `body` to endpoint `ep`
 * rewritten for a prefill (rewrite.h: max_tokens 1, remote decode, the
 * router's `transfer_id` in its kv_transfer_params). `x`: the body's index
 * (bodyidx.h) or NULL, here and below, copied from instead of scanning. */
void px_handoff_prefill(px_endpoint ep, const px_buf *body, const struct px_body_idx *x,
                        const char *transfer_id, px_buf *out);

/* Prefill (named `prefill`) answered `resp`, read into `a` once
 * (px_prefill_answer_read: done here unless a->read; a->read is cleared,
 * its spans die with resp): decode's body goes to *out
 * (reset first), the client's `body` with prefill's kv_transfer_params.
 * From then on only decode's body is needed (retries resend it): `body`
 * and prefill's body `pbody` are freed, and `resp` too unless `keep` (the
 * trace reads it): one copy of the request is held, not three.
 * An answer without them is warned of (req `lid`) and counted in m: decode
 * recomputes the prompt; one without remote_request_id too. `learn`: the
 * prefills' identities (dispatch.h) when the pool dispatches concurrently
 * (the identity is learned), else NULL. `usage_prefill`:
 * --usage-from prefill, its cached_tokens go to `cached`. Prefill's
 * parameters reach decode byte for byte but for their transfer_id, which is
 * the router's `transfer_id` (px_rewrite_decode_xfer). Returns what the
 * answer held; for PX_KVP_BAD_RESPONSE nothing is built (a->err says why). */
px_kvp_status px_handoff_serial(px_metrics *m, const char *lid, const char *prefill,
                                px_prefill_answer *a, px_buf *resp, int keep, px_buf *body,
                                const struct px_body_idx *x, px_buf *pbody, px_pf_cache *learn,
                                int usage_prefill, const char *transfer_id, px_buf *out,
                                char cached[24]);

/* Decode alone: its body (*out, reset first) is the client's without
 * kv_transfer_params of its own. */
void px_handoff_alone(const px_buf *body, const struct px_body_idx *x, px_buf *out);

/* --dispatch concurrent toward a prefill of identity `pf` (one that
 * pushes: px_dispatch_decide): prefill's body (*pbody, the prefill rewrite
 * of the client's) gets publication parameters minted here, decode's
 * (*dbody, reset first) where to register for them, both the router's
 * `transfer_id`; the minted request id goes to `id`. Returns 0, or -1 when
 * no id could be minted: nothing is changed, the request is sent serial. */
int px_handoff_concurrent(const px_pf_identity *pf, const char *transfer_id, const px_buf *body,
                          px_buf *pbody, px_buf *dbody, char id[PX_DISPATCH_ID_LEN]);

/* The concurrent prefill leg answered `resp` (2xx): its identity is
 * learned into `ids`, and with `usage_prefill` its cached_tokens go to `cached` when
 * that is still empty. */
void px_handoff_learn(px_pf_cache *ids, const char *prefill, const px_buf *resp, int usage_prefill,
                      char cached[24]);

/* The body `b` with the keys the proxy owns taken out when it is a JSON
 * object (px_rewrite_forwarded), in place. Returns what that returns. */
int px_handoff_forwarded(px_buf *b);

#endif
