/* SPDX-License-Identifier: Apache-2.0 */
/* Pushes: the producer side of a fetch.  A PULL active message names a
 * publication, its token and the runs wanted; the producer checks them
 * (pull_check) and answers with DATA messages read straight from the
 * published blocks, then an END (pull_issue).  A push job counts as a reader
 * of its publication until its last send completes: a release waits for it
 * (publish.c), so the engine never gets blocks back that a send still reads.
 *
 * One-sided reads (GET) ask the producer's word around the read: a HOLD pull
 * is checked like any pull and answered with an END (confirmed, the blocks
 * are held for this fetch until its transfer deadline) or a refusal; the
 * UNHOLD pull after the read is answered with an END only if the hold was
 * intact.  The consumer side is xfer.c. */
#include "connector/kvc_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Producer side: headers of one PULL's DATA sends, freed with the last send,
 * or by kvc_push_destroy when the worker went away with sends still pending
 * (a peer that left without taking them). */
typedef struct kvc_push_job {
    struct kvc_push_job *prev, *next; /* on a->push_jobs */
    kvc_agent_t *a;
    kvc_pub_t *pub; /* the publication its sends read (a reader of it), or NULL */
    size_t refs;
    uint64_t bytes; /* counted in a->push_bytes until the job ends */
    uint8_t (*hdr)[KVC_WIRE_DATA_HDR_LEN];
} push_job_t;

/* A pull that reached this producer before its publication (KVC_PULL_WAIT):
 * its bytes, kept until kvc_publish of its id serves it or its deadline
 * refuses it.  Bounded in count (per source address and in total) and
 * bytes, shared fairly (pending_make_room). */
typedef struct kvc_pending {
    struct kvc_pending *next;
    kvc_cons_t *cons; /* referenced: its consumer, answered on our own endpoint to it
                         (never UCX's reply endpoint: pull_unowned) */
    uint8_t *msg;     /* owned: the pull as received */
    size_t len;
    char *id;         /* owned: its request id */
    uint64_t deadline_ns;
    bool whole; /* held for a layer-wise publication to be complete */
} pending_t;

/* A layer-wise push (KVC_PUBLISH_FIELD_LAYERWISE): a checked pull of a
 * publication whose regions are not all written yet.  Each region goes out
 * once the engine marks it ready (kvc_publish_ready), the END after the
 * last; all on our own endpoint to the consumer.  Its job stays a reader
 * of the publication until then, so a release in between waits for it and
 * refuses the fetch (defer_advance). */
typedef struct kvc_defer {
    struct kvc_defer *next; /* on a->defers */
    kvc_cons_t *cons;       /* referenced */
    kvc_wire_pull_t pl;     /* owned runs; its request id is not kept */
    push_job_t *j;          /* one reference held until the END */
    uint8_t *sent;          /* owned: per region, its DATA went out */
    size_t nsent, k;        /* regions sent; DATA messages issued */
} defer_t;

/* Pulls one publication may be served: enough for every TP rank of the
 * decode side, not an amplifier for a peer that repeats its pull. */
#define PULLS_PER_PUB_MIN 8
/* Bytes all pushes in flight may reference; beyond, pulls are refused
 * (one is always served, however large). */
#define MAX_PUSH_BYTES (4ull << 30)
/* Consumers per publication the pull bound scales to (TP ratios are far
 * smaller; this only keeps the arithmetic bounded). */
#define MAX_RANKS 65536u

/* A job with room for `nhdr` DATA headers, on the agent's list; NULL when
 * out of memory. */
static push_job_t *job_new(kvc_agent_t *a, size_t nhdr) {
    push_job_t *j = calloc(1, sizeof(*j));
    if (!j || !(j->hdr = calloc(nhdr, KVC_WIRE_DATA_HDR_LEN))) {
        free(j);
        return NULL;
    }
    j->a = a;
    j->next = a->push_jobs;
    if (j->next) j->next->prev = j;
    a->push_jobs = j;
    return j;
}

static void job_drop(push_job_t *j) {
    if (j->prev)
        j->prev->next = j->next;
    else
        j->a->push_jobs = j->next;
    if (j->next) j->next->prev = j->prev;
    free(j->hdr);
    free(j);
}

static void job_free(push_job_t *j) {
    if (j->pub) kvc_pub_push_end(j->a, j->pub); /* may hand the blocks back */
    j->a->push_bytes -= j->bytes;
    job_drop(j);
}

static void pending_free(kvc_agent_t *a, pending_t *p);

static void defer_free(defer_t *d) {
    free(d->pl.runs);
    free(d->sent);
    free(d);
}

