/* SPDX-License-Identifier: Apache-2.0 */
/* Wire formats: side-channel handshake, pull requests, data headers and
 * notifications.  Pure functions (no I/O, no UCX calls) so that the fuzzers
 * and unit tests exercise exactly what the agent runs.
 *
 * Header (12 bytes): u32 magic "KVCH", u16 version, u16 type, u32 body_len.
 * Side channel, in order (version 3; version 2 sent the HANDSHAKE in clear
 * and had another PULL):
 *  C->P HELLO:     str16 engine_id, u8 flags (KVC_HFLAG_*), nonce_c[32]
 *  P->C CHALLENGE: str16 engine_id, u8 flags, nonce_p[32]
 *  C->P AUTH:      u8 proto, mac_c[32]
 *  P->C SEALED:    AES-256-GCM(the HANDSHAKE message below, whole: header
 *                  and body), tag[16]; the SEALED header is the associated
 *                  data (keys and nonces: auth.c)
 *  inside it
 *       HANDSHAKE: str16 engine_id, u64 instance nonce, str16 layout,
 *                  u32 tp_size, blob32 worker_address, u64 num_blocks,
 *                  u32 n_regions, n_regions * { u64 base, u64 len,
 *                  u64 block_len, u8 mem_type, u8 flags, blob32 rkey },
 *                  [blob32 IPC table: only after a CHALLENGE with
 *                  KVC_HFLAG_IPC, layout below],
 *                  mac_p[32] (over everything before it)
 *  P->C ERROR:     i32 status, str16 message  (instead of CHALLENGE or
 *                  SEALED, in clear; the producer closes after it)
 * The MACs are computed in auth.c.  Version 2 sent the HANDSHAKE in clear;
 * a peer speaking it is refused with both versions named.
 * PULL (AM data): u16 version, u16 flags (KVC_PULL_*), u32 n_runs, u64 xfer_id,
 *                 xfer_token[16], pub_token[16], u32 consumer tp (version 3),
 *                 str16 request_id, n_runs * { u64 remote, u64 local, u64 count }
 * DATA header (AM header): u64 xfer_id, u32 region, i32 status,
 *                 u64 local_start, u64 count, xfer_token[16]
 * NOTIFY (AM data): pub_token[16], "<request id>:<tp>"
 * READY, POOL, SLOT (AM headers of the staged-shm path): kvc_int.h, stage.c.
 * Everything a parser reads is bounds-checked against the input length;
 * counts are checked against the bytes that remain before any allocation. */
#include "connector/kvc_int.h"

#include <stdlib.h>
#include <string.h>

/* String copies (here with the parsers, which need them and are built alone
 * into the fuzzers). */
char *kvc_strdup(const char *s) {
    return s ? kvc_strndup(s, strlen(s)) : NULL;
}

char *kvc_strndup(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

void kvc_buf_cleanup(kvc_buf_t *b) {
    free(b->p);
    memset(b, 0, sizeof(*b));
}

void kvc_buf_put(kvc_buf_t *b, const void *p, size_t n) {
    if (b->failed || n == 0) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n)
            cap *= 2;
        uint8_t *np = realloc(b->p, cap);
        if (!np) {
            b->failed = true;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, p, n);
    b->len += n;
}

void kvc_buf_u8(kvc_buf_t *b, uint8_t v) {
    kvc_buf_put(b, &v, 1);
}

