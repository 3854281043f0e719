/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim's KV cache events, published as vLLM does with
 * --kv-events-config: a ZeroMQ PUB socket sending [topic, seq, msgpack
 * KVEventBatch] and an optional ROUTER socket replaying buffered batches
 * from a sequence number on request. The wire format is described at the
 * top of kvevents.c. */
#ifndef SIM_KVEVENTS_H
#define SIM_KVEVENTS_H

#include <event2/event.h>
#include <stddef.h>
#include <stdint.h>

typedef struct sim_kvev sim_kvev;

typedef struct sim_kvev_cfg {
    const char *endpoint;        /* PUB bind address, e.g. tcp://127.0.0.1:5557 */
    const char *replay_endpoint; /* ROUTER bind address, or NULL */
    const char *topic;           /* first frame of every message ("") */
    uint32_t buffer_steps;       /* batches kept for replay */
    const char *encoding;        /* "array" (msgspec array_like) or "map" */
    int drop_seq;                /* this batch is buffered but not sent; -1: none */
    uint32_t block_size;         /* tokens per block, as in BlockStored */
} sim_kvev_cfg;

/* Binds the sockets and hooks the replay socket into base. NULL with a
 * message in err when a socket cannot be bound or the config is wrong. */
sim_kvev *sim_kvev_new(struct event_base *base, const sim_kvev_cfg *cfg, char *err, size_t errlen);
void sim_kvev_free(sim_kvev *k);

/* Events go into the pending batch, in order; flush publishes it. */
void sim_kvev_stored(sim_kvev *k, const uint64_t *hashes, size_t n, int has_parent, uint64_t parent,
                     const uint32_t *tok, size_t ntok);
void sim_kvev_removed(sim_kvev *k, uint64_t hash);
void sim_kvev_cleared(sim_kvev *k);
/* Publishes the pending events as one batch with the next sequence number
 * (nothing when there are none). */
void sim_kvev_flush(sim_kvev *k);

/* Batches published so far (the next sequence number). */
uint64_t sim_kvev_batches(const sim_kvev *k);
/* Replay requests served. */
uint64_t sim_kvev_replays(const sim_kvev *k);

#endif
