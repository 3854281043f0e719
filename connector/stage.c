/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA staging through a bounded pinned pool.
 *
 * Without CUDA memory support in UCX, device regions are not mirrored in
 * host memory: every byte crosses a small pinned pool instead (the agent's
 * staging_pool_bytes, split into slots of at most one pushed message each).
 *
 *  producer: a pull for staged regions becomes a job; progress takes a free
 *            slot, queues device -> slot (cudaMemcpyAsync on the device's
 *            stream, after the waits kvc_publish queued there) and records
 *            the slot's event; once the event completes the chunk goes to
 *            the consumer, and the slot is free again when the consumer is
 *            done with it.  A job holds at most `window` slots (KVC_STAGE_WINDOW,
 *            STAGE_WINDOW by default): the device copy of chunk i+1, the
 *            transfer of chunk i and the consumer's copy of chunk i-1
 *            overlap, and chunks finish one after another instead of in a
 *            batch of every slot at once (UCX interleaves all the sends it is
 *            given, so an unbounded window delays every chunk).
 *  two ways to the consumer:
 *   staged-shm: the consumer is on this host and maps the pool (it is UCX
 *            shared memory: ucp_rkey_ptr on its packed rkey, KVC_AM_POOL,
 *            answered POOL_OK), pins the mapping and copies each chunk from
 *            the producer's slot to its device: a READY message names the
 *            slot, a SLOT FREE hands it back after the consumer's copy is
 *            complete.  No CPU copies a byte and only small messages cross.
 *   staged-wire: otherwise (another host, a transport without a mappable
 *            pool, POOL_NO, KVC_STAGED_WIRE=1 on the consumer): the slot is
 *            sent as one rendezvous DATA message and freed when the send
 *            completes; the consumer receives it into a slot of its own
 *            pool (ucp_am_recv_data_nbx; a message waits, its descriptor
 *            kept, until a slot is free), then slot -> device.
 *  consumer: the fetch holds one reference per chunk until its copy to the
 *            device is complete, so FETCH_DONE means the bytes are on the
 *            device.  A chunk of a fetch that failed meanwhile is dropped
 *            before its copy: nothing lands after FETCH_FAILED.
 *
 * Everything is started from kvc_stage_progress(); UCX callbacks only mark
 * slots and wake the agent.  Events are polled (never a host wait): a
 * progress call comes back every POLL_NS while a copy is pending. */
#include "connector/kvc_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define POLL_NS 20000ull /* 20 us */
#define STAGE_WINDOW 4   /* slots per job (bench/kvc_bench.sh --staged measured 2..16) */

/* Producer: FREE -> D2H -> STAGED (copied; the job's way not known yet) ->
 * SEND (wire) or LENT (READY sent, the consumer reads it) -> FREE.
 * Consumer: FREE -> RECV -> RECVD -> H2D -> FREE. */
typedef enum { S_FREE, S_D2H, S_STAGED, S_SEND, S_LENT, S_RECV, S_RECVD, S_H2D } slot_state_t;
/* A job's way to its consumer: not asked, pool offered, mapped, refused. */
typedef enum { J_WIRE, J_ASKED, J_SHM } job_way_t;

typedef struct sjob sjob_t;

typedef struct {
    uint8_t *p; /* borrowed: inside the pool */
    kvc_agent_t *a;
    slot_state_t state;
    void *ev; /* cudaEvent_t, owned; made on ev_dev */
    int ev_dev;
    sjob_t *job;     /* producer: the job the slot is sending for */
    uint32_t region; /* producer: the chunk's region and first local block */
    uint64_t local;
    uint64_t lent_ns;   /* producer: when the READY went (LENT) */
    kvc_stage_ref_t *x; /* consumer: the fetch, held until the slot's copy is complete */
    int dev;            /* consumer: device of the destination */
    void *dst;          /* consumer: device address of the chunk */
    size_t len;
    kvc_status_t fail; /* consumer: the receive failed */
} slot_t;

/* A send: header storage that lives until completion; kept for the next
 * send once complete (kvc_stage.ctx_spare), so a chunk costs no heap call. */
typedef struct sendctx sendctx_t;
struct sendctx {
    sendctx_t *next; /* spare list */
    kvc_agent_t *a;
    sjob_t *job;
    slot_t *slot; /* freed when the send completes (wire), or NULL */
    uint8_t hdr[KVC_WIRE_POOL_LEN];
};

struct sjob {
    sjob_t *next;
    kvc_cons_t *cons; /* referenced: its consumer (KVC_HFLAG_OWNER), or NULL: */
    ucp_ep_h ep;      /* borrowed: UCX's reply endpoint of an older consumer */
    char *pub_id; /* owned: the publication pulled */
    uint8_t pub_token[KVC_TOKEN_LEN];
    uint64_t xid;
    uint8_t token[KVC_TOKEN_LEN];
    uint16_t flags;
    kvc_run_t *runs; /* owned */
    size_t n;
    size_t ri, rg; /* cursor: run, region, offset in blocks */
    uint64_t off;
    uint64_t sent;   /* DATA messages issued */
    size_t inflight; /* slots and sends of this job not done */
    size_t held;     /* slots of the pool this job holds (<= window) */
    job_way_t way;
    bool failed, ended;
    bool gone; /* its consumer's endpoint failed: nothing more is sent */
    kvc_status_t fail_st;
};

/* A consumer's DATA message waiting for a slot (its rendezvous descriptor
 * is kept by UCX until received or released). */