void kvc_push_destroy(kvc_agent_t *a) {
    while (a->defers) { /* their jobs and consumers go below */
        defer_t *d = a->defers;
        a->defers = d->next;
        defer_free(d);
    }
    while (a->push_jobs)
        job_drop(a->push_jobs);
    while (a->pending) {
        pending_t *p = a->pending;
        a->pending = p->next;
        pending_free(a, p);
    }
}

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
    push_job_t *j = job_new(a, 1);
    if (!j) return;
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
    job_drop(j);
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

/* A pull that would be answered after its callback (held for its
 * publication, or staged) from a consumer without an endpoint of ours
 * (KVC_HFLAG_OWNER, KVC_PULL_CONS): refused now, in the callback.  Its
 * reply endpoint is UCX's, destroyed by UCX when that consumer leaves, so
 * it must never be kept (a send on it later crashed the producer). */
static void pull_unowned(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_pull_t *pl, const char *what) {
    a->stats[KVC_STAT_DENIED]++;
    if (kvc_log_ratelimit(a, KVC_RL_DENIED))
        KVC_LOG(a, KVC_LOG_WARN,
                "push: pull for req=%.*s refused: %s needs an endpoint of ours to the consumer "
                "(it did not send its worker address, KVC_HFLAG_OWNER)",
                (int)pl->request_id.len, (const char *)pl->request_id.p, what);
    push_refuse(a, ep, pl, KVC_ERR_UNSUPPORTED);
}

/* Whether one well-formed pull may be served: a live publication, its token,
 * only its blocks and no more of them than it holds, within the pulls per
 * publication and the bytes in flight.  Refuses it (DENIED, counted, logged)
 * and returns NULL otherwise; *bytes: what serving it sends. */
static bool pending_add(kvc_agent_t *a, kvc_cons_t *cons, const kvc_wire_pull_t *pl,
                        ucp_ep_h ep, const void *msg, size_t len, const kvc_pub_t *whole);
static void pull_end(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_pull_t *pl);

static kvc_pub_t *pull_check(kvc_agent_t *a, kvc_cons_t *cons, ucp_ep_h ep, const kvc_wire_pull_t *pl,
                             uint64_t *bytes, const void *msg, size_t msg_len) {
    kvc_pub_t *pub = kvc_pubtab_find(&a->pubs, (const char *)pl->request_id.p, pl->request_id.len);
    /* Push-mode registration: a fetch that came before its publication is
     * held (bounded) unless that publication already ended. */
    if (!pub && msg && (pl->flags & KVC_PULL_WAIT) && a->pending_fetch_ms &&
        !kvc_token_recall(a, pl->request_id, pl->pub_token)) {
        if (!cons) {
            pull_unowned(a, ep, pl, "a held registration");
            return NULL;
        }
        if (pending_add(a, cons, pl, ep, msg, msg_len, NULL)) return NULL;
    }
    /* A notify-only registration for a publication that already ended: its
     * notification goes out and is taken as a late one (notify.c). */
    if (!pub && pl->n == 0 && !(pl->flags & (KVC_PULL_HOLD | KVC_PULL_UNHOLD)) &&
        kvc_token_recall(a, pl->request_id, pl->pub_token)) {
        pull_end(a, ep, pl);
        return NULL;
    }
    if (!pub || !kvc_mac_equal(pub->token, pl->pub_token, KVC_TOKEN_LEN)) {
        pull_deny(a, ep, pl, pub ? "wrong token" : "unknown or expired publication");
        return NULL;
    }
    /* Only blocks of this publication, and no more of them than it holds:
     * that bounds what one pull can make this producer send. */
    uint64_t total = 0;
    for (size_t i = 0; i < pl->n; i++) {
        const kvc_run_t *run = &pl->runs[i];
        total += run->count;
        if (run->count == 0 || run->remote >= a->num_blocks ||
            run->count > a->num_blocks - run->remote || total > pub->n ||
            !kvc_pub_has_run(pub, run->remote, run->count)) {
            char m[160];
            snprintf(m, sizeof(m), "blocks [%llu,+%llu) are not all part of the publication",
                     (unsigned long long)run->remote, (unsigned long long)run->count);
            pull_deny(a, ep, pl, m);
            return NULL;
        }
    }
    /* Every rank of a larger decode TP pulls before the first one notifies:
     * the ranks the pull says there are, or the count the engine gave. */
    uint32_t ranks = pl->tp > a->tp_size ? pl->tp / a->tp_size : 1;
    if (ranks > MAX_RANKS) ranks = MAX_RANKS;
    if (pub->consumers > ranks) ranks = pub->consumers > MAX_RANKS ? MAX_RANKS : pub->consumers;
    uint32_t max_pulls = ranks * 2 > PULLS_PER_PUB_MIN ? ranks * 2 : PULLS_PER_PUB_MIN;
    if (pub->pulls >= max_pulls) {
        pull_deny(a, ep, pl, "pulled too many times already");
        return NULL;
    }
    for (size_t r = 0; r < a->n_regions && pl->parts > 1; r++)
        if (a->regions[r].block_len % pl->parts || a->regions[r].staged) {
            a->stats[KVC_STAT_DENIED]++;
            KVC_LOG(a, KVC_LOG_WARN,
                    "push: pull for req=%s refused: region %zu (block_len %zu%s) cannot be read "
                    "in %u parts",
                    pub->id, r, a->regions[r].block_len, a->regions[r].staged ? ", staged" : "",
                    pl->parts);
            push_refuse(a, ep, pl,
                        a->regions[r].staged ? KVC_ERR_UNSUPPORTED : KVC_ERR_INCOMPATIBLE);
            return NULL;
        }
    kvc_pub_lease_renew(a, pub); /* a fetch in flight renews the lease */
    *bytes = 0;
    if (pl->flags & KVC_PULL_HOLD) return pub; /* nothing is sent */
    for (size_t r = 0; r < a->n_regions; r++)
        *bytes += total * (a->regions[r].block_len / pl->parts);
    if (a->push_bytes && *bytes > MAX_PUSH_BYTES - a->push_bytes) {
        a->stats[KVC_STAT_DENIED]++;
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN, "push: pull for req=%s refused: %llu bytes already in flight",
                    pub->id, (unsigned long long)a->push_bytes);
        push_refuse(a, ep, pl, KVC_ERR_DENIED);
        return NULL;
    }
    return pub;
}

