/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/kvevents.h"

#include <errno.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "base/hash.h"
#include "base/log.h"
#include "proxy/config.h"
#include "proxy/ctx.h"
#include "proxy/kvindex.h"

/* ---------- decoding ---------- */

/* msgpack-c allocates a container's element array from its declared count
 * before reading the elements, so a 5-byte "array of 4 billion" would ask
 * for 64 GiB. This walk checks the structure first: every count fits in
 * the bytes left (an element takes at least one), nesting is shallow. */
#define MP_DEPTH 16

static int be(const unsigned char *p, size_t len, size_t *off, size_t w, uint64_t *v) {
    if (len - *off < w) return -1;
    uint64_t x = 0;
    for (size_t i = 0; i < w; i++)
        x = x << 8 | p[*off + i];
    *off += w;
    *v = x;
    return 0;
}

static int mp_sane(const unsigned char *p, size_t len) {
    uint64_t pend[MP_DEPTH + 1];
    int d = 0;
    size_t off = 0;
    pend[0] = 1;
    while (d >= 0) {
        if (!pend[d]) {
            d--;
            continue;
        }
        pend[d]--;
        if (off >= len) return -1;
        unsigned c = p[off++];
        uint64_t cnt = 0, skip = 0, v;
        int container = 0;
        if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3) {
        } else if (c >= 0x80 && c <= 0x8f) {
            container = 1;
            cnt = (uint64_t)(c & 0xf) * 2;
        } else if (c >= 0x90 && c <= 0x9f) {
            container = 1;
            cnt = c & 0xf;
        } else if (c >= 0xa0 && c <= 0xbf) {
            skip = c & 0x1f;
        } else {
            switch (c) {
            case 0xc4:
            case 0xd9:
                if (be(p, len, &off, 1, &skip)) return -1;
                break;
            case 0xc5:
            case 0xda:
                if (be(p, len, &off, 2, &skip)) return -1;
                break;
            case 0xc6:
            case 0xdb:
                if (be(p, len, &off, 4, &skip)) return -1;
                break;
            case 0xc7:
                if (be(p, len, &off, 1, &v)) return -1;
                skip = v + 1;
                break;
            case 0xc8:
                if (be(p, len, &off, 2, &v)) return -1;
                skip = v + 1;
                break;
            case 0xc9:
                if (be(p, len, &off, 4, &v)) return -1;
                skip = v + 1;
                break;
            case 0xca:
            case 0xce:
            case 0xd2:
                skip = 4;
                break;
            case 0xcb:
            case 0xcf:
            case 0xd3:
                skip = 8;
                break;
            case 0xcc:
            case 0xd0:
                skip = 1;
                break;
            case 0xcd:
            case 0xd1:
                skip = 2;
                break;
            case 0xd4:
                skip = 2;
                break;
            case 0xd5:
                skip = 3;
                break;
            case 0xd6:
                skip = 5;
                break;
            case 0xd7:
                skip = 9;
                break;
            case 0xd8:
                skip = 17;
                break;
            case 0xdc:
                if (be(p, len, &off, 2, &cnt)) return -1;
                container = 1;
                break;
            case 0xdd:
                if (be(p, len, &off, 4, &cnt)) return -1;
                container = 1;
                break;
            case 0xde:
                if (be(p, len, &off, 2, &cnt)) return -1;
                cnt *= 2;
                container = 1;
                break;
            case 0xdf:
                if (be(p, len, &off, 4, &cnt)) return -1;
                cnt *= 2;
                container = 1;
                break;
            default:
                return -1; /* 0xc1: never used */
            }
        }
        if (container) {
            if (cnt > len - off) return -1;
            if (cnt) {
                if (d == MP_DEPTH) return -1;
                pend[++d] = cnt;
            }
        } else if (skip > len - off) {
            return -1;
        } else {
            off += (size_t)skip;
        }
    }
    return 0;
}

static int is_str(const msgpack_object *o, const char *s) {
    size_t n = strlen(s);
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == n && !memcmp(o->via.str.ptr, s, n);
}

/* An engine block hash: an int (older releases) or bytes (ExternalBlockHash). */
static int block_hash(const msgpack_object *o, uint64_t *h) {
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        *h = o->via.u64;
    } else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *h = (uint64_t)o->via.i64;
    } else if (o->type == MSGPACK_OBJECT_BIN) {
        *h = px_hash64(o->via.bin.ptr, o->via.bin.size);
    } else if (o->type == MSGPACK_OBJECT_STR) {
        *h = px_hash64(o->via.str.ptr, o->via.str.size);
    } else {
        return -1;
    }
    return 0;
}

