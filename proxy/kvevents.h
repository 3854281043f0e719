/* SPDX-License-Identifier: Apache-2.0 */
/* vLLM's KV-cache events (vllm/distributed/kv_events.py): a ZeroMQ PUB
 * socket sends multipart [topic, 8-byte big-endian sequence, msgpack
 * KVEventBatch]; an optional ROUTER socket replays the batches from a
 * sequence number on request, then an end marker (sequence -1).
 *
 * px_kv_decode reads one batch (pure, fuzzed). px_kvsub subscribes to every
 * backend's publisher on the control thread's event loop: the endpoint its
 * config entry or POST /admin/backends declares (kv_events_endpoint,
 * kv_events_replay_endpoint), else tcp://<backend host>:<--kv-events-port>
 * (and <--kv-events-replay-port>); a declaration that changes (a reload,
 * the admin API) re-subscribes that backend alone, its index dropped. It and keeps px_ctx's px_kvindex current:
 * a sequence gap is replayed through tcp://<host>:<--kv-events-replay-port>
 * or, without one or when the replay cannot fill it, the backend's index is
 * dropped and rebuilt from the events that follow; a sequence that restarts
 * (a restarted engine) and a backend ejected by health checks drop it too. */
#ifndef PX_KVEVENTS_H
#define PX_KVEVENTS_H

#include <event2/event.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "base/util.h"
#include "proxy/config.h" /* px_strlist */
#include "proxy/metrics.h" /* px_kv_counters */

/* One BlockStored event, as the decoder hands it over (all borrowed for the
 * call). Engine block hashes that are bytes are reduced to 64 bits with
 * px_hash64. */
typedef struct px_kv_stored {
    const uint64_t *hashes; /* n engine block hashes */
    size_t n;
    int has_parent;
    uint64_t parent;
    const uint32_t *tok; /* n * block_size token ids */
    size_t block_size;
    const uint64_t *extra; /* n: hash of each block's extra keys and LoRA name (0: none) */
    uint64_t lora;         /* px_hash64 of the event's lora_name, 0: the base model */
} px_kv_stored;

typedef struct px_kv_sink {
    void *arg;
    void (*stored)(void *arg, const px_kv_stored *s);
    void (*removed)(void *arg, const uint64_t *hashes, size_t n);
    void (*cleared)(void *arg);
} px_kv_sink;

/* Bounds on what one event may carry; events past them are refused. */
#define PX_KV_MAX_BLOCKS 65536   /* block hashes per event */
#define PX_KV_MAX_TOKENS 1048576 /* token ids per event */
#define PX_KV_MAX_BLOCK_SIZE 4096

/* Decodes one KVEventBatch (msgspec's array layout, which vLLM used up to
 * late 2025, or the map layout with a "type" tag of later releases) and
 * calls the sink per event in order. Returns the events delivered; events
 * that are malformed are skipped and counted in *bad. -1 with err when the
 * payload is not a batch at all. */
int px_kv_decode(const void *buf, size_t len, const px_kv_sink *sink, size_t *bad, char *err,
                 size_t errlen);

struct px_ctx;
typedef struct px_kvsub px_kvsub;

/* With px_ctx's index (--kv-events-port, or a backend entry with
 * kv_events_endpoint at start): subscribes to the current generation's
 * backends and follows their changes. NULL when off (or out of memory,
 * logged). Control thread. */
px_kvsub *px_kvsub_start(struct px_ctx *ctx, struct event_base *base);
void px_kvsub_stop(px_kvsub *k); /* NULL is a no-op */

/* Endpoints backends declare, keyed by the backend's configured URL
 * (px_backend.src): the file layer (px_config.backend_kv, items "URL EP
 * REPLAY", "-" for none), replaced by each accepted configuration, and the
 * admin API's over it. A NULL or "-" endpoint falls back to the flag's.
 * One table per process (px_ctx's registry, ctx.h). Any thread (a lock);
 * the subscriber reads them on its next sync. */
typedef struct px_kv_decls px_kv_decls;
px_kv_decls *px_kv_decls_create(void);    /* empty; never NULL */
void px_kv_decls_destroy(px_kv_decls *t); /* NULL is a no-op */
void px_kvsub_declare_file(px_kv_decls *t, const px_strlist *decl);
/* POST /admin/backends (ep or rep not NULL), or DELETE (both NULL: the
 * admin layer forgets the URL). */
void px_kvsub_declare_admin(px_kv_decls *t, const char *url, const char *ep, const char *rep);
/* A reload from the file dropped the admin API's changes and with them
 * the endpoints it declared. */
void px_kvsub_forget_admin(px_kv_decls *t);

/* The endpoint the backend `backend` (host:port) is subscribed at now;
 * NULL when none (or k is NULL). Valid until the subscriber's next sync.
 * Control thread. */
const char *px_kvsub_endpoint(px_kvsub *k, const char *backend);

/* Appends a JSON array of the subscriptions (backend, endpoint, replay
 * endpoint and where they come from: "flag", "file" or "admin", sequence,
 * per-backend counters, index blocks and bytes) to b; when `backend` is
 * not NULL only that one. Returns how many. Control thread. */
size_t px_kvsub_json(px_kvsub *k, const char *backend, px_buf *b);

#endif
