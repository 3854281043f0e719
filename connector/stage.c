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
 *            the slot's event; once the event completes the slot is sent as
 *            one DATA message, and freed when the send completes.  Slots of
 *            one job are in flight together, so copies and sends overlap.
 *  consumer: staged regions are always received as rendezvous, so that a
 *            DATA message can wait (its descriptor kept) until a slot is
 *            free; wire -> slot (ucp_am_recv_data_nbx), then slot -> device
 *            and the slot's event; the fetch holds one reference per chunk
 *            until its copy is complete, so FETCH_DONE means the bytes are on
 *            the device.  A chunk of a fetch that failed meanwhile is dropped
 *            before its copy: nothing lands after FETCH_FAILED.
 *
 * Everything is started from kvc_stage_progress(); UCX callbacks only mark
 * slots and wake the agent.  Events are polled (never a host wait): a
 * progress call comes back every POLL_NS while a copy is pending. */
#include "connector/kvc_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define POLL_NS 50000ull /* 50 us */

typedef enum { S_FREE, S_D2H, S_SEND, S_RECV, S_RECVD, S_H2D } slot_state_t;

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
    kvc_stage_ref_t *x; /* consumer: the fetch, held until the slot's copy is complete */
    int dev;            /* consumer: device of the destination */
    void *dst;          /* consumer: device address of the chunk */
    size_t len;
    kvc_status_t fail; /* consumer: the receive failed */
} slot_t;

/* A producer-side send: header storage that lives until completion. */
typedef struct {
    kvc_agent_t *a;
    sjob_t *job;
    slot_t *slot;
    uint8_t hdr[KVC_WIRE_DATA_HDR_LEN];
} sendctx_t;

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

struct kvc_stage {
    ucp_mem_h memh;
    uint8_t *base;
    bool pinned;
    size_t slot_bytes, nslots;
    slot_t *slots;
    sjob_t *jobs, *jobs_tail;
    pend_t *pend, *pend_tail;
};

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
    KVC_LOG(a, KVC_LOG_INFO, "staging pool bytes=%zu slots=%zu slot_bytes=%zu pinned=%d",
            slot * nslots, nslots, slot, (int)s->pinned);
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
    free(p);
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

static void send_done(void *req, ucs_status_t us, void *ud) {
    sendctx_t *c = ud;
    c->a->push_inflight--;
    if (us != UCS_OK && us != UCS_ERR_CANCELED)
        KVC_LOG(c->a, KVC_LOG_WARN, "push (staged): send failed: %s", ucs_status_string(us));
    if (c->slot) c->slot->state = S_FREE;
    if (c->job) {
        c->job->inflight--;
        if (us != UCS_OK && !c->job->failed) {
            c->job->failed = true;
            c->job->fail_st = KVC_ERR_TRANSPORT;
        }
    }
    kvc_wake(c->a);
    free(c);
    if (req) ucp_request_free(req);
}

/* One DATA message (or a header alone: data NULL).  Completion, even at
 * once or failed, goes through send_done. */
static void send_msg(kvc_agent_t *a, ucp_ep_h ep, sjob_t *j, slot_t *slot,
                     const kvc_wire_data_hdr_t *h, const void *data, size_t len) {
    sendctx_t *c = calloc(1, sizeof(*c));
    if (!c) {
        if (slot) slot->state = S_FREE;
        if (j && !j->failed) {
            j->failed = true;
            j->fail_st = KVC_ERR_NO_MEMORY;
        }
        return;
    }
    *c = (sendctx_t){.a = a, .job = j, .slot = slot};
    kvc_wire_encode_data_hdr(c->hdr, h);
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = send_done;
    rp.user_data = c;
    if (data && j && (j->flags & KVC_PULL_RNDV)) {
        rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        rp.flags = UCP_AM_SEND_FLAG_RNDV;
    }
    a->push_inflight++;
    if (j) j->inflight++;
    if (slot) slot->state = S_SEND;
    if (!ep) { /* its consumer's endpoint was closed (consumer.c) */
        send_done(NULL, UCS_ERR_CANCELED, c);
        return;
    }
    ucs_status_ptr_t r =
        ucp_am_send_nbx(ep, KVC_AM_DATA, c->hdr, KVC_WIRE_DATA_HDR_LEN, data, data ? len : 0, &rp);
    if (UCS_PTR_IS_PTR(r)) return;
    send_done(NULL, UCS_PTR_STATUS(r), c);
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
            slot_t *sl = free_slot(s);
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
    pend_t *p = calloc(1, sizeof(*p));
    if (!p) {
        ref_release(a, x, KVC_ERR_NO_MEMORY, "out of memory");
        return UCS_ERR_NO_MEMORY;
    }
    *p = (pend_t){.x = x, .data = data, .len = len, .dev = rg->cuda_dev, .dst = dst};
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
                    if (!j->failed) {
                        j->failed = true;
                        j->fail_st = st;
                    }
                }
                sl->state = S_FREE;
                break;
            }
            kvc_wire_data_hdr_t h = {
                j->xid, sl->region, 0, sl->local, sl->len / a->regions[sl->region].block_len, {0}};
            memcpy(h.token, j->token, KVC_TOKEN_LEN);
            send_msg(a, job_ep(j), j, sl, &h, sl->p, sl->len);
            break;
        }
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
        free(p);
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
    for (size_t i = 0; i < s->nslots && !pending; i++)
        pending = s->slots[i].state == S_D2H || s->slots[i].state == S_H2D;
    if (pending && now + POLL_NS < *next) *next = now + POLL_NS;
}
