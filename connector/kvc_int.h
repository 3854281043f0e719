/* SPDX-License-Identifier: Apache-2.0 */
/* Internal declarations shared by the connector's files.  Not installed. */
#ifndef KVC_INT_H
#define KVC_INT_H

#include "include/kvconnector.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#define KVC_HIDDEN __attribute__((visibility("hidden")))

/* ------------------------------------------------------------ wire.c -- */
KVC_HIDDEN char *kvc_strdup(const char *s);
KVC_HIDDEN char *kvc_strndup(const char *s, size_t n);

/* Side-channel messages: 12-byte header (magic, version, type, body length),
 * then a body.  Integers little-endian.  See wire.c for the body layouts.
 * Version 2: authenticated handshake, tokens on pulls and notifications.
 * Version 3: after AUTH, messages travel sealed (KVC_MSG_SEALED, auth.c);
 * one-sided reads bracketed by HOLD/UNHOLD pulls; the consumer's TP size in
 * every pull; a producer that cannot serve a GET consumer says so in an
 * ERROR (KVC_ERR_UNSUPPORTED) instead of handing out rkeys.
 * Version 4: the flags bytes of HELLO and CHALLENGE are under the
 * consumer's AUTH MAC (a relay that cleared KVC_HFLAG_OWNER went
 * unnoticed); the messages are those of version 3.  A version-3 peer
 * computes the MAC without them, so it is refused by version
 * (KVC_ERR_VERSION, both versions named), never as a wrong secret. */
#define KVC_WIRE_MAGIC 0x4843564bu /* "KVCH" on the wire */
#define KVC_WIRE_VERSION 4
#define KVC_WIRE_HDR_LEN 12
#define KVC_WIRE_MAX_BODY (64u << 20)
#define KVC_WIRE_MAX_HELLO 8192u /* HELLO and AUTH bodies */
#define KVC_WIRE_MAX_REGIONS 65536u
#define KVC_WIRE_MAX_STR 4096u
#define KVC_WIRE_MAX_BLOB (1u << 20)
#define KVC_WIRE_DATA_HDR_LEN 48
#define KVC_WIRE_MAX_NOTIFY 65536u
#define KVC_NONCE_LEN 32
#define KVC_MAC_LEN 32
#define KVC_TOKEN_LEN 16
#define KVC_MAX_SECRET 4096u

enum {
    KVC_MSG_HELLO = 1,     /* consumer -> producer */
    KVC_MSG_HANDSHAKE = 2, /* producer -> consumer, after AUTH */
    KVC_MSG_CHALLENGE = 3, /* producer -> consumer */
    KVC_MSG_AUTH = 4,      /* consumer -> producer */
    KVC_MSG_ERROR = 5,     /* producer -> consumer, then close */
    KVC_MSG_SEALED = 6,    /* either way after AUTH: one message, encrypted (auth.c) */
    KVC_MSG_CONSUMER = 7,  /* consumer -> producer, sealed, right after AUTH (KVC_HFLAG_OWNER) */
};

/* HELLO/CHALLENGE flags.
 * KVC_HFLAG_OWNER (endpoint ownership, within version 3): in a HELLO, "I can
 * send my worker address"; in the CHALLENGE, "send it".  Both set: the
 * consumer sends AUTH then at once a sealed CONSUMER (u64 key, blob32 worker
 * address), the producer opens an endpoint of its own to that worker
 * (consumer.c) before its HANDSHAKE, and every PULL of the consumer carries
 * the key (KVC_PULL_CONS); what the producer sends after the AM callback
 * (a held pull served on publish, staged chunks, late refusals) goes on its
 * own endpoint, never on UCX's reply endpoint (answers within the callback
 * still use it: closing its endpoint then cancels them, as a consumer's
 * kvc_fetch_cancel relies on).  A consumer without the flag (or a pull
 * without KVC_PULL_CONS) is answered only within the callback: a pull it
 * asks to be held (KVC_PULL_WAIT) or that a staged producer would push
 * after the callback is refused there (KVC_ERR_UNSUPPORTED), since UCX
 * destroys the reply endpoint when that consumer leaves and a send on a
 * kept one crashed the producer. */
/* KVC_HFLAG_IPC (version 4): in a HELLO, "I can open CUDA IPC
 * handles" (every region of the consumer is CUDA memory, IPC not
 * disabled); in the CHALLENGE, "my sealed HANDSHAKE carries my IPC table"
 * (set only for a consumer that asked, on this host, when the producer
 * exports its regions: ipc.c).  The flag only says whether the table comes;
 * the table itself is under the handshake's MAC and seal. */
/* KVC_HFLAG_LIVE (version 4): in a HELLO, "I keep this connection
 * open after the handshake"; in the CHALLENGE, "so do I".  Both set: the
 * side channel stays open, idle, as long as the consumer's peer entry, and
 * either end seeing it close knows the other is gone (a killed process's
 * socket closes at once) even on a UCX endpoint without peer-failure
 * handling (shared-memory transports). */
enum {
    KVC_HFLAG_SECRET = 1u << 0,
    KVC_HFLAG_OWNER = 1u << 1,
    KVC_HFLAG_IPC = 1u << 2,
    KVC_HFLAG_LIVE = 1u << 3,
};
#define KVC_WIRE_MAX_CONS_ADDR 4096u /* a worker address in a CONSUMER message */

/* Region flags in the handshake table. */
enum { KVC_RFLAG_POOL = 1u << 0, KVC_RFLAG_STAGED = 1u << 1 };

typedef struct {
    const uint8_t *p; /* borrowed: points into the parsed buffer */
    size_t len;
} kvc_span_t;

typedef struct {
    uint16_t version;
    uint16_t type;
    uint32_t body_len;
} kvc_wire_hdr_t;

/* HELLO and CHALLENGE bodies: str16 engine_id, u8 flags, nonce[32]. */
typedef struct {
    kvc_span_t engine_id;
    uint8_t flags;
    const uint8_t *nonce; /* borrowed, KVC_NONCE_LEN bytes */
} kvc_wire_hello_t;

typedef struct {
    uint64_t base, len, block_len;
    uint8_t mem_type, flags;
    kvc_span_t rkey;
} kvc_wire_region_t;

typedef struct {
    kvc_span_t engine_id, layout, worker_addr;
    uint64_t nonce;
    uint64_t num_blocks;
    uint32_t tp_size;
    uint32_t n_regions;
    kvc_wire_region_t *regions; /* owned (parse) or borrowed (encode) */
    kvc_span_t ipc;             /* the producer's IPC table (KVC_HFLAG_IPC), or empty */
    const uint8_t *mac;         /* parse: borrowed, the trailing KVC_MAC_LEN bytes */
    size_t signed_len;          /* parse: body bytes the MAC covers */
} kvc_wire_hs_t;

typedef struct {
    uint64_t remote, local, count;
} kvc_run_t;

/* A run's remote id with this bit set names a position, not a block: the
 * consumer of a held fetch without remote_block_ids (push mode) asks for
 * the publication's last N blocks, position i being the i-th of those N.
 * The producer resolves positions when the publication exists (push.c). */
#define KVC_RUN_TAIL (1ull << 63)

/* region == KVC_DATA_END: the producer's last message for a pull; count is
 * the number of DATA messages it sent before it. */
#define KVC_DATA_END UINT32_MAX
typedef struct {
    uint64_t xfer_id;
    uint32_t region;
    int32_t status;
    uint64_t local_start;
    uint64_t count;
    uint8_t token[KVC_TOKEN_LEN]; /* the fetch's transfer token, echoed */
} kvc_wire_data_hdr_t;

/* A PULL: which publication, with its token, and the runs wanted. */
typedef struct {
    uint64_t xfer_id;
    uint16_t flags;
    uint32_t tp; /* the consumer's TP size (fan-in: how many ranks may pull) */
    uint8_t xfer_token[KVC_TOKEN_LEN];
    uint8_t pub_token[KVC_TOKEN_LEN];
    kvc_span_t request_id;
    kvc_run_t *runs; /* owned (parse: malloc'ed) or borrowed (encode) */
    size_t n;
    /* KVC_PULL_EXT trailer (else 0, 1, 0) */
    uint32_t wait_ms, parts, part;
    uint64_t cons_key; /* KVC_PULL_CONS trailer (else 0) */
} kvc_wire_pull_t;

typedef struct {
    uint8_t *p; /* owned */
    size_t len, cap;
    bool failed; /* an append ran out of memory; p holds a prefix */
} kvc_buf_t;

KVC_HIDDEN void kvc_buf_cleanup(kvc_buf_t *b);
KVC_HIDDEN void kvc_buf_put(kvc_buf_t *b, const void *p, size_t n);
KVC_HIDDEN void kvc_buf_u8(kvc_buf_t *b, uint8_t v);
KVC_HIDDEN void kvc_buf_u16(kvc_buf_t *b, uint16_t v);
KVC_HIDDEN void kvc_buf_u32(kvc_buf_t *b, uint32_t v);
KVC_HIDDEN void kvc_buf_u64(kvc_buf_t *b, uint64_t v);