void kvc_buf_u16(kvc_buf_t *b, uint16_t v) {
    uint8_t x[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    kvc_buf_put(b, x, 2);
}

void kvc_buf_u32(kvc_buf_t *b, uint32_t v) {
    uint8_t x[4];
    for (int i = 0; i < 4; i++)
        x[i] = (uint8_t)(v >> (8 * i));
    kvc_buf_put(b, x, 4);
}

void kvc_buf_u64(kvc_buf_t *b, uint64_t v) {
    uint8_t x[8];
    for (int i = 0; i < 8; i++)
        x[i] = (uint8_t)(v >> (8 * i));
    kvc_buf_put(b, x, 8);
}

static void put_str16(kvc_buf_t *b, const void *s, size_t n) {
    if (n > KVC_WIRE_MAX_STR) {
        b->failed = true;
        return;
    }
    kvc_buf_u16(b, (uint16_t)n);
    kvc_buf_put(b, s, n);
}

static void put_blob32(kvc_buf_t *b, const void *s, size_t n) {
    if (n > KVC_WIRE_MAX_BLOB) {
        b->failed = true;
        return;
    }
    kvc_buf_u32(b, (uint32_t)n);
    kvc_buf_put(b, s, n);
}

/* Reader: every getter fails (and stays failed) instead of reading past end. */
typedef struct {
    const uint8_t *p;
    size_t len, off;
    bool bad;
} rd_t;

static bool rd_need(rd_t *r, size_t n) {
    if (r->bad || r->len - r->off < n) {
        r->bad = true;
        return false;
    }
    return true;
}

static uint64_t rd_uint(rd_t *r, int bytes) {
    if (!rd_need(r, (size_t)bytes)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v |= (uint64_t)r->p[r->off + i] << (8 * i);
    r->off += (size_t)bytes;
    return v;
}

static kvc_span_t rd_span(rd_t *r, size_t n) {
    kvc_span_t s = {NULL, 0};
    if (!rd_need(r, n)) return s;
    s.p = r->p + r->off;
    s.len = n;
    r->off += n;
    return s;
}

static kvc_span_t rd_str16(rd_t *r) {
    size_t n = (size_t)rd_uint(r, 2);
    if (n > KVC_WIRE_MAX_STR) r->bad = true;
    return rd_span(r, n);
}

static kvc_span_t rd_blob32(rd_t *r) {
    size_t n = (size_t)rd_uint(r, 4);
    if (n > KVC_WIRE_MAX_BLOB) r->bad = true;
    return rd_span(r, n);
}

bool kvc_printable(const char *s, size_t len) {
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)s[i] < 0x20 || (unsigned char)s[i] > 0x7e) return false;
    return true;
}

kvc_status_t kvc_wire_parse_hdr(const uint8_t *b, size_t len, uint32_t max_body,
                                kvc_wire_hdr_t *h) {
    rd_t r = {b, len, 0, false};
    if (len < 4) return KVC_AGAIN;
    if (rd_uint(&r, 4) != KVC_WIRE_MAGIC) return KVC_ERR_PROTOCOL;
    if (len < KVC_WIRE_HDR_LEN) return KVC_AGAIN;
    kvc_wire_hdr_t t;
    t.version = (uint16_t)rd_uint(&r, 2);
    t.type = (uint16_t)rd_uint(&r, 2);
    t.body_len = (uint32_t)rd_uint(&r, 4);
    if (t.body_len > max_body) return KVC_ERR_PROTOCOL;
    *h = t;
    return KVC_OK;
}

static void put_hdr(kvc_buf_t *b, uint16_t version, uint16_t type) {
    kvc_buf_u32(b, KVC_WIRE_MAGIC);
    kvc_buf_u16(b, version);
    kvc_buf_u16(b, type);
    kvc_buf_u32(b, 0); /* body length, patched by end_msg */
}

void kvc_wire_end_msg(kvc_buf_t *b, size_t start) {
    if (b->failed) return;
    size_t body = b->len - start - KVC_WIRE_HDR_LEN;
    if (body > KVC_WIRE_MAX_BODY) {
        b->failed = true;
        return;
    }
    for (int i = 0; i < 4; i++)
        b->p[start + 8 + i] = (uint8_t)(body >> (8 * i));
}

void kvc_wire_encode_hello(kvc_buf_t *b, uint16_t version, uint16_t type, const char *engine_id,
                           uint8_t flags, const uint8_t nonce[KVC_NONCE_LEN]) {
    size_t start = b->len;
    put_hdr(b, version, type);
    put_str16(b, engine_id, strlen(engine_id));
    kvc_buf_u8(b, flags);
    kvc_buf_put(b, nonce, KVC_NONCE_LEN);
    kvc_wire_end_msg(b, start);
}

kvc_status_t kvc_wire_parse_hello(const uint8_t *body, size_t len, kvc_wire_hello_t *h) {
    rd_t r = {body, len, 0, false};
    kvc_wire_hello_t t;
    t.engine_id = rd_str16(&r);
    t.flags = (uint8_t)rd_uint(&r, 1);
    t.nonce = rd_span(&r, KVC_NONCE_LEN).p;
    if (r.bad || r.off != len || t.engine_id.len == 0 ||
        !kvc_printable((const char *)t.engine_id.p, t.engine_id.len))
        return KVC_ERR_PROTOCOL;
    *h = t;
    return KVC_OK;
}

void kvc_wire_encode_consumer(kvc_buf_t *b, uint16_t version, uint64_t key, const void *addr,
                              size_t addr_len) {
    size_t start = b->len;
    put_hdr(b, version, KVC_MSG_CONSUMER);
    kvc_buf_u64(b, key);
    put_blob32(b, addr, addr_len);
    kvc_wire_end_msg(b, start);
}

