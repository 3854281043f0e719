/* SPDX-License-Identifier: Apache-2.0 */
/* vLLM's KV cache events, as engine-sim publishes them.
 *
 * Facts (vllm-project/vllm, vllm/distributed/kv_events.py at commit
 * b4e69e0af33f (array form) and 0181ea3173e5 (newest read); options from
 * vllm/config/kv_events.py at 00634b8acf93):
 * - ZmqEventPublisher: a PUB socket (endpoint, default tcp://<any>:5557) sends
 *   each batch as a 3-frame message [topic (utf-8, default ""), sequence
 *   number (8 bytes big-endian, from 0, one per batch), msgspec msgpack
 *   payload]; hwm 100000; the last buffer_steps (10000) batches are kept.
 * - Replay: an optional ROUTER socket (replay_endpoint). A client (DEALER
 *   or REQ) sends [empty delimiter, start seq as 8 bytes big-endian]; the
 *   ROUTER sees [identity, "", seq] (anything but 3 frames is ignored) and
 *   answers [identity, "", seq8, payload] for every buffered batch with
 *   seq >= start, then the end marker [identity, "", -1 as 8 bytes
 *   big-endian signed (ff..ff), ""].
 * - KVEventBatch(ts: float = time.time(), events, data_parallel_rank: int
 *   | None); the publisher fills data_parallel_rank (0 here).
 * - BlockStored(block_hashes, parent_block_hash | None, token_ids,
 *   block_size, lora_id | None, medium | None ("GPU"), lora_name | None,
 *   extra_keys = None, group_idx = None, kv_cache_spec_kind = None,
 *   kv_cache_spec_sliding_window = None); BlockRemoved(block_hashes,
 *   medium, group_idx = None); AllBlocksCleared(). One BlockStored carries
 *   a run of consecutive new blocks of one request (token_ids: all their
 *   tokens), parent_block_hash the block before the run.
 * - Encoding: msgspec Structs with omit_defaults=True (fields equal to their
 *   default are left out) and tag=True (tag = class name). Up to vLLM PR
 *   #42892 (May 2026) they were array_like=True: every struct a msgpack
 *   array of its fields in order, an event's first element its tag:
 *   [ts, [["BlockStored", [h..], parent, [tok..], 16, nil, "GPU", nil]], 0].
 *   Since then events (and, at 0181ea3, the batch) are maps, the tag under
 *   "type": {"ts":..,"events":[{"type":"BlockStored","block_hashes":..}],
 *   "data_parallel_rank":0}. --kv-events-encoding picks one (array).
 * - /tokenize (vllm/entrypoints/openai/protocol.py): TokenizeCompletionRequest
 *   {model?, prompt, add_special_tokens = true, return_token_strs = false}
 *   or TokenizeChatRequest {model?, messages, add_generation_prompt = true,
 *   ...}; TokenizeResponse {count, max_model_len, tokens, token_strs?}.
 *
 * Block hashes here are engine-sim's own chained 64-bit prefix hashes
 * (kvsim_prefix_hashes); consumers key by token ids. */
#include "sim/kvevents.h"

#include <errno.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "base/log.h"
#include "base/util.h"

typedef struct kv_batch {
    uint64_t seq;
    char *data; /* owned */
    size_t len;
} kv_batch;

struct sim_kvev {
    sim_kvev_cfg cfg;
    int map;
    void *ctx, *pub, *router;
    struct event *rev, *rtimer;
    msgpack_sbuffer ev; /* pending events, encoded */
    msgpack_packer evp;
    size_t nev;
    uint64_t seq, replays;
    kv_batch *ring; /* buffer_steps entries; seq % buffer_steps */
};

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* The start of an event: its tag, and in map form its field count. */
static void event_head(sim_kvev *k, const char *tag, size_t nfields) {
    if (k->map) {
        msgpack_pack_map(&k->evp, nfields + 1);
        pack_str(&k->evp, "type");
    } else {
        msgpack_pack_array(&k->evp, nfields + 1);
    }
    pack_str(&k->evp, tag);
    k->nev++;
}

static void field(sim_kvev *k, const char *name) {
    if (k->map) pack_str(&k->evp, name);
}