/* DATA messages one region of a pull takes. */
static size_t region_sends(const kvc_agent_t *a, const kvc_wire_pull_t *pl, size_t r) {
    uint64_t per = pl->parts > 1 ? 1 : a->push_chunk / a->regions[r].block_len;
    if (per == 0) per = 1;
    size_t n = 0;
    for (size_t i = 0; i < pl->n; i++)
        n += (size_t)((pl->runs[i].count + per - 1) / per);
    return n;
}

/* Sends region r of every run of a checked pull, in messages of up to
 * push_chunk (one huge rendezvous over tcp is slower than a stream of a
 * few MiB each); *k: the job's headers used so far.  False when a send
 * failed (the consumer's endpoint error or timeout then ends its fetch). */
static bool issue_region(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_pull_t *pl, push_job_t *j,
                         size_t r, size_t *k) {
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = push_cb;
    rp.user_data = j;
    if (pl->flags & KVC_PULL_RNDV) {
        rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        rp.flags = UCP_AM_SEND_FLAG_RNDV;
    }
    bool sliced = pl->parts > 1; /* one message per block: its part is not contiguous
                                    with the next block's */
    kvc_region_t *rg = &a->regions[r];
    uint64_t per = sliced ? 1 : a->push_chunk / rg->block_len;
    if (per == 0) per = 1;
    size_t part_len = rg->block_len / pl->parts;
    for (size_t i = 0; i < pl->n; i++) {
        const kvc_run_t *run = &pl->runs[i];
        for (uint64_t off = 0; off < run->count; off += per, (*k)++) {
            uint64_t cnt = run->count - off < per ? run->count - off : per;
            kvc_wire_data_hdr_t h = {pl->xfer_id, (uint32_t)r, 0, run->local + off, cnt, {0}};
            memcpy(h.token, pl->xfer_token, KVC_TOKEN_LEN);
            kvc_wire_encode_data_hdr(j->hdr[*k], &h);
            uint64_t at;
            if (!kvc_slice_at(rg->block_len, a->num_blocks, run->remote + off,
                              sliced ? pl->part : 0, sliced ? part_len : rg->block_len, &at))
                return false; /* pull_check let no such run through */
            const uint8_t *src = (const uint8_t *)rg->base + at;
            j->refs++;
            a->push_inflight++;
            ucs_status_ptr_t s =
                ucp_am_send_nbx(ep, KVC_AM_DATA, j->hdr[*k], KVC_WIRE_DATA_HDR_LEN, src,
                                sliced ? part_len : cnt * rg->block_len, &rp);
            if (UCS_PTR_IS_PTR(s)) continue;
            j->refs--;
            a->push_inflight--;
            if (UCS_PTR_IS_ERR(s)) {
                KVC_LOG(a, KVC_LOG_WARN, "push: send for fetch %llu failed: %s",
                        (unsigned long long)pl->xfer_id, ucs_status_string(UCS_PTR_STATUS(s)));
                return false;
            }
        }
    }
    return true;
}

/* The END of a pull that sent k DATA messages. */
static void issue_end(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_pull_t *pl, size_t k) {
    kvc_wire_data_hdr_t end = {pl->xfer_id, KVC_DATA_END, 0, 0, k, {0}};
    memcpy(end.token, pl->xfer_token, KVC_TOKEN_LEN);
    push_hdr_only(a, ep, &end);
}

/* Takes a layer-wise push off the list: its job's reference goes (the
 * publication's blocks come back once its sends end). */