typedef struct pend pend_t;
struct pend {
    pend_t *next;
    kvc_stage_ref_t *x;
    void *data;
    size_t len;
    int dev;
    void *dst;
};

/* Consumer: a chunk copied from a producer's mapped slot. */
typedef struct rd rd_t;
struct rd {
    rd_t *next;
    kvc_stage_ref_t *x;
    kvc_peer_t *peer; /* borrowed: the fetch holds it while x holds */
    uint64_t xid, off;
    uint8_t token[KVC_TOKEN_LEN];
    int dev;
    void *dst;
    size_t len;
    bool copying;
    void *ev; /* cudaEvent_t, owned; made on ev_dev */
    int ev_dev;
};

/* Consumer: a producer's pool mapped here (one per peer). */
struct kvc_spool {
    ucp_rkey_h rkey;
    uint8_t *map; /* borrowed from the rkey: the pool here */
    uint64_t base, len;
    bool pinned, bad; /* bad: offered but not mappable, pulls stop asking */
    uint8_t *blob;    /* owned: the packed rkey it came from */
    size_t blob_len;
};

struct kvc_stage {
    ucp_mem_h memh;
    uint8_t *base;
    bool pinned;
    size_t slot_bytes, nslots, window;
    slot_t *slots;
    void *rkey; /* owned by UCX (ucp_rkey_buffer_release): the pool's, for POOL offers */
    size_t rkey_len;
    bool wire; /* consumer: KVC_STAGED_WIRE, never ask for the mapped pool */
    sjob_t *jobs, *jobs_tail;
    pend_t *pend, *pend_tail;
    rd_t *rds, *rd_spare; /* consumer: mapped-slot copies in flight; spares keep events */
    sendctx_t *ctx_spare; /* completed sends' contexts, for the next ones */
    pend_t *pend_spare;   /* consumer: waiting-message records, for the next ones */
};

/* A record from its spare list, else from the heap (NULL: out of memory). */
static sendctx_t *ctx_get(kvc_agent_t *a) {
    sendctx_t *c = a->stage ? a->stage->ctx_spare : NULL;
    if (!c) return malloc(sizeof(*c));
    a->stage->ctx_spare = c->next;
    return c;
}

static pend_t *pend_get(kvc_stage_t *s) {
    pend_t *p = s->pend_spare;
    if (!p) return malloc(sizeof(*p));
    s->pend_spare = p->next;
    return p;
}

static void ctx_put(kvc_agent_t *a, sendctx_t *c) {
    if (!a->stage) {
        free(c);
        return;
    }
    c->next = a->stage->ctx_spare;
    a->stage->ctx_spare = c;
}

static void pend_put(kvc_stage_t *s, pend_t *p) {
    p->next = s->pend_spare;
    s->pend_spare = p;
}

size_t kvc_stage_pool_bytes(const kvc_agent_t *a) {
    return a->stage ? a->stage->slot_bytes * a->stage->nslots : 0;
}

kvc_status_t kvc_stage_init(kvc_agent_t *a) {
    size_t maxbl = 0;
    for (size_t i = 0; i < a->n_regions; i++)
        if (a->regions[i].staged && a->regions[i].block_len > maxbl)
            maxbl = a->regions[i].block_len;
    if (!maxbl) return KVC_OK;
    /* Slots of one pushed message (a->push_chunk, or one block when blocks
     * are larger): what any producer with the same KVC_PUSH_CHUNK_KB sends
     * fits one.  A pool smaller than two slots is rounded up to two. */
    size_t slot = a->push_chunk > maxbl ? a->push_chunk : maxbl;
    size_t nslots = a->stage_pool_bytes / slot;
    if (nslots < 2) nslots = 2; /* double-buffered at least */
    kvc_stage_t *s = calloc(1, sizeof(*s));
    if (!s || !(s->slots = calloc(nslots, sizeof(*s->slots)))) {
        free(s);
        return KVC_ERR_NO_MEMORY;
    }
    s->slot_bytes = slot;
    s->nslots = nslots;
    const char *w = getenv("KVC_STAGE_WINDOW"); /* tuning (bench/kvc_bench.sh --staged) */
    s->window = w && strtoul(w, NULL, 10) > 0 ? strtoul(w, NULL, 10) : STAGE_WINDOW;
    const char *wire = getenv("KVC_STAGED_WIRE"); /* comparisons: the wire way on one host */
    s->wire = wire && *wire && strcmp(wire, "0");
    /* Allocated by UCX (registered: rendezvous sends and receives need no
     * bounce), then pinned for the CUDA copies. */
    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.length = slot * nslots;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
    ucs_status_t us = ucp_mem_map(a->ctx, &mp, &s->memh);
    if (us != UCS_OK || ucp_mem_query(s->memh, &ma) != UCS_OK) {
        KVC_LOG(a, KVC_LOG_ERROR, "staging pool of %zu bytes: %s", slot * nslots,
                ucs_status_string(us != UCS_OK ? us : UCS_ERR_NO_MEMORY));
        if (us == UCS_OK) ucp_mem_unmap(a->ctx, s->memh);
        free(s->slots);
        free(s);
        return us == UCS_ERR_NO_MEMORY ? KVC_ERR_NO_MEMORY : KVC_ERR_TRANSPORT;
    }
    s->base = ma.address;
    if (ucp_rkey_pack(a->ctx, s->memh, &s->rkey, &s->rkey_len) != UCS_OK) s->rkey = NULL;
    if (kvc_cuda_host_register(a->cuda, s->base, slot * nslots) == KVC_OK)
        s->pinned = true;
    else
        KVC_LOG(a, KVC_LOG_WARN, "%zu-byte staging pool not pinned, copies will be slower: %s",
                slot * nslots, kvc_cuda_last_error(a->cuda));
    for (size_t i = 0; i < nslots; i++) {
        s->slots[i].p = s->base + i * slot;
        s->slots[i].a = a;
        s->slots[i].ev_dev = -1;
    }
    a->stage = s;
    KVC_LOG(a, KVC_LOG_INFO, "staging pool bytes=%zu slots=%zu slot_bytes=%zu window=%zu pinned=%d",
            slot * nslots, nslots, slot, s->window, (int)s->pinned);
    return KVC_OK;
}

