/* SPDX-License-Identifier: Apache-2.0 */
/* Fetches: the consumer side of a transfer (the producer's push is push.c).
 *
 * A fetch goes WAIT_PEER -> [CONFIRM] -> DATA -> [FLUSH -> CHECK] -> NOTIFY
 * -> done, one step per progress call, never from inside a UCX callback:
 * callbacks only count completions and record errors; kvc_xfers_advance()
 * moves the state.
 *
 * DATA uses one of two protocols, chosen per peer (peer.c: choose_proto):
 *  GET:  one ucp_get_nbx per (coalesced run, region), a memcpy through
 *        the mapping of a shared-memory pool, or device-to-device copies
 *        from the producer's CUDA memory mapped here (CUDA IPC, ipc.c;
 *        whole blocks only, polled events).  One-sided, so bracketed by
 *        the producer's word: a HOLD pull (CONFIRM) must be answered with an
 *        END before the first byte is read — the publication is live, the
 *        token right, the blocks its own, and they are held for this fetch —
 *        and an UNHOLD pull after the last byte landed (CHECK) must be
 *        answered with an END too: the hold was intact for the whole read.
 *        A refusal at either point fails the fetch (DENIED).
 *  PUSH: one PULL active message listing the runs, naming the publication
 *        (remote_request_id + its token) and carrying a random transfer
 *        token; the producer checks that every run is part of that
 *        publication and answers with one DATA active message per
 *        (run, region) whose header names the local destination and echoes
 *        the transfer token, then an END saying how many it sent; large ones
 *        arrive as rendezvous and are received straight into the local
 *        region (push.c serves it).  This is the fast path over UCX's tcp transport, whose get
 *        is emulated by the target.
 *
 * Checked transfers: the consumer keeps one bit per (region, block) of the
 * fetch.  DATA with another token is dropped; DATA outside the requested
 * blocks, or for a block already received, fails the fetch before a byte is
 * written; an END after which blocks are still missing fails it too (short
 * transfer).  Completion is every bit set, never a byte count.
 *
 * A failed fetch reports FETCH_FAILED only once every UCX request of it that
 * writes local blocks (gets, receives, staged chunks) has completed or been
 * cancelled: nothing lands in local blocks after the event.  Requests that
 * do not end within FAIL_GRACE_NS are cancelled by closing the peer's
 * endpoint; a send that does not end even then (no peer-failure handling)
 * no longer holds the event back.
 *
 * A fetch struct lives until its event is queued AND every UCX request that
 * points to it has completed (outstanding == 0). */
#include "connector/kvc_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { X_WAIT_PEER, X_CONFIRM, X_DATA, X_FLUSH, X_CHECK, X_NOTIFY, X_DONE } xstate_t;

#define FAIL_GRACE_NS 2000000000ull

struct kvc_xfer {
    kvc_xfer_t *next;
    kvc_agent_t *a;
    uint64_t id, user_data;
    kvc_peer_t *peer;         /* referenced */
    char *req_id;             /* owned */
    uint64_t *remote, *local; /* owned; n pairs (the tail of the remote list) */
    size_t n;
    kvc_run_t *runs; /* owned */
    size_t nruns;
    kvc_proto_t proto;
    bool direct;             /* GET through the shared-memory mapping */
    bool ipc;                /* GET as CUDA IPC copies (ipc.c) */
    kvc_ipc_job_t ipcj;      /* their events */
    size_t cur_run, cur_reg; /* direct copy cursor */
    xstate_t state;
    bool finished;     /* outcome decided (no more data taken) */
    bool fail_pending; /* FETCH_FAILED waits for outstanding == 0 */
    bool fail_aborted; /* the peer was aborted to cancel what is in flight */
    uint64_t fail_deadline_ns;
    kvc_status_t fail_status;
    char fail_msg[256];
    bool word;       /* CONFIRM/CHECK: the producer answered with an END */
    int outstanding; /* UCX requests whose user_data is this fetch */
    int writing;     /* those of them that write local blocks (gets, receives) */
    void **reqs;     /* owned array: those requests, for kvc_fetch_cancel */
    size_t nreqs, reqs_cap;
    bool op_failed;
    kvc_status_t op_status;
    char op_msg[256];
    uint64_t bytes_expected, bytes_got;
    uint64_t deadline_ns;
    kvc_buf_t pull, notify;            /* must outlive their sends */
    uint8_t pub_token[KVC_TOKEN_LEN];  /* the publication's, from kv_transfer_params */
    uint8_t xfer_token[KVC_TOKEN_LEN]; /* random, echoed in every DATA */
    kvc_run_t *byloc;                  /* owned: runs sorted by local start; .remote
                                          holds the run's first bit index */
    uint8_t *bits;                     /* owned: n * n_regions bits, set as DATA lands */
    uint64_t bits_set, chunks_got, end_chunks;
    bool end_seen;
    bool await_end;       /* notify only, registered: the producer's END before the notify */
    uint32_t wait_ms;     /* KVC_FETCH_FIELD_WAIT: the producer may hold the pull this long */
    uint32_t rparts, rpart, lparts, lpart; /* KVC_FETCH_FIELD_SLICE (1, 0, 1, 0: whole) */
    bool renew;           /* kvc_lease_renew: one RENEW pull, no event */
    bool tail;            /* remote ids are KVC_RUN_TAIL positions (push mode) */
    void *cuda_stream;    /* borrowed: the engine's stream that waits for the staging copies */
    bool has_stream;      /* cuda_stream was given: 0 is the legacy default stream */
    kvc_stage_ref_t sref; /* staged chunks in flight (stage.c) */
};

static kvc_status_t ucs_to_kvc(ucs_status_t us) {
    switch (us) {
    case UCS_OK:
        return KVC_OK;
    case UCS_ERR_CANCELED:
        return KVC_ERR_CANCELED;
    case UCS_ERR_NO_MEMORY:
        return KVC_ERR_NO_MEMORY;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
        return KVC_ERR_PEER_FAILED;
    case UCS_ERR_TIMED_OUT:
        return KVC_ERR_TIMED_OUT;
    default:
        return KVC_ERR_TRANSPORT;
    }
}

static void op_error(kvc_xfer_t *x, kvc_status_t st, const char *what, const char *detail) {
    if (x->op_failed) return;
    x->op_failed = true;
    x->sref.dead = true;
    x->op_status = st;
    snprintf(x->op_msg, sizeof(x->op_msg), "%s: %s", what, detail);
}

static void req_forget(kvc_xfer_t *x, void *req) {
    for (size_t i = 0; i < x->nreqs; i++)
        if (x->reqs[i] == req) {
            x->reqs[i] = x->reqs[--x->nreqs];
            return;
        }
}

static void op_done(kvc_xfer_t *x, void *req, ucs_status_t us, const char *what) {
    req_forget(x, req);
    x->outstanding--;
    if (us != UCS_OK) op_error(x, ucs_to_kvc(us), what, ucs_status_string(us));
    kvc_wake(x->a);
}

