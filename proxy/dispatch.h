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
 * in the registry (registry.h). */
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
    PX_DISP_SERIAL = 0,      /* mode serial: the pool says so */
    PX_DISP_NO_IDENTITY,     /* mode concurrent, sent serial: the prefill's identity is unknown */
    PX_DISP_CONCURRENT,      /* both legs at once */
    PX_DISP_COUNT
} px_dispatch_kind;

const char *px_dispatch_kind_mode(px_dispatch_kind k);   /* "serial" | "concurrent" */
const char *px_dispatch_kind_reason(px_dispatch_kind k); /* the reason label */

/* What decode's push params need of a prefill: the exact JSON texts
 * prefill sent for remote_engine_id, remote_host, remote_port, tp_size
 * ("1" when it sent none; vLLM's push scheduler requires the key) and
 * pp_size (passed on only when prefill sent it). */
typedef struct px_pf_identity {
    char engine_id[260]; /* a JSON string, quotes included */
    char host[260];      /* a JSON string, quotes included */
    char port[24];       /* a JSON number */
    char tp_size[24];    /* a JSON number */
    char pp_size[24];    /* a JSON number, or "": not sent */
} px_pf_identity;

/* Reads the identity out of a prefill answer's kv_transfer_params object
 * (`kvp`, n bytes) into *id. Returns 0, or -1 (id untouched) when one of
 * remote_engine_id, remote_host (strings) or remote_port (a number) is
 * missing or too long. Pure. */
int px_dispatch_identity_parse(const char *kvp, size_t n, px_pf_identity *id);

/* The cache. `backend` is the prefill backend's name. learn: stores what
 * its answer's kv_transfer_params say (returns 0, -1 when they hold no
 * identity: nothing changes); get: 1 with *id filled when known, else 0;
 * forget: drops it (decode could not load from it). At most
 * PX_DISPATCH_MAX_IDENTITIES backends are kept, the least recently
 * learned going first. Any thread. */
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

/* Appends prefill's kv_transfer_params (the serial ones plus id, token and
 * transfer_mode "push") to out. */
void px_dispatch_prefill_kvp(const char *id, const char *token, px_buf *out);
/* Appends decode's push kv_transfer_params to out. */
void px_dispatch_decode_kvp(const px_pf_identity *pf, const char *id, const char *token,
                            px_buf *out);

#endif