static void defer_drop(kvc_agent_t *a, defer_t *d) {
    defer_t **pp = &a->defers;
    while (*pp != d)
        pp = &(*pp)->next;
    *pp = d->next;
    kvc_cons_unref(d->cons);
    if (--d->j->refs == 0) job_free(d->j);
    defer_free(d);
}

/* Sends the regions of d that became ready; the END once all went out.  A
 * publication that ended first refuses the fetch: TIMED_OUT when it
 * expired (its producer did not complete it in time), else DENIED. */
static void defer_advance(kvc_agent_t *a, defer_t *d) {
    kvc_pub_t *pub = d->j->pub;
    ucp_ep_h ep = d->cons->dead ? NULL : d->cons->ep;
    if (!ep) { /* nobody to answer: its fetch fails on the endpoint error */
        KVC_LOG(a, KVC_LOG_WARN, "push: consumer %s gone, layer-wise push for req=%s dropped",
                d->cons->engine_id, pub->id);
        defer_drop(a, d);
        return;
    }
    if (pub->released) {
        kvc_status_t st = pub->rel_type == KVC_EV_EXPIRED ? KVC_ERR_TIMED_OUT : KVC_ERR_DENIED;
        KVC_LOG(a, KVC_LOG_WARN,
                "push: req=%s ended with %zu of %zu regions ready, fetch %llu refused (%s)",
                pub->id, a->n_regions - pub->unready, a->n_regions,
                (unsigned long long)d->pl.xfer_id, kvc_status_str(st));
        push_refuse(a, ep, &d->pl, st);
        defer_drop(a, d);
        return;
    }
    if (d->nsent + pub->unready == a->n_regions) return; /* nothing new */
    for (size_t r = 0; r < a->n_regions; r++) {
        if (!pub->ready[r] || d->sent[r]) continue;
        d->sent[r] = 1;
        d->nsent++;
        if (!issue_region(a, ep, &d->pl, d->j, r, &d->k)) {
            defer_drop(a, d);
            return;
        }
    }
    if (d->nsent < a->n_regions) return;
    issue_end(a, ep, &d->pl, d->k);
    defer_drop(a, d);
}

/* A pull of a layer-wise publication that is not complete: what is ready
 * goes now, the rest as it comes (defer_advance), on our own endpoint to
 * the consumer.  Holds the issuing reference of j. */
static void defer_start(kvc_agent_t *a, kvc_cons_t *cons, ucp_ep_h ep, const kvc_wire_pull_t *pl,
                        push_job_t *j) {
    defer_t *d = calloc(1, sizeof(*d));
    kvc_status_t st = KVC_ERR_NO_MEMORY;
    if (d && (d->sent = calloc(a->n_regions, 1)) &&
        (d->pl.runs = malloc(pl->n * sizeof(kvc_run_t) + 1)))
        st = kvc_cons_ep(cons) ? KVC_OK : KVC_ERR_TRANSPORT;
    if (st != KVC_OK) {
        if (d) defer_free(d);
        push_refuse(a, ep, pl, st);
        if (--j->refs == 0) job_free(j);
        return;
    }
    kvc_run_t *runs = d->pl.runs;
    d->pl = *pl;
    d->pl.runs = runs;
    memcpy(runs, pl->runs, pl->n * sizeof(kvc_run_t));
    d->pl.request_id = (kvc_span_t){0};
    d->cons = cons;
    kvc_cons_ref(cons);
    d->j = j;
    d->next = a->defers;
    a->defers = d;
    KVC_LOG(a, KVC_LOG_DEBUG, "push: fetch %llu for req=%s sends its regions as they are ready",
            (unsigned long long)pl->xfer_id, j->pub->id);
    defer_advance(a, d);
}

/* Serves a checked pull: its DATA, region by region, then the END; a
 * layer-wise publication that is not complete yet through defer_start. */
static void pull_issue(kvc_agent_t *a, kvc_cons_t *cons, ucp_ep_h ep, const kvc_wire_pull_t *pl,
                       kvc_pub_t *pub, uint64_t bytes) {
    pub->pulls++;
    size_t nsend = 0;
    for (size_t r = 0; r < a->n_regions; r++)
        nsend += region_sends(a, pl, r);
    if (nsend == 0) return;
    push_job_t *j = job_new(a, nsend);
    if (!j) {
        push_refuse(a, ep, pl, KVC_ERR_NO_MEMORY);
        return;
    }
    j->refs = 1; /* held while issuing */
    j->bytes = bytes;
    j->pub = pub;
    kvc_pub_push_begin(pub);
    a->push_bytes += bytes;
    if (pub->unready) {
        defer_start(a, cons, ep, pl, j);
        return;
    }
    size_t k = 0;
    bool ok = true;
    for (size_t r = 0; r < a->n_regions && ok; r++)
        ok = issue_region(a, ep, pl, j, r, &k);
    if (ok) issue_end(a, ep, pl, k);
    if (--j->refs == 0) job_free(j);
}