static void get_cb(void *req, ucs_status_t us, void *ud) {
    ((kvc_xfer_t *)ud)->writing--;
    op_done(ud, req, us, "get");
    ucp_request_free(req);
}

static void flush_cb(void *req, ucs_status_t us, void *ud) {
    op_done(ud, req, us, "flush");
    ucp_request_free(req);
}

static void send_cb(void *req, ucs_status_t us, void *ud) {
    op_done(ud, req, us, "send");
    ucp_request_free(req);
}

static void recv_cb(void *req, ucs_status_t us, size_t length, void *ud) {
    kvc_xfer_t *x = ud;
    if (us == UCS_OK) x->bytes_got += length;
    x->writing--;
    op_done(x, req, us, "receive");
    ucp_request_free(req);
}

/* Tracks one request returned by a UCX call; false if it failed at once. */
static bool track(kvc_xfer_t *x, ucs_status_ptr_t r, const char *what) {
    if (r == NULL) return true;
    if (UCS_PTR_IS_ERR(r)) {
        ucs_status_t us = UCS_PTR_STATUS(r);
        op_error(x, ucs_to_kvc(us), what, ucs_status_string(us));
        return false;
    }
    x->outstanding++;
    if (!strcmp(what, "get") || !strcmp(what, "receive")) x->writing++;
    if (x->nreqs == x->reqs_cap) { /* untracked when out of memory: cancel then
                                      falls back to closing the endpoint */
        size_t cap = x->reqs_cap ? x->reqs_cap * 2 : 8;
        void **q = realloc(x->reqs, cap * sizeof(*q));
        if (!q) return true;
        x->reqs = q;
        x->reqs_cap = cap;
    }
    x->reqs[x->nreqs++] = r;
    return true;
}

static void emit_failed(kvc_agent_t *a, kvc_xfer_t *x, kvc_status_t st, const char *msg) {
    x->fail_pending = false;
    a->stats[KVC_STAT_FETCH_FAILED]++;
    KVC_LOG(a, KVC_LOG_WARN, "fetch %llu req=%s failed: %s (%s)", (unsigned long long)x->id,
            x->req_id, msg, kvc_status_str(st));
    kvc_event_push(a, KVC_EV_FETCH_FAILED, st, x->id, x->user_data, x->req_id, x->local, x->n, 0,
                   msg);
}

static void xfer_finish(kvc_agent_t *a, kvc_xfer_t *x, kvc_status_t st, const char *msg) {
    if (x->finished) return;
    if (x->renew) { /* fire and forget: logged, no event */
        if (st != KVC_OK)
            KVC_LOG(a, KVC_LOG_WARN, "lease renewal for req=%s not sent: %s (%s)", x->req_id,
                    msg ? msg : "", kvc_status_str(st));
        x->finished = true;
        x->state = X_DONE;
        return;
    }
    /* No staging copy may land after FETCH_FAILED: wait for all of them. */
    if (st != KVC_OK) kvc_cuda_drain(a->cuda);
    x->finished = true;
    x->sref.dead = true;
    x->state = X_DONE;
    if (st != KVC_OK && x->outstanding > 0) {
        /* Receives or gets in flight may still write local blocks: the
         * event waits for them (kvc_xfers_advance). */
        x->fail_pending = true;
        x->fail_status = st;
        snprintf(x->fail_msg, sizeof(x->fail_msg), "%s", msg);
        x->fail_deadline_ns = kvc_now_ns() + FAIL_GRACE_NS;
        kvc_wake(a);
        return;
    }
    if (st == KVC_OK) {
        a->stats[KVC_STAT_FETCH_DONE]++;
        a->stats[KVC_STAT_BYTES_FETCHED] += x->bytes_expected;
        if (x->ipc) a->stats[KVC_STAT_BYTES_IPC] += x->bytes_expected;
        /* Staged fetches say which way their chunks came. */
        const char *path = x->ipc                      ? "ipc"
                           : x->proto == KVC_PROTO_GET ? (x->direct ? "get-mapped" : "get")
                           : !a->n_staged || !x->n     ? "push"
                           : x->sref.lent              ? "staged-shm"
                                                       : "staged-wire";
        if (!x->ipc && a->n_staged && x->n)
            a->stats[x->sref.lent ? KVC_STAT_FETCH_STAGED_SHM : KVC_STAT_FETCH_STAGED_WIRE]++;
        KVC_LOG(a, KVC_LOG_DEBUG, "fetch %llu req=%s done blocks=%zu bytes=%llu path=%s",
                (unsigned long long)x->id, x->req_id, x->n, (unsigned long long)x->bytes_expected,
                path);
        kvc_event_push(a, KVC_EV_FETCH_DONE, KVC_OK, x->id, x->user_data, x->req_id, x->local, x->n,
                       x->bytes_expected, NULL);
    } else {
        emit_failed(a, x, st, msg);
    }
}

static void xfer_free(kvc_xfer_t *x) {
    kvc_ipc_job_cleanup(x->a, &x->ipcj);
    free(x->req_id);
    free(x->remote);
    free(x->local);
    free(x->runs);
    free(x->byloc);
    free(x->bits);
    free(x->reqs);
    kvc_buf_cleanup(&x->pull);
    kvc_buf_cleanup(&x->notify);
    free(x);
}

/* ------------------------------------------------------------- consumer -- */

static void start_notify(kvc_agent_t *a, kvc_xfer_t *x) {
    /* Staged regions: every chunk's pool -> device copy completed before
     * its hold was released (stage.c), so the bytes are on the device. */
    kvc_wire_encode_notify(&x->notify, x->pub_token, x->req_id, a->tp_size);
    if (x->notify.failed) {
        xfer_finish(a, x, KVC_ERR_NO_MEMORY, "out of memory");
        return;
    }
    x->state = X_NOTIFY;
    void *r = NULL;
    kvc_status_t st = kvc_notify_send(a, x->peer->ep, &x->notify, send_cb, x, &r);
    if (st != KVC_OK || !track(x, r, "notify")) {
        if (!x->op_failed) op_error(x, st, "notify", "send failed");
    }
}

static int cmp_local(const void *p, const void *q) {
    const kvc_run_t *x = p, *y = q;
    return x->local < y->local ? -1 : x->local > y->local;
}

/* The per-fetch map of what may arrive: runs by local start, one bit per
 * (region, fetched block). */
static kvc_status_t build_checks(kvc_agent_t *a, kvc_xfer_t *x) {
    size_t nbits = x->n * a->n_regions;
    x->byloc = malloc(x->nruns * sizeof(*x->byloc));
    x->bits = calloc((nbits + 7) / 8, 1);
    if (!x->byloc || !x->bits) return KVC_ERR_NO_MEMORY;
    uint64_t pos = 0;
    for (size_t i = 0; i < x->nruns; i++) {
        x->byloc[i] = x->runs[i];
        x->byloc[i].remote = pos; /* first fetch position of the run */
        pos += x->runs[i].count;
    }
    qsort(x->byloc, x->nruns, sizeof(*x->byloc), cmp_local);
    return KVC_OK;
}