/* KVC_OK: header complete and sane; KVC_AGAIN: need more bytes;
 * KVC_ERR_PROTOCOL: bad magic or body longer than max_body. */
KVC_HIDDEN kvc_status_t kvc_wire_parse_hdr(const uint8_t *b, size_t len, uint32_t max_body,
                                           kvc_wire_hdr_t *h);
/* HELLO or CHALLENGE (type), same body layout. */
KVC_HIDDEN void kvc_wire_encode_hello(kvc_buf_t *b, uint16_t version, uint16_t type,
                                      const char *engine_id, uint8_t flags,
                                      const uint8_t nonce[KVC_NONCE_LEN]);
KVC_HIDDEN kvc_status_t kvc_wire_parse_hello(const uint8_t *body, size_t len, kvc_wire_hello_t *h);
/* AUTH body: u8 proto, mac[32]. */
KVC_HIDDEN void kvc_wire_encode_auth(kvc_buf_t *b, uint16_t version, uint8_t proto,
                                     const uint8_t mac[KVC_MAC_LEN]);
KVC_HIDDEN kvc_status_t kvc_wire_parse_auth(const uint8_t *body, size_t len, uint8_t *proto,
                                            const uint8_t **mac);
/* ERROR body: i32 status, str16 message (printable). */
KVC_HIDDEN void kvc_wire_encode_error(kvc_buf_t *b, uint16_t version, kvc_status_t st,
                                      const char *msg);
KVC_HIDDEN kvc_status_t kvc_wire_parse_error(const uint8_t *body, size_t len, int32_t *st,
                                             kvc_span_t *msg);
/* HANDSHAKE without its MAC (kvc_wire_encode_handshake) then the MAC appended
 * by the caller over the body (kvc_buf_put + kvc_wire_end_msg). */
KVC_HIDDEN void kvc_wire_encode_handshake(kvc_buf_t *b, uint16_t version, const kvc_wire_hs_t *hs);
/* Patches the body length of the message that starts at `start` in b. */
KVC_HIDDEN void kvc_wire_end_msg(kvc_buf_t *b, size_t start);
/* On KVC_OK *hs references `body` and owns hs->regions (kvc_wire_hs_cleanup). */
KVC_HIDDEN kvc_status_t kvc_wire_parse_handshake(const uint8_t *body, size_t len,
                                                 kvc_wire_hs_t *hs);
KVC_HIDDEN void kvc_wire_hs_cleanup(kvc_wire_hs_t *hs);

/* KVC_PULL_RNDV: the consumer can only take rendezvous DATA (device memory).
 * KVC_PULL_HOLD: a one-sided read is about to start: confirm the publication
 * and hold its blocks for it (no DATA; an END or a refusal answers).
 * KVC_PULL_UNHOLD: that read ended: was the hold intact all along?  (END:
 * yes; a DENIED refusal: no, the read may have seen reused blocks.) */
/* KVC_PULL_EXT: a 16-byte trailer follows the runs: u32 wait_ms, u32 remote
 * parts, u32 remote part, u32 reserved (0).  Producers before it drop such a
 * pull as malformed (the consumer's fetch then times out).
 * KVC_PULL_WAIT: an unknown publication is not refused but held up to
 * min(wait_ms, pending_fetch_ms) for its kvc_publish (push-mode
 * registration); past it refused with KVC_ERR_TIMED_OUT.  A pull of no runs
 * (a notify-only fetch registering) is answered by an END once published.
 * KVC_PULL_RENEW: no runs, no answer: renew the publication's lease.
 * KVC_PULL_CONS: an 8-byte trailer (last, after EXT's): u64 the consumer key
 * it sent in its CONSUMER message; answers go on the producer's own endpoint
 * to that consumer (KVC_HFLAG_OWNER).
 * KVC_PULL_SHM: the consumer has staged regions and can read the producer's
 * staging pool through a shared-memory mapping (stage.c): a producer that
 * stages offers its pool (KVC_AM_POOL) and, when the consumer maps it,
 * lends slots (KVC_AM_READY / KVC_AM_SLOT) instead of sending DATA.  An
 * older producer ignores the flag. */
enum {
    KVC_PULL_RNDV = 1u << 0,
    KVC_PULL_HOLD = 1u << 1,
    KVC_PULL_UNHOLD = 1u << 2,
    KVC_PULL_EXT = 1u << 3,
    KVC_PULL_WAIT = 1u << 4,
    KVC_PULL_RENEW = 1u << 5,
    KVC_PULL_CONS = 1u << 6,
    KVC_PULL_SHM = 1u << 7,
};
#define KVC_PULL_CONS_LEN 8
#define KVC_PULL_EXT_LEN 16
/* PULL: u16 version, u16 flags, u32 n_runs, u64 xfer_id, xfer_token[16],
 * pub_token[16], u32 consumer tp, str16 request_id,
 * n_runs * {u64 remote, u64 local, u64 count}. */
KVC_HIDDEN void kvc_wire_encode_pull(kvc_buf_t *b, const kvc_wire_pull_t *pl);
/* On KVC_OK pl->runs is malloc'ed (caller frees), request_id borrows p. */
KVC_HIDDEN kvc_status_t kvc_wire_parse_pull(const uint8_t *p, size_t len, kvc_wire_pull_t *pl);
KVC_HIDDEN void kvc_wire_encode_data_hdr(uint8_t out[KVC_WIRE_DATA_HDR_LEN],
                                         const kvc_wire_data_hdr_t *h);
KVC_HIDDEN kvc_status_t kvc_wire_parse_data_hdr(const uint8_t *p, size_t len,
                                                kvc_wire_data_hdr_t *h);

/* CONSUMER body: u64 key, blob32 worker address (1..KVC_WIRE_MAX_CONS_ADDR).
 * Parse: *addr borrows p. */
KVC_HIDDEN void kvc_wire_encode_consumer(kvc_buf_t *b, uint16_t version, uint64_t key,
                                         const void *addr, size_t addr_len);
KVC_HIDDEN kvc_status_t kvc_wire_parse_consumer(const uint8_t *p, size_t len, uint64_t *key,
                                                kvc_span_t *addr);

/* Notification: token[16] then "<request id>:<tp>" split at the last ':';
 * the id must be non-empty printable ASCII.  Without ':' the whole text is
 * the id and tp is 0. */
KVC_HIDDEN void kvc_wire_encode_notify(kvc_buf_t *b, const uint8_t token[KVC_TOKEN_LEN],
                                       const char *request_id, uint32_t tp);
KVC_HIDDEN kvc_status_t kvc_wire_parse_notify(const uint8_t *p, size_t len, const uint8_t **token,
                                              kvc_span_t *id, uint32_t *tp);
/* 32 hex digits <-> 16 bytes.  Parse: KVC_ERR_INVALID_PARAM unless exactly
 * 32 hex digits. */
KVC_HIDDEN void kvc_token_hex(const uint8_t t[KVC_TOKEN_LEN], char out[2 * KVC_TOKEN_LEN + 1]);
KVC_HIDDEN kvc_status_t kvc_token_parse(const char *hex, uint8_t t[KVC_TOKEN_LEN]);
KVC_HIDDEN bool kvc_printable(const char *s, size_t len);

/* Pairs remote[i] with local[i] and merges runs where both are consecutive.
 * *runs malloc'ed (NULL when n == 0). */
KVC_HIDDEN kvc_status_t kvc_coalesce(const uint64_t *remote, const uint64_t *local, size_t n,
                                     kvc_run_t **runs, size_t *nruns);

/* ---------------------------------------------------------- params.c -- */

typedef struct {
    char *engine_id, *request_id, *host; /* owned */
    uint16_t port;
    uint64_t *block_ids; /* owned */
    size_t num_blocks;
    uint32_t tp_size;
    uint8_t token[KVC_TOKEN_LEN];
} kvc_remote_t;

KVC_HIDDEN kvc_status_t kvc_params_parse_json(const char *json, kvc_remote_t *r, char *err,
                                              size_t errlen);
KVC_HIDDEN void kvc_remote_cleanup(kvc_remote_t *r);
KVC_HIDDEN char *kvc_params_to_json(const char *engine_id, const char *request_id, const char *host,
                                    uint16_t port, const uint64_t *blocks, size_t n,
                                    uint32_t tp_size, const uint8_t token[KVC_TOKEN_LEN]);

/* ------------------------------------------------------------ auth.c -- */
/* Cryptographic randomness (OpenSSL RAND_bytes).  KVC_ERR_IO if unavailable. */
KVC_HIDDEN kvc_status_t kvc_random(void *p, size_t n);
/* mac_c = HMAC-SHA-256(secret, "kvc4 consumer" | nonce_c | nonce_p | proto |
 *                      hello flags | challenge flags | str16 consumer id |
 *                      str16 producer id)
 * Every byte of HELLO and CHALLENGE that changes what either side does is
 * under it (version 4: the flags bytes; "kvc2 consumer" without them). */
KVC_HIDDEN void kvc_mac_consumer(const kvc_agent_t *a, const uint8_t *nonce_c,
                                 const uint8_t *nonce_p, uint8_t proto, uint8_t hello_flags,
                                 uint8_t chal_flags, kvc_span_t cons_id, kvc_span_t prod_id,
                                 uint8_t out[KVC_MAC_LEN]);