/* A structural hash of an extra-keys entry (depth bounded by mp_sane). */
static uint64_t obj_hash(const msgpack_object *o, uint64_t h) {
    h = px_hash64_more(h, &o->type, sizeof o->type);
    switch (o->type) {
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        return px_hash64_more(h, &o->via.u64, sizeof o->via.u64);
    case MSGPACK_OBJECT_BOOLEAN:
        return px_hash64_more(h, &o->via.boolean, sizeof o->via.boolean);
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        return px_hash64_more(h, &o->via.f64, sizeof o->via.f64);
    case MSGPACK_OBJECT_STR:
        return px_hash64_more(h, o->via.str.ptr, o->via.str.size);
    case MSGPACK_OBJECT_BIN:
        return px_hash64_more(h, o->via.bin.ptr, o->via.bin.size);
    case MSGPACK_OBJECT_ARRAY:
        for (uint32_t i = 0; i < o->via.array.size; i++)
            h = obj_hash(&o->via.array.ptr[i], h);
        return h;
    case MSGPACK_OBJECT_MAP:
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            h = obj_hash(&o->via.map.ptr[i].key, h);
            h = obj_hash(&o->via.map.ptr[i].val, h);
        }
        return h;
    default:
        return h;
    }
}

/* What block i's extra keys add to its index key. vLLM's entry is a tuple
 * of the LoRA name (every block of a LoRA request), multimodal keys (tuples),
 * the cache_salt (the first block of a sequence only, a string) and
 * prompt-embedding hashes (bytes) (kv_cache_utils.py,
 * generate_block_hash_extra_keys, read at vllm-project/vllm@001cabc1). The
 * LoRA name is already in `lora`'s part of the key and a salt is keyed as
 * a request keys its own (px_kv_salt_key), so that a request can match
 * them; whatever else is there is hashed as it is and matches no request
 * the proxy can compute, as it should. */
static uint64_t entry_extra(const msgpack_object *e, const msgpack_object *lora_name, int first) {
    if (!e || e->type == MSGPACK_OBJECT_NIL) return 0;
    if (e->type != MSGPACK_OBJECT_ARRAY) return obj_hash(e, 1);
    const msgpack_object *salt = NULL;
    uint64_t other = 1;
    int has_other = 0;
    for (uint32_t j = 0; j < e->via.array.size; j++) {
        const msgpack_object *x = &e->via.array.ptr[j];
        if (x->type == MSGPACK_OBJECT_STR) {
            if (lora_name && lora_name->type == MSGPACK_OBJECT_STR &&
                x->via.str.size == lora_name->via.str.size &&
                !memcmp(x->via.str.ptr, lora_name->via.str.ptr, x->via.str.size))
                continue;
            if (first) { /* the salt comes after the LoRA name and multimodal keys */
                if (salt) other = obj_hash(salt, other), has_other = 1;
                salt = x;
                continue;
            }
        }
        other = obj_hash(x, other);
        has_other = 1;
    }
    return (salt ? px_kv_salt_key(salt->via.str.ptr, salt->via.str.size) : 0) ^
           (has_other ? other : 0);
}

/* The fields of one event, found by position (array layout) or name. */
typedef struct fields {
    const msgpack_object *hashes, *parent, *tok, *bs, *lora_name, *extra;
} fields;

static const char *const stored_names[] = {"block_hashes", "parent_block_hash", "token_ids",
                                           "block_size",   "lora_id",           "medium",
                                           "lora_name",    "extra_keys"};

static void field_set(fields *f, int i, const msgpack_object *v) {
    switch (i) {
    case 0:
        f->hashes = v;
        break;
    case 1:
        f->parent = v;
        break;
    case 2:
        f->tok = v;
        break;
    case 3:
        f->bs = v;
        break;
    case 6:
        f->lora_name = v;
        break;
    case 7:
        f->extra = v;
        break;
    default:
        break;
    }
}

static uint64_t *hashes_of(const msgpack_object *a, size_t *n) {
    if (!a || a->type != MSGPACK_OBJECT_ARRAY || a->via.array.size > PX_KV_MAX_BLOCKS) return NULL;
    *n = a->via.array.size;
    uint64_t *h = px_xmalloc((*n ? *n : 1) * sizeof *h);
    for (size_t i = 0; i < *n; i++)
        if (block_hash(&a->via.array.ptr[i], &h[i]) < 0) {
            free(h);
            return NULL;
        }
    return h;
}