/* Confirms a one-sided read of a checked publication: its blocks are held
 * for this fetch until the transfer deadline. */
static void pull_hold(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_pull_t *pl, kvc_pub_t *pub) {
    if (pub->cap) { /* the engine's writes (publish.c capture) end before any read */
        unsigned syncs = 0;
        kvc_status_t st = kvc_cuda_capture_wait(pub->cap, &syncs);
        a->stats[KVC_STAT_CUDA_SYNCS] += syncs;
        if (st != KVC_OK) { /* kept: every read of it is refused */
            KVC_LOG(a, KVC_LOG_WARN, "pull for req=%s: the publication's CUDA writes: %s", pub->id,
                    kvc_cuda_last_error(a->cuda));
            push_refuse(a, ep, pl, st);
            return;
        }
        kvc_cuda_capture_put(pub->cap);
        pub->cap = NULL;
    }
    uint64_t deadline = kvc_now_ns() + (uint64_t)a->xfer_timeout_ms * 1000000ull;
    if (kvc_pub_hold(a, pub, pl->xfer_id, pl->xfer_token, deadline) != KVC_OK) {
        push_refuse(a, ep, pl, KVC_ERR_NO_MEMORY);
        return;
    }
    pub->pulls++;
    kvc_wire_data_hdr_t end = {pl->xfer_id, KVC_DATA_END, 0, 0, 0, {0}};
    memcpy(end.token, pl->xfer_token, KVC_TOKEN_LEN);
    push_hdr_only(a, ep, &end);
}

/* A pull of no blocks (a notify-only fetch registered before publication,
 * KVC_PULL_WAIT): the publication exists now, an END says so and its
 * notification follows. */
static void pull_end(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_pull_t *pl) {
    kvc_wire_data_hdr_t end = {pl->xfer_id, KVC_DATA_END, 0, 0, 0, {0}};
    memcpy(end.token, pl->xfer_token, KVC_TOKEN_LEN);
    push_hdr_only(a, ep, &end);
}

static void pull_ready(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_pull_t *pl, kvc_pub_t *pub) {
    pub->pulls++;
    pull_end(a, ep, pl);
}

/* The read ended: an END if its hold was intact, else a refusal. */
static void pull_unhold(kvc_agent_t *a, ucp_ep_h ep, const kvc_wire_pull_t *pl) {
    if (kvc_pub_unhold(a, (const char *)pl->request_id.p, pl->request_id.len, pl->xfer_id,
                       pl->xfer_token) != KVC_OK) {
        pull_deny(a, ep, pl, "no intact hold for this read (released or too late)");
        return;
    }
    kvc_wire_data_hdr_t end = {pl->xfer_id, KVC_DATA_END, 0, 0, 0, {0}};
    memcpy(end.token, pl->xfer_token, KVC_TOKEN_LEN);
    push_hdr_only(a, ep, &end);
}

/* A lease renewal: no answer either way (a refusal is counted and logged). */
static void pull_renew(kvc_agent_t *a, const kvc_wire_pull_t *pl) {
    kvc_pub_t *pub = kvc_pubtab_find(&a->pubs, (const char *)pl->request_id.p, pl->request_id.len);
    if (!pub) { /* not published yet (decode queued before prefill's worker
                   published: nothing to renew) or already ended */
        KVC_LOG(a, KVC_LOG_DEBUG, "lease renewal for req=%.*s: no such publication now",
                (int)pl->request_id.len, (const char *)pl->request_id.p);
        return;
    }
    if (!kvc_mac_equal(pub->token, pl->pub_token, KVC_TOKEN_LEN)) {
        a->stats[KVC_STAT_DENIED]++;
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN, "lease renewal for req=%s refused: wrong token", pub->id);
        return;
    }
    a->stats[KVC_STAT_LEASE_RENEWALS]++;
    kvc_pub_lease_renew(a, pub);
}

/* Positions (KVC_RUN_TAIL) to the publication's last blocks, once it
 * exists; before that the pull is held (or refused) as it is.  False: more
 * positions than published blocks, or out of memory (refused). */