/* Fetch position of local blocks [start, start+count) if they lie in one
 * requested run, else UINT64_MAX. */
static uint64_t run_pos(const kvc_xfer_t *x, uint64_t start, uint64_t count) {
    size_t lo = 0, hi = x->nruns;
    while (lo < hi) { /* last run with local <= start */
        size_t mid = lo + (hi - lo) / 2;
        if (x->byloc[mid].local <= start)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0) return UINT64_MAX;
    const kvc_run_t *r = &x->byloc[lo - 1];
    if (start - r->local >= r->count || count > r->count - (start - r->local)) return UINT64_MAX;
    return r->remote + (start - r->local);
}

/* Into local parts, a run's blocks are not contiguous locally: one run per
 * block, so that a producer (which only knows its own parts) sends every
 * block as a message of its own, and a one-sided read reads it alone. */
static kvc_status_t split_runs(kvc_xfer_t *x) {
    if (x->nruns == x->n) return KVC_OK;
    kvc_run_t *v = malloc(x->n * sizeof(*v));
    if (!v) return KVC_ERR_NO_MEMORY;
    for (size_t i = 0; i < x->n; i++)
        v[i] = (kvc_run_t){.remote = x->remote[i], .local = x->local[i], .count = 1};
    free(x->runs);
    x->runs = v;
    x->nruns = x->n;
    return KVC_OK;
}

/* Sends this fetch's PULL with `flags` (x->pull must not be in flight). */
static void send_pull(kvc_agent_t *a, kvc_xfer_t *x, uint16_t flags) {
    kvc_wire_pull_t pl = {.xfer_id = x->id,
                          .flags = flags,
                          .tp = a->tp_size,
                          .request_id = {(const uint8_t *)x->req_id, strlen(x->req_id)},
                          .runs = x->runs,
                          .n = x->nruns,
                          .parts = x->rparts,
                          .part = x->rpart};
    /* Registration before publication applies to the first pull only. */
    if (x->wait_ms && !(flags & (KVC_PULL_UNHOLD | KVC_PULL_RENEW))) {
        pl.flags |= KVC_PULL_WAIT;
        pl.wait_ms = x->wait_ms;
    }
    if ((pl.flags & KVC_PULL_WAIT) || x->rparts > 1) pl.flags |= KVC_PULL_EXT;
    if (x->peer->owner) { /* answered on the producer's own endpoint to us */
        pl.flags |= KVC_PULL_CONS;
        pl.cons_key = a->nonce;
    }
    memcpy(pl.xfer_token, x->xfer_token, KVC_TOKEN_LEN);
    memcpy(pl.pub_token, x->pub_token, KVC_TOKEN_LEN);
    kvc_buf_cleanup(&x->pull);
    kvc_wire_encode_pull(&x->pull, &pl);
    if (x->pull.failed) {
        xfer_finish(a, x, KVC_ERR_NO_MEMORY, "out of memory");
        return;
    }
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.user_data = x;
    rp.cb.send = send_cb;
    rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    x->word = false;
    track(x, ucp_am_send_nbx(x->peer->ep, KVC_AM_PULL, NULL, 0, x->pull.p, x->pull.len, &rp),
          "pull");
}

static void start_data(kvc_agent_t *a, kvc_xfer_t *x, uint64_t now) {
    kvc_peer_t *p = x->peer;
    if (x->renew) {
        x->state = X_NOTIFY; /* done once the RENEW is sent */
        send_pull(a, x, KVC_PULL_RENEW);
        return;
    }
    /* Part sizes must match per region: whole blocks of one length, or the
     * heterogeneous-TP parts (KVC_FETCH_FIELD_SLICE). */
    for (size_t r = 0; r < a->n_regions; r++) {
        uint64_t rbl = p->rr[r].block_len, lbl = a->regions[r].block_len, part;
        if (kvc_slice_len(rbl, x->rparts, lbl, x->lparts, &part) != KVC_OK) {
            char m[240];
            snprintf(m, sizeof(m),
                     "block geometry mismatch in region %zu: remote %s block_len %llu / %u parts "
                     "!= local block_len %llu / %u parts",
                     r, p->engine_id, (unsigned long long)rbl, x->rparts, (unsigned long long)lbl,
                     x->lparts);
            xfer_finish(a, x, KVC_ERR_INCOMPATIBLE, m);
            return;
        }
        if (x->lparts > 1 && a->regions[r].staged) {
            xfer_finish(a, x, KVC_ERR_UNSUPPORTED, "partial-block reads into staged CUDA regions");
            return;
        }
    }
    for (size_t i = 0; i < x->n && !x->tail; i++) {
        if (x->remote[i] >= p->num_blocks) {
            char m[200];
            snprintf(m, sizeof(m), "remote block id %llu out of range: engine %s has %llu blocks",
                     (unsigned long long)x->remote[i], p->engine_id,
                     (unsigned long long)p->num_blocks);
            xfer_finish(a, x, KVC_ERR_INVALID_PARAM, m);
            return;
        }
    }
    if (kvc_coalesce(x->remote, x->local, x->n, &x->runs, &x->nruns) != KVC_OK ||
        (x->lparts > 1 && split_runs(x) != KVC_OK)) {
        xfer_finish(a, x, KVC_ERR_NO_MEMORY, "out of memory");
        return;
    }
    /* Positions are resolved by the producer when it sends: no one-sided read. */
    x->proto = x->tail ? KVC_PROTO_PUSH : p->proto;
    /* CUDA IPC copies whole blocks; parts of blocks go by push. */
    x->ipc = x->proto == KVC_PROTO_GET && p->ipc && x->lparts == 1 && x->rparts == 1;
    if (p->ipc && !x->ipc) x->proto = KVC_PROTO_PUSH;
    x->deadline_ns = now + ((uint64_t)a->xfer_timeout_ms + x->wait_ms) * 1000000ull;
    size_t per_block = 0;
    for (size_t r = 0; r < a->n_regions; r++)
        per_block += a->regions[r].block_len / x->lparts;
    x->bytes_expected = (uint64_t)x->n * per_block;
    x->state = X_DATA;
    if (x->n == 0) { /* notify only */
        /* Registered before the publication: a PULL of no blocks, held by
         * the producer until kvc_publish and answered by an END; the
         * notification follows it (else it would be refused unpublished). */
        if (x->wait_ms) {
            x->await_end = true;
            send_pull(a, x, 0);
        }
        return;
    }
    if (build_checks(a, x) != KVC_OK) {
        xfer_finish(a, x, KVC_ERR_NO_MEMORY, "out of memory");
        return;
    }
    if (x->proto == KVC_PROTO_GET) {
        /* Not a byte is read before the producer holds the blocks for us. */
        x->state = X_CONFIRM;
        send_pull(a, x, KVC_PULL_HOLD);
        return;
    }
    /* Device memory cannot take an eager copy in the handler: ask for
     * rendezvous only, which UCX receives straight into device memory, or
     * (staged) into a pool slot when one is free (stage.c). */
    uint16_t flags = 0;
    for (size_t r = 0; r < a->n_regions; r++)
        if (a->regions[r].mem_type == KVC_MEM_CUDA) flags |= KVC_PULL_RNDV;
    if (a->n_staged && kvc_stage_shm_wanted(a, p)) flags |= KVC_PULL_SHM;
    send_pull(a, x, flags);
}