static void ref_hold(kvc_stage_ref_t *r) {
    r->holds++;
}

static void ref_release(kvc_agent_t *a, kvc_stage_ref_t *r, kvc_status_t st, const char *what) {
    r->holds--;
    if (st != KVC_OK && r->st == KVC_OK) {
        const char *w = what ? what : kvc_status_str(st);
        size_t k = strlen(w) < sizeof(r->msg) - 1 ? strlen(w) : sizeof(r->msg) - 1;
        r->st = st;
        memcpy(r->msg, w, k); /* truncated: the CUDA error's name comes first */
        r->msg[k] = '\0';
    }
    kvc_wake(a);
}

static bool ref_live(const kvc_stage_ref_t *r) {
    return !r->dead && r->st == KVC_OK;
}

static void pend_drop(kvc_agent_t *a, pend_t *p, kvc_status_t st, const char *what) {
    ucp_am_data_release(a->worker, p->data);
    ref_release(a, p->x, st, what);
    pend_put(a->stage, p);
}

void kvc_stage_cleanup(kvc_agent_t *a) {
    kvc_stage_t *s = a->stage;
    if (!s) return;
    /* Receives into slots end before the slots go (the endpoints are
     * closed by now, so they complete as cancelled; bounded). */
    uint64_t until = kvc_now_ns() + 2000000000ull;
    for (bool busy = true; busy && kvc_now_ns() < until;) {
        busy = false;
        for (size_t i = 0; i < s->nslots && !busy; i++)
            busy = s->slots[i].state == S_RECV;
        if (busy) ucp_worker_progress(a->worker);
    }
    /* Copies still queued read or write the slots: they end first. */
    kvc_cuda_drain(a->cuda);
    while (s->pend) {
        pend_t *p = s->pend;
        s->pend = p->next;
        pend_drop(a, p, KVC_ERR_CANCELED, "agent destroyed");
    }
    while (s->jobs) {
        sjob_t *j = s->jobs;
        s->jobs = j->next;
        free(j->runs);
        free(j->pub_id);
        free(j);
    }
    while (s->ctx_spare) {
        sendctx_t *c = s->ctx_spare;
        s->ctx_spare = c->next;
        free(c);
    }
    while (s->pend_spare) {
        pend_t *p = s->pend_spare;
        s->pend_spare = p->next;
        free(p);
    }
    for (int k = 0; k < 2; k++) /* the peers (and their mappings) are gone already */
        while (k ? s->rd_spare : s->rds) {
            rd_t *r = k ? s->rd_spare : s->rds;
            *(k ? &s->rd_spare : &s->rds) = r->next;
            if (r->ev) kvc_cuda_event_destroy(a->cuda, r->ev);
            free(r);
        }
    if (s->rkey) ucp_rkey_buffer_release(s->rkey);
    for (size_t i = 0; i < s->nslots; i++)
        if (s->slots[i].ev) kvc_cuda_event_destroy(a->cuda, s->slots[i].ev);
    if (s->pinned) kvc_cuda_host_unregister(a->cuda, s->base);
    ucp_mem_unmap(a->ctx, s->memh);
    free(s->slots);
    free(s);
    a->stage = NULL;
}

static slot_t *free_slot(kvc_stage_t *s) {
    for (size_t i = 0; i < s->nslots; i++)
        if (s->slots[i].state == S_FREE) return &s->slots[i];
    return NULL;
}

/* ------------------------------------------------------------ producer -- */

static void job_fail(sjob_t *j, kvc_status_t st) {
    if (j->failed) return;
    j->failed = true;
    j->fail_st = st;
}

/* A slot of job j is free again. */
static void slot_release(slot_t *sl) {
    if (sl->job) {
        sl->job->held--;
        sl->job = NULL;
    }
    sl->state = S_FREE;
}

static void send_done(void *req, ucs_status_t us, void *ud) {
    sendctx_t *c = ud;
    kvc_agent_t *a = c->a;
    a->push_inflight--;
    if (us != UCS_OK && us != UCS_ERR_CANCELED)
        KVC_LOG(c->a, KVC_LOG_WARN, "push (staged): send failed: %s", ucs_status_string(us));
    if (c->slot) slot_release(c->slot);
    if (c->job) {
        c->job->inflight--;
        if (us != UCS_OK) job_fail(c->job, KVC_ERR_TRANSPORT);
    }
    kvc_wake(a);
    ctx_put(a, c);
    if (req) ucp_request_free(req);
}

/* One active message `id` of job j (NULL: none): header hdr (hlen bytes,
 * copied), data (or NULL), rendezvous when rndv.  Completion, even at once
 * or failed, goes through send_done, which frees `slot` (when given). */
