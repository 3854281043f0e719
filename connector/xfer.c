/* Fetches (consumer) and pushes (producer side of a fetch).
 *
 * A fetch goes WAIT_PEER -> DATA -> [FLUSH] -> NOTIFY -> done, one step per
 * progress call, never from inside a UCX callback: callbacks only count
 * completions and record errors; kvc_xfers_advance() moves the state.
 *
 * DATA uses one of two protocols, chosen per peer (peer.c: choose_proto):
 *  GET:  one ucp_get_nbx per (coalesced run, region).  One-sided on shared
 *        memory pools and on RDMA.
 *  PUSH: one PULL active message listing the runs, naming the publication
 *        (remote_request_id + its token) and carrying a random transfer
 *        token; the producer checks that every run is part of that
 *        publication and answers with one DATA active message per
 *        (run, region) whose header names the local destination and echoes
 *        the transfer token, then an END saying how many it sent; large ones
 *        arrive as rendezvous and are received straight into the local
 *        region.  This is the fast path over UCX's tcp transport, whose get
 *        is emulated by the target.
 *
 * Checked transfers: the consumer keeps one bit per (region, block) of the
 * fetch.  DATA with another token is dropped; DATA outside the requested
 * blocks, or for a block already received, fails the fetch before a byte is
 * written; an END after which blocks are still missing fails it too (short
 * transfer).  Completion is every bit set, never a byte count.
 *
 * A fetch struct lives until its event is queued AND every UCX request that
 * points to it has completed (outstanding == 0). */
#include "kvc_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { KVC_AM_PULL = 21, KVC_AM_DATA = 22 };

typedef enum { X_WAIT_PEER, X_DATA, X_FLUSH, X_NOTIFY, X_DONE } xstate_t;

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
    size_t cur_run, cur_reg; /* direct copy cursor */
    xstate_t state;
    bool finished;   /* event queued */
    int outstanding; /* UCX requests whose user_data is this fetch */
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
    void *cuda_stream; /* borrowed: the engine's stream that waits for the staging copies */
};

/* Producer side: headers of one PULL's DATA sends, freed with the last send. */
typedef struct {
    kvc_agent_t *a;
    size_t refs;
    uint64_t bytes; /* counted in a->push_bytes until the job ends */
    uint8_t (*hdr)[KVC_WIRE_DATA_HDR_LEN];
} push_job_t;

/* Pulls one publication may be served: enough for every TP rank of the
 * decode side, not an amplifier for a peer that repeats its pull. */
#define PULLS_PER_PUB_MIN 8
/* Bytes all pushes in flight may reference; beyond, pulls are refused
 * (one is always served, however large). */
#define MAX_PUSH_BYTES (4ull << 30)

static void job_free(push_job_t *j) {
    j->a->push_bytes -= j->bytes;
    free(j->hdr);
    free(j);
}

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
    x->op_status = st;
    snprintf(x->op_msg, sizeof(x->op_msg), "%s: %s", what, detail);
}

static void op_done(kvc_xfer_t *x, ucs_status_t us, const char *what) {
    x->outstanding--;
    if (us != UCS_OK) op_error(x, ucs_to_kvc(us), what, ucs_status_string(us));
    kvc_wake(x->a);
}

static void get_cb(void *req, ucs_status_t us, void *ud) {
    op_done(ud, us, "get");
    ucp_request_free(req);
}

static void flush_cb(void *req, ucs_status_t us, void *ud) {
    op_done(ud, us, "flush");
    ucp_request_free(req);
}

static void send_cb(void *req, ucs_status_t us, void *ud) {
    op_done(ud, us, "send");
    ucp_request_free(req);
}

static void recv_cb(void *req, ucs_status_t us, size_t length, void *ud) {
    kvc_xfer_t *x = ud;
    if (us == UCS_OK) x->bytes_got += length;
    op_done(x, us, "receive");
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
    return true;
}