/* GET, once the producer confirmed: the one-sided reads. */
static void start_reads(kvc_agent_t *a, kvc_xfer_t *x) {
    kvc_peer_t *p = x->peer;
    x->state = X_DATA;
    if (x->ipc) {
        kvc_status_t st = kvc_ipc_copy(a, p, x->runs, x->nruns, &x->ipcj);
        if (st != KVC_OK) op_error(x, st, "CUDA IPC copy", kvc_cuda_last_error(a->cuda));
        return;
    }
    bool local_host = true;
    for (size_t r = 0; r < a->n_regions; r++)
        local_host &= a->regions[r].mem_type == KVC_MEM_HOST;
    if (p->shm && local_host) {
        x->direct = true; /* copied in slices by advance() */
        return;
    }
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.user_data = x;
    rp.cb.send = get_cb;
    for (size_t i = 0; i < x->nruns; i++) {
        const kvc_run_t *run = &x->runs[i];
        for (size_t r = 0; r < a->n_regions; r++) {
            size_t bl = a->regions[r].block_len, rbl = p->rr[r].block_len;
            if (x->lparts == 1 && x->rparts == 1) {
                uint8_t *dst = (uint8_t *)a->regions[r].base + run->local * bl;
                uint64_t src = p->rr[r].base + run->remote * bl;
                if (!track(x, ucp_get_nbx(p->ep, dst, run->count * bl, src, p->rr[r].rkey, &rp),
                           "get"))
                    return;
                continue;
            }
            size_t part = bl / x->lparts; /* one get per block: parts are strided */
            for (uint64_t b = 0; b < run->count; b++) {
                uint8_t *dst =
                    (uint8_t *)a->regions[r].base + (run->local + b) * bl + x->lpart * part;
                uint64_t src = p->rr[r].base + (run->remote + b) * rbl + x->rpart * part;
                if (!track(x, ucp_get_nbx(p->ep, dst, part, src, p->rr[r].rkey, &rp), "get"))
                    return;
            }
        }
    }
}

/* GET, after the last byte landed: was the hold intact all along? */
static void start_check(kvc_agent_t *a, kvc_xfer_t *x) {
    x->state = X_CHECK;
    send_pull(a, x, KVC_PULL_UNHOLD);
}

/* One-sided read through UCX's mapping of the producer's pool (ucp_rkey_ptr):
 * the same memcpy UCX's shared-memory get does, without needing an sm lane
 * (peer-failure handling keeps the endpoint on tcp).  Sliced so that a huge
 * fetch does not hold the caller's loop for long; true when all copied. */
#define DIRECT_SLICE (64u << 20)
static bool direct_copy(kvc_agent_t *a, kvc_xfer_t *x) {
    size_t budget = DIRECT_SLICE;
    while (x->cur_run < x->nruns) {
        const kvc_run_t *run = &x->runs[x->cur_run];
        size_t bl = a->regions[x->cur_reg].block_len;
        size_t rbl = x->peer->rr[x->cur_reg].block_len, part = bl / x->lparts;
        if (x->lparts == 1 && x->rparts == 1)
            memcpy((uint8_t *)a->regions[x->cur_reg].base + run->local * bl,
                   x->peer->rr[x->cur_reg].mapped + run->remote * bl, run->count * bl);
        else
            for (uint64_t b = 0; b < run->count; b++)
                memcpy((uint8_t *)a->regions[x->cur_reg].base + (run->local + b) * bl +
                           x->lpart * part,
                       x->peer->rr[x->cur_reg].mapped + (run->remote + b) * rbl + x->rpart * part,
                       part);
        x->bytes_got += run->count * part;
        if (++x->cur_reg == a->n_regions) {
            x->cur_reg = 0;
            x->cur_run++;
        }
        if (run->count * part >= budget) break;
        budget -= run->count * part;
    }
    if (x->cur_run < x->nruns) {
        kvc_wake(a);
        return false;
    }
    return true;
}

/* True (fetch failed) when the data phase ran past its deadline; else the
 * deadline feeds the timer. */
static bool stalled(kvc_agent_t *a, kvc_xfer_t *x, uint64_t now, uint64_t *next) {
    if (now < x->deadline_ns) {
        if (x->deadline_ns < *next) *next = x->deadline_ns;
        return false;
    }
    char m[160];
    snprintf(m, sizeof(m), "data not complete after %u ms (%llu of %llu bytes)", a->xfer_timeout_ms,
             (unsigned long long)x->bytes_got, (unsigned long long)x->bytes_expected);
    /* A peer that stalls a fetch this long is treated as broken: closing its
     * endpoint cancels what is still in flight, so nothing lands in local
     * blocks after the failure event. */
    kvc_peer_abort(a, x->peer, KVC_ERR_TIMED_OUT, m);
    xfer_finish(a, x, KVC_ERR_TIMED_OUT, m);
    return true;
}