static bool tail_resolve(kvc_agent_t *a, kvc_wire_pull_t *pl) {
    uint64_t total = 0;
    bool any = false;
    for (size_t i = 0; i < pl->n; i++) {
        any |= (pl->runs[i].remote & KVC_RUN_TAIL) != 0;
        if (pl->runs[i].count > (uint64_t)SIZE_MAX - total) return false;
        total += pl->runs[i].count;
    }
    if (!any) return true;
    kvc_pub_t *pub = kvc_pubtab_find(&a->pubs, (const char *)pl->request_id.p, pl->request_id.len);
    if (!pub) return true;
    if (total > pub->n) return false;
    uint64_t *rem = malloc((size_t)total * sizeof(uint64_t) + 1);
    uint64_t *loc = malloc((size_t)total * sizeof(uint64_t) + 1);
    size_t k = 0;
    bool ok = rem && loc;
    for (size_t i = 0; ok && i < pl->n; i++) {
        const kvc_run_t *run = &pl->runs[i];
        for (uint64_t j = 0; j < run->count; j++, k++) {
            uint64_t pos = (run->remote & ~KVC_RUN_TAIL) + j;
            if (!(run->remote & KVC_RUN_TAIL) || pos >= total) {
                ok = false;
                break;
            }
            rem[k] = pub->blocks[pub->n - total + pos];
            loc[k] = run->local + j;
        }
    }
    kvc_run_t *runs = NULL;
    size_t n = 0;
    if (ok) ok = kvc_coalesce(rem, loc, k, &runs, &n) == KVC_OK;
    free(rem);
    free(loc);
    if (!ok) return false;
    free(pl->runs);
    pl->runs = runs;
    pl->n = n;
    return true;
}

/* Whether a pull of a layer-wise publication waits until every region is
 * ready: one-sided reads and their CUDA IPC copies (the HOLD is their only
 * word from us), staged pushes (one pipelined job) and notify-only
 * registrations (their release must not overtake the writes).  Others are
 * pushed region by region (defer_start). */
static bool waits_whole(const kvc_agent_t *a, const kvc_wire_pull_t *pl) {
    return (pl->flags & KVC_PULL_HOLD) || pl->n == 0 || a->n_staged;
}

/* One parsed pull from consumer cons (NULL: a pull without KVC_PULL_CONS,
 * answered in its callback or refused, pull_unowned), answered now on ep
 * (the reply endpoint in the AM callback, cons's own endpoint later); msg/len:
 * its bytes (kept if it is held for its publication), NULL when it is
 * served from the held list. */
static void pull_serve(kvc_agent_t *a, kvc_cons_t *cons, ucp_ep_h ep, kvc_wire_pull_t *pl,
                       const void *msg, size_t len) {
    uint64_t bytes = 0;
    if (pl->flags & KVC_PULL_RENEW) {
        pull_renew(a, pl);
        return;
    }
    if (pl->flags & KVC_PULL_UNHOLD) {
        pull_unhold(a, ep, pl);
        return;
    }
    if (!tail_resolve(a, pl)) {
        pull_deny(a, ep, pl, "more blocks asked for than the publication holds");
        return;
    }
    kvc_pub_t *pub = pull_check(a, cons, ep, pl, &bytes, msg, len);
    if (pub && pub->unready && waits_whole(a, pl)) { /* served once it is complete */
        if (!cons)
            pull_unowned(a, ep, pl, "a wait for a layer-wise publication");
        else if (msg)
            pending_add(a, cons, pl, ep, msg, len, pub);
        return;
    }
    if (pub && (pl->flags & KVC_PULL_HOLD))
        pull_hold(a, ep, pl, pub);
    else if (pub && pl->n == 0) /* a notify-only fetch's registration: published now */
        pull_ready(a, ep, pl, pub);
    else if (pub && a->n_staged && !cons) /* staged chunks go out after the callback */
        pull_unowned(a, ep, pl, "a staged push");
    else if (pub && a->n_staged) { /* through the pinned pool, pipelined (stage.c) */
        pub->pulls++;
        kvc_stage_push(a, cons, ep, pl, pl->runs, pl->n);
        pl->runs = NULL; /* the staged job owns them now */
    } else if (pub && pub->unready && !cons)
        pull_unowned(a, ep, pl, "a layer-wise push");
    else if (pub)
        pull_issue(a, cons, ep, pl, pub, bytes);
}

/* ------------------------------------------------ held registrations -- */


static void pending_free(kvc_agent_t *a, pending_t *p) {
    a->n_pending--;
    a->pending_bytes -= p->len;
    p->cons->held--;
    p->cons->held_bytes -= p->len;
    p->cons->src->held--;
    p->cons->src->held_bytes -= p->len;
    kvc_cons_unref(p->cons);
    free(p->msg);
    free(p->id);
    free(p);
}

/* Takes a held fetch of consumer v off the list (its newest) to make room
 * for another consumer's: refused KVC_ERR_BUSY on v's endpoint. */
static void pending_evict(kvc_agent_t *a, kvc_cons_t *v, const char *why) {
    pending_t **pp = &a->pending;
    while (*pp && (*pp)->cons != v)
        pp = &(*pp)->next;
    pending_t *p = *pp;
    if (!p) return;
    *pp = p->next;
    a->stats[KVC_STAT_PENDING_REFUSED]++;
    if (kvc_log_ratelimit(a, KVC_RL_DENIED))
        KVC_LOG(a, KVC_LOG_WARN,
                "push: held registration for req=%s of consumer %s from %s refused: %s, it "
                "holds more than the one that takes its place",
                p->id, v->engine_id, v->src->addr, why);
    kvc_wire_pull_t pl;
    if (v->ep && kvc_wire_parse_pull(p->msg, p->len, &pl) == KVC_OK) {
        push_refuse(a, v->ep, &pl, KVC_ERR_BUSY);
        free(pl.runs);
    }
    pending_free(a, p);
}