static void xfer_finish(kvc_agent_t *a, kvc_xfer_t *x, kvc_status_t st, const char *msg) {
    if (x->finished) return;
    /* No staging copy may land after FETCH_FAILED: wait for all of them. */
    if (st != KVC_OK) kvc_cuda_drain(a->cuda);
    x->finished = true;
    x->state = X_DONE;
    if (st == KVC_OK) {
        a->stats[KVC_STAT_FETCH_DONE]++;
        a->stats[KVC_STAT_BYTES_FETCHED] += x->bytes_expected;
        KVC_LOG(a, KVC_LOG_DEBUG, "fetch %llu req=%s done blocks=%zu bytes=%llu",
                (unsigned long long)x->id, x->req_id, x->n, (unsigned long long)x->bytes_expected);
        kvc_event_push(a, KVC_EV_FETCH_DONE, KVC_OK, x->id, x->user_data, x->req_id, x->local, x->n,
                       x->bytes_expected, NULL);
    } else {
        a->stats[KVC_STAT_FETCH_FAILED]++;
        KVC_LOG(a, KVC_LOG_WARN, "fetch %llu req=%s failed: %s (%s)", (unsigned long long)x->id,
                x->req_id, msg, kvc_status_str(st));
        kvc_event_push(a, KVC_EV_FETCH_FAILED, st, x->id, x->user_data, x->req_id, x->local, x->n,
                       0, msg);
    }
}

void kvc_xfers_fail_peer(kvc_agent_t *a, kvc_peer_t *p, kvc_status_t st, const char *msg) {
    for (kvc_xfer_t *x = a->xfers; x; x = x->next)
        if (x->peer == p && !x->finished) xfer_finish(a, x, st, msg);
}

static void xfer_free(kvc_xfer_t *x) {
    free(x->req_id);
    free(x->remote);
    free(x->local);
    free(x->runs);
    free(x->byloc);
    free(x->bits);
    kvc_buf_cleanup(&x->pull);
    kvc_buf_cleanup(&x->notify);
    free(x);
}

/* ------------------------------------------------------------- consumer -- */

/* Staged regions: mirror -> device for the fetched blocks, all regions and
 * devices queued first, then one host sync per device, or none when the
 * engine gave a stream to order after the copies. */
static kvc_status_t stage_in(kvc_agent_t *a, kvc_xfer_t *x) {
    kvc_status_t st = KVC_OK;
    /* The engine may still have work queued that reads these blocks' old
     * contents (a finished request's last kernels): the copies that
     * overwrite them wait for it.  One device only (an event must be
     * recorded on the stream's own device). */
    if (x->cuda_stream && kvc_cuda_devices(a->cuda) == 1)
        st = kvc_cuda_wait_for(a->cuda, NULL, x->cuda_stream);
    if (st == KVC_OK) st = kvc_stage_copy(a, x->local, x->n, true);
    if (st != KVC_OK) return st;
    if (x->cuda_stream) return kvc_cuda_order_before(a->cuda, x->cuda_stream);
    a->stats[KVC_STAT_CUDA_SYNCS]++;
    return kvc_cuda_sync(a->cuda);
}