kvc_status_t kvc_wire_parse_consumer(const uint8_t *p, size_t len, uint64_t *key,
                                     kvc_span_t *addr) {
    rd_t r = {p, len, 0, false};
    uint64_t k = rd_uint(&r, 8);
    kvc_span_t a = rd_blob32(&r);
    if (r.bad || r.off != len || a.len == 0 || a.len > KVC_WIRE_MAX_CONS_ADDR)
        return KVC_ERR_PROTOCOL;
    *key = k;
    *addr = a;
    return KVC_OK;
}

void kvc_wire_encode_auth(kvc_buf_t *b, uint16_t version, uint8_t proto,
                          const uint8_t mac[KVC_MAC_LEN]) {
    size_t start = b->len;
    put_hdr(b, version, KVC_MSG_AUTH);
    kvc_buf_u8(b, proto);
    kvc_buf_put(b, mac, KVC_MAC_LEN);
    kvc_wire_end_msg(b, start);
}

kvc_status_t kvc_wire_parse_auth(const uint8_t *body, size_t len, uint8_t *proto,
                                 const uint8_t **mac) {
    if (!body || len != 1 + KVC_MAC_LEN || body[0] > KVC_PROTO_PUSH) return KVC_ERR_PROTOCOL;
    *proto = body[0];
    *mac = body + 1;
    return KVC_OK;
}

void kvc_wire_encode_error(kvc_buf_t *b, uint16_t version, kvc_status_t st, const char *msg) {
    size_t start = b->len;
    put_hdr(b, version, KVC_MSG_ERROR);
    kvc_buf_u32(b, (uint32_t)(int32_t)st);
    put_str16(b, msg, strlen(msg));
    kvc_wire_end_msg(b, start);
}

kvc_status_t kvc_wire_parse_error(const uint8_t *body, size_t len, int32_t *st, kvc_span_t *msg) {
    rd_t r = {body, len, 0, false};
    int32_t s = (int32_t)(uint32_t)rd_uint(&r, 4);
    kvc_span_t m = rd_str16(&r);
    if (r.bad || r.off != len || !kvc_printable((const char *)m.p, m.len)) return KVC_ERR_PROTOCOL;
    *st = s;
    *msg = m;
    return KVC_OK;
}

void kvc_wire_encode_handshake(kvc_buf_t *b, uint16_t version, const kvc_wire_hs_t *hs) {
    size_t start = b->len;
    put_hdr(b, version, KVC_MSG_HANDSHAKE);
    put_str16(b, hs->engine_id.p, hs->engine_id.len);
    kvc_buf_u64(b, hs->nonce);
    put_str16(b, hs->layout.p, hs->layout.len);
    kvc_buf_u32(b, hs->tp_size);
    put_blob32(b, hs->worker_addr.p, hs->worker_addr.len);
    kvc_buf_u64(b, hs->num_blocks);
    if (hs->n_regions > KVC_WIRE_MAX_REGIONS) b->failed = true;
    kvc_buf_u32(b, hs->n_regions);
    for (uint32_t i = 0; i < hs->n_regions; i++) {
        const kvc_wire_region_t *rg = &hs->regions[i];
        kvc_buf_u64(b, rg->base);
        kvc_buf_u64(b, rg->len);
        kvc_buf_u64(b, rg->block_len);
        kvc_buf_u8(b, rg->mem_type);
        kvc_buf_u8(b, rg->flags);
        put_blob32(b, rg->rkey.p, rg->rkey.len);
    }
    if (hs->ipc.len) put_blob32(b, hs->ipc.p, hs->ipc.len);
    kvc_wire_end_msg(b, start);
}

/* Smallest encoding of one region entry: 3 u64 + 2 u8 + empty blob32. */
#define REGION_MIN_BYTES (8 * 3 + 2 + 4)