/* mac_p = HMAC-SHA-256(secret, "kvc2 producer" | nonce_c | nonce_p | body) */
KVC_HIDDEN void kvc_mac_producer(const kvc_agent_t *a, const uint8_t *nonce_c,
                                 const uint8_t *nonce_p, const uint8_t *body, size_t len,
                                 uint8_t out[KVC_MAC_LEN]);
/* Constant time. */
KVC_HIDDEN bool kvc_mac_equal(const uint8_t *x, const uint8_t *y, size_t n);
/* The side channel after AUTH.  Both sides derive two keys (one per
 * direction) with HKDF-SHA-256: key material the secret, salt
 * nonce_c | nonce_p, info "kvc3 channel" | mac_c (the consumer's AUTH MAC,
 * which binds both engine ids and the protocol).  Each message is sealed
 * with AES-256-GCM under its direction's key; the nonce is 4 zero bytes and
 * the direction's message count (u64 LE), so no nonce repeats under a key;
 * the outer header is the associated data.  A SEALED body is the whole inner
 * message (header and body) encrypted, then the 16-byte tag. */
#define KVC_CHAN_KEY_LEN 32
#define KVC_CHAN_TAG_LEN 16
typedef struct {
    uint8_t tx[KVC_CHAN_KEY_LEN], rx[KVC_CHAN_KEY_LEN];
    uint64_t seq_tx, seq_rx;
    bool ready;
} kvc_chan_t;
/* producer: tx is the producer-to-consumer key.  KVC_ERR_IO if OpenSSL
 * fails (ch not ready). */
KVC_HIDDEN kvc_status_t kvc_chan_init(kvc_chan_t *ch, const kvc_agent_t *a, const uint8_t *nonce_c,
                                      const uint8_t *nonce_p, const uint8_t mac_c[KVC_MAC_LEN],
                                      bool producer);
/* Wipes the keys. */
KVC_HIDDEN void kvc_chan_cleanup(kvc_chan_t *ch);
/* Appends the SEALED message carrying `msg` (one whole inner message) to
 * out.  KVC_ERR_IO (out->failed set) on failure. */
KVC_HIDDEN kvc_status_t kvc_chan_seal(kvc_chan_t *ch, kvc_buf_t *out, uint16_t version,
                                      const uint8_t *msg, size_t len);
/* Opens one whole SEALED message `rec` (header included).  KVC_OK: *msg
 * (malloc'ed, the caller cleanses and frees it) holds the inner message.
 * KVC_ERR_AUTH: the tag does not verify (changed in transit, another key):
 * the caller closes the connection.  KVC_ERR_PROTOCOL: not a SEALED message
 * or too short.  KVC_ERR_NO_MEMORY. */
KVC_HIDDEN kvc_status_t kvc_chan_open(kvc_chan_t *ch, const uint8_t *rec, size_t rec_len,
                                      uint8_t **msg, size_t *len);
/* A publication that ended (released or expired), remembered so that a
 * late notification with its token is told apart from an invented one
 * (auth.c keeps them, notify.c asks).  A fixed ring: memory does not grow with notifications. */
#define KVC_NOTIFY_GONE 1024
typedef struct {
    uint64_t id_hash;
    uint8_t token[KVC_TOKEN_LEN];
    bool used; /* its one KVC_EV_UNKNOWN_NOTIFY was raised */
} kvc_gone_t;

/* Remembers the token of a publication that ended (released, expired) in
 * a->gone, for late notifications (notify.c). */
KVC_HIDDEN void kvc_token_remember(kvc_agent_t *a, const char *id, const uint8_t *token);
/* The remembered publication with that id and token (constant-time token
 * compare), or NULL. */
KVC_HIDDEN kvc_gone_t *kvc_token_recall(kvc_agent_t *a, kvc_span_t id, const uint8_t *token);
/* Fills a->secret from the params or KVC_SECRET_FILE / KVC_SECRET. */
KVC_HIDDEN kvc_status_t kvc_secret_init(kvc_agent_t *a, const kvc_agent_params_t *p);
/* Rate-limited warning: at most a few lines per second per kind. */
KVC_HIDDEN bool kvc_log_ratelimit(kvc_agent_t *a, int kind);

/* ------------------------------------------------ cuda.c / copyplan.c -- */

/* One staging copy: `count` runs of `len` blocks, the first at block
 * `start`, each `stride` blocks after the previous (count 1: stride 0). */
typedef struct {
    uint64_t start, len, stride, count;
} kvc_crun_t;
/* The copies for block ids `ids` (any order, repeats allowed) of a region
 * with block_len: maximal runs of consecutive ids, equal runs at a constant
 * stride folded into one.  *out malloc'ed (NULL when n == 0). */
KVC_HIDDEN kvc_status_t kvc_cuda_plan(const uint64_t *ids, size_t n, size_t block_len,
                                      kvc_crun_t **out, size_t *nout);

/* The CUDA layer (cuda.c; cuda_none.c without CUDA).  Every function keeps
 * the caller's current device; failures clear CUDA's last error and leave a
 * message naming the CUDA error in kvc_cuda_last_error(). */
typedef struct kvc_cuda kvc_cuda_t;
KVC_HIDDEN bool kvc_cuda_built(void);
KVC_HIDDEN const char *kvc_cuda_last_error(const kvc_cuda_t *c);
/* KVC_ERR_NO_DEVICE (reason in err) when no usable device. */
KVC_HIDDEN kvc_status_t kvc_cuda_create(kvc_cuda_t **out, char *err, size_t errlen);
/* Waits for every queued copy, then frees streams and events. */
KVC_HIDDEN void kvc_cuda_destroy(kvc_cuda_t *c);
/* The device owning [base, base+len) (cudaPointerGetAttributes); hint >= 0
 * must match it.  Creates that device's stream.  KVC_ERR_INVALID_PARAM: not
 * device memory, not one allocation, or another device than the hint. */
KVC_HIDDEN kvc_status_t kvc_cuda_region_device(kvc_cuda_t *c, const void *base, size_t len,
                                               int hint, int *dev);
KVC_HIDDEN kvc_status_t kvc_cuda_host_register(kvc_cuda_t *c, void *p, size_t len);
KVC_HIDDEN void kvc_cuda_host_unregister(kvc_cuda_t *c, void *p);
/* Every device stream waits for the caller's event, or for the work queued
 * so far on the caller's stream (has_stream; one device only).  A stream
 * that is given is a stream, 0 included: 0 and cudaStreamLegacy are the
 * legacy default stream and cudaStreamPerThread the calling thread's default
 * stream, both on the regions' device.  No event and no stream: no-op. */
KVC_HIDDEN kvc_status_t kvc_cuda_wait_for(kvc_cuda_t *c, void *event, bool has_stream,
                                          void *stream);
/* Queues the planned copies of one region on its device's stream. */
KVC_HIDDEN kvc_status_t kvc_cuda_copy_runs(kvc_cuda_t *c, int dev, void *dev_base, void *host_base,
                                           size_t block_len, const kvc_crun_t *runs, size_t nruns,
                                           bool to_device);
/* Staging pool (stage.c): queues one copy of len bytes on dev's stream and
 * records *ev after it (created, or re-created on dev, as needed; owned by
 * the caller, kvc_cuda_event_destroy). */
KVC_HIDDEN kvc_status_t kvc_cuda_copy_event(kvc_cuda_t *c, int dev, void *dst, const void *src,
                                            size_t len, bool to_device, void **ev, int *ev_dev);
/* 1: the event's work is complete; 0: not yet; -1: it failed (*st set). */
KVC_HIDDEN int kvc_cuda_event_poll(kvc_cuda_t *c, void *ev, kvc_status_t *st);
KVC_HIDDEN void kvc_cuda_event_destroy(kvc_cuda_t *c, void *ev);
/* Hands an event made on dev back (its work complete or no longer waited
 * for): kept for kvc_cuda_d2d_runs, or destroyed when dev keeps enough. */
KVC_HIDDEN void kvc_cuda_event_put(kvc_cuda_t *c, int dev, void *ev);
/* A publication's capture (publish.c, agents that export over CUDA IPC):
 * an event per device recorded on its stream after the wait for the
 * engine's writes, instead of a host sync at publish.  Wait (push.c, before
 * a one-sided read is confirmed): complete at once, or a host wait for it
 * (*syncs counts them).  Put: back to c's spares (NULL: nothing). */
typedef struct kvc_cuda_cap kvc_cuda_cap_t;
KVC_HIDDEN kvc_status_t kvc_cuda_capture(kvc_cuda_t *c, kvc_cuda_cap_t **out);
KVC_HIDDEN kvc_status_t kvc_cuda_capture_wait(kvc_cuda_cap_t *k, unsigned *syncs);
KVC_HIDDEN void kvc_cuda_capture_put(kvc_cuda_cap_t *k);
/* One host sync per device with queued work; every device is synced even
 * when one fails. */