static void start_notify(kvc_agent_t *a, kvc_xfer_t *x) {
    if (a->n_staged && x->n) {
        kvc_status_t st = stage_in(a, x);
        if (st != KVC_OK) {
            char m[400];
            snprintf(m, sizeof(m), "staging host->device copy failed: %s",
                     kvc_cuda_last_error(a->cuda));
            xfer_finish(a, x, st, m); /* drains what was queued */
            return;
        }
    }
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

static void start_data(kvc_agent_t *a, kvc_xfer_t *x, uint64_t now) {
    kvc_peer_t *p = x->peer;
    for (size_t i = 0; i < x->n; i++) {
        if (x->remote[i] >= p->num_blocks) {
            char m[200];
            snprintf(m, sizeof(m), "remote block id %llu out of range: engine %s has %llu blocks",
                     (unsigned long long)x->remote[i], p->engine_id,
                     (unsigned long long)p->num_blocks);
            xfer_finish(a, x, KVC_ERR_INVALID_PARAM, m);
            return;
        }
    }
    if (kvc_coalesce(x->remote, x->local, x->n, &x->runs, &x->nruns) != KVC_OK) {
        xfer_finish(a, x, KVC_ERR_NO_MEMORY, "out of memory");
        return;
    }
    x->proto = p->proto;
    x->deadline_ns = now + (uint64_t)a->xfer_timeout_ms * 1000000ull;
    size_t per_block = 0;
    for (size_t r = 0; r < a->n_regions; r++)
        per_block += a->regions[r].block_len;
    x->bytes_expected = (uint64_t)x->n * per_block;
    x->state = X_DATA;
    if (x->n == 0) return; /* notify only */
    if (build_checks(a, x) != KVC_OK) {
        xfer_finish(a, x, KVC_ERR_NO_MEMORY, "out of memory");
        return;
    }

    bool local_host = true;
    for (size_t r = 0; r < a->n_regions; r++)
        local_host &= a->regions[r].mem_type == KVC_MEM_HOST || a->regions[r].staged;
    if (x->proto == KVC_PROTO_GET && p->shm && local_host) {
        x->direct = true; /* copied in slices by advance() */
        return;
    }
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.user_data = x;
    if (x->proto == KVC_PROTO_GET) {
        rp.cb.send = get_cb;
        for (size_t i = 0; i < x->nruns; i++) {
            const kvc_run_t *run = &x->runs[i];
            for (size_t r = 0; r < a->n_regions; r++) {
                size_t bl = a->regions[r].block_len;
                uint8_t *dst = (uint8_t *)a->regions[r].base + run->local * bl;
                uint64_t src = p->rr[r].base + run->remote * bl;
                if (!track(x, ucp_get_nbx(p->ep, dst, run->count * bl, src, p->rr[r].rkey, &rp),
                           "get"))
                    return;
            }
        }
        return;
    }
    /* Device memory cannot take an eager copy in the handler: ask for
     * rendezvous only, which UCX receives straight into device memory. */
    uint16_t flags = 0;
    for (size_t r = 0; r < a->n_regions; r++)
        if (a->regions[r].mem_type == KVC_MEM_CUDA && !a->regions[r].staged) flags |= KVC_PULL_RNDV;
    kvc_wire_pull_t pl = {.xfer_id = x->id,
                          .flags = flags,
                          .request_id = {(const uint8_t *)x->req_id, strlen(x->req_id)},
                          .runs = x->runs,
                          .n = x->nruns};
    memcpy(pl.xfer_token, x->xfer_token, KVC_TOKEN_LEN);
    memcpy(pl.pub_token, x->pub_token, KVC_TOKEN_LEN);
    kvc_wire_encode_pull(&x->pull, &pl);
    if (x->pull.failed) {
        xfer_finish(a, x, KVC_ERR_NO_MEMORY, "out of memory");
        return;
    }
    rp.cb.send = send_cb;
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    track(x, ucp_am_send_nbx(p->ep, KVC_AM_PULL, NULL, 0, x->pull.p, x->pull.len, &rp), "pull");
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
        memcpy((uint8_t *)a->regions[x->cur_reg].base + run->local * bl,
               x->peer->rr[x->cur_reg].mapped + run->remote * bl, run->count * bl);
        x->bytes_got += run->count * bl;
        if (++x->cur_reg == a->n_regions) {
            x->cur_reg = 0;
            x->cur_run++;
        }
        if (run->count * bl >= budget) break;
        budget -= run->count * bl;
    }
    if (x->cur_run < x->nruns) {
        kvc_wake(a);
        return false;
    }
    return true;
}