kvc_status_t kvc_wire_parse_handshake(const uint8_t *body, size_t len, kvc_wire_hs_t *hs) {
    if (!body || len < KVC_MAC_LEN) return KVC_ERR_PROTOCOL;
    kvc_wire_hs_t t;
    memset(&t, 0, sizeof(t));
    t.mac = body + len - KVC_MAC_LEN;
    t.signed_len = len -= KVC_MAC_LEN;
    rd_t r = {body, len, 0, false};
    t.engine_id = rd_str16(&r);
    t.nonce = rd_uint(&r, 8);
    t.layout = rd_str16(&r);
    t.tp_size = (uint32_t)rd_uint(&r, 4);
    t.worker_addr = rd_blob32(&r);
    t.num_blocks = rd_uint(&r, 8);
    t.n_regions = (uint32_t)rd_uint(&r, 4);
    if (r.bad || t.n_regions > KVC_WIRE_MAX_REGIONS ||
        (size_t)t.n_regions > (len - r.off) / REGION_MIN_BYTES)
        return KVC_ERR_PROTOCOL;
    if (t.n_regions) {
        t.regions = calloc(t.n_regions, sizeof(*t.regions));
        if (!t.regions) return KVC_ERR_NO_MEMORY;
    }
    for (uint32_t i = 0; i < t.n_regions && !r.bad; i++) {
        kvc_wire_region_t *rg = &t.regions[i];
        rg->base = rd_uint(&r, 8);
        rg->len = rd_uint(&r, 8);
        rg->block_len = rd_uint(&r, 8);
        rg->mem_type = (uint8_t)rd_uint(&r, 1);
        rg->flags = (uint8_t)rd_uint(&r, 1);
        rg->rkey = rd_blob32(&r);
        /* Geometry must be self-consistent: len == num_blocks * block_len
         * without overflow, and the region must not wrap the address space. */
        if (!r.bad &&
            (rg->block_len == 0 || t.num_blocks == 0 || rg->block_len > UINT64_MAX / t.num_blocks ||
             rg->block_len * t.num_blocks != rg->len || rg->base > UINT64_MAX - rg->len))
            r.bad = true;
    }
    if (!r.bad && r.off < len) t.ipc = rd_blob32(&r); /* KVC_HFLAG_IPC's table */
    if (r.bad || r.off != len || !kvc_printable((const char *)t.engine_id.p, t.engine_id.len) ||
        !kvc_printable((const char *)t.layout.p, t.layout.len)) {
        free(t.regions);
        return KVC_ERR_PROTOCOL;
    }
    *hs = t;
    return KVC_OK;
}

void kvc_wire_hs_cleanup(kvc_wire_hs_t *hs) {
    free(hs->regions);
    memset(hs, 0, sizeof(*hs));
}

#define RUN_BYTES 24

void kvc_wire_encode_pull(kvc_buf_t *b, const kvc_wire_pull_t *pl) {
    if (pl->n > UINT32_MAX) {
        b->failed = true;
        return;
    }
    kvc_buf_u16(b, KVC_WIRE_VERSION);
    kvc_buf_u16(b, pl->flags);
    kvc_buf_u32(b, (uint32_t)pl->n);
    kvc_buf_u64(b, pl->xfer_id);
    kvc_buf_put(b, pl->xfer_token, KVC_TOKEN_LEN);
    kvc_buf_put(b, pl->pub_token, KVC_TOKEN_LEN);
    kvc_buf_u32(b, pl->tp);
    put_str16(b, pl->request_id.p, pl->request_id.len);
    for (size_t i = 0; i < pl->n; i++) {
        kvc_buf_u64(b, pl->runs[i].remote);
        kvc_buf_u64(b, pl->runs[i].local);
        kvc_buf_u64(b, pl->runs[i].count);
    }
    if (pl->flags & KVC_PULL_EXT) {
        kvc_buf_u32(b, pl->wait_ms);
        kvc_buf_u32(b, pl->parts);
        kvc_buf_u32(b, pl->part);
        kvc_buf_u32(b, 0);
    }
    if (pl->flags & KVC_PULL_CONS) kvc_buf_u64(b, pl->cons_key);
}

kvc_status_t kvc_wire_parse_pull(const uint8_t *p, size_t len, kvc_wire_pull_t *pl) {
    rd_t r = {p, len, 0, false};
    kvc_wire_pull_t t;
    memset(&t, 0, sizeof(t));
    uint16_t ver = (uint16_t)rd_uint(&r, 2);
    t.flags = (uint16_t)rd_uint(&r, 2);
    uint32_t cnt = (uint32_t)rd_uint(&r, 4);
    t.xfer_id = rd_uint(&r, 8);
    kvc_span_t xt = rd_span(&r, KVC_TOKEN_LEN);
    kvc_span_t pt = rd_span(&r, KVC_TOKEN_LEN);
    t.tp = (uint32_t)rd_uint(&r, 4);
    t.request_id = rd_str16(&r);
    t.parts = 1;
    if ((t.flags & KVC_PULL_CONS) && !r.bad) {
        if (len - r.off < KVC_PULL_CONS_LEN) return KVC_ERR_PROTOCOL;
        rd_t e = {p + len - KVC_PULL_CONS_LEN, KVC_PULL_CONS_LEN, 0, false};
        t.cons_key = rd_uint(&e, 8);
        len -= KVC_PULL_CONS_LEN;
    }
    if ((t.flags & KVC_PULL_EXT) && !r.bad) {
        if (len - r.off < KVC_PULL_EXT_LEN) return KVC_ERR_PROTOCOL;
        rd_t e = {p + len - KVC_PULL_EXT_LEN, KVC_PULL_EXT_LEN, 0, false};
        t.wait_ms = (uint32_t)rd_uint(&e, 4);
        t.parts = (uint32_t)rd_uint(&e, 4);
        t.part = (uint32_t)rd_uint(&e, 4);
        if (t.parts == 0 || t.part >= t.parts) return KVC_ERR_PROTOCOL;
        len -= KVC_PULL_EXT_LEN;
    }
    if (r.bad || ver != KVC_WIRE_VERSION || t.request_id.len == 0 ||
        !kvc_printable((const char *)t.request_id.p, t.request_id.len) ||
        (size_t)cnt != (len - r.off) / RUN_BYTES || (len - r.off) % RUN_BYTES)
        return KVC_ERR_PROTOCOL;
    memcpy(t.xfer_token, xt.p, KVC_TOKEN_LEN);
    memcpy(t.pub_token, pt.p, KVC_TOKEN_LEN);
    if (cnt) {
        t.runs = malloc((size_t)cnt * sizeof(*t.runs));
        if (!t.runs) return KVC_ERR_NO_MEMORY;
    }
    for (uint32_t i = 0; i < cnt; i++) {
        t.runs[i].remote = rd_uint(&r, 8);
        t.runs[i].local = rd_uint(&r, 8);
        t.runs[i].count = rd_uint(&r, 8);
    }
    t.n = cnt;
    *pl = t;
    return KVC_OK;
}