static void advance(kvc_agent_t *a, kvc_xfer_t *x, uint64_t now, uint64_t *next) {
    kvc_status_t pst;
    const char *pmsg;
    /* A dead peer fails its fetches here, in every state (peer.c only marks
     * it: it may die inside a UCX callback). */
    if (kvc_peer_dead(x->peer, &pst, &pmsg)) {
        xfer_finish(a, x, pst, pmsg);
        return;
    }
    if (x->state == X_WAIT_PEER) {
        if (!kvc_peer_ready(x->peer)) return;
        /* Host->device copies of earlier fetches, ordered on the engine's
         * stream, may still read the mirror: new data lands there only after
         * they ran (polled, never a host wait). */
        kvc_status_t cst;
        if (a->n_staged && !kvc_cuda_idle(a->cuda, &cst)) {
            if (cst != KVC_OK) {
                char m[400];
                snprintf(m, sizeof(m), "staging copies of an earlier fetch failed: %s",
                         kvc_cuda_last_error(a->cuda));
                xfer_finish(a, x, cst, m);
                return;
            }
            uint64_t poll = now + 100000; /* 0.1 ms */
            if (poll < *next) *next = poll;
            return;
        }
        start_data(a, x, now);
        if (x->finished) return;
    }
    if (x->sref.st != KVC_OK) op_error(x, x->sref.st, "staged chunk", x->sref.msg);
    if (x->op_failed) {
        xfer_finish(a, x, x->op_status, x->op_msg);
        return;
    }
    if (x->state == X_CONFIRM || x->state == X_CHECK) {
        if (!x->word || x->outstanding) { /* the producer's END, and our PULL sent */
            stalled(a, x, now, next);
            return;
        }
        if (x->state == X_CONFIRM) {
            start_reads(a, x);
            if (x->op_failed) xfer_finish(a, x, x->op_status, x->op_msg);
            if (x->finished || !x->direct) return;
        } else {
            start_notify(a, x);
            return;
        }
    }
    if (x->state == X_DATA && x->direct) {
        if (direct_copy(a, x)) start_check(a, x);
        return;
    }
    if (x->state == X_DATA && x->ipc) {
        /* The UNHOLD only once every copy completed: its END then covers
         * the whole read. */
        kvc_status_t cst = KVC_OK;
        int q = kvc_ipc_poll(a, &x->ipcj, &cst);
        if (q < 0) {
            char m[400];
            snprintf(m, sizeof(m), "CUDA IPC copy: %s", kvc_cuda_last_error(a->cuda));
            xfer_finish(a, x, cst, m);
        } else if (q == 0) {
            if (!stalled(a, x, now, next) && now + 50000 < *next) *next = now + 50000;
        } else {
            x->bytes_got = x->bytes_expected;
            start_check(a, x);
        }
        return;
    }
    if (x->state == X_DATA) {
        bool landed = x->outstanding == 0 && x->sref.holds == 0 &&
                      (x->proto == KVC_PROTO_GET || x->n == 0 ||
                       x->bits_set == (uint64_t)x->n * a->n_regions) &&
                      (!x->await_end || x->end_seen);
        if (!landed && x->outstanding == 0 && x->sref.holds == 0 && x->end_seen &&
            x->chunks_got >= x->end_chunks) {
            char m[200];
            snprintf(m, sizeof(m),
                     "short transfer: the producer ended after %llu messages with %llu of %llu "
                     "blocks sent",
                     (unsigned long long)x->chunks_got, (unsigned long long)x->bits_set,
                     (unsigned long long)x->n * a->n_regions);
            xfer_finish(a, x, KVC_ERR_PROTOCOL, m);
            return;
        }
        if (!landed) {
            stalled(a, x, now, next);
            return;
        }
        if (x->proto == KVC_PROTO_GET && x->n) {
            ucp_request_param_t rp;
            memset(&rp, 0, sizeof(rp));
            rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
            rp.cb.send = flush_cb;
            rp.user_data = x;
            x->state = X_FLUSH;
            if (!track(x, ucp_ep_flush_nbx(x->peer->ep, &rp), "flush")) return;
        } else {
            start_notify(a, x);
            return;
        }
    }
    if (x->state == X_FLUSH && x->outstanding == 0) {
        start_check(a, x);
        return;
    }
    if (x->state == X_NOTIFY && x->outstanding == 0) xfer_finish(a, x, KVC_OK, NULL);
}

void kvc_xfers_advance(kvc_agent_t *a, uint64_t now, uint64_t *next) {
    kvc_xfer_t **pp = &a->xfers;
    while (*pp) {
        kvc_xfer_t *x = *pp;
        if (!x->finished) advance(a, x, now, next);
        /* Only gets, receives and staged chunks write local blocks.  A send
         * (the PULL) to a peer that died may never end: without peer-failure
         * handling (UCX_TLS=sm,self) even the forced close leaves it
         * pending, and the event must not wait for it. */
        if (x->fail_pending && x->writing == 0 && x->sref.holds == 0)
            emit_failed(a, x, x->fail_status, x->fail_msg);
        if (x->fail_pending && !x->fail_aborted) {
            if (now >= x->fail_deadline_ns) {
                /* Closing the endpoint cancels what is still in flight. */
                x->fail_aborted = true;
                kvc_peer_abort(a, x->peer, x->fail_status, x->fail_msg);
            } else if (x->fail_deadline_ns < *next) {
                *next = x->fail_deadline_ns;
            }
        }
        if (x->finished && !x->fail_pending && x->outstanding == 0 && x->sref.holds == 0) {
            *pp = x->next;
            kvc_peer_unref(a, x->peer);
            xfer_free(x);
            continue;
        }
        pp = &x->next;
    }
}

void kvc_xfers_destroy(kvc_agent_t *a) {
    while (a->xfers) {
        kvc_xfer_t *x = a->xfers;
        a->xfers = x->next;
        xfer_free(x);
    }
}

static int cmp_u64(const void *p, const void *q) {
    uint64_t x = *(const uint64_t *)p, y = *(const uint64_t *)q;
    return x < y ? -1 : x > y;
}

static kvc_status_t remote_from_fields(const kvc_fetch_params_t *p, kvc_remote_t *r) {
    if (!p->remote_engine_id || !p->remote_request_id || !p->remote_host ||
        (p->num_remote_blocks && !p->remote_block_ids))
        return KVC_ERR_INVALID_PARAM;
    r->engine_id = kvc_strdup(p->remote_engine_id);
    r->request_id = kvc_strdup(p->remote_request_id);
    r->host = kvc_strdup(p->remote_host);
    r->port = p->remote_port;
    r->num_blocks = p->num_remote_blocks;
    if (r->num_blocks) {
        r->block_ids = malloc(r->num_blocks * sizeof(uint64_t));
        if (r->block_ids)
            memcpy(r->block_ids, p->remote_block_ids, r->num_blocks * sizeof(uint64_t));
    }
    if (!r->engine_id || !r->request_id || !r->host || (r->num_blocks && !r->block_ids))
        return KVC_ERR_NO_MEMORY;
    return kvc_token_parse(p->remote_kv_token, r->token);
}