static int do_stored(const fields *f, const px_kv_sink *sink) {
    size_t n;
    uint64_t *h = hashes_of(f->hashes, &n);
    if (!h) return -1;
    uint32_t *tok = NULL;
    uint64_t *extra = NULL;
    int rc = -1;
    if (!f->bs || f->bs->type != MSGPACK_OBJECT_POSITIVE_INTEGER || !f->bs->via.u64 ||
        f->bs->via.u64 > PX_KV_MAX_BLOCK_SIZE)
        goto out;
    size_t bs = (size_t)f->bs->via.u64;
    if (!f->tok || f->tok->type != MSGPACK_OBJECT_ARRAY ||
        f->tok->via.array.size > PX_KV_MAX_TOKENS || f->tok->via.array.size != n * bs)
        goto out;
    tok = px_xmalloc((n * bs + 1) * sizeof *tok);
    for (size_t i = 0; i < n * bs; i++) {
        const msgpack_object *t = &f->tok->via.array.ptr[i];
        if (t->type != MSGPACK_OBJECT_POSITIVE_INTEGER || t->via.u64 > UINT32_MAX) goto out;
        tok[i] = (uint32_t)t->via.u64;
    }
    px_kv_stored s = {.hashes = h, .n = n, .tok = tok, .block_size = bs};
    if (f->parent && f->parent->type != MSGPACK_OBJECT_NIL) {
        if (block_hash(f->parent, &s.parent) < 0) goto out;
        s.has_parent = 1;
    }
    uint64_t lora = 0;
    if (f->lora_name && f->lora_name->type == MSGPACK_OBJECT_STR)
        lora = px_hash64(f->lora_name->via.str.ptr, f->lora_name->via.str.size);
    s.lora = lora;
    int has_extra = f->extra && f->extra->type == MSGPACK_OBJECT_ARRAY;
    if (has_extra && f->extra->via.array.size != n) goto out;
    if (lora || has_extra) {
        extra = px_xmalloc((n ? n : 1) * sizeof *extra);
        for (size_t i = 0; i < n; i++) {
            const msgpack_object *e = has_extra ? &f->extra->via.array.ptr[i] : NULL;
            extra[i] = px_mix64(lora) ^ entry_extra(e, f->lora_name, i == 0 && !s.has_parent);
        }
        s.extra = extra;
    }
    if (sink->stored) sink->stored(sink->arg, &s);
    rc = 0;
out:
    free(h);
    free(tok);
    free(extra);
    return rc;
}

static int do_event(const msgpack_object *ev, const px_kv_sink *sink) {
    const msgpack_object *tag = NULL;
    fields f = {0};
    if (ev->type == MSGPACK_OBJECT_ARRAY && ev->via.array.size >= 1) {
        tag = &ev->via.array.ptr[0];
        for (uint32_t i = 1; i < ev->via.array.size && i <= 8; i++)
            field_set(&f, (int)i - 1, &ev->via.array.ptr[i]);
    } else if (ev->type == MSGPACK_OBJECT_MAP) {
        for (uint32_t i = 0; i < ev->via.map.size; i++) {
            const msgpack_object *k = &ev->via.map.ptr[i].key, *v = &ev->via.map.ptr[i].val;
            if (is_str(k, "type")) tag = v;
            for (int j = 0; j < 8; j++)
                if (is_str(k, stored_names[j])) field_set(&f, j, v);
        }
    }
    if (!tag) return -1;
    if (is_str(tag, "BlockStored")) return do_stored(&f, sink);
    if (is_str(tag, "BlockRemoved")) {
        size_t n;
        uint64_t *h = hashes_of(f.hashes, &n);
        if (!h) return -1;
        if (sink->removed) sink->removed(sink->arg, h, n);
        free(h);
        return 0;
    }
    if (is_str(tag, "AllBlocksCleared")) {
        if (sink->cleared) sink->cleared(sink->arg);
        return 0;
    }
    return -1;
}