KVC_HIDDEN kvc_status_t kvc_cuda_sync(kvc_cuda_t *c);
/* No host sync: `stream` (a cudaStream_t, 0 included: the legacy default
 * stream of every device with regions) waits for all queued work.
 * cudaStreamPerThread cannot be named from the progress thread: host sync. */
KVC_HIDDEN kvc_status_t kvc_cuda_order_before(kvc_cuda_t *c, void *stream);
/* True when nothing queued is still running (event queries, non-blocking);
 * false with *st set on a failure. */
KVC_HIDDEN bool kvc_cuda_idle(kvc_cuda_t *c, kvc_status_t *st);
/* After a failure: waits for everything queued; errors cleared. */
KVC_HIDDEN void kvc_cuda_drain(kvc_cuda_t *c);
/* Devices that hold regions. */
KVC_HIDDEN int kvc_cuda_devices(const kvc_cuda_t *c);

/* ----------------------------------------------------------- slice.c -- */
/* The bytes of one part when remote blocks of rbl bytes are cut in rparts
 * equal parts and local blocks of lbl in lparts: *len; KVC_ERR_INCOMPATIBLE
 * unless both divide evenly into parts of one length (none of them 0). */
KVC_HIDDEN kvc_status_t kvc_slice_len(uint64_t rbl, uint32_t rparts, uint64_t lbl,
                                      uint32_t lparts, uint64_t *len);
/* Offset of part `part` (parts of len bytes) of block b in a region of
 * nblocks blocks of block_len: *off, true; false when that part does not
 * lie wholly inside block b, or b is not in the region (nothing computed
 * overflows).  Whole blocks: part 0, len block_len. */
KVC_HIDDEN bool kvc_slice_at(uint64_t block_len, uint64_t nblocks, uint64_t b, uint64_t part,
                             uint64_t len, uint64_t *off);

/* CUDA IPC (ipc.c).  Producer: the allocation holding [p, p+len) on device
 * dev, exported: its base and size (the driver's address range), the
 * cudaIpcGetMemHandle handle of its base, and the PCI bus id of dev.
 * KVC_ERR_UNSUPPORTED when the allocation cannot be exported that way
 * (VMM memory, cudaMallocAsync pools): the message says why. */
#define KVC_IPC_HANDLE_LEN 64 /* CUDA_IPC_HANDLE_SIZE */
#define KVC_IPC_BUS_LEN 32
/* How an exported allocation is opened: a cudaIpcGetMemHandle handle, or
 * VMM pieces (physical allocations mapped contiguously, their POSIX fds
 * passed over a Unix socket: ipcfd.c). */
enum { KVC_IPC_KIND_HANDLE = 0, KVC_IPC_KIND_VMM = 1 };
typedef struct {
    uint64_t base, size;
    uint8_t kind;                       /* KVC_IPC_KIND_* */
    uint8_t handle[KVC_IPC_HANDLE_LEN]; /* KIND_HANDLE */
    uint32_t first_piece, n_pieces;     /* KIND_VMM: its pieces, in address order */
    char bus[KVC_IPC_BUS_LEN];
} kvc_cuda_export_t;
KVC_HIDDEN kvc_status_t kvc_cuda_ipc_export(kvc_cuda_t *c, int dev, const void *p, size_t len,
                                            kvc_cuda_export_t *out);
/* Consumer: the visible device with PCI bus id `bus`, or -1. */
KVC_HIDDEN int kvc_cuda_device_by_bus(kvc_cuda_t *c, const char *bus);
/* Opens a producer's handle into device dev's address space (peer access
 * enabled lazily when the memory is on another GPU); *ptr its base. */
KVC_HIDDEN kvc_status_t kvc_cuda_ipc_open(kvc_cuda_t *c, int dev,
                                          const uint8_t handle[KVC_IPC_HANDLE_LEN], void **ptr);
KVC_HIDDEN void kvc_cuda_ipc_close(kvc_cuda_t *c, int dev, void *ptr);
/* Queues device-to-device copies on dev's stream: run i copies
 * runs[i].count * block_len bytes from src + runs[i].remote * block_len to
 * dst + runs[i].local * block_len; then records *ev (when NULL, one dev
 * kept or a new one; the caller hands it back with kvc_cuda_event_put)
 * after them.  kvc_cuda_drain waits for them. */
KVC_HIDDEN kvc_status_t kvc_cuda_d2d_runs(kvc_cuda_t *c, int dev, void *dst, const void *src,
                                          size_t block_len, const kvc_run_t *runs, size_t n,
                                          void **ev);

/* ------------------------------------------------------------- ipc.c -- */
/* Same-node CUDA IPC: the consumer maps the producer's device memory and
 * copies device-to-device on its own streams (ipc.c has the design). */
typedef struct kvc_ipc_peer kvc_ipc_peer_t;
typedef struct kvc_peer kvc_peer_t;
/* Producer, once its regions are registered: its IPC table (a->ipc_tab),
 * when IPC is on and every region is CUDA memory that can be exported;
 * otherwise none (logged).  Cleanup: after the peers are gone. */
KVC_HIDDEN void kvc_ipc_export(kvc_agent_t *a);
KVC_HIDDEN void kvc_ipc_export_cleanup(kvc_agent_t *a);
/* Consumer: every region is CUDA memory and IPC is on (HELLO flag). */
KVC_HIDDEN bool kvc_ipc_can_import(const kvc_agent_t *a);
/* Producer: appends the table to a handshake body as its blob32 trailer. */
KVC_HIDDEN void kvc_ipc_hs_append(const kvc_agent_t *a, kvc_buf_t *b);
/* Consumer, after the handshake's MAC checked out: when the table shows a
 * producer on this node (host identity, another process) whose GPUs are
 * visible here, opens its allocations on the devices of the local regions
 * (p->ipc).  Anything else leaves p->ipc NULL (push/staged then; logged).
 * True when VMM allocations' fds are still to come over the producer's
 * socket: the peer waits in PEER_IPC until kvc_ipc_peer_io says the open
 * ended (peer.c, kvc_peer_ipc_io). */
KVC_HIDDEN bool kvc_ipc_peer_open(kvc_agent_t *a, kvc_peer_t *p, kvc_span_t table);
/* The fd socket of p (PEER_IPC) is readable: what came is imported.
 * True when the open ended: p->ipc mapped, or NULL (failed, logged). */
KVC_HIDDEN bool kvc_ipc_peer_io(kvc_agent_t *a, kvc_peer_t *p, uint32_t events);
/* Waits for queued copies, then closes p's mappings. */
KVC_HIDDEN void kvc_ipc_peer_close(kvc_agent_t *a, kvc_peer_t *p);
/* One fetch's copies: an event per device that copies. */
typedef struct {
    void **ev; /* owned: events, one per device in dev */
    int *dev;  /* owned */
    int n;
} kvc_ipc_job_t;
/* Queues the copies of runs (remote -> local, whole blocks) for every region
 * and records the job's events.  KVC_ERR_CUDA etc. (a->cuda's message). */
KVC_HIDDEN kvc_status_t kvc_ipc_copy(kvc_agent_t *a, kvc_peer_t *p, const kvc_run_t *runs, size_t n,
                                     kvc_ipc_job_t *j);
/* 1: every copy completed; 0: not yet; -1: one failed (*st set). */
KVC_HIDDEN int kvc_ipc_poll(kvc_agent_t *a, kvc_ipc_job_t *j, kvc_status_t *st);
KVC_HIDDEN void kvc_ipc_job_cleanup(kvc_agent_t *a, kvc_ipc_job_t *j);
/* The table (wire.c, pure, fuzzed): u8 version 2, str16 host identity,
 * u32 pid, u32 n_allocs, n_allocs * { str16 PCI bus id, u64 size, u8 kind,
 * KIND_HANDLE: blob32 handle | KIND_VMM: u32 n_pieces }, u32 n_pieces,
 * n_pieces * { u64 size }, and when n_pieces > 0: str16 socket name,
 * blob32 socket token; then u32 n_regions, n_regions * { u32 alloc, u64
 * offset }.  The pieces are the VMM allocations' in their order, each
 * allocation's sizes summing to its size; the fds come in that order. */