static kvc_status_t fetch_start(kvc_agent_t *a, const kvc_fetch_params_t *p, bool renew,
                                uint64_t *xfer_id) {
    if (!a || !p || !xfer_id) return KVC_ERR_INVALID_PARAM;
    if (!a->n_regions) return KVC_ERR_STATE;
    kvc_remote_t r;
    memset(&r, 0, sizeof(r));
    kvc_status_t st;
    if ((p->field_mask & KVC_FETCH_FIELD_JSON) && p->kv_transfer_params_json) {
        char err[200];
        st = kvc_params_parse_json(p->kv_transfer_params_json, &r, err, sizeof(err));
        if (st != KVC_OK) {
            KVC_LOG(a, KVC_LOG_WARN, "fetch: invalid kv_transfer_params: %s", err);
            goto err_remote;
        }
    } else if (p->field_mask & KVC_FETCH_FIELD_REMOTE) {
        if ((st = remote_from_fields(p, &r)) != KVC_OK) goto err_remote;
    } else {
        st = KVC_ERR_INVALID_PARAM;
        goto err_remote;
    }
    st = KVC_ERR_INVALID_PARAM;
    if (!*r.request_id || !kvc_printable(r.request_id, strlen(r.request_id)) || !*r.host ||
        r.port == 0 || !*r.engine_id)
        goto err_remote;
    /* One kv_transfer_params object for every prefill rank: rank r listens
     * on remote_port + r (see KVC_FETCH_FIELD_REMOTE_RANK). */
    if (p->field_mask & KVC_FETCH_FIELD_REMOTE_RANK) {
        if (p->remote_rank > 65535u - r.port) {
            KVC_LOG(a, KVC_LOG_WARN, "fetch req=%s: remote_port %u + rank %u is not a port",
                    r.request_id, r.port, p->remote_rank);
            goto err_remote;
        }
        r.port = (uint16_t)(r.port + p->remote_rank);
    }
    uint32_t rparts = 1, rpart = 0, lparts = 1, lpart = 0;
    if (p->field_mask & KVC_FETCH_FIELD_SLICE) {
        rparts = p->remote_parts;
        rpart = p->remote_part;
        lparts = p->local_parts;
        lpart = p->local_part;
        if (!rparts || !lparts || rpart >= rparts || lpart >= lparts) {
            KVC_LOG(a, KVC_LOG_WARN, "fetch req=%s: bad slice %u/%u -> %u/%u", r.request_id,
                    rpart, rparts, lpart, lparts);
            goto err_remote;
        }
    }
    size_t nl = 0;
    const uint64_t *lids = NULL;
    if (!renew && (p->field_mask & KVC_FETCH_FIELD_LOCAL_BLOCKS)) {
        nl = p->num_local_blocks;
        lids = p->local_block_ids;
        if (nl && !lids) goto err_remote;
    }
    /* Push mode: a held fetch without remote_block_ids takes the
     * publication's last nl blocks, whichever they are (KVC_RUN_TAIL). */
    bool tail = nl && r.num_blocks == 0 && !renew && (p->field_mask & KVC_FETCH_FIELD_WAIT) &&
                p->wait_ms;
    if (nl > r.num_blocks && !tail) {
        KVC_LOG(a, KVC_LOG_WARN, "fetch req=%s: %zu local blocks for %zu remote", r.request_id, nl,
                r.num_blocks);
        goto err_remote;
    }
    for (size_t i = 0; i < nl; i++)
        if (lids[i] >= a->num_blocks) {
            KVC_LOG(a, KVC_LOG_WARN, "fetch req=%s: local block %llu out of range (%llu)",
                    r.request_id, (unsigned long long)lids[i], (unsigned long long)a->num_blocks);
            goto err_remote;
        }
    if (nl > 1) { /* a local block named twice would be written twice */
        uint64_t *sorted = malloc(nl * sizeof(uint64_t));
        if (!sorted) {
            st = KVC_ERR_NO_MEMORY;
            goto err_remote;
        }
        memcpy(sorted, lids, nl * sizeof(uint64_t));
        qsort(sorted, nl, sizeof(uint64_t), cmp_u64);
        bool dup = false;
        for (size_t i = 1; i < nl && !dup; i++)
            dup = sorted[i] == sorted[i - 1];
        free(sorted);
        if (dup) {
            KVC_LOG(a, KVC_LOG_WARN, "fetch req=%s: a local block id is repeated", r.request_id);
            goto err_remote;
        }
    }

    st = KVC_ERR_NO_MEMORY;
    kvc_xfer_t *x = calloc(1, sizeof(*x));
    if (!x) goto err_remote;
    x->a = a;
    x->req_id = r.request_id;
    r.request_id = NULL;
    memcpy(x->pub_token, r.token, KVC_TOKEN_LEN);
    if ((st = kvc_random(x->xfer_token, KVC_TOKEN_LEN)) != KVC_OK) goto err_xfer;
    st = KVC_ERR_NO_MEMORY;
    x->n = nl;
    if (nl) {
        x->remote = malloc(nl * sizeof(uint64_t));
        x->local = malloc(nl * sizeof(uint64_t));
        if (!x->remote || !x->local) goto err_xfer;
        /* Fewer local than remote: decode has the prefix cached; the tail is new. */
        if (tail)
            for (size_t i = 0; i < nl; i++)
                x->remote[i] = KVC_RUN_TAIL | i;
        else
            memcpy(x->remote, r.block_ids + (r.num_blocks - nl), nl * sizeof(uint64_t));
        memcpy(x->local, lids, nl * sizeof(uint64_t));
    }
    x->renew = renew;
    x->tail = tail;
    x->rparts = rparts;
    x->rpart = rpart;
    x->lparts = lparts;
    x->lpart = lpart;
    x->wait_ms = !renew && (p->field_mask & KVC_FETCH_FIELD_WAIT) ? p->wait_ms : 0;
    x->has_stream = !renew && (p->field_mask & KVC_FETCH_FIELD_CUDA_STREAM) != 0;
    x->cuda_stream = x->has_stream ? p->cuda_stream : NULL;
    /* The engine may still have work queued that reads these blocks' old
     * contents (a finished request's last kernels): the copies that
     * overwrite them wait for it.  Taken here, on the engine's thread, so
     * that cudaStreamPerThread is its stream.  One device only (an event
     * must be recorded on the stream's own device). */
    if (x->has_stream && (a->n_staged || kvc_ipc_can_import(a)) && kvc_cuda_devices(a->cuda) == 1 &&
        (st = kvc_cuda_wait_for(a->cuda, NULL, true, x->cuda_stream)) != KVC_OK) {
        KVC_LOG(a, KVC_LOG_WARN, "fetch req=%s: waiting for the engine's stream failed: %s",
                x->req_id, kvc_cuda_last_error(a->cuda));
        goto err_xfer;
    }
    if ((st = kvc_peer_get(a, r.host, r.port, r.engine_id, &x->peer)) != KVC_OK) goto err_xfer;
    kvc_peer_ref(x->peer);
    x->id = renew ? 0 : a->next_xfer_id++;
    x->user_data = (p->field_mask & KVC_FETCH_FIELD_USER_DATA) ? p->user_data : 0;
    x->state = X_WAIT_PEER;
    x->next = a->xfers;
    a->xfers = x;
    kvc_remote_cleanup(&r);
    KVC_LOG(a, KVC_LOG_DEBUG, "%s %llu req=%s blocks=%zu wait_ms=%u slice=%u/%u->%u/%u",
            renew ? "lease renewal" : "fetch", (unsigned long long)x->id, x->req_id, x->n,
            x->wait_ms, x->rpart, x->rparts, x->lpart, x->lparts);
    kvc_wake(a);
    *xfer_id = x->id;
    return KVC_INPROGRESS;

err_xfer:
    xfer_free(x);
err_remote:
    kvc_remote_cleanup(&r);
    return st;
}

static kvc_xfer_t *find_xfer(kvc_agent_t *a, uint64_t id) {
    for (kvc_xfer_t *x = a->xfers; x; x = x->next)
        if (x->id == id && !x->finished && !x->renew) return x;
    return NULL;
}

static void data_reject(kvc_agent_t *a, kvc_xfer_t *x, const char *what, uint64_t start,
                        uint64_t count) {
    char m[200];
    snprintf(m, sizeof(m), "%s (local blocks [%llu,+%llu))", what, (unsigned long long)start,
             (unsigned long long)count);
    if (kvc_log_ratelimit(a, KVC_RL_DATA))
        KVC_LOG(a, KVC_LOG_WARN, "fetch %llu req=%s: %s", (unsigned long long)x->id, x->req_id, m);
    op_error(x, KVC_ERR_PROTOCOL, "checked transfer", m);
}