static void advance(kvc_agent_t *a, kvc_xfer_t *x, uint64_t now, uint64_t *next) {
    kvc_status_t pst;
    const char *pmsg;
    if (x->state == X_WAIT_PEER) {
        if (kvc_peer_dead(x->peer, &pst, &pmsg)) {
            xfer_finish(a, x, pst, pmsg);
            return;
        }
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
    if (x->op_failed) {
        xfer_finish(a, x, x->op_status, x->op_msg);
        return;
    }
    if (x->state == X_DATA && x->direct) {
        if (direct_copy(a, x)) start_notify(a, x);
        return;
    }
    if (x->state == X_DATA) {
        bool landed = x->outstanding == 0 && (x->proto == KVC_PROTO_GET || x->n == 0 ||
                                              x->bits_set == (uint64_t)x->n * a->n_regions);
        if (!landed && x->outstanding == 0 && x->end_seen && x->chunks_got >= x->end_chunks) {
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
            if (now >= x->deadline_ns) {
                char m[160];
                snprintf(m, sizeof(m), "data not complete after %u ms (%llu of %llu bytes)",
                         a->xfer_timeout_ms, (unsigned long long)x->bytes_got,
                         (unsigned long long)x->bytes_expected);
                /* A peer that stalls a fetch this long is treated as broken:
                 * closing its endpoint cancels what is still in flight, so
                 * nothing lands in local blocks after the failure event. */
                kvc_peer_abort(a, x->peer, KVC_ERR_TIMED_OUT, m);
                xfer_finish(a, x, KVC_ERR_TIMED_OUT, m);
                return;
            }
            if (x->deadline_ns < *next) *next = x->deadline_ns;
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
        start_notify(a, x);
        return;
    }
    if (x->state == X_NOTIFY && x->outstanding == 0) xfer_finish(a, x, KVC_OK, NULL);
}

void kvc_xfers_advance(kvc_agent_t *a, uint64_t now, uint64_t *next) {
    kvc_xfer_t **pp = &a->xfers;
    while (*pp) {
        kvc_xfer_t *x = *pp;
        if (!x->finished) advance(a, x, now, next);
        if (x->finished && x->outstanding == 0) {
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

kvc_status_t kvc_fetch(kvc_agent_t *a, const kvc_fetch_params_t *p, uint64_t *xfer_id) {
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
    size_t nl = 0;
    const uint64_t *lids = NULL;
    if (p->field_mask & KVC_FETCH_FIELD_LOCAL_BLOCKS) {
        nl = p->num_local_blocks;
        lids = p->local_block_ids;
        if (nl && !lids) goto err_remote;
    }
    if (nl > r.num_blocks) {
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
        memcpy(x->remote, r.block_ids + (r.num_blocks - nl), nl * sizeof(uint64_t));
        memcpy(x->local, lids, nl * sizeof(uint64_t));
    }
    if ((st = kvc_peer_get(a, r.host, r.port, r.engine_id, &x->peer)) != KVC_OK) goto err_xfer;
    kvc_peer_ref(x->peer);
    x->id = a->next_xfer_id++;
    x->user_data = (p->field_mask & KVC_FETCH_FIELD_USER_DATA) ? p->user_data : 0;
    x->cuda_stream = (p->field_mask & KVC_FETCH_FIELD_CUDA_STREAM) ? p->cuda_stream : NULL;
    x->state = X_WAIT_PEER;
    x->next = a->xfers;
    a->xfers = x;
    kvc_remote_cleanup(&r);
    KVC_LOG(a, KVC_LOG_DEBUG, "fetch %llu req=%s blocks=%zu", (unsigned long long)x->id, x->req_id,
            x->n);
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
        if (x->id == id && !x->finished) return x;
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
    kvc_xfer_t *x = find_xfer(a, h.xfer_id);
    if (!x || x->state != X_DATA) {
        KVC_LOG(a, KVC_LOG_DEBUG, "push: data for finished fetch %llu dropped",
                (unsigned long long)h.xfer_id);
        return rndv ? UCS_ERR_CANCELED : UCS_OK;
    }
    if (!kvc_mac_equal(h.token, x->xfer_token, KVC_TOKEN_LEN)) {
        /* Not from the producer this fetch asked: never written, and it
         * does not get to fail someone else's fetch either. */
        if (kvc_log_ratelimit(a, KVC_RL_DATA))
            KVC_LOG(a, KVC_LOG_WARN,
                    "push: data for fetch %llu with a wrong transfer token, "
                    "dropped",
                    (unsigned long long)h.xfer_id);
        return rndv ? UCS_ERR_CANCELED : UCS_OK;
    }
    kvc_wake(a);
    if (h.status != 0) {
        kvc_status_t st =
            h.status < 0 && h.status >= KVC_ERR_CUDA ? (kvc_status_t)h.status : KVC_ERR_PROTOCOL;
        op_error(x, st, "producer refused the fetch", kvc_status_str(st));
        return rndv ? UCS_ERR_CANCELED : UCS_OK;
    }
    if (h.region == KVC_DATA_END) {
        x->end_seen = true;
        x->end_chunks = h.count;
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    if (h.region >= a->n_regions || h.count == 0 || h.local_start >= a->num_blocks ||
        h.count > a->num_blocks - h.local_start ||
        h.count > UINT64_MAX / a->regions[h.region].block_len ||
        len != h.count * a->regions[h.region].block_len) {
        data_reject(a, x, "data message does not match the fetch (region, range or size)",
                    h.local_start, h.count);
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    uint64_t pos = run_pos(x, h.local_start, h.count);
    if (pos == UINT64_MAX) {
        data_reject(a, x, "data outside the requested blocks", h.local_start, h.count);
        return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    uint64_t bit0 = (uint64_t)h.region * x->n + pos;
    for (uint64_t i = 0; i < h.count; i++)
        if (x->bits[(bit0 + i) / 8] & (1u << ((bit0 + i) % 8))) {
            data_reject(a, x, "a block sent twice", h.local_start + i, 1);
            return rndv ? UCS_ERR_INVALID_PARAM : UCS_OK;
        }
    kvc_region_t *rg = &a->regions[h.region];
    uint8_t *dst = (uint8_t *)rg->base + h.local_start * rg->block_len;
    if (!rndv && rg->mem_type == KVC_MEM_CUDA && !rg->staged) {
        op_error(x, KVC_ERR_PROTOCOL, "push", "eager data for device memory (asked rendezvous)");
        return UCS_OK;
    }
    for (uint64_t i = 0; i < h.count; i++)
        x->bits[(bit0 + i) / 8] |= (uint8_t)(1u << ((bit0 + i) % 8));
    x->bits_set += h.count;
    x->chunks_got++;
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

/* ------------------------------------------------------------- producer -- */

static void push_cb(void *req, ucs_status_t us, void *ud) {
    push_job_t *j = ud;
    if (us != UCS_OK && us != UCS_ERR_CANCELED)
        KVC_LOG(j->a, KVC_LOG_WARN, "push: send failed: %s", ucs_status_string(us));
    j->a->push_inflight--;
    if (--j->refs == 0) job_free(j);
    ucp_request_free(req);
}

/* Sends one header-only DATA message (a refusal, or the END of a pull). */
static void push_hdr_only(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_data_hdr_t *h) {
    /* The header must live until completion (UCX 1.13), so it goes in a job. */
    push_job_t *j = calloc(1, sizeof(*j));
    if (!j || !(j->hdr = calloc(1, KVC_WIRE_DATA_HDR_LEN))) {
        free(j);
        return;
    }
    j->a = a;
    kvc_wire_encode_data_hdr(j->hdr[0], h);
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = push_cb;
    rp.user_data = j;
    j->refs = 1;
    ucs_status_ptr_t r =
        ucp_am_send_nbx(ep, KVC_AM_DATA, j->hdr[0], KVC_WIRE_DATA_HDR_LEN, NULL, 0, &rp);
    if (UCS_PTR_IS_PTR(r)) {
        a->push_inflight++;
        return;
    }
    free(j->hdr);
    free(j);
}

static void push_refuse(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_pull_t *pl, kvc_status_t st) {
    kvc_wire_data_hdr_t h = {pl->xfer_id, 0, (int32_t)st, 0, 0, {0}};
    memcpy(h.token, pl->xfer_token, KVC_TOKEN_LEN);
    push_hdr_only(a, ep, &h);
}

/* A pull that names no live publication, or presents its token wrongly, or
 * asks for blocks it does not hold: refused, counted, logged (rate-limited). */
static void pull_deny(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_pull_t *pl, const char *why) {
    a->stats[KVC_STAT_DENIED]++;
    if (kvc_log_ratelimit(a, KVC_RL_DENIED))
        KVC_LOG(a, KVC_LOG_WARN, "push: pull for req=%.*s refused: %s", (int)pl->request_id.len,
                (const char *)pl->request_id.p, why);
    push_refuse(a, ep, pl, KVC_ERR_DENIED);
}

static ucs_status_t pull_cb(void *arg, const void *header, size_t hlen, void *data, size_t len,
                            const ucp_am_recv_param_t *param) {
    kvc_agent_t *a = arg;
    if (a->destroying) return UCS_OK;
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || !param->reply_ep ||
        (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN, "push: pull request without reply endpoint, dropped");
        return (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ? UCS_ERR_INVALID_PARAM : UCS_OK;
    }
    ucp_ep_h ep = param->reply_ep;
    kvc_wire_pull_t pl;
    kvc_status_t st = kvc_wire_parse_pull(data, len, &pl);
    if (st != KVC_OK) {
        a->stats[KVC_STAT_DENIED]++;
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN, "push: malformed pull request (%zu bytes), dropped", len);
        return UCS_OK;
    }
    kvc_run_t *runs = pl.runs;
    size_t n = pl.n;
    kvc_pub_t *pub = kvc_pubtab_find(&a->pubs, (const char *)pl.request_id.p, pl.request_id.len);
    if (!pub || !kvc_mac_equal(pub->token, pl.pub_token, KVC_TOKEN_LEN)) {
        pull_deny(a, ep, &pl, pub ? "wrong token" : "unknown or expired publication");
        free(runs);
        return UCS_OK;
    }
    /* Only blocks of this publication, and no more of them than it holds:
     * that bounds what one pull can make this producer send. */
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        total += runs[i].count;
        if (runs[i].count == 0 || runs[i].remote >= a->num_blocks ||
            runs[i].count > a->num_blocks - runs[i].remote || total > pub->n ||
            !kvc_pub_has_run(pub, runs[i].remote, runs[i].count)) {
            char m[160];
            snprintf(m, sizeof(m), "blocks [%llu,+%llu) are not all part of the publication",
                     (unsigned long long)runs[i].remote, (unsigned long long)runs[i].count);
            pull_deny(a, ep, &pl, m);
            free(runs);
            return UCS_OK;
        }
    }
    uint32_t max_pulls =
        pub->consumers * 2 > PULLS_PER_PUB_MIN ? pub->consumers * 2 : PULLS_PER_PUB_MIN;
    if (pub->pulls >= max_pulls) {
        pull_deny(a, ep, &pl, "pulled too many times already");
        free(runs);
        return UCS_OK;
    }
    uint64_t bytes = 0;
    for (size_t r = 0; r < a->n_regions; r++)
        bytes += total * a->regions[r].block_len;
    if (a->push_bytes && bytes > MAX_PUSH_BYTES - a->push_bytes) {
        a->stats[KVC_STAT_DENIED]++;
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN, "push: pull for req=%s refused: %llu bytes already in flight",
                    pub->id, (unsigned long long)a->push_bytes);
        push_refuse(a, ep, &pl, KVC_ERR_DENIED);
        free(runs);
        return UCS_OK;
    }
    pub->pulls++;
    uint64_t xid = pl.xfer_id;
    uint16_t flags = pl.flags;
    /* Large runs go as several messages: one huge rendezvous over tcp is
     * slower than a stream of a few MiB each. */
    size_t nsend = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t r = 0; r < a->n_regions; r++) {
            uint64_t per = a->push_chunk / a->regions[r].block_len;
            if (per == 0) per = 1;
            nsend += (size_t)((runs[i].count + per - 1) / per);
        }
    if (nsend == 0) {
        free(runs);
        return UCS_OK;
    }
    push_job_t *j = calloc(1, sizeof(*j));
    if (!j || !(j->hdr = calloc(nsend, KVC_WIRE_DATA_HDR_LEN))) {
        free(j);
        free(runs);
        push_refuse(a, ep, &pl, KVC_ERR_NO_MEMORY);
        return UCS_OK;
    }
    j->a = a;
    j->refs = 1; /* held while issuing */
    j->bytes = bytes;
    a->push_bytes += bytes;
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = push_cb;
    rp.user_data = j;
    if (flags & KVC_PULL_RNDV) {
        rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        rp.flags = UCP_AM_SEND_FLAG_RNDV;
    }
    size_t k = 0;
    bool failed = false;
    for (size_t i = 0; i < n && !failed; i++) {
        for (size_t r = 0; r < a->n_regions && !failed; r++) {
            kvc_region_t *rg = &a->regions[r];
            uint64_t per = a->push_chunk / rg->block_len;
            if (per == 0) per = 1;
            for (uint64_t off = 0; off < runs[i].count; off += per, k++) {
                uint64_t cnt = runs[i].count - off < per ? runs[i].count - off : per;
                kvc_wire_data_hdr_t h = {xid, (uint32_t)r, 0, runs[i].local + off, cnt, {0}};
                memcpy(h.token, pl.xfer_token, KVC_TOKEN_LEN);
                kvc_wire_encode_data_hdr(j->hdr[k], &h);
                const uint8_t *src =
                    (const uint8_t *)rg->base + (runs[i].remote + off) * rg->block_len;
                j->refs++;
                a->push_inflight++;
                ucs_status_ptr_t s =
                    ucp_am_send_nbx(ep, KVC_AM_DATA, j->hdr[k], KVC_WIRE_DATA_HDR_LEN, src,
                                    cnt * rg->block_len, &rp);
                if (UCS_PTR_IS_PTR(s)) continue;
                j->refs--;
                a->push_inflight--;
                if (UCS_PTR_IS_ERR(s)) {
                    KVC_LOG(a, KVC_LOG_WARN, "push: send for fetch %llu failed: %s",
                            (unsigned long long)xid, ucs_status_string(UCS_PTR_STATUS(s)));
                    failed = true; /* the consumer's endpoint error or timeout ends its fetch */
                    break;
                }
            }
        }
    }
    if (!failed) {
        kvc_wire_data_hdr_t end = {xid, KVC_DATA_END, 0, 0, k, {0}};
        memcpy(end.token, pl.xfer_token, KVC_TOKEN_LEN);
        push_hdr_only(a, ep, &end);
    }
    if (--j->refs == 0) job_free(j);
    free(runs);
    return UCS_OK;
}

kvc_status_t kvc_xfer_register_am(kvc_agent_t *a) {
    kvc_status_t st = kvc_set_am_handler(a, KVC_AM_PULL, pull_cb);
    return st != KVC_OK ? st : kvc_set_am_handler(a, KVC_AM_DATA, data_cb);
}