#define KVC_IPC_MAX_PIECES 65536u
#define KVC_IPC_SOCK_LEN 64     /* the socket's name, printable, no NUL */
#define KVC_IPC_FD_TOKEN_LEN 32 /* proves a fd request comes from a handshaken consumer */
typedef struct {
    kvc_span_t bus, handle; /* borrowed from the table */
    uint64_t size;
    uint8_t kind;
    uint32_t first_piece, n_pieces; /* KIND_VMM */
} kvc_ipc_alloc_t;
typedef struct {
    kvc_span_t host;
    uint32_t pid, n_allocs, n_regions, n_pieces;
    kvc_ipc_alloc_t *allocs; /* owned */
    uint64_t *piece_size;    /* owned (n_pieces) */
    kvc_span_t sock, token;  /* n_pieces > 0 */
    uint32_t *reg_alloc;     /* owned */
    uint64_t *reg_off;       /* owned */
} kvc_ipc_table_t;
typedef struct {
    const char *host;
    uint32_t pid;
    const kvc_cuda_export_t *allocs;
    uint32_t n_allocs;
    const uint64_t *piece_size; /* n_pieces: the VMM allocations' pieces */
    uint32_t n_pieces;
    const char *sock;     /* n_pieces > 0 */
    const uint8_t *token; /* KVC_IPC_FD_TOKEN_LEN bytes */
    const uint32_t *reg_alloc;
    const uint64_t *reg_off;
    uint32_t n_regions;
} kvc_ipc_tab_in_t;
KVC_HIDDEN void kvc_wire_encode_ipc(kvc_buf_t *b, const kvc_ipc_tab_in_t *in);
/* KVC_ERR_PROTOCOL unless well-formed: n_regions as given, region i inside
 * its allocation (reg_off[i] + region_len[i] <= size), handles of
 * KVC_IPC_HANDLE_LEN bytes, printable host and bus ids (shorter than
 * KVC_IPC_BUS_LEN), VMM allocations whose pieces (none of size 0, at most
 * KVC_IPC_MAX_PIECES in all) sum to their size, a printable socket name
 * shorter than KVC_IPC_SOCK_LEN and a token of KVC_IPC_FD_TOKEN_LEN bytes
 * when there are pieces.  On KVC_OK t borrows p (kvc_wire_ipc_cleanup). */
KVC_HIDDEN kvc_status_t kvc_wire_parse_ipc(const uint8_t *p, size_t len, const uint64_t *region_len,
                                           uint32_t n_regions, kvc_ipc_table_t *t);
KVC_HIDDEN void kvc_wire_ipc_cleanup(kvc_ipc_table_t *t);

/* ------------------------------------------------------------ path.c -- */

/* KVC_TRANSPORT_* bits of a comma-separated list of UCX transport names. */
KVC_HIDDEN uint32_t kvc_transport_bits(const char *names);

typedef struct {
    kvc_proto_t want;    /* the agent's proto (AUTO, GET, PUSH) */
    bool keys;           /* the producer sent rkeys */
    bool mapped;         /* every remote region is mapped here (shared memory) */
    bool rma;            /* this agent's UCX context has the RMA feature */
    bool local_dev;      /* a local region is registered as device memory */
    bool local_staged;   /* a local region is staged through the pinned pool */
    bool remote_dev;     /* a remote region is device memory */
    bool ipc;            /* the producer's CUDA memory is mapped here (CUDA IPC, ipc.c) */
    uint32_t transports; /* KVC_TRANSPORT_* of the endpoint */
} kvc_path_in_t;

typedef struct {
    kvc_proto_t proto; /* GET or PUSH */
    bool mapped_copy;  /* GET as memcpy through the shared-memory mapping */
    const char *why;   /* static text, for the log */
    bool ipc_copy;     /* GET as device-to-device copies from CUDA IPC mappings */
} kvc_path_t;

/* Pure.  KVC_ERR_UNSUPPORTED (why set) when the wanted protocol cannot be
 * served: a get of device memory without a cuda_ipc or RDMA transport. */
KVC_HIDDEN kvc_status_t kvc_choose_path(const kvc_path_in_t *in, kvc_path_t *out);

/* ------------------------------------------------------- agent types -- */

/* Rate-limited log kinds (kvc_log_ratelimit). */
enum { KVC_RL_AUTH, KVC_RL_DENIED, KVC_RL_PEER, KVC_RL_DATA, KVC_RL_KINDS };

typedef enum {
    PE_LISTEN,
    PE_UCX,
    PE_TIMER,
    PE_WAKE,
    PE_SCONN,
    PE_PEER,
    PE_IPCFD_LISTEN, /* obj: the agent (ipcfd.c) */
    PE_IPCFD_CONN,   /* obj: a kvc_ipcfd_conn_t */
    PE_IPCFD_FETCH   /* obj: the peer whose fds come (ipc.c) */
} kvc_pe_kind_t;

typedef struct {
    kvc_pe_kind_t kind;
    void *obj;
} kvc_pollent_t;

typedef struct {
    void *base;     /* host-visible memory UCX reads/writes (pool, user memory); staged: NULL */
    void *dev_base; /* CUDA staged: the device memory; else NULL */
    int cuda_dev;   /* CUDA regions: the device that owns the memory */
    size_t len, block_len;
    kvc_mem_type_t mem_type;
    bool pool, staged, unpinned;
    ucp_mem_h memh;
    void *rkey_buf; /* owned by UCX (ucp_rkey_buffer_release) */
    size_t rkey_len;
} kvc_region_t;

/* A confirmed one-sided read of a publication (KVC_PULL_HOLD). */
typedef struct {
    uint64_t xfer_id;
    uint8_t token[KVC_TOKEN_LEN]; /* the fetch's transfer token */
    uint64_t deadline_ns;         /* past it the hold is broken */
} kvc_hold_t;

typedef struct kvc_pub kvc_pub_t;
struct kvc_pub {
    kvc_pub_t *hnext;         /* hash chain */
    kvc_pub_t *eprev, *enext; /* expiry list, sorted by deadline */
    char *id;                 /* owned */
    uint64_t *blocks;         /* owned */
    uint64_t *sorted;         /* owned: blocks, sorted, for membership checks */
    size_t n;
    uint64_t deadline_ns;      /* expiry-list key: min(hard_deadline_ns, lease end) */
    uint64_t hard_deadline_ns; /* the fixed expiry: upper bound of any lease */
    uint64_t lease_ns;         /* lease length (0: none) */
    uint64_t user_data;
    uint8_t token[KVC_TOKEN_LEN];
    uint32_t consumers; /* notifications needed; 0: from the first one */
    uint32_t notified;  /* matching notifications so far */
    uint32_t pulls;     /* pulls served (bounded, push.c) */
    /* Readers: while any is left, the blocks are not handed back. */
    uint32_t pushes;   /* push jobs sending from the blocks (push.c) */
    kvc_hold_t *holds; /* owned: confirmed one-sided reads */
    kvc_cuda_cap_t *cap; /* owned: the capture a first one-sided read waits for, or NULL */
    size_t nholds, holds_cap;
    /* Released (out of the table) while readers were left: on the draining
     * list until the last one ends, then its event goes to the engine. */
    bool released;
    kvc_event_type_t rel_type;
    kvc_status_t rel_status;
    const char *rel_msg; /* static text or NULL */
    kvc_pub_t *dnext;    /* draining list */
    /* Layer-wise (KVC_PUBLISH_FIELD_LAYERWISE): ready[r] once region r is
     * written (NULL: published whole); unready: regions not ready yet. */
    uint8_t *ready;
    size_t unready;
};

typedef struct {
    kvc_pub_t **buckets; /* owned */
    size_t nbuckets, count;
    kvc_pub_t *ehead, *etail;
    kvc_pub_t *draining; /* released, waiting for their readers */
} kvc_pubtab_t;

typedef struct kvc_sconn kvc_sconn_t;
typedef struct kvc_cons kvc_cons_t;
typedef struct kvc_peer kvc_peer_t;
typedef struct kvc_xfer kvc_xfer_t;
typedef struct kvc_evnode kvc_evnode_t;
typedef struct kvc_stage kvc_stage_t;

struct kvc_evnode {
    kvc_evnode_t *next;
    kvc_event_t ev;
    char *request_id; /* owned */
    uint64_t *blocks; /* owned */
    char *message;    /* owned */
};

struct kvc_agent {
    char *engine_id, *listen_host, *adv_host, *layout; /* owned */
    uint16_t port;
    kvc_log_cb_t log_cb;
    void *log_arg;
    kvc_log_level_t log_level;
    uint32_t connect_timeout_ms, expiry_ms, xfer_timeout_ms, tp_size;
    kvc_proto_t proto;
    uint16_t wire_version; /* KVC_WIRE_VERSION unless KVC_TEST_WIRE_VERSION */
    uint64_t nonce;        /* this instance */
    uint8_t *secret;       /* owned (cleansed on destroy); NULL: unauthenticated */
    size_t secret_len;
    uint32_t max_handshakes;
    uint64_t rl_sec[KVC_RL_KINDS];
    uint32_t rl_count[KVC_RL_KINDS];

    ucp_context_h ctx;
    ucp_worker_h worker;
    bool cuda_native; /* UCX can register CUDA memory */
    bool rma;         /* the UCX context has UCP_FEATURE_RMA */
    ucp_address_t *worker_addr;
    size_t worker_addr_len;

    int epfd, ucx_efd, listen_fd, timer_fd, wake_fd;
    kvc_pollent_t pe_listen, pe_ucx, pe_timer, pe_wake;
    bool wake_pending;

    uint64_t num_blocks;
    size_t n_regions;
    kvc_region_t *regions;   /* owned */
    kvc_buf_t hs_msg;        /* prebuilt handshake reply (MAC appended per consumer) */
    kvc_buf_t hs_msg_nokeys; /* the same without rkeys (push consumers) */
    kvc_cuda_t *cuda;        /* owned; agents with CUDA regions only */
    size_t n_staged;         /* regions staged through the pinned pool */
    size_t stage_pool_bytes; /* the pool's size setting */
    struct kvc_stage *stage; /* owned; agents with staged regions only */
    bool cuda_direct;        /* a region is registered as device memory */
    bool ipc_off;            /* CUDA IPC disabled (KVC_AGENT_FIELD_CUDA_IPC, KVC_IPC=0) */
    kvc_buf_t ipc_tab;       /* producer: its IPC table (empty: no IPC export) */
    /* owned: the producer's fd socket for its VMM allocations (ipcfd.c) */
    struct kvc_ipcfd_srv *ipcfd;

