/* SPDX-License-Identifier: Apache-2.0 */
/* Connector test fixture: agents in this process ("sides") on loopback UCX,
 * pumped alternately, with their events recorded; kv_transfer_params built
 * as vLLM's scheduler does; publish/fetch helpers and byte patterns.  Used
 * by test_kvc_api2.c and test_kvc_owner.c.  Include after cmocka.h; define
 * KVC_FIXTURE_SECRET first to change the cluster secret. */
#ifndef KVC_FIXTURE_H
#define KVC_FIXTURE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "connector/kvc_int.h"

#ifndef KVC_FIXTURE_SECRET
#define KVC_FIXTURE_SECRET "unit-kvc-fixture-secret"
#endif

#define NREG 2
#define MAXEV 256

typedef struct {
    kvc_event_type_t type;
    kvc_status_t st;
    uint64_t xfer_id;
    char req[64];
    char msg[300];
} rec_t;

typedef struct {
    kvc_agent_t *a;
    uint8_t *mem[NREG]; /* owned when the regions are the caller's */
    uint64_t nb;
    size_t bl;
    rec_t ev[MAXEV];
    int n;
} side_t;

typedef struct {
    const char *name, *tls;
    bool pool;         /* connector-allocated shared-memory pool (one-sided reads) */
    uint64_t nb;
    size_t bl;
    uint16_t port;     /* 0: any */
    uint32_t lease_ms; /* 0: none */
    uint32_t pending_ms, max_pending, max_per_peer;
    bool thread;
    uint32_t tp;       /* this engine's TP size; 0: 1 */
} opts_t;

static inline void quiet_log(void *arg, kvc_log_level_t level, const char *msg) {
    (void)level;
    if (getenv("KVC_TEST_VERBOSE")) fprintf(stderr, "%s: %s\n", (const char *)arg, msg);
}