/* Room for one more held fetch of cons (len bytes) within the bounds: per
 * source address, in total, in bytes.  At a bound, a held fetch of whoever
 * holds more than cons's share gives way (kvc_cons_heaviest): an honest
 * consumer always gets its share, whatever keys or connections others
 * invent.  NULL: room; else why not. */
static const char *pending_make_room(kvc_agent_t *a, kvc_cons_t *cons, size_t len) {
    if (len > a->max_pending_bytes) return "larger than the memory bound of held registrations";
    for (int evicted = 0; evicted < 64; evicted++) {
        const char *why = NULL;
        kvc_cons_t *v = NULL;
        if (cons->src->held >= a->max_pending_peer) {
            why = "too many held registrations from this source address";
            v = kvc_cons_heaviest(a, cons, 1, false, true);
        } else if (a->n_pending >= a->max_pending) {
            why = "too many held registrations";
            v = kvc_cons_heaviest(a, cons, 1, false, false);
        } else if (len > a->max_pending_bytes - a->pending_bytes) {
            why = "held registrations over their memory bound";
            v = kvc_cons_heaviest(a, cons, len, true, false);
        } else {
            return NULL;
        }
        if (!v) return why;
        pending_evict(a, v, why);
    }
    return "held registrations over their memory bound";
}

/* whole: the layer-wise publication it waits to be complete (bounded by
 * that publication's end), else NULL (a registration before publication). */
static bool pending_add(kvc_agent_t *a, kvc_cons_t *cons, const kvc_wire_pull_t *pl,
                        ucp_ep_h ep, const void *msg, size_t len, const kvc_pub_t *whole) {
    const char *why = pending_make_room(a, cons, len);
    if (why) {
        a->stats[KVC_STAT_PENDING_REFUSED]++;
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN, "push: registration for req=%.*s refused: %s (%zu held)",
                    (int)pl->request_id.len, (const char *)pl->request_id.p, why, a->n_pending);
        push_refuse(a, ep, pl, KVC_ERR_BUSY);
        return true; /* answered */
    }
    if (!kvc_cons_ep(cons)) {
        push_refuse(a, ep, pl, KVC_ERR_TRANSPORT);
        return true;
    }
    pending_t *p = calloc(1, sizeof(*p));
    if (!p || !(p->msg = malloc(len)) ||
        !(p->id = kvc_strndup((const char *)pl->request_id.p, pl->request_id.len))) {
        if (p) free(p->msg);
        free(p);
        push_refuse(a, ep, pl, KVC_ERR_NO_MEMORY);
        return true;
    }
    memcpy(p->msg, msg, len);
    p->len = len;
    p->cons = cons;
    kvc_cons_ref(cons);
    cons->held++;
    cons->held_bytes += len;
    cons->src->held++;
    cons->src->held_bytes += len;
    uint32_t ms = pl->wait_ms && pl->wait_ms < a->pending_fetch_ms ? pl->wait_ms : a->pending_fetch_ms;
    p->deadline_ns = kvc_now_ns() + (uint64_t)ms * 1000000ull;
    if ((p->whole = whole != NULL)) p->deadline_ns = whole->hard_deadline_ns;
    p->next = a->pending;
    a->pending = p;
    a->n_pending++;
    a->pending_bytes += len;
    a->stats[KVC_STAT_PENDING_FETCHES] = a->n_pending;
    KVC_LOG(a, KVC_LOG_DEBUG, "push: fetch %llu for req=%s held until its publication (%u ms)",
            (unsigned long long)pl->xfer_id, p->id, ms);
    kvc_wake(a); /* the timer takes its deadline */
    return true;
}

/* Serves the held pulls whose publication exists now. */
static void pending_serve(kvc_agent_t *a) {
    a->pending_check = false;
    pending_t **pp = &a->pending;
    while (*pp) {
        pending_t *p = *pp;
        /* A dead consumer's pulls wait for kvc_cons_sweep to drop them. */
        kvc_pub_t *pub = p->cons->dead ? NULL : kvc_pubtab_find(&a->pubs, p->id, strlen(p->id));
        kvc_wire_pull_t pl;
        bool parsed = pub && kvc_wire_parse_pull(p->msg, p->len, &pl) == KVC_OK;
        if (!pub || (parsed && pub->unready && waits_whole(a, &pl))) {
            if (parsed) free(pl.runs);
            pp = &p->next;
            continue;
        }
        *pp = p->next;
        if (parsed) {
            a->stats[KVC_STAT_PENDING_SERVED]++;
            KVC_LOG(a, KVC_LOG_DEBUG, "push: held fetch %llu for req=%s served on publish",
                    (unsigned long long)pl.xfer_id, p->id);
            pull_serve(a, p->cons, p->cons->ep, &pl, NULL, 0);
            free(pl.runs);
        }
        pending_free(a, p);
    }
    a->stats[KVC_STAT_PENDING_FETCHES] = a->n_pending;
}

