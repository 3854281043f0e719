/* SPDX-License-Identifier: Apache-2.0 */
/* --dispatch: how a disaggregated request's two legs are sent.
 *
 * serial: prefill first; decode gets the kv_transfer_params of prefill's
 * answer (vLLM's pull connector, the toy proxy's flow).
 * concurrent: both at once, for a push connector. pdproxy mints the
 * request id and the publication token; prefill is told to publish under
 * them ({"do_remote_decode":true,"remote_request_id","remote_kv_token",
 * "transfer_mode":"push"}); decode is told where and under what to find
 * the KV ({"do_remote_prefill":true,"transfer_mode":"push",
 * "remote_engine_id","remote_request_id","remote_kv_token","remote_host",
 * "remote_port","tp_size"}, no remote_block_ids) and registers its fetch
 * at prefill before prefill is done. Decode's params need the prefill's
 * identity, which only that prefill's own answers tell: a process-wide
 * cache, per prefill backend, learned from its answers' kv_transfer_params
 * (any worker thread reads and writes it, under a mutex), one per process
 * in the registry (registry.h).
 *
 * Only a prefill that pushes may be sent both legs at once: its answers
 * say "transfer_mode":"push" (vLLM's NIXL schedulers write the key since
 * its PR #50620; docs/vllm-upstream.md). Decode's params without
 * remote_block_ids toward a prefill that pulls make vLLM's pull scheduler
 * fail an assertion (its engine core dies), so such a prefill, or one
 * that names no mode, is sent serial, counted with its reason.
 *
 * Both modes put a transfer_id on both legs: an id pdproxy mints per
 * dispatch (never a client's), by which vLLM's push connector pairs the
 * prefill and decode requests (its fallback, pairing by base request id,
 * pairs the wrong ones when clients reuse X-Request-Id). */
#ifndef PX_DISPATCH_H
#define PX_DISPATCH_H

#include <stddef.h>

#include "base/util.h"

typedef enum { PX_DISPATCH_SERIAL = 0, PX_DISPATCH_CONCURRENT = 1 } px_dispatch_mode;

#define PX_DISPATCH_MODES "serial|concurrent"

/* A mode's name to its value; -1 when unknown. */
int px_dispatch_parse(const char *s);
const char *px_dispatch_name(px_dispatch_mode m);

/* How one disaggregated request was dispatched (pdproxy_dispatch_total). */
typedef enum {
    PX_DISP_SERIAL = 0,   /* mode serial: the pool says so */
    PX_DISP_NO_IDENTITY,  /* mode concurrent, sent serial: the prefill's identity is unknown */
    PX_DISP_CONCURRENT,   /* both legs at once */
    PX_DISP_PULLS,        /* mode concurrent, sent serial: the prefill pulls */
    PX_DISP_MODE_UNKNOWN, /* mode concurrent, sent serial: the prefill names no transfer_mode */
    PX_DISP_COUNT
} px_dispatch_kind;

const char *px_dispatch_kind_mode(px_dispatch_kind k);   /* "serial" | "concurrent" */
const char *px_dispatch_kind_reason(px_dispatch_kind k); /* the reason label */

/* How a prefill's connector moves the KV, as its answers' transfer_mode
 * says: absent (or not a string), "push", anything else. */
typedef enum { PX_XFER_UNKNOWN = 0, PX_XFER_PULL, PX_XFER_PUSH } px_xfer_mode;

/* What decode's push params need of a prefill: the exact JSON texts
 * prefill sent for remote_engine_id, remote_host, remote_port, tp_size
 * ("1" when it sent none; vLLM's push scheduler requires the key) and
 * pp_size (passed on only when prefill sent it); and its transfer mode. */
typedef struct px_pf_identity {
    char engine_id[260]; /* a JSON string, quotes included */
    char host[260];      /* a JSON string, quotes included */
    char port[24];       /* a JSON number */
    char tp_size[24];    /* a JSON number */
    char pp_size[24];    /* a JSON number, or "": not sent */
    px_xfer_mode mode;
} px_pf_identity;

/* Reads the identity out of a prefill answer's kv_transfer_params object
 * (`kvp`, n bytes) into *id. Returns 0, or -1 (id untouched) when one of
 * remote_engine_id, remote_host (strings) or remote_port (a number) is
 * missing or too long. Pure. */
int px_dispatch_identity_parse(const char *kvp, size_t n, px_pf_identity *id);

/* How a request of a pool in `mode` goes to a prefill whose cached
 * identity is `id` (NULL: none known): PX_DISP_CONCURRENT only for a
 * concurrent pool and a prefill known to push. Pure. */
px_dispatch_kind px_dispatch_decide(px_dispatch_mode mode, const px_pf_identity *id);

/* The cache. `backend` is the prefill backend's name. learn: stores what
 * its answer's kv_transfer_params say, mode included (returns 0; -1 when
 * they hold no identity, and what was known of that prefill is dropped:
 * its answers no longer say where it is); get: 1 with *id filled when
 * known, else 0; forget: drops it (decode could not load from it, or the
 * prefill failed a health check: it may come back as another engine, in
 * another mode). At most PX_DISPATCH_MAX_IDENTITIES backends are kept,
 * the least recently learned going first. Any thread. */
#define PX_DISPATCH_MAX_IDENTITIES 4096
typedef struct px_pf_cache px_pf_cache;
px_pf_cache *px_pf_cache_create(void); /* empty; never NULL */
void px_pf_cache_destroy(px_pf_cache *c); /* NULL is a no-op */
int px_dispatch_learn(px_pf_cache *c, const char *backend, const char *kvp, size_t n);
int px_dispatch_get(px_pf_cache *c, const char *backend, px_pf_identity *id);
void px_dispatch_forget(px_pf_cache *c, const char *backend);

/* Mints a request id ("pdproxy-" and 32 hex digits) and a token (32 hex
 * digits, what libkvconnector's kv_token takes) from OpenSSL's RAND_bytes.
 * Returns 0, or -1 when the generator fails (nothing is written). */
#define PX_DISPATCH_ID_LEN 41 /* with its NUL */
int px_dispatch_mint(char id[PX_DISPATCH_ID_LEN], char token[33]);

/* Mints a transfer_id ("xfer-" and 32 hex digits) from the same
 * generator. Returns 0, or -1 (nothing written). */
#define PX_DISPATCH_XFER_LEN 38 /* with its NUL */
int px_dispatch_mint_transfer_id(char id[PX_DISPATCH_XFER_LEN]);

/* Appends prefill's kv_transfer_params (the serial ones plus id, token,
 * transfer_mode "push" and transfer_id) to out. */
void px_dispatch_prefill_kvp(const char *id, const char *token, const char *transfer_id,
                             px_buf *out);
/* Appends decode's push kv_transfer_params (with transfer_id) to out. */
void px_dispatch_decode_kvp(const px_pf_identity *pf, const char *id, const char *token,
                            const char *transfer_id, px_buf *out);

#endif