/* The fetch a DATA or READY header is for, when it comes from the producer
 * that fetch asked (its transfer token) while it takes data; else NULL
 * (dropped).  A refusal fails the fetch here (*refused set). */
static kvc_xfer_t *data_fetch(kvc_agent_t *a, const kvc_wire_data_hdr_t *h, bool *refused) {
    *refused = false;
    kvc_xfer_t *x = find_xfer(a, h->xfer_id);
    if (!x || (x->state != X_DATA && x->state != X_CONFIRM && x->state != X_CHECK)) {
        KVC_LOG(a, KVC_LOG_DEBUG, "push: data for finished fetch %llu dropped",
                (unsigned long long)h->xfer_id);
        return NULL;
    }
    if (!kvc_mac_equal(h->token, x->xfer_token, KVC_TOKEN_LEN)) {
        /* Not from the producer this fetch asked: never written, and it
         * does not get to fail someone else's fetch either. */
        if (kvc_log_ratelimit(a, KVC_RL_DATA))
            KVC_LOG(a, KVC_LOG_WARN,
                    "push: data for fetch %llu with a wrong transfer token, "
                    "dropped",
                    (unsigned long long)h->xfer_id);
        return NULL;
    }
    kvc_wake(a);
    if (h->status != 0) {
        kvc_status_t st =
            h->status < 0 && h->status >= KVC_ERR_BUSY ? (kvc_status_t)h->status : KVC_ERR_PROTOCOL;
        const char *why = st == KVC_ERR_TIMED_OUT
                              ? "not published (or not complete) within the registration wait"
                          : st == KVC_ERR_BUSY ? "it holds too many registrations"
                          : st == KVC_ERR_INCOMPATIBLE ? "its blocks cannot be read in these parts"
                                                       : kvc_status_str(st);
        op_error(x, st, "producer refused the fetch", why);
        /* It no longer knows our consumer key (our record there failed or
         * gave way to others): the next fetch handshakes again. */
        if (st == KVC_ERR_PEER_FAILED && x->peer->owner) x->peer->linked = false;
        *refused = true;
        return NULL;
    }
    return x;
}

/* A chunk of len bytes for local blocks [local_start, +count) of region:
 * taken (its blocks marked received) only if the whole of it is for blocks
 * this fetch asked for and has not received; else the fetch fails.
 * *dst: where it lands (host regions). */
static bool chunk_take(kvc_agent_t *a, kvc_xfer_t *x, const kvc_wire_data_hdr_t *h, size_t len,
                       uint8_t **dst) {
    if (x->proto == KVC_PROTO_GET) {
        data_reject(a, x, "data pushed to a one-sided read", h->local_start, h->count);
        return false;
    }
    bool sliced = x->lparts > 1 || x->rparts > 1;
    if (h->region >= a->n_regions || h->count == 0 || h->local_start >= a->num_blocks ||
        h->count > a->num_blocks - h->local_start ||
        h->count > UINT64_MAX / a->regions[h->region].block_len ||
        (sliced ? h->count != 1 || len != a->regions[h->region].block_len / x->lparts
                : len != h->count * a->regions[h->region].block_len)) {
        data_reject(a, x, "data message does not match the fetch (region, range or size)",
                    h->local_start, h->count);
        return false;
    }
    uint64_t pos = run_pos(x, h->local_start, h->count);
    if (pos == UINT64_MAX) {
        data_reject(a, x, "data outside the requested blocks", h->local_start, h->count);
        return false;
    }
    uint64_t bit0 = (uint64_t)h->region * x->n + pos;
    for (uint64_t i = 0; i < h->count; i++)
        if (x->bits[(bit0 + i) / 8] & (1u << ((bit0 + i) % 8))) {
            data_reject(a, x, "a block sent twice", h->local_start + i, 1);
            return false;
        }
    kvc_region_t *rg = &a->regions[h->region];
    uint64_t off = 0;
    if (!kvc_slice_at(rg->block_len, a->num_blocks, h->local_start, sliced ? x->lpart : 0,
                      sliced ? rg->block_len / x->lparts : rg->block_len, &off)) {
        data_reject(a, x, "data message outside its local block", h->local_start, h->count);
        return false;
    }
    *dst = (uint8_t *)rg->base + off;
    for (uint64_t i = 0; i < h->count; i++)
        x->bits[(bit0 + i) / 8] |= (uint8_t)(1u << ((bit0 + i) % 8));
    x->bits_set += h->count;
    x->chunks_got++;
    return true;
}

/* Consumer: a DATA message from the producer.  Nothing is written unless the
 * whole message is for blocks this fetch asked for and has not received. */