static void send_am(kvc_agent_t *a, ucp_ep_h ep, sjob_t *j, slot_t *slot, unsigned id,
                    const void *hdr, size_t hlen, const void *data, size_t len, bool rndv) {
    sendctx_t *c = ctx_get(a);
    if (!c) {
        if (slot) slot_release(slot);
        if (j) job_fail(j, KVC_ERR_NO_MEMORY);
        return;
    }
    *c = (sendctx_t){.next = NULL, .a = a, .job = j, .slot = slot};
    memcpy(c->hdr, hdr, hlen);
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = send_done;
    rp.user_data = c;
    rp.flags = rndv ? UCP_AM_SEND_FLAG_RNDV : data ? 0 : UCP_AM_SEND_FLAG_EAGER;
    a->push_inflight++;
    if (j) j->inflight++;
    if (slot) slot->state = S_SEND;
    if (!ep) { /* its consumer's endpoint was closed (consumer.c) */
        send_done(NULL, UCS_ERR_CANCELED, c);
        return;
    }
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, c->hdr, hlen, data, data ? len : 0, &rp);
    if (UCS_PTR_IS_PTR(r)) return;
    send_done(NULL, UCS_PTR_STATUS(r), c);
}

/* One DATA message (or a header alone: data NULL). */
static void send_msg(kvc_agent_t *a, ucp_ep_h ep, sjob_t *j, slot_t *slot,
                     const kvc_wire_data_hdr_t *h, const void *data, size_t len) {
    uint8_t hdr[KVC_WIRE_DATA_HDR_LEN];
    kvc_wire_encode_data_hdr(hdr, h);
    send_am(a, ep, j, slot, KVC_AM_DATA, hdr, sizeof(hdr), data, len,
            data && j && (j->flags & KVC_PULL_RNDV));
}

static ucp_ep_h job_ep(const sjob_t *j) {
    return j->cons ? j->cons->ep : j->ep;
}

static void job_hdr(kvc_agent_t *a, sjob_t *j, uint32_t region, int32_t status, uint64_t count) {
    if (j->gone) return;
    kvc_wire_data_hdr_t h = {j->xid, region, status, 0, count, {0}};
    memcpy(h.token, j->token, KVC_TOKEN_LEN);
    send_msg(a, job_ep(j), NULL, NULL, &h, NULL, 0);
}

/* Its consumer's endpoint failed (consumer.c): the job fails here and
 * sends nothing more; chunks in flight end as their sends are cancelled. */
static void job_check_gone(kvc_agent_t *a, sjob_t *j) {
    if (j->gone || !j->cons || !j->cons->dead) return;
    j->gone = true;
    if (!j->failed) {
        j->failed = true;
        j->fail_st = KVC_ERR_PEER_FAILED;
    }
    KVC_LOG(a, KVC_LOG_WARN, "push (staged) req=%s: consumer gone, job dropped", j->pub_id);
}

void kvc_stage_push(kvc_agent_t *a, kvc_cons_t *cons, ucp_ep_h ep, const kvc_wire_pull_t *pl,
                    kvc_run_t *runs, size_t n) {
    sjob_t *j = calloc(1, sizeof(*j));
    if (j) j->pub_id = kvc_strndup((const char *)pl->request_id.p, pl->request_id.len);
    if (!j || !j->pub_id || !a->stage || (cons && !kvc_cons_ep(cons))) {
        if (j) free(j->pub_id);
        free(j);
        free(runs);
        kvc_wire_data_hdr_t h = {pl->xfer_id, 0, (int32_t)KVC_ERR_NO_MEMORY, 0, 0, {0}};
        memcpy(h.token, pl->xfer_token, KVC_TOKEN_LEN);
        send_msg(a, ep, NULL, NULL, &h, NULL, 0);
        return;
    }
    j->ep = cons ? NULL : ep;
    j->cons = cons;
    if (cons) kvc_cons_ref(cons);
    memcpy(j->pub_token, pl->pub_token, KVC_TOKEN_LEN);
    j->xid = pl->xfer_id;
    memcpy(j->token, pl->xfer_token, KVC_TOKEN_LEN);
    j->flags = pl->flags;
    j->runs = runs;
    j->n = n;
    if ((pl->flags & KVC_PULL_SHM) && a->stage->rkey) {
        /* The consumer may map the pool: offered first, the chunks copied
         * meanwhile wait in their slots for its answer (KVC_SLOT_POOL_*). */
        kvc_stage_t *s = a->stage;
        kvc_wire_pool_t pool = {{j->xid, 0, 0, 0, 0, {0}},
                                (uint64_t)(uintptr_t)s->base,
                                s->slot_bytes * s->nslots,
                                s->slot_bytes};
        memcpy(pool.h.token, j->token, KVC_TOKEN_LEN);
        uint8_t hdr[KVC_WIRE_POOL_LEN];
        kvc_wire_encode_pool(hdr, &pool);
        j->way = J_ASKED;
        send_am(a, job_ep(j), j, NULL, KVC_AM_POOL, hdr, sizeof(hdr), s->rkey, s->rkey_len, false);
    }
    if (a->stage->jobs_tail)
        a->stage->jobs_tail->next = j;
    else
        a->stage->jobs = j;
    a->stage->jobs_tail = j;
    kvc_wake(a);
}

