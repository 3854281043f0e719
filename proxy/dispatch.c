/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/dispatch.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/rand.h>

#include "base/json.h"

static const char *const mode_names[] = {"serial", "concurrent"};

int px_dispatch_parse(const char *s) {
    for (int i = 0; i < 2; i++)
        if (s && !strcmp(s, mode_names[i])) return i;
    return -1;
}

const char *px_dispatch_name(px_dispatch_mode m) {
    return mode_names[m == PX_DISPATCH_CONCURRENT];
}

static const char *const kind_reasons[PX_DISP_COUNT] = {
    "configured", "no_identity", "identity_cached", "prefill_pulls", "mode_unknown"};

const char *px_dispatch_kind_mode(px_dispatch_kind k) {
    return k == PX_DISP_CONCURRENT ? "concurrent" : "serial";
}

const char *px_dispatch_kind_reason(px_dispatch_kind k) {
    return kind_reasons[k];
}

/* ---------- the prefill's identity ---------- */

/* Copies member `key` of kvp, of JSON type `t`, as its exact text into
 * out. Returns -1 when absent, of another type or too long. */
static int member_text(const char *kvp, size_t n, const char *key, px_json_type t, char *out,
                       size_t cap) {
    px_json_member m;
    if (!px_json_find(kvp, n, key, &m) || m.type != t || m.val_len + 1 > cap) return -1;
    memcpy(out, m.val, m.val_len);
    out[m.val_len] = '\0';
    return 0;
}

int px_dispatch_identity_parse(const char *kvp, size_t n, px_pf_identity *id) {
    px_pf_identity v;
    if (member_text(kvp, n, "remote_engine_id", PX_JSON_STRING, v.engine_id,
                    sizeof v.engine_id) < 0 ||
        member_text(kvp, n, "remote_host", PX_JSON_STRING, v.host, sizeof v.host) < 0 ||
        member_text(kvp, n, "remote_port", PX_JSON_NUMBER, v.port, sizeof v.port) < 0)
        return -1;
    if (member_text(kvp, n, "tp_size", PX_JSON_NUMBER, v.tp_size, sizeof v.tp_size) < 0)
        snprintf(v.tp_size, sizeof v.tp_size, "1");
    if (member_text(kvp, n, "pp_size", PX_JSON_NUMBER, v.pp_size, sizeof v.pp_size) < 0)
        v.pp_size[0] = '\0';
    px_json_member m;
    v.mode = PX_XFER_UNKNOWN;
    if (px_json_find(kvp, n, "transfer_mode", &m) && m.type == PX_JSON_STRING)
        v.mode = px_json_str_eq(m.val + 1, m.val_len - 2, "push") ? PX_XFER_PUSH : PX_XFER_PULL;
    *id = v;
    return 0;
}

px_dispatch_kind px_dispatch_decide(px_dispatch_mode mode, const px_pf_identity *id) {
    if (mode != PX_DISPATCH_CONCURRENT) return PX_DISP_SERIAL;
    if (!id) return PX_DISP_NO_IDENTITY;
    switch (id->mode) {
    case PX_XFER_PUSH:
        return PX_DISP_CONCURRENT;
    case PX_XFER_PULL:
        return PX_DISP_PULLS;
    default:
        return PX_DISP_MODE_UNKNOWN;
    }
}

typedef struct ident_entry {
    char backend[256];
    px_pf_identity id;
    uint64_t stamp; /* when learned, in learn order: the oldest goes first */
} ident_entry;

struct px_pf_cache {
    pthread_mutex_t mu;
    ident_entry e[PX_DISPATCH_MAX_IDENTITIES];
    size_t n;
    uint64_t clock;
};