static ucs_status_t data_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    kvc_agent_t *a = arg;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    kvc_wire_data_hdr_t h;
    if (a->destroying) return UCS_OK;
    if (kvc_wire_parse_data_hdr(header, hlen, &h) != KVC_OK) {
        if (kvc_log_ratelimit(a, KVC_RL_DATA))
            KVC_LOG(a, KVC_LOG_WARN, "push: malformed data header (%zu bytes), dropped", hlen);
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    bool refused;
    kvc_xfer_t *x = data_fetch(a, &h, &refused);
    if (!x) return rndv ? UCS_ERR_CANCELED : UCS_OK;
    bool one_sided = x->proto == KVC_PROTO_GET;
    if (h.region == KVC_DATA_END) {
        if (x->state == X_CONFIRM || x->state == X_CHECK)
            x->word = true; /* the producer's word on a one-sided read */
        else if (!one_sided || x->n == 0) {
            x->end_seen = true;
            x->end_chunks = h.count;
        }
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    if (h.region < a->n_regions && !rndv && a->regions[h.region].mem_type == KVC_MEM_CUDA) {
        op_error(x, KVC_ERR_PROTOCOL, "push", "eager data for device memory (asked rendezvous)");
        return UCS_OK;
    }
    uint8_t *dst;
    if (!chunk_take(a, x, &h, len, &dst)) return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    kvc_region_t *rg = &a->regions[h.region];
    if (rg->staged) return kvc_stage_recv(a, &x->sref, h.region, h.local_start, data, len);
    if (!rndv) {
        memcpy(dst, data, len);
        x->bytes_got += len;
        return UCS_OK;
    }
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = recv_cb;
    rp.user_data = x;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(a->worker, data, dst, len, &rp);
    if (r == NULL)
        x->bytes_got += len;
    else
        track(x, r, "receive");
    return UCS_INPROGRESS;
}

/* The fetch (finished or not) with this id, to hand a slot back to. */
static kvc_xfer_t *any_xfer(kvc_agent_t *a, uint64_t id) {
    for (kvc_xfer_t *x = a->xfers; x; x = x->next)
        if (x->id == id && !x->renew) return x;
    return NULL;
}

/* Consumer: the producer offers its staging pool for a staged fetch. */
static ucs_status_t pool_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    kvc_agent_t *a = arg;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    kvc_wire_pool_t pl;
    if (a->destroying || rndv || kvc_wire_parse_pool(header, hlen, len, &pl) != KVC_OK) {
        if (!a->destroying && kvc_log_ratelimit(a, KVC_RL_DATA))
            KVC_LOG(a, KVC_LOG_WARN, "push: malformed pool offer (%zu bytes), dropped", hlen);
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    kvc_xfer_t *x = any_xfer(a, pl.h.xfer_id);
    if (x && kvc_mac_equal(pl.h.token, x->xfer_token, KVC_TOKEN_LEN))
        kvc_stage_pool_offer(a, x->peer, &pl, data, len);
    return UCS_OK;
}

/* Consumer: a chunk is ready in a slot of the producer's mapped pool. */
static ucs_status_t ready_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                             const ucp_am_recv_param_t *param) {
    kvc_agent_t *a = arg;
    (void)data;
    bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    kvc_wire_ready_t rm;
    if (a->destroying || rndv || len || kvc_wire_parse_ready(header, hlen, &rm) != KVC_OK) {
        if (!a->destroying && kvc_log_ratelimit(a, KVC_RL_DATA))
            KVC_LOG(a, KVC_LOG_WARN, "push: malformed ready message (%zu bytes), dropped", hlen);
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    kvc_wire_data_hdr_t h = rm.h;
    uint64_t off = rm.off;
    bool refused;
    kvc_xfer_t *x = data_fetch(a, &h, &refused);
    if (!x) {
        /* A fetch that ended: the slot goes back at once (same token only). */
        kvc_xfer_t *y = any_xfer(a, h.xfer_id);
        if (y && kvc_mac_equal(h.token, y->xfer_token, KVC_TOKEN_LEN))
            kvc_stage_slot_send(a, y->peer->ep, h.xfer_id, h.token, KVC_SLOT_FREE, off);
        return UCS_OK;
    }
    uint8_t *dst;
    if (h.region >= a->n_regions || !a->regions[h.region].staged) {
        data_reject(a, x, "ready message for a region that is not staged", h.local_start,
                    h.count);
    } else if (h.count > a->num_blocks) {
        data_reject(a, x, "ready message for more blocks than a region holds", h.local_start,
                    h.count);
    } else if (chunk_take(a, x, &h, (size_t)h.count * a->regions[h.region].block_len, &dst)) {
        size_t bytes = (size_t)h.count * a->regions[h.region].block_len;
        kvc_status_t st = kvc_stage_ready(a, &x->sref, x->peer, h.xfer_id, h.token, h.region,
                                          h.local_start, off, bytes);
        if (st == KVC_OK) return UCS_OK;
        op_error(x, st, "staged chunk", "its slot is not in a pool mapped here");
    }
    kvc_stage_slot_send(a, x->peer->ep, h.xfer_id, h.token, KVC_SLOT_FREE, off);
    return UCS_OK;
}

kvc_status_t kvc_fetch(kvc_agent_t *a, const kvc_fetch_params_t *p, uint64_t *xfer_id) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_lock(a);
    kvc_status_t st = fetch_start(a, p, false, xfer_id);
    kvc_unlock(a);
    return st;
}

/* A renewal is a fetch of nothing that sends one RENEW pull once the peer
 * is ready and ends silently (id 0: never matched by DATA or cancel). */
kvc_status_t kvc_lease_renew(kvc_agent_t *a, const kvc_fetch_params_t *p) {
    uint64_t id;
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_lock(a);
    kvc_status_t st = fetch_start(a, p, true, &id);
    kvc_unlock(a);
    return st == KVC_INPROGRESS ? KVC_OK : st;
}

kvc_status_t kvc_xfer_register_am(kvc_agent_t *a) {
    kvc_status_t st = kvc_set_am_handler(a, KVC_AM_DATA, data_cb);
    if (st == KVC_OK) st = kvc_set_am_handler(a, KVC_AM_POOL, pool_cb);
    if (st == KVC_OK) st = kvc_set_am_handler(a, KVC_AM_READY, ready_cb);
    if (st == KVC_OK) st = kvc_set_am_handler(a, KVC_AM_SLOT, kvc_stage_slot_cb);
    return st;
}

/* Cancel: the fetch takes no DATA from now on (data_cb drops what arrives
 * for a finished fetch), then what is already in flight is cancelled and
 * progressed to its end here, so that nothing lands after the return; as a
 * last resort the endpoint to the producer is closed. */
static kvc_status_t cancel_impl(kvc_agent_t *a, uint64_t xfer_id) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_xfer_t *x = NULL;
    for (kvc_xfer_t *y = a->xfers; y; y = y->next) /* renewals (id 0) are not fetches */
        if (y->id == xfer_id && !y->renew && (!y->finished || y->fail_pending)) x = y;
    if (!x) return KVC_ERR_NOT_FOUND;
    x->finished = true;
    x->sref.dead = true;
    x->state = X_DONE;
    x->fail_pending = false;
    for (size_t i = 0; i < x->nreqs; i++)
        ucp_request_cancel(a->worker, x->reqs[i]);
    uint64_t until = kvc_now_ns() + FAIL_GRACE_NS;
    bool aborted = false;
    while (x->outstanding > 0 || x->sref.holds > 0) {
        if (!aborted && kvc_now_ns() >= until) {
            aborted = true;
            kvc_peer_abort(a, x->peer, KVC_ERR_CANCELED, "fetch cancelled, requests did not end");
        }
        ucp_worker_progress(a->worker);
        uint64_t ignored = UINT64_MAX;
        kvc_stage_progress(a, kvc_now_ns(), &ignored);
        if (aborted && kvc_now_ns() >= until + FAIL_GRACE_NS) break;
    }
    kvc_cuda_drain(a->cuda);
    a->stats[KVC_STAT_FETCH_CANCELED]++;
    if (x->outstanding > 0 || x->sref.holds > 0) {
        /* UCX did not end them even with the endpoint closed: no promise
         * can be made now.  The event comes when they end. */
        KVC_LOG(a, KVC_LOG_WARN, "fetch %llu req=%s: cancel could not end %d requests in time",
                (unsigned long long)x->id, x->req_id, x->outstanding);
        x->fail_pending = true;
        x->fail_aborted = true;
        x->fail_status = KVC_ERR_CANCELED;
        snprintf(x->fail_msg, sizeof(x->fail_msg), "fetch cancelled");
        kvc_wake(a);
        return KVC_ERR_TIMED_OUT;
    }
    KVC_LOG(a, KVC_LOG_DEBUG, "fetch %llu req=%s cancelled (endpoint %s)",
            (unsigned long long)x->id, x->req_id, aborted ? "closed" : "kept");
    emit_failed(a, x, KVC_ERR_CANCELED, "fetch cancelled");
    kvc_wake(a);
    return KVC_OK;
}

kvc_status_t kvc_fetch_cancel(kvc_agent_t *a, uint64_t xfer_id) {
    if (!a) return KVC_ERR_INVALID_PARAM;
    kvc_lock(a);
    kvc_status_t st = cancel_impl(a, xfer_id);
    kvc_unlock(a);
    return st;
}