static inline kvc_status_t side_try(side_t *s, const opts_t *o) {
    memset(s, 0, sizeof(*s));
    setenv("UCX_TLS", o->tls ? o->tls : "tcp,self", 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    unsetenv("KVC_PROTO");
    kvc_agent_params_t p = {0};
    p.field_mask = KVC_AGENT_FIELD_ENGINE_ID | KVC_AGENT_FIELD_LOG | KVC_AGENT_FIELD_SECRET |
                   KVC_AGENT_FIELD_XFER_TIMEOUT | KVC_AGENT_FIELD_LEASE |
                   KVC_AGENT_FIELD_PENDING_FETCH | KVC_AGENT_FIELD_LISTEN_PORT |
                   KVC_AGENT_FIELD_PROGRESS_THREAD | KVC_AGENT_FIELD_TP_SIZE;
    p.tp_size = o->tp ? o->tp : 1;
    p.engine_id = o->name;
    p.log_cb = quiet_log;
    p.log_arg = (void *)o->name;
    p.log_level = KVC_LOG_DEBUG;
    p.secret = KVC_FIXTURE_SECRET;
    p.secret_len = strlen(KVC_FIXTURE_SECRET);
    p.xfer_timeout_ms = 30000;
    p.listen_port = o->port;
    p.lease_ms = o->lease_ms;
    p.pending_fetch_ms = o->pending_ms ? o->pending_ms : 30000;
    p.max_pending_fetches = o->max_pending;
    p.max_pending_per_peer = o->max_per_peer;
    p.progress_thread = o->thread;
    kvc_status_t st = kvc_agent_create(&p, &s->a);
    if (st != KVC_OK) return st;
    kvc_region_params_t rp[NREG];
    memset(rp, 0, sizeof(rp));
    for (int r = 0; r < NREG; r++) {
        rp[r].len = o->nb * o->bl;
        if (!o->pool) {
            s->mem[r] = calloc(o->nb, o->bl);
            assert_non_null(s->mem[r]);
            rp[r].field_mask = KVC_REGION_FIELD_BASE;
            rp[r].base = s->mem[r];
        }
    }
    assert_int_equal(kvc_agent_register_regions(s->a, o->nb, rp, NREG), KVC_OK);
    s->nb = o->nb;
    s->bl = o->bl;
    return KVC_OK;
}

static inline void side_init(side_t *s, const opts_t *o) {
    assert_int_equal(side_try(s, o), KVC_OK);
}

static inline void side_cleanup(side_t *s) {
    kvc_agent_destroy(s->a);
    for (int r = 0; r < NREG; r++)
        free(s->mem[r]);
}

static inline uint8_t *block(side_t *s, int r, uint64_t b) {
    void *base;
    assert_int_equal(kvc_region_base(s->a, (size_t)r, &base), KVC_OK);
    return (uint8_t *)base + b * s->bl;
}

/* Byte i of block b of region r of producer `gen`: position-dependent. */
static inline uint8_t pat(uint8_t gen, int r, uint64_t b, size_t i) {
    return (uint8_t)(gen * 31u + (unsigned)r * 7u + (unsigned)b * 13u + (unsigned)(i * 3u + i / 251));
}

static inline void fill(side_t *s, uint64_t b, uint8_t gen) {
    for (int r = 0; r < NREG; r++)
        for (size_t i = 0; i < s->bl; i++)
            block(s, r, b)[i] = pat(gen, r, b, i);
}

static inline void canary(side_t *s, uint8_t c) {
    for (int r = 0; r < NREG; r++)
        memset(block(s, r, 0), c, s->nb * s->bl);
}

/* Keeps an event the agent returned in the side's record. */
static inline void record_ev(side_t *s, const kvc_event_t *e) {
    assert_true(s->n < MAXEV);
    rec_t *r = &s->ev[s->n++];
    r->type = e->type;
    r->st = e->status;
    r->xfer_id = e->xfer_id;
    snprintf(r->req, sizeof(r->req), "%s", e->request_id ? e->request_id : "");
    snprintf(r->msg, sizeof(r->msg), "%s", e->message ? e->message : "");
}

static inline void pump_once(side_t *s) {
    kvc_agent_progress(s->a);
    kvc_event_t e;
    while (kvc_agent_next_event(s->a, &e) == KVC_OK)
        record_ev(s, &e);
}

static inline const rec_t *find_ev(const side_t *s, kvc_event_type_t t, const char *req) {
    for (int i = 0; i < s->n; i++)
        if (s->ev[i].type == t && (!req || !strcmp(s->ev[i].req, req))) return &s->ev[i];
    return NULL;
}

static inline int count_fetch_ev(const side_t *s, uint64_t id) {
    int k = 0;
    for (int i = 0; i < s->n; i++)
        k += (s->ev[i].type == KVC_EV_FETCH_DONE || s->ev[i].type == KVC_EV_FETCH_FAILED) &&
             s->ev[i].xfer_id == id;
    return k;
}

static inline const rec_t *fetch_ev(const side_t *s, uint64_t id) {
    for (int i = 0; i < s->n; i++)
        if ((s->ev[i].type == KVC_EV_FETCH_DONE || s->ev[i].type == KVC_EV_FETCH_FAILED) &&
            s->ev[i].xfer_id == id)
            return &s->ev[i];
    return NULL;
}

static inline uint64_t stat(side_t *s, kvc_stat_t w) {
    uint64_t v = 0;
    assert_int_equal(kvc_agent_stat(s->a, w, &v), KVC_OK);
    return v;
}

/* Drives the agents until cond holds; fails the test after ms. */
#define PUMP_UNTIL(P, D, cond, ms)                                                                 \
    do {                                                                                           \
        uint64_t t0_ = kvc_now_ns();                                                               \
        while (!(cond)) {                                                                          \
            assert_true(kvc_now_ns() - t0_ < (uint64_t)(ms)*1000000ull);                           \
            pump_once(P);                                                                          \
            pump_once(D);                                                                          \
        }                                                                                          \
    } while (0)

static inline uint16_t port_of(side_t *s) {
    uint16_t port = 0;
    assert_int_equal(kvc_agent_get_port(s->a, &port), KVC_OK);
    return port;
}

/* kv_transfer_params as vLLM's scheduler builds them before the worker
 * publishes: the engine id, host, port, blocks and the token it drew. */
static inline char *params_json(const char *engine, uint16_t port, const char *req, const uint64_t *ids,
                         size_t n, const char *token) {
    static char buf[4096];
    int off = snprintf(buf, sizeof(buf),
                       "{\"do_remote_prefill\":true,\"do_remote_decode\":false,"
                       "\"remote_engine_id\":\"%s\",\"remote_request_id\":\"%s\","
                       "\"remote_host\":\"127.0.0.1\",\"remote_port\":%u,\"tp_size\":1,"
                       "\"remote_kv_token\":\"%s\",\"remote_block_ids\":[",
                       engine, req, port, token);
    for (size_t i = 0; i < n; i++)
        off += snprintf(buf + off, sizeof(buf) - (size_t)off, "%s%llu", i ? "," : "",
                        (unsigned long long)ids[i]);
    snprintf(buf + off, sizeof(buf) - (size_t)off, "]}");
    return buf;
}

static inline void publish_tok(side_t *P, const char *id, const uint64_t *ids, size_t n, const char *tok) {
    kvc_publish_params_t pp = {.field_mask = KVC_PUBLISH_FIELD_TOKEN, .kv_token = tok};
    char *json = NULL;
    assert_int_equal(kvc_publish(P->a, id, ids, n, &pp, &json), KVC_OK);
    assert_non_null(strstr(json, tok));
    kvc_free(json);
}

static inline uint64_t fetch_p(side_t *D, const char *json, const uint64_t *lids, size_t n,
                        uint64_t extra_mask, const kvc_fetch_params_t *extra) {
    kvc_fetch_params_t fp = {0};
    if (extra) fp = *extra;
    fp.field_mask = KVC_FETCH_FIELD_JSON | KVC_FETCH_FIELD_LOCAL_BLOCKS | extra_mask;
    fp.kv_transfer_params_json = json;
    fp.local_block_ids = lids;
    fp.num_local_blocks = n;
    uint64_t id = 0;
    assert_int_equal(kvc_fetch(D->a, &fp, &id), KVC_INPROGRESS);
    return id;
}

static inline bool same_blocks(side_t *P, uint64_t pb, side_t *D, uint64_t db) {
    for (int r = 0; r < NREG; r++)
        if (memcmp(block(P, r, pb), block(D, r, db), P->bl)) return false;
    return true;
}

#endif