px_pf_cache *px_pf_cache_create(void) {
    px_pf_cache *c = px_xcalloc(1, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    return c;
}

void px_pf_cache_destroy(px_pf_cache *c) {
    if (!c) return;
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static ident_entry *find(px_pf_cache *c, const char *backend) {
    for (size_t i = 0; i < c->n; i++)
        if (!strcmp(c->e[i].backend, backend)) return &c->e[i];
    return NULL;
}

int px_dispatch_learn(px_pf_cache *c, const char *backend, const char *kvp, size_t n) {
    px_pf_identity id;
    if (!backend || strlen(backend) >= sizeof c->e[0].backend) return -1;
    if (px_dispatch_identity_parse(kvp, n, &id) < 0) {
        px_dispatch_forget(c, backend);
        return -1;
    }
    pthread_mutex_lock(&c->mu);
    ident_entry *e = find(c, backend);
    if (!e && c->n < PX_DISPATCH_MAX_IDENTITIES) e = &c->e[c->n++];
    if (!e) { /* full: the least recently learned makes room */
        e = &c->e[0];
        for (size_t i = 1; i < c->n; i++)
            if (c->e[i].stamp < e->stamp) e = &c->e[i];
    }
    snprintf(e->backend, sizeof e->backend, "%s", backend);
    e->id = id;
    e->stamp = ++c->clock;
    pthread_mutex_unlock(&c->mu);
    return 0;
}

int px_dispatch_get(px_pf_cache *c, const char *backend, px_pf_identity *id) {
    pthread_mutex_lock(&c->mu);
    ident_entry *e = backend ? find(c, backend) : NULL;
    if (e) *id = e->id;
    pthread_mutex_unlock(&c->mu);
    return e != NULL;
}

void px_dispatch_forget(px_pf_cache *c, const char *backend) {
    pthread_mutex_lock(&c->mu);
    ident_entry *e = backend ? find(c, backend) : NULL;
    if (e) *e = c->e[--c->n];
    pthread_mutex_unlock(&c->mu);
}

/* ---------- the legs' kv_transfer_params ---------- */

static void hex(const unsigned char *b, size_t n, char *out) {
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[b[i] >> 4];
        out[2 * i + 1] = d[b[i] & 15];
    }
    out[2 * n] = '\0';
}

/* Random bytes for the minted ids, drawn from OpenSSL's generator a
 * batch at a time per thread: RAND_bytes costs a getpid() per call (its
 * fork check), one system call per request on the fast path
 * (integration.proxy_budget); a batch serves 256 transfer ids. pdproxy
 * does not fork after its threads start, so no batch is ever shared. */
static int random_bytes(unsigned char *out, size_t n) {
    static _Thread_local unsigned char pool[4096];
    static _Thread_local size_t left;
    if (n > sizeof pool) return RAND_bytes(out, (int)n) == 1 ? 0 : -1;
    if (left < n) {
        if (RAND_bytes(pool, sizeof pool) != 1) return -1;
        left = sizeof pool;
    }
    memcpy(out, pool + sizeof pool - left, n);
    memset(pool + sizeof pool - left, 0, n); /* used once */
    left -= n;
    return 0;
}

int px_dispatch_mint(char id[PX_DISPATCH_ID_LEN], char token[33]) {
    unsigned char b[32];
    if (random_bytes(b, sizeof b) < 0) return -1;
    memcpy(id, "pdproxy-", 8);
    hex(b, 16, id + 8);
    hex(b + 16, 16, token);
    return 0;
}

int px_dispatch_mint_transfer_id(char id[PX_DISPATCH_XFER_LEN]) {
    unsigned char b[16];
    if (random_bytes(b, sizeof b) < 0) return -1;
    memcpy(id, "xfer-", 5);
    hex(b, sizeof b, id + 5);
    return 0;
}

void px_dispatch_prefill_kvp(const char *id, const char *token, const char *transfer_id,
                             px_buf *out) {
    px_buf_printf(out,
                  "{\"do_remote_decode\":true,\"do_remote_prefill\":false,"
                  "\"remote_engine_id\":null,\"remote_block_ids\":null,\"remote_host\":null,"
                  "\"remote_port\":null,\"remote_request_id\":\"%s\",\"remote_kv_token\":\"%s\","
                  "\"transfer_mode\":\"push\",\"transfer_id\":\"%s\"}",
                  id, token, transfer_id);
}

void px_dispatch_decode_kvp(const px_pf_identity *pf, const char *id, const char *token,
                            const char *transfer_id, px_buf *out) {
    px_buf_printf(out,
                  "{\"do_remote_prefill\":true,\"do_remote_decode\":false,"
                  "\"transfer_mode\":\"push\",\"remote_engine_id\":%s,"
                  "\"remote_request_id\":\"%s\",\"remote_kv_token\":\"%s\",\"remote_host\":%s,"
                  "\"remote_port\":%s,\"tp_size\":%s%s%s,\"transfer_id\":\"%s\"}",
                  pf->engine_id, id, token, pf->host, pf->port, pf->tp_size,
                  pf->pp_size[0] ? ",\"pp_size\":" : "", pf->pp_size, transfer_id);
}