/* The job's publication is still published (not unpublished, expired or
 * released): its blocks still hold its KV.  Checked before a chunk is read
 * from the device and again once it is in the slot, before it is sent: an
 * engine reuses blocks only after the publication is gone, so a chunk that
 * passes the second check was read before any reuse. */
static bool job_live(kvc_agent_t *a, sjob_t *j) {
    kvc_pub_t *p = kvc_pubtab_find(&a->pubs, j->pub_id, strlen(j->pub_id));
    if (p && kvc_mac_equal(p->token, j->pub_token, KVC_TOKEN_LEN)) return true;
    if (!j->failed) {
        j->failed = true;
        j->fail_st = KVC_ERR_DENIED;
        KVC_LOG(a, KVC_LOG_WARN, "push (staged) req=%s: publication gone mid-transfer, refused",
                j->pub_id);
    }
    return false;
}

/* Starts the job's next messages while slots are free.  False when the
 * cursor is at the end. */
static bool job_start(kvc_agent_t *a, sjob_t *j) {
    kvc_stage_t *s = a->stage;
    while (!j->failed && j->ri < j->n && job_live(a, j)) {
        kvc_run_t *run = &j->runs[j->ri];
        kvc_region_t *rg = &a->regions[j->rg];
        uint64_t per = (rg->staged ? s->slot_bytes : a->push_chunk) / rg->block_len;
        if (per == 0) per = 1;
        uint64_t cnt = run->count - j->off < per ? run->count - j->off : per;
        size_t len = cnt * rg->block_len;
        kvc_wire_data_hdr_t h = {j->xid, (uint32_t)j->rg, 0, run->local + j->off, cnt, {0}};
        memcpy(h.token, j->token, KVC_TOKEN_LEN);
        size_t src_off = (run->remote + j->off) * rg->block_len;
        if (rg->staged) {
            slot_t *sl = j->held < s->window ? free_slot(s) : NULL;
            if (!sl) return true;
            kvc_status_t st =
                kvc_cuda_copy_event(a->cuda, rg->cuda_dev, sl->p, (uint8_t *)rg->dev_base + src_off,
                                    len, false, &sl->ev, &sl->ev_dev);
            if (st != KVC_OK) {
                KVC_LOG(a, KVC_LOG_WARN, "push (staged): device->pool copy: %s",
                        kvc_cuda_last_error(a->cuda));
                j->failed = true;
                j->fail_st = st;
                break;
            }
            a->stats[KVC_STAT_CUDA_COPIES]++;
            sl->state = S_D2H;
            sl->job = j;
            j->held++;
            sl->len = len;
            sl->region = (uint32_t)j->rg; /* the DATA header is built at send time */
            sl->local = h.local_start;
            j->inflight++;
        } else {
            send_msg(a, job_ep(j), j, NULL, &h, (const uint8_t *)rg->base + src_off, len);
        }
        j->sent++;
        j->off += cnt;
        if (j->off == run->count) {
            j->off = 0;
            if (++j->rg == a->n_regions) {
                j->rg = 0;
                j->ri++;
            }
        }
    }
    return !j->failed && j->ri < j->n;
}

/* ------------------------------------------------------------ consumer -- */

static void recv_done(void *req, ucs_status_t us, size_t length, void *ud) {
    slot_t *sl = ud;
    (void)length;
    sl->fail = us == UCS_OK             ? KVC_OK
               : us == UCS_ERR_CANCELED ? KVC_ERR_CANCELED
                                        : KVC_ERR_TRANSPORT;
    sl->state = S_RECVD;
    kvc_wake(sl->a);
    if (req) ucp_request_free(req);
}

static void recv_start(kvc_agent_t *a, slot_t *sl, kvc_stage_ref_t *x, void *data, size_t len,
                       int dev, void *dst) {
    *sl = (slot_t){.p = sl->p,
                   .a = a,
                   .ev = sl->ev,
                   .ev_dev = sl->ev_dev,
                   .state = S_RECV,
                   .x = x,
                   .dev = dev,
                   .dst = dst,
                   .len = len};
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = recv_done;
    rp.user_data = sl;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(a->worker, data, sl->p, len, &rp);
    if (UCS_PTR_IS_PTR(r)) return;
    recv_done(NULL, UCS_PTR_STATUS(r), len, sl);
}

ucs_status_t kvc_stage_recv(kvc_agent_t *a, kvc_stage_ref_t *x, size_t region, uint64_t local_start,
                            void *data, size_t len) {
    kvc_stage_t *s = a->stage;
    kvc_region_t *rg = &a->regions[region];
    if (!s || len > s->slot_bytes) {
        char m[160];
        snprintf(m, sizeof(m), "a %zu-byte message does not fit a %zu-byte staging slot", len,
                 s ? s->slot_bytes : 0);
        ref_hold(x);
        ref_release(a, x, KVC_ERR_PROTOCOL, m);
        return UCS_ERR_INVALID_PARAM;
    }
    void *dst = (uint8_t *)rg->dev_base + local_start * rg->block_len;
    ref_hold(x);
    slot_t *sl = s->pend ? NULL : free_slot(s);
    if (sl) {
        recv_start(a, sl, x, data, len, rg->cuda_dev, dst);
        return UCS_INPROGRESS;
    }
    pend_t *p = pend_get(s);
    if (!p) {
        ref_release(a, x, KVC_ERR_NO_MEMORY, "out of memory");
        return UCS_ERR_NO_MEMORY;
    }
    *p = (pend_t){.next = NULL, .x = x, .data = data, .len = len, .dev = rg->cuda_dev, .dst = dst};
    if (s->pend_tail)
        s->pend_tail->next = p;
    else
        s->pend = p;
    s->pend_tail = p;
    return UCS_INPROGRESS; /* the descriptor stays valid until received or released */
}