static void put_le(uint8_t *out, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++)
        out[i] = (uint8_t)(v >> (8 * i));
}

/* Written in place: one header per pushed chunk, no heap buffer. */
void kvc_wire_encode_data_hdr(uint8_t out[KVC_WIRE_DATA_HDR_LEN], const kvc_wire_data_hdr_t *h) {
    put_le(out, h->xfer_id, 8);
    put_le(out + 8, h->region, 4);
    put_le(out + 12, (uint32_t)h->status, 4);
    put_le(out + 16, h->local_start, 8);
    put_le(out + 24, h->count, 8);
    memcpy(out + 32, h->token, KVC_TOKEN_LEN);
}

kvc_status_t kvc_wire_parse_data_hdr(const uint8_t *p, size_t len, kvc_wire_data_hdr_t *h) {
    if (!p || len != KVC_WIRE_DATA_HDR_LEN) return KVC_ERR_PROTOCOL;
    rd_t r = {p, len, 0, false};
    kvc_wire_data_hdr_t t;
    t.xfer_id = rd_uint(&r, 8);
    t.region = (uint32_t)rd_uint(&r, 4);
    t.status = (int32_t)(uint32_t)rd_uint(&r, 4);
    t.local_start = rd_uint(&r, 8);
    t.count = rd_uint(&r, 8);
    memcpy(t.token, rd_span(&r, KVC_TOKEN_LEN).p, KVC_TOKEN_LEN);
    *h = t;
    return KVC_OK;
}

/* ------------------------------------------- staged-shm: READY, POOL, SLOT -- */

void kvc_wire_encode_ready(uint8_t out[KVC_WIRE_READY_LEN], const kvc_wire_ready_t *r) {
    kvc_wire_encode_data_hdr(out, &r->h);
    put_le(out + KVC_WIRE_DATA_HDR_LEN, r->off, 8);
}

kvc_status_t kvc_wire_parse_ready(const uint8_t *p, size_t len, kvc_wire_ready_t *r) {
    kvc_wire_ready_t t;
    if (!p || len != KVC_WIRE_READY_LEN ||
        kvc_wire_parse_data_hdr(p, KVC_WIRE_DATA_HDR_LEN, &t.h) != KVC_OK)
        return KVC_ERR_PROTOCOL;
    rd_t rd = {p + KVC_WIRE_DATA_HDR_LEN, 8, 0, false};
    t.off = rd_uint(&rd, 8);
    /* A chunk lent: never an END, a refusal or an empty one (those come as DATA). */
    if (t.h.status != 0 || t.h.region == KVC_DATA_END || t.h.count == 0) return KVC_ERR_PROTOCOL;
    *r = t;
    return KVC_OK;
}

void kvc_wire_encode_pool(uint8_t out[KVC_WIRE_POOL_LEN], const kvc_wire_pool_t *pl) {
    kvc_wire_encode_data_hdr(out, &pl->h);
    put_le(out + KVC_WIRE_DATA_HDR_LEN, pl->base, 8);
    put_le(out + KVC_WIRE_DATA_HDR_LEN + 8, pl->len, 8);
    put_le(out + KVC_WIRE_DATA_HDR_LEN + 16, pl->slot_bytes, 8);
}