    kvc_pubtab_t pubs;
    kvc_gone_t gone[KVC_NOTIFY_GONE]; /* ring, notify.c */
    size_t gone_next;
    kvc_sconn_t *sconns;
    kvc_sconn_t *sconns_dead; /* closed, freed at the end of progress */
    kvc_peer_t *peers;        /* cache of handshaken/connecting producers */
    kvc_xfer_t *xfers;        /* active and finishing fetches */
    uint64_t next_xfer_id;
    uint64_t push_inflight; /* producer-side sends in flight */
    uint64_t push_bytes;    /* bytes those sends reference (bounded, push.c) */
    struct kvc_push_job *push_jobs; /* owned: jobs with sends pending (push.c) */
    size_t push_chunk;      /* largest DATA message (bytes, whole blocks) */

    kvc_evnode_t *evq_head, *evq_tail, *ev_cur;
    /* Progress thread (KVC_AGENT_FIELD_PROGRESS_THREAD, context.c): every
     * public call takes mu (recursive) when threaded. */
    bool threaded;
    pthread_mutex_t mu;
    pthread_t thr;
    atomic_bool thr_stop;
    uint64_t stats[KVC_STAT_LAST + 1];
    struct kvc_cons *conss; /* owned: consumers this producer has endpoints to (consumer.c) */
    size_t n_cons;          /* live records */
    struct kvc_src *srcs;   /* owned: their source addresses */
    uint32_t max_cons, max_cons_addr; /* KVC_MAX_CONSUMERS, KVC_MAX_CONSUMERS_ADDR */
    bool cons_check; /* an endpoint to a consumer failed: sweep (kvc_cons_sweep) */
    /* Leases and held registrations (pending.c). */
    uint32_t lease_ms, pending_fetch_ms, max_pending, max_pending_peer;
    size_t max_pending_bytes;
    struct kvc_pending *pending; /* owned: fetches registered before their publication */
    size_t n_pending, pending_bytes;
    bool pending_check; /* a publication came: serve the held pulls that wait for it */
    struct kvc_defer *defers; /* owned: layer-wise pushes waiting for regions (push.c) */
    bool destroying;
};

/* Sets the handler of the UCX active messages `id` on a's worker: whole
 * messages only, with `a` as the handler's argument. */
static inline kvc_status_t kvc_set_am_handler(kvc_agent_t *a, unsigned id,
                                              ucp_am_recv_callback_t cb) {
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                      UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = id,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = cb,
        .arg = a};
    return ucp_worker_set_am_recv_handler(a->worker, &hp) == UCS_OK ? KVC_OK : KVC_ERR_TRANSPORT;
}