/* ------------------------------------------------------------ progress -- */

/* Polls a slot's copy.  1: complete, 0: pending, -1: failed (*st). */
static int slot_poll(kvc_agent_t *a, slot_t *sl, kvc_status_t *st) {
    return kvc_cuda_event_poll(a->cuda, sl->ev, st);
}

static void rds_progress(kvc_agent_t *a, bool *pending);

/* Producer: a copied chunk goes its job's way (READY or DATA); a lent or
 * waiting slot comes back when its consumer is gone or silent past the
 * data timeout (the consumer's fetch has failed by then). */
static void slot_step(kvc_agent_t *a, slot_t *sl, uint64_t now) {
    sjob_t *j = sl->job;
    job_check_gone(a, j);
    bool stale = now - sl->lent_ns > (uint64_t)a->xfer_timeout_ms * 1000000ull;
    if (sl->state == S_LENT) {
        if (!j->gone && !stale) return;
        if (stale && !j->gone) {
            KVC_LOG(a, KVC_LOG_WARN, "push (staged) req=%s: slot not handed back in %u ms",
                    j->pub_id, a->xfer_timeout_ms);
            job_fail(j, KVC_ERR_TIMED_OUT);
        }
        j->inflight--;
        slot_release(sl);
        return;
    }
    if (j->way == J_ASKED && !j->failed && !stale) return; /* its consumer has not answered */
    j->inflight--;
    if (j->failed || j->way == J_ASKED || !job_live(a, j)) {
        job_fail(j, KVC_ERR_TIMED_OUT);
        slot_release(sl);
        return;
    }
    kvc_wire_data_hdr_t h = {
        j->xid, sl->region, 0, sl->local, sl->len / a->regions[sl->region].block_len, {0}};
    memcpy(h.token, j->token, KVC_TOKEN_LEN);
    if (j->way == J_WIRE) {
        send_msg(a, job_ep(j), j, sl, &h, sl->p, sl->len);
        return;
    }
    kvc_wire_ready_t rd = {h, (uint64_t)(sl->p - a->stage->base)};
    uint8_t hdr[KVC_WIRE_READY_LEN];
    kvc_wire_encode_ready(hdr, &rd);
    j->inflight++; /* the slot, until the consumer hands it back */
    sl->state = S_LENT;
    sl->lent_ns = now;
    send_am(a, job_ep(j), j, NULL, KVC_AM_READY, hdr, sizeof(hdr), NULL, 0, false);
}

void kvc_stage_progress(kvc_agent_t *a, uint64_t now, uint64_t *next) {
    kvc_stage_t *s = a->stage;
    if (!s) return;
    bool pending = false;
    for (size_t i = 0; i < s->nslots; i++) {
        slot_t *sl = &s->slots[i];
        kvc_status_t st = KVC_OK;
        int r;
        switch (sl->state) {
        case S_RECVD:
            if (sl->fail != KVC_OK || !ref_live(sl->x)) {
                /* The fetch failed meanwhile: its bytes never reach the device. */
                ref_release(a, sl->x, sl->fail != KVC_OK ? sl->fail : KVC_ERR_CANCELED,
                            "staged receive");
                sl->state = S_FREE;
                break;
            }
            st = kvc_cuda_copy_event(a->cuda, sl->dev, sl->dst, sl->p, sl->len, true, &sl->ev,
                                     &sl->ev_dev);
            if (st != KVC_OK) {
                char m[400];
                snprintf(m, sizeof(m), "staging pool->device copy: %s",
                         kvc_cuda_last_error(a->cuda));
                ref_release(a, sl->x, st, m);
                sl->state = S_FREE;
                break;
            }
            a->stats[KVC_STAT_CUDA_COPIES]++;
            sl->state = S_H2D;
            pending = true;
            break;
        case S_H2D:
            r = slot_poll(a, sl, &st);
            if (r == 0) {
                pending = true;
                break;
            }
            if (r < 0) {
                char m[400];
                snprintf(m, sizeof(m), "staging pool->device copy: %s",
                         kvc_cuda_last_error(a->cuda));
                ref_release(a, sl->x, st, m);
            } else {
                ref_release(a, sl->x, KVC_OK, NULL);
            }
            sl->state = S_FREE;
            break;
        case S_D2H: {
            r = slot_poll(a, sl, &st);
            sjob_t *j = sl->job;
            if (r == 0) {
                pending = true;
                break;
            }
            j->inflight--;
            job_check_gone(a, j);
            if (r < 0 || j->failed || !job_live(a, j)) {
                if (r < 0) {
                    KVC_LOG(a, KVC_LOG_WARN, "push (staged): device->pool copy: %s",
                            kvc_cuda_last_error(a->cuda));
                    job_fail(j, st);
                }
                slot_release(sl);
                break;
            }
            j->inflight++; /* the slot's chunk, until it is sent or handed back */
            sl->state = S_STAGED;
            sl->lent_ns = now;
        } /* fall through: sent now unless the job's way is still open */
        /* FALLTHROUGH */
        case S_STAGED:
        case S_LENT:
            slot_step(a, sl, now);
            break;
        default:
            break;
        }
    }
    /* Waiting consumer messages take freed slots first, in arrival order. */
    while (s->pend) {
        pend_t *p = s->pend;
        if (!ref_live(p->x)) {
            s->pend = p->next;
            if (!s->pend) s->pend_tail = NULL;
            pend_drop(a, p, KVC_ERR_CANCELED, "staged receive");
            continue;
        }
        slot_t *sl = free_slot(s);
        if (!sl) break;
        s->pend = p->next;
        if (!s->pend) s->pend_tail = NULL;
        recv_start(a, sl, p->x, p->data, p->len, p->dev, p->dst);
        pend_put(s, p);
    }
    /* Producer jobs, oldest first; a finished one sends its END (or its
     * refusal, after a failure) once nothing of it is in flight. */
    sjob_t **pp = &s->jobs, *prev = NULL;
    while (*pp) {
        sjob_t *j = *pp;
        job_check_gone(a, j);
        if (job_start(a, j)) pending = true;
        if (j->inflight || (!j->failed && j->ri < j->n)) {
            prev = j;
            pp = &j->next;
            continue;
        }
        if (j->failed)
            job_hdr(a, j, 0, (int32_t)j->fail_st, 0);
        else
            job_hdr(a, j, KVC_DATA_END, 0, j->sent);
        *pp = j->next;
        if (s->jobs_tail == j) s->jobs_tail = prev;
        if (j->cons) kvc_cons_unref(j->cons);
        free(j->runs);
        free(j->pub_id);
        free(j);
    }
    rds_progress(a, &pending);
    uint64_t tmo = (uint64_t)a->xfer_timeout_ms * 1000000ull;
    for (size_t i = 0; i < s->nslots; i++) {
        slot_t *sl = &s->slots[i];
        pending |= sl->state == S_D2H || sl->state == S_H2D;
        if ((sl->state == S_STAGED || sl->state == S_LENT) && sl->lent_ns + tmo + 1 < *next)
            *next = sl->lent_ns + tmo + 1; /* reclaimed then, if still out */
    }
    if (pending && now + POLL_NS < *next) *next = now + POLL_NS;
}