void sim_kvev_stored(sim_kvev *k, const uint64_t *hashes, size_t n, int has_parent, uint64_t parent,
                     const uint32_t *tok, size_t ntok) {
    if (!k || !n) return;
    event_head(k, "BlockStored", 7);
    field(k, "block_hashes");
    msgpack_pack_array(&k->evp, n);
    for (size_t i = 0; i < n; i++)
        msgpack_pack_uint64(&k->evp, hashes[i]);
    field(k, "parent_block_hash");
    if (has_parent)
        msgpack_pack_uint64(&k->evp, parent);
    else
        msgpack_pack_nil(&k->evp);
    field(k, "token_ids");
    msgpack_pack_array(&k->evp, ntok);
    for (size_t i = 0; i < ntok; i++)
        msgpack_pack_uint32(&k->evp, tok[i]);
    field(k, "block_size");
    msgpack_pack_uint32(&k->evp, k->cfg.block_size);
    field(k, "lora_id");
    msgpack_pack_nil(&k->evp);
    field(k, "medium");
    pack_str(&k->evp, "GPU");
    field(k, "lora_name");
    msgpack_pack_nil(&k->evp);
}

void sim_kvev_removed(sim_kvev *k, uint64_t hash) {
    if (!k) return;
    event_head(k, "BlockRemoved", 2);
    field(k, "block_hashes");
    msgpack_pack_array(&k->evp, 1);
    msgpack_pack_uint64(&k->evp, hash);
    field(k, "medium");
    pack_str(&k->evp, "GPU");
}

void sim_kvev_cleared(sim_kvev *k) {
    if (!k) return;
    event_head(k, "AllBlocksCleared", 0);
}

static void seq_bytes(int64_t seq, unsigned char out[8]) {
    uint64_t u = (uint64_t)seq;
    for (int i = 7; i >= 0; i--) {
        out[i] = (unsigned char)(u & 0xff);
        u >>= 8;
    }
}