/* --------------------------------------------------------- loop.c -- */
KVC_HIDDEN void kvc_log(kvc_agent_t *a, kvc_log_level_t lvl, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define KVC_LOG(a, lvl, ...)                                                                       \
    do {                                                                                           \
        if ((int)(lvl) <= (int)(a)->log_level) kvc_log((a), (lvl), __VA_ARGS__);                   \
    } while (0)
KVC_HIDDEN uint64_t kvc_now_ns(void);
/* The agent's mutex around a public call, when it has a progress thread. */
KVC_HIDDEN void kvc_lock(const kvc_agent_t *a);
KVC_HIDDEN void kvc_unlock(const kvc_agent_t *a);
KVC_HIDDEN void kvc_wake(kvc_agent_t *a);
/* Queues an event; copies strings and blocks.  Drops it silently when out of
 * memory or when the agent is being destroyed (logged). */
KVC_HIDDEN void kvc_event_push(kvc_agent_t *a, kvc_event_type_t type, kvc_status_t st,
                               uint64_t xfer_id, uint64_t user_data, const char *request_id,
                               const uint64_t *blocks, size_t n, uint64_t bytes, const char *msg);
KVC_HIDDEN kvc_status_t kvc_ep_add(kvc_agent_t *a, int fd, uint32_t events, kvc_pollent_t *pe);
KVC_HIDDEN kvc_status_t kvc_ep_mod(kvc_agent_t *a, int fd, uint32_t events, kvc_pollent_t *pe);
KVC_HIDDEN void kvc_ep_del(kvc_agent_t *a, int fd);
/* Log callback and level from the params (KVC_AGENT_FIELD_LOG*) or the
 * defaults: stderr, KVC_LOG_LEVEL. */
KVC_HIDDEN void kvc_log_init(kvc_agent_t *a, const kvc_agent_params_t *p);
/* Frees the event last handed out by kvc_agent_next_event(). */
KVC_HIDDEN void kvc_event_release(kvc_agent_t *a);
/* The epoll set with the UCX, timer and wake fds in it (a->ucx_efd first).
 * KVC_ERR_IO; kvc_loop_close() cleans up either way. */
KVC_HIDDEN kvc_status_t kvc_loop_open(kvc_agent_t *a);
/* Closes the loop's fds and frees every queued event. */
KVC_HIDDEN void kvc_loop_close(kvc_agent_t *a);
/* Arms the timerfd for monotonic time `next` (ns); UINT64_MAX disarms. */
KVC_HIDDEN void kvc_timer_arm(kvc_agent_t *a, uint64_t next);
KVC_HIDDEN void kvc_timer_drain(kvc_agent_t *a);
KVC_HIDDEN void kvc_wake_drain(kvc_agent_t *a);

/* ---------------------------------------------------------- stage.c -- */
#define KVC_STAGE_POOL_DEFAULT ((size_t)256 << 20)
/* The bounded pinned pool that staged regions go through (stage.c has the
 * design).  Init after the regions are registered; cleanup before they go. */
KVC_HIDDEN kvc_status_t kvc_stage_init(kvc_agent_t *a);
KVC_HIDDEN void kvc_stage_cleanup(kvc_agent_t *a);
KVC_HIDDEN size_t kvc_stage_pool_bytes(const kvc_agent_t *a);
KVC_HIDDEN void kvc_stage_progress(kvc_agent_t *a, uint64_t now, uint64_t *next);
/* Producer: serves a checked pull through the pool; takes `runs`. */
KVC_HIDDEN void kvc_stage_push(kvc_agent_t *a, kvc_cons_t *c, ucp_ep_h ep,
                               const kvc_wire_pull_t *pl, kvc_run_t *runs, size_t n);
/* Staged jobs whose consumer record is dead fail there and send nothing
 * more (kvc_stage_progress). */
/* A fetch's account of its staged chunks, embedded in the fetch (xfer.c)
 * and kept by stage.c: the fetch has not landed while holds > 0, and fails
 * with st (message msg) once a chunk failed.  xfer.c sets dead when the
 * fetch fails or finishes: its chunks still to come are dropped before
 * they reach the device. */
typedef struct {
    uint32_t holds;
    bool dead;
    kvc_status_t st;
    uint64_t lent; /* chunks read from the producer's mapped pool (staged-shm) */
    char msg[200];
} kvc_stage_ref_t;
/* Consumer: a checked rendezvous DATA message for staged region `region`
 * of the fetch whose account is `ref`; the return value is the AM
 * handler's.  The fetch must outlive its holds. */
KVC_HIDDEN ucs_status_t kvc_stage_recv(kvc_agent_t *a, kvc_stage_ref_t *ref, size_t region,
                                       uint64_t local_start, void *data, size_t len);
/* Staged through the producer's mapped pool (staged-shm), AM headers
 * (wire.c, pure, fuzzed; each parse takes exactly its length):
 *  READY: a DATA header (status 0, a region, count > 0), u64 the slot's
 *         offset in the pool; no data.
 *  POOL:  a DATA header (xfer id and token), u64 pool address, u64 pool
 *         length, u64 slot bytes (the length a multiple of it, the pool not
 *         wrapping); the packed rkey is its data (1..KVC_WIRE_MAX_BLOB).
 *  SLOT:  u64 xfer id, token, u32 kind (KVC_SLOT_*), u32 0, u64 slot offset. */
#define KVC_WIRE_READY_LEN (KVC_WIRE_DATA_HDR_LEN + 8)
#define KVC_WIRE_POOL_LEN (KVC_WIRE_DATA_HDR_LEN + 24)
#define KVC_WIRE_SLOT_LEN (8 + KVC_TOKEN_LEN + 16)
enum { KVC_SLOT_POOL_OK = 1, KVC_SLOT_POOL_NO = 2, KVC_SLOT_FREE = 3 };
typedef struct {
    kvc_wire_data_hdr_t h;
    uint64_t off;
} kvc_wire_ready_t;
typedef struct {
    kvc_wire_data_hdr_t h;
    uint64_t base, len, slot_bytes;
} kvc_wire_pool_t;
typedef struct {
    uint64_t xfer_id;
    uint8_t token[KVC_TOKEN_LEN];
    uint32_t kind;
    uint64_t off;
} kvc_wire_slot_t;
KVC_HIDDEN void kvc_wire_encode_ready(uint8_t out[KVC_WIRE_READY_LEN], const kvc_wire_ready_t *r);
KVC_HIDDEN kvc_status_t kvc_wire_parse_ready(const uint8_t *p, size_t len, kvc_wire_ready_t *r);
KVC_HIDDEN void kvc_wire_encode_pool(uint8_t out[KVC_WIRE_POOL_LEN], const kvc_wire_pool_t *pl);
KVC_HIDDEN kvc_status_t kvc_wire_parse_pool(const uint8_t *p, size_t len, size_t rkey_len,
                                            kvc_wire_pool_t *pl);
KVC_HIDDEN void kvc_wire_encode_slot(uint8_t out[KVC_WIRE_SLOT_LEN], const kvc_wire_slot_t *s);
KVC_HIDDEN kvc_status_t kvc_wire_parse_slot(const uint8_t *p, size_t len, kvc_wire_slot_t *s);
/* Consumer: whether its pulls to p ask for the mapped pool (KVC_PULL_SHM):
 * staged regions here, KVC_STAGED_WIRE unset, and p's pool not found
 * unmappable before. */
KVC_HIDDEN bool kvc_stage_shm_wanted(const kvc_agent_t *a, const kvc_peer_t *p);
/* Consumer: the producer p offers its pool for fetch (xfer_id, token):
 * mapped here (once per peer and pool), answered with a SLOT
 * POOL_OK or POOL_NO on p's endpoint. */
KVC_HIDDEN void kvc_stage_pool_offer(kvc_agent_t *a, kvc_peer_t *p, const kvc_wire_pool_t *pl,
                                     const void *rkey, size_t rkey_len);
/* Consumer: a checked READY of the fetch whose account is ref: its chunk
 * is copied from p's mapped slot to the device, and the slot handed back
 * (SLOT FREE) once the copy is complete.  KVC_ERR_PROTOCOL when p has no
 * mapped pool or the slot is outside it (the fetch fails). */
KVC_HIDDEN kvc_status_t kvc_stage_ready(kvc_agent_t *a, kvc_stage_ref_t *ref, kvc_peer_t *p,
                                        uint64_t xfer_id, const uint8_t token[KVC_TOKEN_LEN],
                                        size_t region, uint64_t local_start, uint64_t off,
                                        size_t len);
/* Consumer: hands a slot back at once (a READY for a fetch that ended). */
KVC_HIDDEN void kvc_stage_slot_send(kvc_agent_t *a, ucp_ep_h ep, uint64_t xfer_id,
                                    const uint8_t token[KVC_TOKEN_LEN], uint32_t kind,
                                    uint64_t off);
/* Producer: the AM handler of SLOT messages. */
KVC_HIDDEN ucs_status_t kvc_stage_slot_cb(void *arg, const void *header, size_t hlen, void *data,
                                          size_t len, const ucp_am_recv_param_t *param);
/* Consumer: unmaps p's pool (peer.c, when p's rkeys go). */
KVC_HIDDEN void kvc_stage_peer_cleanup(kvc_agent_t *a, kvc_peer_t *p);

/* ---------------------------------------------------------- mem.c -- */
KVC_HIDDEN void kvc_mem_cleanup(kvc_agent_t *a);
KVC_HIDDEN kvc_status_t kvc_mem_build_handshake(kvc_agent_t *a);

/* ------------------------------------------------------- listen.c -- */
KVC_HIDDEN kvc_status_t kvc_listen_open(kvc_agent_t *a);
KVC_HIDDEN void kvc_listen_accept(kvc_agent_t *a);
KVC_HIDDEN void kvc_sconn_io(kvc_agent_t *a, kvc_sconn_t *c, uint32_t events);
KVC_HIDDEN void kvc_sconns_timers(kvc_agent_t *a, uint64_t now, uint64_t *next);
KVC_HIDDEN void kvc_sconns_destroy(kvc_agent_t *a);
KVC_HIDDEN void kvc_sconns_reap(kvc_agent_t *a);
/* getaddrinfo() for a TCP address; passive: for bind().  KVC_ERR_INVALID_PARAM
 * when it does not resolve. */
KVC_HIDDEN kvc_status_t kvc_resolve(const char *host, uint16_t port, struct sockaddr_storage *ss,
                                    socklen_t *sl, bool passive);

/* --------------------------------------------------------- peer.c -- */
KVC_HIDDEN void kvc_peer_io(kvc_agent_t *a, kvc_peer_t *p, uint32_t events);
/* The fd socket of a peer waiting for the producer's VMM fds (PE_IPCFD_FETCH). */
KVC_HIDDEN void kvc_peer_ipc_io(kvc_agent_t *a, kvc_peer_t *p, uint32_t events);
/* Finds or starts a handshake with host:port.  KVC_ERR_NO_MEMORY only. */
KVC_HIDDEN kvc_status_t kvc_peer_get(kvc_agent_t *a, const char *host, uint16_t port,
                                     const char *engine_id, kvc_peer_t **out);
KVC_HIDDEN void kvc_peer_ref(kvc_peer_t *p);
KVC_HIDDEN void kvc_peer_unref(kvc_agent_t *a, kvc_peer_t *p);
KVC_HIDDEN bool kvc_peer_ready(const kvc_peer_t *p);
KVC_HIDDEN bool kvc_peer_dead(const kvc_peer_t *p, kvc_status_t *st, const char **msg);
KVC_HIDDEN void kvc_peers_timers(kvc_agent_t *a, uint64_t now, uint64_t *next);
KVC_HIDDEN void kvc_peers_reap(kvc_agent_t *a);
/* Marks the peer dead (every fetch on it fails on its next advance) and
 * closes its endpoint, which cancels the UCX requests still in flight (no
 * late writes into local blocks). */
KVC_HIDDEN void kvc_peer_abort(kvc_agent_t *a, kvc_peer_t *p, kvc_status_t st, const char *msg);
KVC_HIDDEN void kvc_peers_destroy(kvc_agent_t *a);

/* peer internals used by xfer.c */
struct kvc_peer_region {
    uint64_t base, len, block_len;
    ucp_rkey_h rkey;
    const uint8_t *mapped; /* the region mapped here (shared memory), or NULL */
    uint8_t mem_type;      /* kvc_mem_type_t as the producer registered it */
};
/* PEER_IPC: handshaken, the producer's VMM allocations' fds on the way
 * (ipc.c); READY once they are mapped, or on push when that fails. */
typedef enum {
    PEER_CONNECTING,
    PEER_HELLO,
    PEER_AUTH,
    PEER_IPC,
    PEER_READY,
    PEER_DEAD
} kvc_peer_state_t;
struct kvc_peer {
    kvc_peer_t *next;
    kvc_agent_t *a;
    kvc_pollent_t pe;
    char *host; /* owned */
    uint16_t port;
    char *engine_id; /* owned: expected, then the handshake's */
    kvc_peer_state_t state;
    bool linked; /* in a->peers */
    int fd;
    kvc_buf_t out;
    size_t out_off;
    uint8_t *in; /* owned */
    size_t in_len, in_cap;
    uint64_t deadline_ns;
    ucp_ep_h ep;
    void *close_req; /* ucp_ep_close_nbx in progress */
    uint64_t nonce, num_blocks;
    uint8_t nonce_c[KVC_NONCE_LEN], nonce_p[KVC_NONCE_LEN];
    uint8_t hello_flags; /* the flags our HELLO sent (under the AUTH MAC) */
    kvc_chan_t chan; /* keys of the sealed channel, from AUTH on */
    bool owner;      /* the producer answers on its own endpoint: pulls carry our key */
    bool live;       /* KVC_HFLAG_LIVE: the side channel stays open; its close fails us */
    uint32_t n_regions;
    struct kvc_peer_region *rr; /* owned */
    kvc_proto_t proto;
    bool shm;            /* every remote region is mapped here (ucp_rkey_ptr) */
    kvc_ipc_peer_t *ipc; /* owned: the producer's CUDA memory mapped here (ipc.c) */
    uint32_t transports; /* KVC_TRANSPORT_* of the endpoint (0: not collected) */
    struct kvc_spool *spool; /* owned (stage.c): its staging pool mapped here, or NULL */
    int refs;
    kvc_status_t fail_status;
    char fail_msg[320];
};

/* UCX active message ids of the data path (PULL: consumer -> producer,
 * DATA: producer -> consumer; NOTIFY is notify.c's).  Staged through a
 * mapped pool (stage.c): POOL and READY producer -> consumer, SLOT
 * consumer -> producer. */
enum { KVC_AM_PULL = 21, KVC_AM_DATA = 22, KVC_AM_POOL = 24, KVC_AM_READY = 25, KVC_AM_SLOT = 26 };

/* --------------------------------------------------------- xfer.c -- */
KVC_HIDDEN kvc_status_t kvc_xfer_register_am(kvc_agent_t *a);
KVC_HIDDEN void kvc_xfers_advance(kvc_agent_t *a, uint64_t now, uint64_t *next);
KVC_HIDDEN void kvc_xfers_destroy(kvc_agent_t *a);

/* ----------------------------------------------------- consumer.c -- */
/* A consumer as this producer knows it: its key, and the endpoint this
 * producer opened to its worker (owned, with an error handler), on which
 * every answer to its pulls goes.  Jobs and held pulls reference it
 * (kvc_cons_ref) instead of keeping UCX's reply endpoint, which UCX may
 * destroy once the AM callback returned (the consumer closed or died). */
typedef struct kvc_cons kvc_cons_t;
/* A source address of consumers (their side-channel connection's): the
 * unit the bounds on records and held fetches are shared by, since the
 * consumer key is the consumer's own choice. */
typedef struct kvc_src kvc_src_t;
struct kvc_src {
    kvc_src_t *next;
    char addr[64];
    uint32_t live;      /* live records of it */
    uint32_t held;      /* held fetches of its records (push.c) */
    size_t held_bytes;  /* their bytes */
    int refs;           /* records that point to it */
};
struct kvc_cons {
    kvc_cons_t *next;
    kvc_agent_t *a;
    uint64_t key;
    kvc_src_t *src;  /* referenced: where it handshook from */
    uint64_t used_ns; /* its handshake or its last pull (least recently used goes first) */
    uint32_t held;   /* its held fetches (push.c) */
    size_t held_bytes;
    ucp_ep_h ep;     /* owned; NULL once closed */
    void *close_req; /* ucp_ep_close_nbx in progress */
    uint8_t *addr;   /* owned: its worker address */
    size_t addr_len;
    char *engine_id; /* owned, for logs */
    int refs;        /* jobs and held pulls; +1 while listed in a->conss */
    bool dead;       /* the endpoint failed or a newer record replaced it: no more sends */
};
/* Live records, in all and per source address (a->max_cons, a->max_cons_addr). */
#define KVC_MAX_CONSUMERS 4096u
#define KVC_MAX_CONSUMERS_ADDR 256u
/* A new record of `key` with that worker address, from source address
 * `src` (an older record of the key is retired).  At a bound, a record
 * that nothing references (no held fetch, no staged job) gives way, the
 * least recently used: of the same address when it holds its bound, else
 * of the address with the most records, never for a newcomer whose address
 * would then hold more.  KVC_ERR_BUSY (none can give way), KVC_ERR_NO_MEMORY. */
KVC_HIDDEN kvc_status_t kvc_cons_attach(kvc_agent_t *a, uint64_t key, const uint8_t *addr,
                                        size_t addr_len, const char *engine_id, const char *src);
/* The record whose held fetch is to give way to one more of `c` costing
 * `cost` (1 by count, its bytes by_bytes), or NULL: none holds more than
 * c's share.  Across source addresses (the one holding the most, if it
 * holds at least cost more than c's), unless own_addr or c's address is the
 * one holding the most; then within c's address, the record holding the
 * most, if it holds at least cost more than c. */
KVC_HIDDEN kvc_cons_t *kvc_cons_heaviest(kvc_agent_t *a, const kvc_cons_t *c, size_t cost,
                                         bool by_bytes, bool own_addr);
/* c's endpoint of ours, created on first use (a pull kept past its
 * callback); NULL when c is dead or ucp_ep_create failed. */
KVC_HIDDEN ucp_ep_h kvc_cons_ep(kvc_cons_t *c);
/* An endpoint to a worker address with peer-failure handling (cb, arg),
 * or, where no transport supports that (UCX_TLS=sm alone), one without
 * (*degraded set). loop.c. */
KVC_HIDDEN ucs_status_t kvc_ep_open(kvc_agent_t *a, const void *worker_addr,
                                    ucp_err_handler_cb_t cb, void *arg, ucp_ep_h *out,
                                    bool *degraded);
/* The live record of key, or NULL. */
KVC_HIDDEN kvc_cons_t *kvc_cons_find(kvc_agent_t *a, uint64_t key);
KVC_HIDDEN void kvc_cons_ref(kvc_cons_t *c);
/* May free c (when retired and closed). */
KVC_HIDDEN void kvc_cons_unref(kvc_cons_t *c);
/* No more sends to c: dead, its place (in all and at its address) given
 * back; the sweep closes its endpoint and unlists it.  Only marks: may run
 * inside a UCX callback.  No-op on a dead record. */
KVC_HIDDEN void kvc_cons_retire(kvc_cons_t *c);
/* From progress, after kvc_pending_timers and kvc_stage_progress (which
 * drop the held pulls and staged jobs of dead records): closes the
 * endpoints of the records whose endpoint failed (force: sends in flight
 * complete as cancelled), unlists them and frees those nothing references.
 * A dead record's ep is NULL from then on. */
KVC_HIDDEN void kvc_cons_sweep(kvc_agent_t *a);
/* Agent destroy, before the worker: closes every endpoint. */
KVC_HIDDEN void kvc_cons_close_all(kvc_agent_t *a);
/* After the worker and the jobs are gone. */
KVC_HIDDEN void kvc_cons_destroy(kvc_agent_t *a);

/* --------------------------------------------------------- push.c -- */
KVC_HIDDEN kvc_status_t kvc_push_register_am(kvc_agent_t *a);
/* Held registrations (pulls that came before their publication), from
 * progress: those whose publication now exists are served (kvc_publish sets
 * pending_check and wakes the agent: publish.c does not call push.c), those
 * past their deadline refused, those of a dead consumer record dropped. */
KVC_HIDDEN void kvc_pending_timers(kvc_agent_t *a, uint64_t now, uint64_t *next);
/* Frees the push jobs whose sends never completed; after the worker is
 * destroyed, when no callback can reach them. */
KVC_HIDDEN void kvc_push_destroy(kvc_agent_t *a);

/* ------------------------------------------------------- notify.c -- */
KVC_HIDDEN kvc_status_t kvc_notify_register_am(kvc_agent_t *a);
/* Handles one notification's bytes (producer side). */
KVC_HIDDEN void kvc_notify_handle(kvc_agent_t *a, const uint8_t *p, size_t len);
KVC_HIDDEN kvc_status_t kvc_notify_send(kvc_agent_t *a, ucp_ep_h ep, const kvc_buf_t *msg,
                                        ucp_send_nbx_callback_t cb, void *arg, void **req);

/* -------------------------------------------------------- publish.c -- */
KVC_HIDDEN kvc_status_t kvc_pubtab_init(kvc_pubtab_t *t);
KVC_HIDDEN void kvc_pubtab_cleanup(kvc_pubtab_t *t);
KVC_HIDDEN kvc_pub_t *kvc_pubtab_find(kvc_pubtab_t *t, const char *id, size_t len);
KVC_HIDDEN void kvc_pubtab_insert(kvc_pubtab_t *t, kvc_pub_t *p);
KVC_HIDDEN void kvc_pubtab_remove(kvc_pubtab_t *t, kvc_pub_t *p);
KVC_HIDDEN void kvc_pub_free(kvc_pub_t *p);
/* True when every block of [start, start+count) is published in p. */
KVC_HIDDEN bool kvc_pub_has_run(const kvc_pub_t *p, uint64_t start, uint64_t count);
/* Expiry, and holds past their deadline on released publications. */
KVC_HIDDEN void kvc_expiry_run(kvc_agent_t *a, uint64_t now, uint64_t *next);
/* Takes p out of the table and hands its blocks back to the engine with
 * event `type` (0: none) as soon as no push or confirmed read uses them:
 * now, or when the last one ends.  p may be freed. */
KVC_HIDDEN void kvc_pub_release(kvc_agent_t *a, kvc_pub_t *p, kvc_event_type_t type,
                                kvc_status_t st, const char *msg);
/* Renews p's lease (a pull or a RENEW for it arrived): re-sorted in the
 * expiry list.  No-op without a lease. */
KVC_HIDDEN void kvc_pub_lease_renew(kvc_agent_t *a, kvc_pub_t *p);
/* A push job starts / ends sending from p's blocks. */
KVC_HIDDEN void kvc_pub_push_begin(kvc_pub_t *p);
KVC_HIDDEN void kvc_pub_push_end(kvc_agent_t *a, kvc_pub_t *p);
/* A confirmed one-sided read of live publication p by fetch (xfer_id,
 * token) until deadline_ns.  KVC_OK or KVC_ERR_NO_MEMORY. */
KVC_HIDDEN kvc_status_t kvc_pub_hold(kvc_agent_t *a, kvc_pub_t *p, uint64_t xfer_id,
                                     const uint8_t token[KVC_TOKEN_LEN], uint64_t deadline_ns);
/* Ends that read: KVC_OK when its hold was intact (the blocks were not
 * handed back meanwhile), else KVC_ERR_DENIED.  The publication may have
 * been released meanwhile (then it may be freed now). */
KVC_HIDDEN kvc_status_t kvc_pub_unhold(kvc_agent_t *a, const char *id, size_t len, uint64_t xfer_id,
                                       const uint8_t token[KVC_TOKEN_LEN]);

#endif