static int fail(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

int px_kv_decode(const void *buf, size_t len, const px_kv_sink *sink, size_t *bad, char *err,
                 size_t errlen) {
    if (mp_sane(buf, len) < 0) return fail(err, errlen, "not well-formed msgpack");
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    if (msgpack_unpack_next(&u, buf, len, &off) != MSGPACK_UNPACK_SUCCESS) {
        msgpack_unpacked_destroy(&u);
        return fail(err, errlen, "msgpack decoder refused it");
    }
    const msgpack_object *b = &u.data, *events = NULL;
    if (b->type == MSGPACK_OBJECT_ARRAY && b->via.array.size >= 2) {
        events = &b->via.array.ptr[1];
    } else if (b->type == MSGPACK_OBJECT_MAP) {
        for (uint32_t i = 0; i < b->via.map.size; i++)
            if (is_str(&b->via.map.ptr[i].key, "events")) events = &b->via.map.ptr[i].val;
    }
    if (!events || events->type != MSGPACK_OBJECT_ARRAY) {
        msgpack_unpacked_destroy(&u);
        return fail(err, errlen, "not a KVEventBatch [ts, events, data_parallel_rank]");
    }
    int n = 0;
    for (uint32_t i = 0; i < events->via.array.size; i++) {
        if (do_event(&events->via.array.ptr[i], sink) == 0)
            n++;
        else if (bad)
            (*bad)++;
    }
    msgpack_unpacked_destroy(&u);
    return n;
}

/* ---------- the subscriber ---------- */

/* Bounds on what a publisher can make pdproxy hold: ZeroMQ refuses larger
 * messages (and drops that connection) and queues at most RCVHWM of them. */
#define SUB_MAX_MSG (4 << 20)
#define SUB_HWM 16
#define DRAIN_BUDGET 256     /* messages per callback: a flood cannot starve the loop */
#define REPLAY_TIMEOUT_S 2.0 /* a replay not ended by then is given up */
#define SYNC_INTERVAL_S 0.5  /* how often the backend list is compared */

typedef struct sub {
    struct px_kvsub *k;
    char *name;      /* owned: the backend's name, the index slot's */
    char *endpoint;  /* owned */
    char *replay_ep; /* owned; NULL: no replay socket */
    const char *from; /* static: "flag", "file" or "admin" */
    int slot;
    void *sock, *rep;             /* owned: SUB, DEALER */
    void *mon;                    /* owned: PAIR reading the SUB socket's monitor events */
    struct event *ev, *rev, *mev; /* owned */
    struct event *reopen;         /* owned: makes the SUB socket again, on the next turn */
    struct event *rtimer;         /* owned */
    int have_seq, replaying, seen, was_healthy;
    uint64_t next; /* the sequence expected */
    unsigned long long batches, events, malformed, gaps, replays, replay_fail, resets;
    uint64_t malformed_log_ns;        /* when the last malformed batch was logged */
    unsigned long long malformed_quiet; /* malformed batches not logged since */
    struct sub *nx;
} sub;

struct px_kvsub {
    px_ctx *ctx;
    struct event_base *base;
    void *zctx;
    struct event *sync; /* owned */
    sub *subs;
    int port, rport;
};

static void reset_index(sub *s, const char *why) {
    px_kvindex_clear(s->k->ctx->kvindex, s->slot);
    s->resets++;
    atomic_fetch_add(&s->k->ctx->kvc.resets, 1);
    PX_LOG(PX_LOG_INFO, "msg=\"kv index dropped\" backend=%s reason=%s", s->name, why);
}

static void sink_stored(void *arg, const px_kv_stored *st) {
    sub *s = arg;
    size_t refused = 0;
    if (st->lora) px_kvindex_lora_seen(s->k->ctx->kvindex, st->lora);
    px_kvindex_store(s->k->ctx->kvindex, s->slot, st->hashes, st->n, st->has_parent, st->parent,
                     st->tok, st->block_size, st->extra, &refused);
    if (refused) atomic_fetch_add(&s->k->ctx->kvc.refused, refused);
}

static void sink_removed(void *arg, const uint64_t *h, size_t n) {
    sub *s = arg;
    px_kvindex_remove(s->k->ctx->kvindex, s->slot, h, n);
}

static void sink_cleared(void *arg) {
    sub *s = arg;
    px_kvindex_clear(s->k->ctx->kvindex, s->slot);
}

static void apply(sub *s, const void *p, size_t n) {
    px_kv_sink sink = {s, sink_stored, sink_removed, sink_cleared};
    size_t bad = 0;
    char err[128];
    int ev = px_kv_decode(p, n, &sink, &bad, err, sizeof err);
    if (ev < 0 || bad) {
        s->malformed++;
        atomic_fetch_add(&s->k->ctx->kvc.malformed, 1);
        /* One line a second at most per backend: a publisher sending
         * garbage fast must not fill the log (the counter has them all). */
        uint64_t now = px_now_ns();
        if (s->malformed_log_ns && now - s->malformed_log_ns < 1000000000ull) {
            s->malformed_quiet++;
        } else {
            PX_LOG(PX_LOG_WARN,
                   "msg=\"kv events: malformed batch\" backend=%s bad_events=%zu error=%s "
                   "not_logged_since=%llu",
                   s->name, bad, ev < 0 ? err : "-", s->malformed_quiet);
            s->malformed_log_ns = now;
            s->malformed_quiet = 0;
        }
    }
    if (ev > 0) {
        s->events += (unsigned)ev;
        atomic_fetch_add(&s->k->ctx->kvc.events, (unsigned)ev);
    }
    s->batches++;
    atomic_fetch_add(&s->k->ctx->kvc.batches, 1);
}

/* Reads one multipart message into up to 3 frames; the rest is dropped.
 * Returns the number of frames, 0 when none is waiting, -1 on error. */
static int recv3(void *sock, zmq_msg_t m[3]) {
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t x;
        zmq_msg_init(&x);
        if (zmq_msg_recv(&x, sock, n ? 0 : ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&x);
            for (int i = 0; i < n && i < 3; i++)
                zmq_msg_close(&m[i]);
            return n ? -1 : (errno == EAGAIN ? 0 : -1);
        }
        more = zmq_msg_more(&x);
        if (n < 3)
            m[n] = x;
        else
            zmq_msg_close(&x);
        n++;
    }
    return n;
}

static void close3(zmq_msg_t m[3], int n) {
    for (int i = 0; i < n && i < 3; i++)
        zmq_msg_close(&m[i]);
}

static int seq_of(zmq_msg_t *m, uint64_t *q) {
    if (zmq_msg_size(m) != 8) return -1;
    const unsigned char *p = zmq_msg_data(m);
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    *q = v;
    return 0;
}

static void arm_s(struct event *ev, double s) {
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    event_add(ev, &tv);
}