void sim_kvev_flush(sim_kvev *k) {
    if (!k || !k->nev) return;
    msgpack_sbuffer b;
    msgpack_sbuffer_init(&b);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &b, msgpack_sbuffer_write);
    if (k->map) {
        msgpack_pack_map(&pk, 3);
        pack_str(&pk, "ts");
    } else {
        msgpack_pack_array(&pk, 3);
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    msgpack_pack_double(&pk, (double)now.tv_sec + (double)now.tv_nsec / 1e9);
    if (k->map) pack_str(&pk, "events");
    msgpack_pack_array(&pk, k->nev);
    msgpack_sbuffer_write(&b, k->ev.data, k->ev.size);
    if (k->map) pack_str(&pk, "data_parallel_rank");
    msgpack_pack_int(&pk, 0);
    msgpack_sbuffer_clear(&k->ev);
    k->nev = 0;

    uint64_t seq = k->seq++;
    unsigned char sb[8];
    seq_bytes((int64_t)seq, sb);
    if (k->cfg.drop_seq < 0 || (uint64_t)k->cfg.drop_seq != seq) {
        const char *t = k->cfg.topic ? k->cfg.topic : "";
        /* PUB never blocks: beyond its high-water mark it drops, as vLLM's. */
        if (zmq_send(k->pub, t, strlen(t), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
            zmq_send(k->pub, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
            zmq_send(k->pub, b.data, b.size, ZMQ_DONTWAIT) < 0)
            PX_LOG(PX_LOG_WARN, "msg=\"cannot publish KV events\" seq=%llu error=\"%s\"",
                   (unsigned long long)seq, zmq_strerror(zmq_errno()));
    } else {
        PX_LOG(PX_LOG_INFO, "msg=\"KV event batch withheld (--kv-events-drop-seq)\" seq=%llu",
               (unsigned long long)seq);
    }
    kv_batch *slot = &k->ring[seq % k->cfg.buffer_steps];
    free(slot->data);
    slot->seq = seq;
    slot->len = b.size;
    slot->data = msgpack_sbuffer_release(&b);
    msgpack_sbuffer_destroy(&b);
}

/* ----------------------------------------------------------- replay -- */

static void router_send(sim_kvev *k, const zmq_msg_t *id, const void *seq8, const void *data,
                        size_t len) {
    zmq_msg_t idc;
    zmq_msg_init(&idc);
    zmq_msg_copy(&idc, (zmq_msg_t *)id);
    /* A ROUTER drops what it cannot route; it does not block. */
    zmq_msg_send(&idc, k->router, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_msg_close(&idc);
    zmq_send(k->router, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(k->router, seq8, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(k->router, data, len, ZMQ_DONTWAIT);
}

/* One request: [identity, "", start seq (8 bytes big-endian)]. */
static void serve_one(sim_kvev *k) {
    zmq_msg_t f[3];
    int nf = 0, more = 1, bad = 0;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, k->router, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (nf < 3)
            f[nf++] = m;
        else {
            bad = 1;
            zmq_msg_close(&m);
        }
    }
    if (bad || nf != 3 || zmq_msg_size(&f[2]) != 8) {
        PX_LOG(PX_LOG_WARN, "msg=\"invalid KV event replay request\" frames=%d", bad ? 4 : nf);
    } else {
        const unsigned char *p = zmq_msg_data(&f[2]);
        uint64_t start = 0;
        for (int i = 0; i < 8; i++)
            start = start << 8 | p[i];
        k->replays++;
        uint64_t first = k->seq > k->cfg.buffer_steps ? k->seq - k->cfg.buffer_steps : 0;
        if (start > first) first = start;
        for (uint64_t s = first; s < k->seq; s++) {
            kv_batch *b = &k->ring[s % k->cfg.buffer_steps];
            unsigned char sb[8];
            seq_bytes((int64_t)s, sb);
            router_send(k, &f[0], sb, b->data, b->len);
        }
        unsigned char end[8];
        seq_bytes(-1, end);
        router_send(k, &f[0], end, "", 0);
        PX_LOG(PX_LOG_DEBUG, "msg=\"KV events replayed\" from=%llu to=%llu",
               (unsigned long long)start, (unsigned long long)k->seq);
    }
    for (int i = 0; i < nf; i++)
        zmq_msg_close(&f[i]);
}

/* ZMQ_FD is edge-triggered: drain while ZMQ_EVENTS says readable. A timer
 * calls this too, so a missed edge only delays a replay. */
static void on_router(evutil_socket_t fd, short what, void *arg) {
    sim_kvev *k = arg;
    for (int i = 0; i < 1024; i++) {
        int ev = 0;
        size_t sz = sizeof ev;
        if (zmq_getsockopt(k->router, ZMQ_EVENTS, &ev, &sz) < 0 || !(ev & ZMQ_POLLIN)) return;
        serve_one(k);
    }
}

sim_kvev *sim_kvev_new(struct event_base *base, const sim_kvev_cfg *cfg, char *err, size_t errlen) {
    const char *enc = cfg->encoding ? cfg->encoding : "array";
    if (strcmp(enc, "array") && strcmp(enc, "map")) {
        snprintf(err, errlen, "--kv-events-encoding '%s': expected array or map", enc);
        return NULL;
    }
    sim_kvev *k = px_xcalloc(1, sizeof *k);
    k->cfg = *cfg;
    if (!k->cfg.buffer_steps) k->cfg.buffer_steps = 1;
    k->map = !strcmp(enc, "map");
    msgpack_sbuffer_init(&k->ev);
    msgpack_packer_init(&k->evp, &k->ev, msgpack_sbuffer_write);
    k->ring = px_xcalloc(k->cfg.buffer_steps, sizeof *k->ring);
    k->ctx = zmq_ctx_new();
    k->pub = zmq_socket(k->ctx, ZMQ_PUB);
    int hwm = 100000, linger = 0;
    zmq_setsockopt(k->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(k->pub, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(k->pub, cfg->endpoint) < 0) {
        snprintf(err, errlen, "--kv-events-endpoint '%s': %s", cfg->endpoint,
                 zmq_strerror(zmq_errno()));
        sim_kvev_free(k);
        return NULL;
    }
    if (cfg->replay_endpoint) {
        k->router = zmq_socket(k->ctx, ZMQ_ROUTER);
        zmq_setsockopt(k->router, ZMQ_LINGER, &linger, sizeof linger);
        if (zmq_bind(k->router, cfg->replay_endpoint) < 0) {
            snprintf(err, errlen, "--kv-events-replay-endpoint '%s': %s", cfg->replay_endpoint,
                     zmq_strerror(zmq_errno()));
            sim_kvev_free(k);
            return NULL;
        }
        int fd;
        size_t sz = sizeof fd;
        zmq_getsockopt(k->router, ZMQ_FD, &fd, &sz);
        k->rev = event_new(base, fd, EV_READ | EV_PERSIST, on_router, k);
        event_add(k->rev, NULL);
        k->rtimer = event_new(base, -1, EV_PERSIST, on_router, k);
        struct timeval tv = {0, 100000};
        event_add(k->rtimer, &tv);
    }
    return k;
}

void sim_kvev_free(sim_kvev *k) {
    if (!k) return;
    if (k->rev) event_free(k->rev);
    if (k->rtimer) event_free(k->rtimer);
    if (k->router) zmq_close(k->router);
    if (k->pub) zmq_close(k->pub);
    zmq_ctx_term(k->ctx);
    for (uint32_t i = 0; i < k->cfg.buffer_steps; i++)
        free(k->ring[i].data);
    free(k->ring);
    msgpack_sbuffer_destroy(&k->ev);
    free(k);
}

uint64_t sim_kvev_batches(const sim_kvev *k) {
    return k ? k->seq : 0;
}

uint64_t sim_kvev_replays(const sim_kvev *k) {
    return k ? k->replays : 0;
}