kvc_status_t kvc_wire_parse_pool(const uint8_t *p, size_t len, size_t rkey_len,
                                 kvc_wire_pool_t *pl) {
    kvc_wire_pool_t t;
    if (!p || len != KVC_WIRE_POOL_LEN || rkey_len == 0 || rkey_len > KVC_WIRE_MAX_BLOB ||
        kvc_wire_parse_data_hdr(p, KVC_WIRE_DATA_HDR_LEN, &t.h) != KVC_OK)
        return KVC_ERR_PROTOCOL;
    rd_t rd = {p + KVC_WIRE_DATA_HDR_LEN, 24, 0, false};
    t.base = rd_uint(&rd, 8);
    t.len = rd_uint(&rd, 8);
    t.slot_bytes = rd_uint(&rd, 8);
    if (t.h.status != 0 || t.len == 0 || t.slot_bytes == 0 || t.slot_bytes > t.len ||
        t.len % t.slot_bytes || t.base > UINT64_MAX - t.len)
        return KVC_ERR_PROTOCOL;
    *pl = t;
    return KVC_OK;
}

void kvc_wire_encode_slot(uint8_t out[KVC_WIRE_SLOT_LEN], const kvc_wire_slot_t *s) {
    put_le(out, s->xfer_id, 8);
    memcpy(out + 8, s->token, KVC_TOKEN_LEN);
    put_le(out + 8 + KVC_TOKEN_LEN, s->kind, 4);
    put_le(out + 8 + KVC_TOKEN_LEN + 4, 0, 4);
    put_le(out + 8 + KVC_TOKEN_LEN + 8, s->off, 8);
}

kvc_status_t kvc_wire_parse_slot(const uint8_t *p, size_t len, kvc_wire_slot_t *s) {
    if (!p || len != KVC_WIRE_SLOT_LEN) return KVC_ERR_PROTOCOL;
    rd_t r = {p, len, 0, false};
    kvc_wire_slot_t t;
    t.xfer_id = rd_uint(&r, 8);
    memcpy(t.token, rd_span(&r, KVC_TOKEN_LEN).p, KVC_TOKEN_LEN);
    t.kind = (uint32_t)rd_uint(&r, 4);
    (void)rd_uint(&r, 4); /* reserved */
    t.off = rd_uint(&r, 8);
    if (r.bad || t.kind < KVC_SLOT_POOL_OK || t.kind > KVC_SLOT_FREE) return KVC_ERR_PROTOCOL;
    *s = t;
    return KVC_OK;
}

void kvc_wire_encode_notify(kvc_buf_t *b, const uint8_t token[KVC_TOKEN_LEN],
                            const char *request_id, uint32_t tp) {
    char num[16];
    int k = 0;
    char tmp[16];
    do {
        tmp[k++] = (char)('0' + tp % 10);
        tp /= 10;
    } while (tp);
    for (int i = 0; i < k; i++)
        num[i] = tmp[k - 1 - i];
    kvc_buf_put(b, token, KVC_TOKEN_LEN);
    kvc_buf_put(b, request_id, strlen(request_id));
    kvc_buf_u8(b, ':');
    kvc_buf_put(b, num, (size_t)k);
}

kvc_status_t kvc_wire_parse_notify(const uint8_t *p, size_t len, const uint8_t **token,
                                   kvc_span_t *id, uint32_t *tp) {
    if (!p || len <= KVC_TOKEN_LEN || len > KVC_WIRE_MAX_NOTIFY) return KVC_ERR_PROTOCOL;
    const uint8_t *tok = p;
    p += KVC_TOKEN_LEN;
    len -= KVC_TOKEN_LEN;
    size_t colon = len;
    for (size_t i = len; i-- > 0;)
        if (p[i] == ':') {
            colon = i;
            break;
        }
    uint32_t t = 0;
    if (colon < len) {
        size_t nd = len - colon - 1;
        if (nd == 0 || nd > 9) return KVC_ERR_PROTOCOL;
        for (size_t i = colon + 1; i < len; i++) {
            if (p[i] < '0' || p[i] > '9') return KVC_ERR_PROTOCOL;
            t = t * 10 + (uint32_t)(p[i] - '0');
        }
    }
    if (colon == 0 || !kvc_printable((const char *)p, colon)) return KVC_ERR_PROTOCOL;
    *token = tok;
    id->p = p;
    id->len = colon;
    *tp = t;
    return KVC_OK;
}

kvc_status_t kvc_coalesce(const uint64_t *remote, const uint64_t *local, size_t n, kvc_run_t **runs,
                          size_t *nruns) {
    if (n == 0) {
        *runs = NULL;
        *nruns = 0;
        return KVC_OK;
    }
    kvc_run_t *v = malloc(n * sizeof(*v));
    if (!v) return KVC_ERR_NO_MEMORY;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (k && v[k - 1].remote + v[k - 1].count == remote[i] &&
            v[k - 1].local + v[k - 1].count == local[i]) {
            v[k - 1].count++;
            continue;
        }
        v[k].remote = remote[i];
        v[k].local = local[i];
        v[k].count = 1;
        k++;
    }
    /* Shrinking cannot fail in a way that matters: keep the larger block. */
    kvc_run_t *s = realloc(v, k * sizeof(*v));
    *runs = s ? s : v;
    *nruns = k;
    return KVC_OK;
}