static void start_replay(sub *s) {
    unsigned char q[8];
    for (int i = 0; i < 8; i++)
        q[i] = (unsigned char)(s->next >> (56 - 8 * i));
    /* ROUTER on the engine: [identity, "", start]; the DEALER sends the
     * empty delimiter itself. */
    if (zmq_send(s->rep, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(s->rep, q, 8, ZMQ_DONTWAIT) < 0) {
        s->replay_fail++;
        atomic_fetch_add(&s->k->ctx->kvc.replay_fail, 1);
        reset_index(s, "replay_send_failed");
        s->have_seq = 0;
        return;
    }
    s->replaying = 1;
    s->replays++;
    atomic_fetch_add(&s->k->ctx->kvc.replays, 1);
    arm_s(s->rtimer, REPLAY_TIMEOUT_S);
    /* A send can consume the descriptor's edge: look again. */
    event_active(s->rev, EV_READ, 0);
}

/* One live batch with sequence q. */
static void on_live(sub *s, uint64_t q, const void *p, size_t n) {
    if (!s->have_seq) {
        s->have_seq = 1;
        s->next = q;
    }
    if (q == s->next) {
        apply(s, p, n);
        s->next = q + 1;
        return;
    }
    if (s->replaying) return; /* earlier: replayed already; later: the replay brings it */
    if (q < s->next) {
        /* Sequences only grow on one publisher: this one started again. */
        reset_index(s, "sequence_restarted");
        apply(s, p, n);
        s->next = q + 1;
        return;
    }
    s->gaps++;
    atomic_fetch_add(&s->k->ctx->kvc.gaps, 1);
    PX_LOG(PX_LOG_INFO, "msg=\"kv events: sequence gap\" backend=%s expected=%llu got=%llu",
           s->name, (unsigned long long)s->next, (unsigned long long)q);
    if (s->rep) {
        start_replay(s);
        return;
    }
    reset_index(s, "gap_without_replay");
    apply(s, p, n);
    s->next = q + 1;
}

static void on_sub(evutil_socket_t fd, short what, void *arg) {
    sub *s = arg;
    for (int i = 0; i < DRAIN_BUDGET; i++) {
        zmq_msg_t m[3];
        int n = recv3(s->sock, m);
        if (n <= 0) return;
        uint64_t q;
        if (n != 3 || seq_of(&m[1], &q) < 0) {
            s->malformed++;
            atomic_fetch_add(&s->k->ctx->kvc.malformed, 1);
        } else {
            on_live(s, q, zmq_msg_data(&m[2]), zmq_msg_size(&m[2]));
        }
        close3(m, n);
    }
    event_active(s->ev, EV_READ, 0); /* more may wait: next turn */
}

static void open_replay(sub *s);

static void on_replay_timeout(evutil_socket_t fd, short what, void *arg) {
    sub *s = arg;
    if (!s->replaying) return;
    s->replaying = 0;
    s->replay_fail++;
    atomic_fetch_add(&s->k->ctx->kvc.replay_fail, 1);
    reset_index(s, "replay_timeout");
    s->have_seq = 0;
    /* Answers that come late must not be taken for a new replay's. */
    open_replay(s);
}

static void on_rep(evutil_socket_t fd, short what, void *arg) {
    sub *s = arg;
    for (int i = 0; i < DRAIN_BUDGET; i++) {
        zmq_msg_t m[3];
        int n = recv3(s->rep, m);
        if (n <= 0) return;
        uint64_t q;
        if (n == 3 && seq_of(&m[1], &q) == 0 && s->replaying) {
            if (q == UINT64_MAX) { /* the end marker, -1 */
                s->replaying = 0;
                event_del(s->rtimer);
            } else if (q == s->next) {
                apply(s, zmq_msg_data(&m[2]), zmq_msg_size(&m[2]));
                s->next = q + 1;
            } else if (q > s->next) {
                /* The engine's buffer no longer reaches back to the gap. */
                s->replay_fail++;
                atomic_fetch_add(&s->k->ctx->kvc.replay_fail, 1);
                reset_index(s, "replay_incomplete");
                apply(s, zmq_msg_data(&m[2]), zmq_msg_size(&m[2]));
                s->next = q + 1;
            }
        } else if (n != 3) {
            s->malformed++;
            atomic_fetch_add(&s->k->ctx->kvc.malformed, 1);
        }
        close3(m, n);
    }
    event_active(s->rev, EV_READ, 0);
}

static void *zsock(px_kvsub *k, int type, const char *ep) {
    void *z = zmq_socket(k->zctx, type);
    if (!z) return NULL;
    int64_t max = SUB_MAX_MSG;
    int hwm = SUB_HWM, one = 1, zero = 0, ivl = 200;
    zmq_setsockopt(z, ZMQ_MAXMSGSIZE, &max, sizeof max);
    zmq_setsockopt(z, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(z, ZMQ_IPV6, &one, sizeof one);
    zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(z, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    if (type == ZMQ_SUB) zmq_setsockopt(z, ZMQ_SUBSCRIBE, "", 0);
    if (zmq_connect(z, ep) < 0) {
        zmq_close(z);
        return NULL;
    }
    return z;
}

static struct event *zevent(px_kvsub *k, void *z, event_callback_fn cb, void *arg) {
    int fd;
    size_t sz = sizeof fd;
    if (zmq_getsockopt(z, ZMQ_FD, &fd, &sz) < 0) return NULL;
    struct event *ev = event_new(k->base, fd, EV_READ | EV_PERSIST, cb, arg);
    if (ev) {
        event_add(ev, NULL);
        event_active(ev, EV_READ, 0); /* the edge may have passed already */
    }
    return ev;
}

static void close_replay(sub *s) {
    if (s->rev) event_free(s->rev);
    if (s->rep) zmq_close(s->rep);
    s->rev = NULL;
    s->rep = NULL;
}

static void open_replay(sub *s) {
    close_replay(s);
    if (!s->replay_ep) return;
    s->rep = zsock(s->k, ZMQ_DEALER, s->replay_ep);
    if (s->rep) s->rev = zevent(s->k, s->rep, on_rep, s);
}

static void close_sub(sub *s) {
    if (s->mev) event_free(s->mev);
    if (s->mon) zmq_close(s->mon);
    if (s->sock) zmq_socket_monitor(s->sock, NULL, 0);
    if (s->ev) event_free(s->ev);
    if (s->sock) zmq_close(s->sock);
    s->mev = s->ev = NULL;
    s->mon = s->sock = NULL;
}

static void sub_free(sub *s) {
    close_sub(s);
    if (s->reopen) event_free(s->reopen);
    close_replay(s);
    if (s->rtimer) event_free(s->rtimer);
    free(s->name);
    free(s->endpoint);
    free(s->replay_ep);
    free(s);
}

/* The monitor: a publisher whose connection ended (an engine that went
 * away, or one that broke the protocol, after which libzmq does not
 * reconnect by itself) may come back with another cache: the index is
 * dropped and the socket made again. */
static void on_mon(evutil_socket_t fd, short what, void *arg) {
    sub *s = arg;
    for (int i = 0; i < DRAIN_BUDGET; i++) {
        zmq_msg_t m[3];
        int n = recv3(s->mon, m);
        if (n <= 0) return;
        uint16_t ev = 0;
        if (zmq_msg_size(&m[0]) >= 2) memcpy(&ev, zmq_msg_data(&m[0]), 2);
        close3(m, n);
        if (ev == ZMQ_EVENT_DISCONNECTED) {
            reset_index(s, "publisher_disconnected");
            s->have_seq = 0;
            s->replaying = 0;
            event_del(s->rtimer);
            arm_s(s->reopen, 0); /* not here: this callback's socket goes */
            return;
        }
    }
    event_active(s->mev, EV_READ, 0);
}

static int open_sub(sub *s) {
    px_kvsub *k = s->k;
    s->sock = zsock(k, ZMQ_SUB, s->endpoint);
    if (!s->sock || !(s->ev = zevent(k, s->sock, on_sub, s))) return -1;
    char mep[64];
    snprintf(mep, sizeof mep, "inproc://kvmon-%p", (void *)s);
    if (zmq_socket_monitor(s->sock, mep, ZMQ_EVENT_DISCONNECTED) < 0) return -1;
    s->mon = zmq_socket(k->zctx, ZMQ_PAIR);
    if (!s->mon || zmq_connect(s->mon, mep) < 0) return -1;
    s->mev = zevent(k, s->mon, on_mon, s);
    return s->mev ? 0 : -1;
}

static void on_reopen(evutil_socket_t fd, short what, void *arg) {
    sub *s = arg;
    close_sub(s);
    if (open_sub(s) < 0) {
        close_sub(s);
        arm_s(s->reopen, 1.0);
        return;
    }
    open_replay(s);
}

static char *ep_for(const char *host, int port) {
    char buf[600];
    snprintf(buf, sizeof buf, strchr(host, ':') ? "tcp://[%s]:%d" : "tcp://%s:%d", host, port);
    return strdup(buf);
}

/* ---- endpoints backends declare (config entries, admin API) ----
 * Few (one per backend that has one), read twice a second by the control
 * thread: a list under a lock. */
typedef struct decl {
    char *url;         /* owned: the backend's configured URL */
    char *file[2];     /* owned: endpoint, replay endpoint; NULL: none */
    char *admin[2];    /* owned */
    int in_file, in_admin;
    struct decl *nx;
} decl;

struct px_kv_decls {
    pthread_mutex_t mu;
    decl *list; /* owned */
};

px_kv_decls *px_kv_decls_create(void) {
    px_kv_decls *t = px_xcalloc(1, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    return t;
}

void px_kv_decls_destroy(px_kv_decls *t) {
    if (!t) return;
    while (t->list) {
        decl *d = t->list;
        t->list = d->nx;
        free(d->url);
        for (int i = 0; i < 2; i++) {
            free(d->file[i]);
            free(d->admin[i]);
        }
        free(d);
    }
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static decl *decl_get(px_kv_decls *t, const char *url, int create) {
    for (decl *d = t->list; d; d = d->nx)
        if (!strcmp(d->url, url)) return d;
    if (!create) return NULL;
    decl *d = px_xcalloc(1, sizeof *d);
    d->url = px_xstrdup(url);
    d->nx = t->list;
    t->list = d;
    return d;
}

static void set2(char *dst[2], const char *ep, const char *rep) {
    const char *v[2] = {ep, rep};
    for (int i = 0; i < 2; i++) {
        free(dst[i]);
        dst[i] = v[i] && v[i][0] && strcmp(v[i], "-") ? px_xstrdup(v[i]) : NULL;
    }
}

void px_kvsub_declare_file(px_kv_decls *t, const px_strlist *l) {
    pthread_mutex_lock(&t->mu);
    for (decl *d = t->list; d; d = d->nx) {
        d->in_file = 0;
        set2(d->file, NULL, NULL);
    }
    for (size_t i = 0; i < l->n; i++) {
        char url[600], ep[600], rep[600];
        if (sscanf(l->v[i], "%599s %599s %599s", url, ep, rep) != 3) continue;
        decl *d = decl_get(t, url, 1);
        d->in_file = 1;
        set2(d->file, ep, rep);
    }
    pthread_mutex_unlock(&t->mu);
}

void px_kvsub_declare_admin(px_kv_decls *t, const char *url, const char *ep, const char *rep) {
    pthread_mutex_lock(&t->mu);
    decl *d = decl_get(t, url, ep || rep);
    if (d) {
        d->in_admin = ep || rep;
        set2(d->admin, ep, rep);
    }
    pthread_mutex_unlock(&t->mu);
}

void px_kvsub_forget_admin(px_kv_decls *t) {
    pthread_mutex_lock(&t->mu);
    for (decl *d = t->list; d; d = d->nx) {
        d->in_admin = 0;
        set2(d->admin, NULL, NULL);
    }
    pthread_mutex_unlock(&t->mu);
}

/* The endpoints the backend `b` is to be subscribed at now (owned, NULL:
 * none) and where they come from. The admin API's declaration over the
 * file's; each of its two over what the flags derive from the address. */
static void endpoints_of(px_kvsub *k, px_backend *b, char **ep, char **rep, const char **from) {
    char host[512];
    int port, https;
    *ep = *rep = NULL;
    *from = "flag";
    px_kv_decls *t = k->ctx->reg->kv_decls;
    pthread_mutex_lock(&t->mu);
    decl *d = decl_get(t, b->src, 0);
    char *const *v = d && d->in_admin ? d->admin : d && d->in_file ? d->file : NULL;
    if (v) {
        *from = d->in_admin ? "admin" : "file";
        if (v[0]) *ep = px_xstrdup(v[0]);
        if (v[1]) *rep = px_xstrdup(v[1]);
    }
    pthread_mutex_unlock(&t->mu);
    if ((*ep && *rep) || (k->port == 0 && (!*ep || !k->rport)) ||
        px_url_split(b->url, host, sizeof host, &port, &https) < 0)
        return;
    if (!*ep && k->port) *ep = ep_for(host, k->port);
    if (!*rep && k->rport) *rep = ep_for(host, k->rport);
}

static int same(const char *a, const char *b) {
    return a == b || (a && b && !strcmp(a, b));
}

static sub *sub_new(px_kvsub *k, px_backend *b) {
    char *ep, *rep;
    const char *from;
    endpoints_of(k, b, &ep, &rep, &from);
    int slot = ep ? px_kvindex_slot(k->ctx->kvindex, b->name, 1) : -1;
    if (slot < 0) {
        free(ep);
        free(rep);
        return NULL;
    }
    sub *s = px_xcalloc(1, sizeof *s);
    s->k = k;
    s->slot = slot;
    s->name = strdup(b->name);
    s->endpoint = ep;
    s->replay_ep = rep;
    s->from = from;
    s->was_healthy = 1;
    s->rtimer = evtimer_new(k->base, on_replay_timeout, s);
    s->reopen = evtimer_new(k->base, on_reopen, s);
    if (open_sub(s) < 0) {
        PX_LOG(PX_LOG_WARN, "msg=\"kv events: cannot subscribe\" backend=%s endpoint=%s error=%s",
               s->name, s->endpoint, zmq_strerror(errno));
        sub_free(s);
        return NULL;
    }
    open_replay(s);
    PX_LOG(PX_LOG_INFO, "msg=\"kv events: subscribed\" backend=%s endpoint=%s replay=%s from=%s",
           s->name, s->endpoint, s->replay_ep ? s->replay_ep : "-", s->from);
    return s;
}

/* The backend's declared endpoints changed: its index goes (the new
 * publisher may be another engine), and the sockets are made again. 0,
 * or -1 when it now has no endpoint at all (the caller drops it). */
static int resubscribe(sub *s, px_backend *b) {
    if (!s->endpoint) return -1; /* lost its endpoint earlier in this sync */
    char *ep, *rep;
    const char *from;
    endpoints_of(s->k, b, &ep, &rep, &from);
    s->from = from;
    if (same(ep, s->endpoint) && same(rep, s->replay_ep)) {
        free(ep);
        free(rep);
        return 0;
    }
    PX_LOG(PX_LOG_INFO,
           "msg=\"kv events: endpoint changed\" backend=%s endpoint=%s replay=%s was=%s from=%s",
           s->name, ep ? ep : "-", rep ? rep : "-", s->endpoint, from);
    free(s->endpoint);
    free(s->replay_ep);
    s->endpoint = ep;
    s->replay_ep = rep;
    if (!ep) return -1;
    reset_index(s, "endpoint_changed");
    s->have_seq = 0;
    s->replaying = 0;
    event_del(s->rtimer);
    event_del(s->reopen);
    close_sub(s);
    if (open_sub(s) < 0) {
        close_sub(s);
        arm_s(s->reopen, 1.0); /* on_reopen opens the replay socket too */
        return 0;
    }
    open_replay(s);
    return 0;
}

static void visit(px_kvsub *k, px_pool *p) {
    size_t n;
    px_backend **m = px_pool_members(p, &n);
    for (size_t i = 0; i < n; i++) {
        sub *s = k->subs;
        while (s && strcmp(s->name, m[i]->name))
            s = s->nx;
        if (!s && (s = sub_new(k, m[i]))) {
            s->nx = k->subs;
            k->subs = s;
        }
        if (s && resubscribe(s, m[i]) < 0) s = NULL; /* unseen: dropped below */
        if (s) {
            s->seen = 1;
            int h = atomic_load(&m[i]->healthy);
            /* An engine that went away may come back empty. */
            if (!h && s->was_healthy) {
                reset_index(s, "backend_unhealthy");
                s->have_seq = 0;
            }
            s->was_healthy = h;
        }
        px_backend_release(m[i]);
    }
    free(m);
}

static void on_sync(evutil_socket_t fd, short what, void *arg) {
    px_kvsub *k = arg;
    for (sub *s = k->subs; s; s = s->nx)
        s->seen = 0;
    px_gen *g = px_ctx_gen(k->ctx);
    for (size_t i = 0; i < g->nps; i++) {
        visit(k, &g->ps[i].prefill);
        visit(k, &g->ps[i].decode);
    }
    px_gen_release(g);
    for (sub **pp = &k->subs; *pp;) {
        sub *s = *pp;
        if (s->seen) {
            pp = &s->nx;
            continue;
        }
        reset_index(s, "backend_removed");
        *pp = s->nx;
        sub_free(s);
    }
}

px_kvsub *px_kvsub_start(px_ctx *ctx, struct event_base *base) {
    if (!ctx->kvindex) return NULL;
    px_kvsub *k = px_xcalloc(1, sizeof *k);
    k->ctx = ctx;
    k->base = base;
    k->port = (int)ctx->cfg->kv_events_port;
    k->rport = (int)ctx->cfg->kv_events_replay_port;
    k->zctx = zmq_ctx_new();
    k->sync = event_new(base, -1, EV_PERSIST, on_sync, k);
    if (!k->zctx || !k->sync) {
        PX_LOG(PX_LOG_ERROR, "msg=\"kv events: cannot start ZeroMQ\"");
        px_kvsub_stop(k);
        return NULL;
    }
    on_sync(-1, 0, k);
    arm_s(k->sync, SYNC_INTERVAL_S);
    ctx->kvsub = k;
    return k;
}

void px_kvsub_stop(px_kvsub *k) {
    if (!k) return;
    if (k->ctx->kvsub == k) k->ctx->kvsub = NULL;
    while (k->subs) {
        sub *s = k->subs;
        k->subs = s->nx;
        sub_free(s);
    }
    if (k->sync) event_free(k->sync);
    if (k->zctx) zmq_ctx_term(k->zctx);
    free(k);
}

const char *px_kvsub_endpoint(px_kvsub *k, const char *backend) {
    for (sub *s = k ? k->subs : NULL; s; s = s->nx)
        if (!strcmp(s->name, backend)) return s->endpoint;
    return NULL;
}

size_t px_kvsub_json(px_kvsub *k, const char *backend, px_buf *b) {
    size_t n = 0;
    px_buf_appends(b, "[");
    for (sub *s = k ? k->subs : NULL; s; s = s->nx) {
        if (backend && strcmp(backend, s->name)) continue;
        px_kvindex_stats st;
        px_kvindex_stats_get(k->ctx->kvindex, s->slot, &st);
        if (n++) px_buf_appends(b, ",");
        px_buf_appends(b, "{\"backend\":");
        px_buf_append_json_str(b, s->name, strlen(s->name));
        px_buf_appends(b, ",\"endpoint\":");
        px_buf_append_json_str(b, s->endpoint, strlen(s->endpoint));
        px_buf_appends(b, ",\"replay_endpoint\":");
        if (s->replay_ep)
            px_buf_append_json_str(b, s->replay_ep, strlen(s->replay_ep));
        else
            px_buf_appends(b, "null");
        px_buf_printf(b, ",\"endpoint_from\":\"%s\"", s->from);
        px_buf_printf(b,
                      ",\"have_seq\":%s,\"next_seq\":%llu,\"replaying\":%s,\"blocks\":%zu,"
                      "\"bytes\":%zu,\"block_size\":%zu,\"batches\":%llu,\"events\":%llu,"
                      "\"malformed\":%llu,\"gaps\":%llu,\"replays\":%llu,\"replay_failures\":%llu,"
                      "\"resets\":%llu}",
                      s->have_seq ? "true" : "false", (unsigned long long)s->next,
                      s->replaying ? "true" : "false", st.blocks, st.bytes, st.block_size,
                      s->batches, s->events, s->malformed, s->gaps, s->replays, s->replay_fail,
                      s->resets);
    }
    px_buf_appends(b, "]");
    return n;
}