/* Drops the held pulls of consumers whose endpoint failed (consumer.c):
 * nobody to answer; their count and bytes are returned. */
static void pending_drop_dead(kvc_agent_t *a) {
    pending_t **pp = &a->pending;
    while (*pp) {
        pending_t *p = *pp;
        if (!p->cons->dead) {
            pp = &p->next;
            continue;
        }
        *pp = p->next;
        KVC_LOG(a, KVC_LOG_WARN, "push: consumer %s gone, held fetch for req=%s dropped",
                p->cons->engine_id, p->id);
        pending_free(a, p);
    }
}

void kvc_pending_timers(kvc_agent_t *a, uint64_t now, uint64_t *next) {
    pending_drop_dead(a);
    if (a->pending_check) pending_serve(a);
    for (defer_t *d = a->defers, *nx; d; d = nx) {
        nx = d->next;
        defer_advance(a, d);
    }
    pending_t **pp = &a->pending;
    while (*pp) {
        pending_t *p = *pp;
        /* Held for a layer-wise publication that ended incomplete. */
        bool ended = p->whole && !kvc_pubtab_find(&a->pubs, p->id, strlen(p->id));
        if (p->deadline_ns > now && !ended) {
            if (p->deadline_ns < *next) *next = p->deadline_ns;
            pp = &p->next;
            continue;
        }
        *pp = p->next;
        kvc_wire_pull_t pl;
        if (p->cons->dead) {
            /* nobody to answer */
        } else if (ended && kvc_wire_parse_pull(p->msg, p->len, &pl) == KVC_OK) {
            KVC_LOG(a, KVC_LOG_WARN,
                    "push: fetch %llu for req=%s refused: the publication ended before all its "
                    "regions were ready",
                    (unsigned long long)pl.xfer_id, p->id);
            push_refuse(a, p->cons->ep, &pl, KVC_ERR_DENIED);
            free(pl.runs);
        } else if (!ended && kvc_wire_parse_pull(p->msg, p->len, &pl) == KVC_OK) {
            a->stats[KVC_STAT_PENDING_EXPIRED]++;
            KVC_LOG(a, KVC_LOG_WARN,
                    "push: fetch %llu registered for req=%s never met its publication, refused",
                    (unsigned long long)pl.xfer_id, p->id);
            push_refuse(a, p->cons->ep, &pl, KVC_ERR_TIMED_OUT);
            free(pl.runs);
        }
        pending_free(a, p);
    }
    a->stats[KVC_STAT_PENDING_FETCHES] = a->n_pending;
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
    kvc_wire_pull_t pl;
    if (kvc_wire_parse_pull(data, len, &pl) != KVC_OK) {
        a->stats[KVC_STAT_DENIED]++;
        if (kvc_log_ratelimit(a, KVC_RL_DENIED))
            KVC_LOG(a, KVC_LOG_WARN, "push: malformed pull request (%zu bytes), dropped", len);
        return UCS_OK;
    }
    kvc_cons_t *c = NULL;
    if (pl.flags & KVC_PULL_CONS) {
        /* What is sent in this callback goes on the reply endpoint (valid
         * until we return; UCX ends the sends still queued on it if it goes,
         * and a consumer that closes its endpoint cancels them); whatever is
         * sent later (a held pull, a staged job) on our own endpoint to the
         * consumer, which the jobs reference. */
        if ((c = kvc_cons_find(a, pl.cons_key))) {
            c->used_ns = kvc_now_ns();
        } else {
            a->stats[KVC_STAT_DENIED]++;
            if (kvc_log_ratelimit(a, KVC_RL_DENIED))
                KVC_LOG(a, KVC_LOG_WARN,
                        "push: pull for req=%.*s from an unknown or lost consumer (key %016llx), "
                        "refused",
                        (int)pl.request_id.len, (const char *)pl.request_id.p,
                        (unsigned long long)pl.cons_key);
            push_refuse(a, param->reply_ep, &pl, KVC_ERR_PEER_FAILED);
            free(pl.runs);
            return UCS_OK;
        }
    }
    pull_serve(a, c, param->reply_ep, &pl, data, len);
    free(pl.runs);
    return UCS_OK;
}



kvc_status_t kvc_push_register_am(kvc_agent_t *a) {
    return kvc_set_am_handler(a, KVC_AM_PULL, pull_cb);
}