/* ------------------------------------------------- producer: SLOT messages -- */

ucs_status_t kvc_stage_slot_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                               const ucp_am_recv_param_t *param) {
    kvc_agent_t *a = arg;
    kvc_wire_slot_t m;
    (void)data;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (a->destroying || !a->stage || len || kvc_wire_parse_slot(header, hlen, &m) != KVC_OK) {
        if (!a->destroying && kvc_log_ratelimit(a, KVC_RL_DATA))
            KVC_LOG(a, KVC_LOG_WARN, "push (staged): malformed slot message, dropped");
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    kvc_stage_t *s = a->stage;
    sjob_t *j = s->jobs;
    while (j && !(j->xid == m.xfer_id && kvc_mac_equal(j->token, m.token, KVC_TOKEN_LEN)))
        j = j->next;
    uint64_t i = m.off / s->slot_bytes;
    if (!j) {
        a->stats[KVC_STAT_DENIED]++; /* not a job of ours, or a wrong token */
    } else if (m.kind == KVC_SLOT_FREE) {
        slot_t *sl = m.off % s->slot_bytes == 0 && i < s->nslots ? &s->slots[i] : NULL;
        if (sl && sl->state == S_LENT && sl->job == j) {
            j->inflight--;
            slot_release(sl);
        }
    } else if (j->way == J_ASKED) { /* POOL_OK or POOL_NO */
        j->way = m.kind == KVC_SLOT_POOL_OK ? J_SHM : J_WIRE;
        KVC_LOG(a, KVC_LOG_DEBUG, "push (staged) req=%s: consumer %s the pool", j->pub_id,
                j->way == J_SHM ? "maps" : "does not map");
    }
    kvc_wake(a);
    return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
}

/* ------------------------------------------ consumer: the mapped pool -- */

void kvc_stage_slot_send(kvc_agent_t *a, ucp_ep_h ep, uint64_t xfer_id,
                         const uint8_t token[KVC_TOKEN_LEN], uint32_t kind, uint64_t off) {
    kvc_wire_slot_t m = {xfer_id, {0}, kind, off};
    memcpy(m.token, token, KVC_TOKEN_LEN);
    uint8_t hdr[KVC_WIRE_SLOT_LEN];
    kvc_wire_encode_slot(hdr, &m);
    /* Lost (no endpoint, out of memory): the producer reclaims the slot at
     * its data timeout. */
    send_am(a, ep, NULL, NULL, KVC_AM_SLOT, hdr, sizeof(hdr), NULL, 0, false);
}

bool kvc_stage_shm_wanted(const kvc_agent_t *a, const kvc_peer_t *p) {
    return a->stage && !a->stage->wire && !(p->spool && p->spool->bad);
}

void kvc_stage_peer_cleanup(kvc_agent_t *a, kvc_peer_t *p) {
    struct kvc_spool *sp = p->spool;
    if (!sp) return;
    if (sp->map) kvc_cuda_drain(a->cuda); /* no copy reads the mapping any more */
    if (sp->pinned) kvc_cuda_host_unregister(a->cuda, sp->map);
    if (sp->rkey) ucp_rkey_destroy(sp->rkey);
    free(sp->blob);
    free(sp);
    p->spool = NULL;
}

/* Maps the offered pool here; false when it cannot be (another host, no
 * shared-memory transport, a bad offer). */
static bool spool_map(kvc_agent_t *a, kvc_peer_t *p, const kvc_wire_pool_t *pl, const void *rkey,
                      size_t rkey_len) {
    struct kvc_spool *sp = p->spool;
    if (sp) /* one pool per producer: the same offer again, or a refusal */
        return !sp->bad && sp->blob_len == rkey_len && !memcmp(sp->blob, rkey, rkey_len);
    if (!(sp = p->spool = calloc(1, sizeof(*sp)))) return false;
    sp->bad = true;
    sp->base = pl->base; /* kvc_wire_parse_pool: a length, not wrapping, a key */
    sp->len = pl->len;
    void *ptr = NULL;
    if (!p->ep || !(sp->blob = malloc(rkey_len))) return false;
    memcpy(sp->blob, rkey, rkey_len);
    sp->blob_len = rkey_len;
    if (ucp_ep_rkey_unpack(p->ep, rkey, &sp->rkey) != UCS_OK) {
        sp->rkey = NULL;
        return false;
    }
    if (ucp_rkey_ptr(sp->rkey, sp->base, &ptr) != UCS_OK || !ptr) return false;
    sp->map = ptr;
    sp->bad = false;
    /* Pinned here too, so that the copies to the device run at DMA speed. */
    sp->pinned = kvc_cuda_host_register(a->cuda, sp->map, sp->len) == KVC_OK;
    if (sp->pinned)
        KVC_LOG(a, KVC_LOG_INFO, "peer %s:%u: staging pool of %llu bytes mapped here, pinned",
                p->host, p->port, (unsigned long long)sp->len);
    else
        KVC_LOG(a, KVC_LOG_WARN,
                "peer %s:%u: staging pool of %llu bytes mapped here but not pinned, copies from "
                "it will be slower: %s",
                p->host, p->port, (unsigned long long)sp->len, kvc_cuda_last_error(a->cuda));
    return true;
}

void kvc_stage_pool_offer(kvc_agent_t *a, kvc_peer_t *p, const kvc_wire_pool_t *pl,
                          const void *rkey, size_t rkey_len) {
    bool ok = a->stage && !a->stage->wire && spool_map(a, p, pl, rkey, rkey_len);
    kvc_stage_slot_send(a, p->ep, pl->h.xfer_id, pl->h.token,
                        ok ? KVC_SLOT_POOL_OK : KVC_SLOT_POOL_NO, 0);
}

kvc_status_t kvc_stage_ready(kvc_agent_t *a, kvc_stage_ref_t *ref, kvc_peer_t *p, uint64_t xfer_id,
                             const uint8_t token[KVC_TOKEN_LEN], size_t region,
                             uint64_t local_start, uint64_t off, size_t len) {
    kvc_stage_t *s = a->stage;
    struct kvc_spool *sp = p->spool;
    if (!s || !sp || sp->bad || off > sp->len || len > sp->len - off) return KVC_ERR_PROTOCOL;
    rd_t *r = s->rd_spare;
    if (r)
        s->rd_spare = r->next;
    else if (!(r = calloc(1, sizeof(*r))))
        return KVC_ERR_NO_MEMORY;
    else
        r->ev_dev = -1;
    kvc_region_t *rg = &a->regions[region];
    r->next = NULL;
    r->x = ref;
    r->peer = p;
    r->xid = xfer_id;
    r->off = off;
    memcpy(r->token, token, KVC_TOKEN_LEN);
    r->dev = rg->cuda_dev;
    r->dst = (uint8_t *)rg->dev_base + local_start * rg->block_len;
    r->len = len;
    r->copying = false;
    rd_t **pp = &s->rds;
    while (*pp)
        pp = &(*pp)->next;
    *pp = r;
    ref_hold(ref);
    ref->lent++;
    kvc_wake(a);
    return KVC_OK;
}

/* Mapped-slot copies: started, polled, and each slot handed back once its
 * copy is complete (or at once for a fetch that failed meanwhile). */
static void rds_progress(kvc_agent_t *a, bool *pending) {
    kvc_stage_t *s = a->stage;
    rd_t **pp = &s->rds;
    while (*pp) {
        rd_t *r = *pp;
        kvc_status_t st = KVC_OK;
        int done = 1;
        char m[400] = "";
        if (!r->copying && ref_live(r->x)) {
            st = kvc_cuda_copy_event(a->cuda, r->dev, r->dst, r->peer->spool->map + r->off, r->len,
                                     true, &r->ev, &r->ev_dev);
            if (st == KVC_OK) {
                a->stats[KVC_STAT_CUDA_COPIES]++;
                r->copying = true;
            }
        } else if (!r->copying) {
            st = KVC_ERR_CANCELED;
            snprintf(m, sizeof(m), "staged chunk");
        }
        if (r->copying) done = kvc_cuda_event_poll(a->cuda, r->ev, &st);
        if (done == 0) {
            *pending = true;
            pp = &r->next;
            continue;
        }
        if (st != KVC_OK && !m[0])
            snprintf(m, sizeof(m), "mapped pool->device copy: %s", kvc_cuda_last_error(a->cuda));
        kvc_stage_slot_send(a, r->peer->ep, r->xid, r->token, KVC_SLOT_FREE, r->off);
        ref_release(a, r->x, st, st == KVC_OK ? NULL : m);
        *pp = r->next;
        r->next = s->rd_spare;
        s->rd_spare = r;
    }
}