void kvc_token_hex(const uint8_t t[KVC_TOKEN_LEN], char out[2 * KVC_TOKEN_LEN + 1]) {
    static const char hx[] = "0123456789abcdef";
    for (size_t i = 0; i < KVC_TOKEN_LEN; i++) {
        out[2 * i] = hx[t[i] >> 4];
        out[2 * i + 1] = hx[t[i] & 15];
    }
    out[2 * KVC_TOKEN_LEN] = '\0';
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

kvc_status_t kvc_token_parse(const char *hex, uint8_t t[KVC_TOKEN_LEN]) {
    if (!hex || strlen(hex) != 2 * KVC_TOKEN_LEN) return KVC_ERR_INVALID_PARAM;
    uint8_t v[KVC_TOKEN_LEN];
    for (size_t i = 0; i < KVC_TOKEN_LEN; i++) {
        int h = hexval(hex[2 * i]), l = hexval(hex[2 * i + 1]);
        if (h < 0 || l < 0) return KVC_ERR_INVALID_PARAM;
        v[i] = (uint8_t)(h << 4 | l);
    }
    memcpy(t, v, KVC_TOKEN_LEN);
    return KVC_OK;
}

/* ------------------------------------------------------ CUDA IPC table -- */

void kvc_wire_encode_ipc(kvc_buf_t *b, const kvc_ipc_tab_in_t *in) {
    kvc_buf_u8(b, 2);
    put_str16(b, in->host, strlen(in->host));
    kvc_buf_u32(b, in->pid);
    kvc_buf_u32(b, in->n_allocs);
    for (uint32_t i = 0; i < in->n_allocs; i++) {
        const kvc_cuda_export_t *al = &in->allocs[i];
        put_str16(b, al->bus, strnlen(al->bus, KVC_IPC_BUS_LEN - 1));
        kvc_buf_u64(b, al->size);
        kvc_buf_u8(b, al->kind);
        if (al->kind == KVC_IPC_KIND_VMM)
            kvc_buf_u32(b, al->n_pieces);
        else
            put_blob32(b, al->handle, KVC_IPC_HANDLE_LEN);
    }
    kvc_buf_u32(b, in->n_pieces);
    for (uint32_t i = 0; i < in->n_pieces; i++)
        kvc_buf_u64(b, in->piece_size[i]);
    if (in->n_pieces) {
        put_str16(b, in->sock, strnlen(in->sock, KVC_IPC_SOCK_LEN - 1));
        put_blob32(b, in->token, KVC_IPC_FD_TOKEN_LEN);
    }
    kvc_buf_u32(b, in->n_regions);
    for (uint32_t i = 0; i < in->n_regions; i++) {
        kvc_buf_u32(b, in->reg_alloc[i]);
        kvc_buf_u64(b, in->reg_off[i]);
    }
}

#define IPC_ALLOC_MIN_BYTES (2 + 8 + 1 + 4)
#define IPC_REGION_BYTES (4 + 8)

/* The allocations of a table (t->n_allocs of them, storage allocated):
 * false when one is malformed.  VMM allocations take their pieces in
 * order (first_piece set here). */
static bool rd_ipc_allocs(rd_t *r, kvc_ipc_table_t *t, uint32_t *pieces) {
    *pieces = 0;
    for (uint32_t i = 0; i < t->n_allocs && !r->bad; i++) {
        kvc_ipc_alloc_t *al = &t->allocs[i];
        al->bus = rd_str16(r);
        al->size = rd_uint(r, 8);
        al->kind = (uint8_t)rd_uint(r, 1);
        if (al->kind == KVC_IPC_KIND_VMM) {
            al->first_piece = *pieces;
            al->n_pieces = (uint32_t)rd_uint(r, 4);
            if (al->n_pieces == 0 || al->n_pieces > KVC_IPC_MAX_PIECES - *pieces) return false;
            *pieces += al->n_pieces;
        } else if (al->kind == KVC_IPC_KIND_HANDLE) {
            al->handle = rd_blob32(r);
            if (!r->bad && al->handle.len != KVC_IPC_HANDLE_LEN) return false;
        } else {
            return false;
        }
        if (!r->bad && (al->bus.len == 0 || al->bus.len >= KVC_IPC_BUS_LEN ||
                        !kvc_printable((const char *)al->bus.p, al->bus.len)))
            return false;
    }
    return !r->bad;
}

/* The pieces' sizes, then the socket's name and token when there are
 * pieces: false when malformed or when an allocation's pieces do not sum
 * to its size. */
static bool rd_ipc_pieces(rd_t *r, kvc_ipc_table_t *t) {
    for (uint32_t i = 0; i < t->n_pieces && !r->bad; i++)
        if ((t->piece_size[i] = rd_uint(r, 8)) == 0) return false;
    for (uint32_t i = 0; i < t->n_allocs && !r->bad; i++) {
        const kvc_ipc_alloc_t *al = &t->allocs[i];
        uint64_t sum = 0;
        for (uint32_t k = 0; al->kind == KVC_IPC_KIND_VMM && k < al->n_pieces; k++) {
            uint64_t sz = t->piece_size[al->first_piece + k];
            if (sz > al->size - sum) return false;
            sum += sz;
        }
        if (al->kind == KVC_IPC_KIND_VMM && sum != al->size) return false;
    }
    if (t->n_pieces && !r->bad) {
        t->sock = rd_str16(r);
        t->token = rd_blob32(r);
        if (!r->bad && (t->sock.len == 0 || t->sock.len >= KVC_IPC_SOCK_LEN ||
                        !kvc_printable((const char *)t->sock.p, t->sock.len) ||
                        t->token.len != KVC_IPC_FD_TOKEN_LEN))
            return false;
    }
    return !r->bad;
}

kvc_status_t kvc_wire_parse_ipc(const uint8_t *p, size_t len, const uint64_t *region_len,
                                uint32_t n_regions, kvc_ipc_table_t *t) {
    memset(t, 0, sizeof(*t));
    rd_t r = {p, len, 0, false};
    if (rd_uint(&r, 1) != 2) return KVC_ERR_PROTOCOL;
    t->host = rd_str16(&r);
    t->pid = (uint32_t)rd_uint(&r, 4);
    t->n_allocs = (uint32_t)rd_uint(&r, 4);
    if (r.bad || t->host.len == 0 || !kvc_printable((const char *)t->host.p, t->host.len) ||
        t->n_allocs == 0 || t->n_allocs > n_regions ||
        t->n_allocs > (len - r.off) / IPC_ALLOC_MIN_BYTES)
        return KVC_ERR_PROTOCOL;
    t->allocs = calloc(t->n_allocs, sizeof(*t->allocs));
    t->reg_alloc = calloc(n_regions ? n_regions : 1, sizeof(*t->reg_alloc));
    t->reg_off = calloc(n_regions ? n_regions : 1, sizeof(*t->reg_off));
    if (!t->allocs || !t->reg_alloc || !t->reg_off) {
        kvc_wire_ipc_cleanup(t);
        return KVC_ERR_NO_MEMORY;
    }
    uint32_t pieces = 0;
    if (!rd_ipc_allocs(&r, t, &pieces)) r.bad = true;
    if (!r.bad &&
        ((t->n_pieces = (uint32_t)rd_uint(&r, 4)) != pieces || r.bad || (len - r.off) / 8 < pieces))
        r.bad = true;
    if (!r.bad && pieces && !(t->piece_size = calloc(pieces, sizeof(*t->piece_size)))) {
        kvc_wire_ipc_cleanup(t);
        return KVC_ERR_NO_MEMORY;
    }
    if (!r.bad && !rd_ipc_pieces(&r, t)) r.bad = true;
    if (!r.bad && rd_uint(&r, 4) != n_regions) r.bad = true;
    if (!r.bad && (len - r.off) / IPC_REGION_BYTES < n_regions) r.bad = true;
    for (uint32_t i = 0; i < n_regions && !r.bad; i++) {
        t->reg_alloc[i] = (uint32_t)rd_uint(&r, 4);
        t->reg_off[i] = rd_uint(&r, 8);
        if (!r.bad && (t->reg_alloc[i] >= t->n_allocs ||
                       t->reg_off[i] > t->allocs[t->reg_alloc[i]].size ||
                       region_len[i] > t->allocs[t->reg_alloc[i]].size - t->reg_off[i]))
            r.bad = true;
    }
    if (r.bad || r.off != len) {
        kvc_wire_ipc_cleanup(t);
        return KVC_ERR_PROTOCOL;
    }
    t->n_regions = n_regions;
    return KVC_OK;
}

void kvc_wire_ipc_cleanup(kvc_ipc_table_t *t) {
    free(t->allocs);
    free(t->piece_size);
    free(t->reg_alloc);
    free(t->reg_off);
    memset(t, 0, sizeof(*t));
}
