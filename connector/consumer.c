/* SPDX-License-Identifier: Apache-2.0 */
/* The producer's endpoints to its consumers.
 *
 * UCX hands an AM callback a reply endpoint, but that endpoint is UCX's:
 * one it created for the remote worker, which it destroys when that peer
 * closes or fails (UCX 1.13, ucp_ep.c ucp_ep_set_failed: "destroy endpoint
 * which is not exposed to a user due to peer failure").  Whatever the
 * producer sends after the callback (a held pull served on publish, staged
 * chunks, pushes) must therefore go on an endpoint it owns.  A consumer
 * that says KVC_HFLAG_OWNER sends its worker address (sealed, after AUTH);
 * the producer keeps it under the consumer's key, which every pull of that
 * consumer names, and opens an endpoint to it, with its own error handler,
 * the first time it keeps a pull of that consumer past the callback (held
 * or staged).  Pulls answered at once stay on the reply endpoint: a
 * connection of our own beside the consumer's would keep that one's
 * transport up when the consumer closes its endpoint to cancel a fetch
 * (UCX tcp shares one socket between the two directions).  When the
 * endpoint fails the record is marked dead: push.c drops its held pulls
 * (their bounds and counts returned) and stage.c its staged jobs on their
 * next turn, and this file's sweep closes the endpoint with force (sends in flight complete as cancelled,
 * which ends their push jobs and hands blocks back), and the record is
 * freed once nothing references it.
 *
 * Records are bounded in all and per source address (the key is the
 * consumer's own choice, the address is not): at a bound, a record nothing
 * references gives way, least recently used first (kvc_cons_attach), so
 * neither handshakes with fresh keys nor decode agents that restart with
 * new ones fill the table for good.  A consumer whose record went that way
 * is refused its next pull (KVC_ERR_PEER_FAILED) and handshakes again.
 *
 * The producer connects only to a worker address that came inside the
 * authenticated, sealed side channel (a relay cannot substitute one); with
 * no cluster secret, any client that reaches the side channel could name an
 * address, as it could already pull anything published. */
#include "connector/kvc_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void src_unref(kvc_agent_t *a, kvc_src_t *s) {
    if (--s->refs > 0) return;
    for (kvc_src_t **pp = &a->srcs; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    free(s);
}

/* The record of source address addr, created if needed; NULL: no memory. */
static kvc_src_t *src_get(kvc_agent_t *a, const char *addr) {
    for (kvc_src_t *s = a->srcs; s; s = s->next)
        if (!strcmp(s->addr, addr)) return s;
    kvc_src_t *s = calloc(1, sizeof(*s));
    if (!s) return NULL;
    snprintf(s->addr, sizeof(s->addr), "%s", addr);
    s->next = a->srcs;
    a->srcs = s;
    return s;
}

static void cons_free(kvc_cons_t *c) {
    if (c->src) src_unref(c->a, c->src);
    free(c->addr);
    free(c->engine_id);
    free(c);
}

static void *ep_close_force(ucp_ep_h ep) {
    ucp_request_param_t rp;
    memset(&rp, 0, sizeof(rp));
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void *req = ucp_ep_close_nbx(ep, &rp);
    return UCS_PTR_IS_PTR(req) ? req : NULL;
}

void kvc_cons_retire(kvc_cons_t *c) {
    if (c->dead) return;
    c->dead = true;
    c->src->live--;
    c->a->n_cons--;
    c->a->cons_check = true;
}

/* Runs from ucp_worker_progress: only marks (the sweep does the rest, never
 * inside a UCX callback). */
static void cons_err_cb(void *arg, ucp_ep_h ep, ucs_status_t us) {
    (void)ep;
    kvc_cons_t *c = arg;
    kvc_agent_t *a = c->a;
    if (c->dead) return;
    kvc_cons_retire(c);
    a->stats[KVC_STAT_CONSUMERS_LOST]++;
    KVC_LOG(a, KVC_LOG_INFO, "consumer %s (key %016llx): endpoint failed: %s",
            c->engine_id ? c->engine_id : "?", (unsigned long long)c->key,
            ucs_status_string(us));
    kvc_wake(a);
}

kvc_cons_t *kvc_cons_find(kvc_agent_t *a, uint64_t key) {
    for (kvc_cons_t *c = a->conss; c; c = c->next)
        if (c->key == key && !c->dead) return c;
    return NULL;
}

void kvc_cons_ref(kvc_cons_t *c) {
    c->refs++;
}

void kvc_cons_unref(kvc_cons_t *c) {
    if (--c->refs > 0) return;
    /* Only unlisted records reach 0 (the list holds a reference), and those
     * had their endpoint close started; a close still running keeps it. */
    if (c->close_req) {
        c->refs = 1; /* the sweep finishes it */
        return;
    }
    cons_free(c);
}

/* The least recently used live record of s that nothing references, or NULL. */
static kvc_cons_t *lru_idle(kvc_agent_t *a, const kvc_src_t *s) {
    kvc_cons_t *v = NULL;
    for (kvc_cons_t *c = a->conss; c; c = c->next)
        if (c->src == s && !c->dead && c->refs == 1 && (!v || c->used_ns < v->used_ns)) v = c;
    return v;
}

/* Room for one more live record from s: true, possibly after retiring an
 * idle one; false: none can give way. */
static bool cons_make_room(kvc_agent_t *a, kvc_src_t *s) {
    const kvc_src_t *from = NULL;
    if (s->live >= a->max_cons_addr) {
        from = s;
    } else if (a->n_cons >= a->max_cons) {
        const kvc_src_t *most = NULL;
        for (const kvc_src_t *o = a->srcs; o; o = o->next)
            if (!most || o->live > most->live) most = o;
        /* never for a newcomer whose address would then hold more */
        if (most && (most == s || most->live > s->live)) from = most;
        if (!from) return false;
    } else {
        return true;
    }
    kvc_cons_t *v = lru_idle(a, from);
    if (!v) return false;
    KVC_LOG(a, KVC_LOG_INFO,
            "consumer %s (key %016llx) from %s forgotten, least recently used, for a new one "
            "from %s",
            v->engine_id, (unsigned long long)v->key, from->addr, s->addr);
    kvc_cons_retire(v);
    return true;
}

kvc_status_t kvc_cons_attach(kvc_agent_t *a, uint64_t key, const uint8_t *addr, size_t addr_len,
                             const char *engine_id, const char *src) {
    /* A consumer handshakes again only after it gave up its previous
     * endpoint to us (failed, cancelled, idle): the connection under our
     * endpoint to it may be going down with that one, so each handshake
     * gets a fresh endpoint and the key's older record is retired. */
    kvc_cons_t *old = kvc_cons_find(a, key);
    if (old) kvc_cons_retire(old);
    kvc_src_t *s = src_get(a, src);
    if (!s) return KVC_ERR_NO_MEMORY;
    s->refs++; /* held while room is made */
    kvc_status_t st = KVC_ERR_BUSY;
    kvc_cons_t *c = NULL;
    if (!cons_make_room(a, s)) goto err;
    st = KVC_ERR_NO_MEMORY;
    c = calloc(1, sizeof(*c));
    if (!c || !(c->addr = malloc(addr_len)) || !(c->engine_id = kvc_strdup(engine_id))) goto err;
    memcpy(c->addr, addr, addr_len);
    c->addr_len = addr_len;
    c->a = a;
    c->key = key;
    c->src = s;
    c->used_ns = kvc_now_ns();
    s->live++;
    c->refs = 1;
    c->next = a->conss;
    a->conss = c;
    a->n_cons++;
    KVC_LOG(a, KVC_LOG_DEBUG, "consumer %s (key %016llx) from %s known", engine_id,
            (unsigned long long)key, src);
    return KVC_OK;

err:
    if (c) {
        free(c->addr);
        free(c);
    }
    src_unref(a, s);
    return st;
}

kvc_cons_t *kvc_cons_heaviest(kvc_agent_t *a, const kvc_cons_t *c, size_t cost, bool by_bytes,
                              bool own_addr) {
#define WEIGHT(x) (by_bytes ? (x)->held_bytes : (size_t)(x)->held)
    const kvc_src_t *in = c->src;
    if (!own_addr) {
        const kvc_src_t *most = c->src;
        for (const kvc_src_t *o = a->srcs; o; o = o->next)
            if (WEIGHT(o) > WEIGHT(most)) most = o;
        if (most != c->src) {
            if (WEIGHT(most) < WEIGHT(c->src) + cost) return NULL;
            in = most;
        }
    }
    kvc_cons_t *v = NULL;
    for (kvc_cons_t *o = a->conss; o; o = o->next)
        if (o->src == in && !o->dead && o->held && (!v || WEIGHT(o) > WEIGHT(v))) v = o;
    if (!v || v == c || (in == c->src && WEIGHT(v) < WEIGHT(c) + cost)) return NULL;
    return v;
#undef WEIGHT
}

ucp_ep_h kvc_cons_ep(kvc_cons_t *c) {
    if (c->ep || c->dead) return c->ep;
    kvc_agent_t *a = c->a;
    /* Without peer-failure support (sm alone) the endpoint is still ours,
     * so sends on it stay safe; a dead consumer is then only noticed by
     * failed sends. */
    bool degraded;
    ucs_status_t us = kvc_ep_open(a, c->addr, cons_err_cb, c, &c->ep, &degraded);
    if (us != UCS_OK) {
        KVC_LOG(a, KVC_LOG_WARN, "consumer %s: endpoint to its worker: %s", c->engine_id,
                ucs_status_string(us));
        return NULL;
    }
    KVC_LOG(a, KVC_LOG_DEBUG, "consumer %s (key %016llx): endpoint of our own to its worker",
            c->engine_id, (unsigned long long)c->key);
    return c->ep;
}

void kvc_cons_sweep(kvc_agent_t *a) {
    if (!a->cons_check) return;
    a->cons_check = false;
    kvc_cons_t **pp = &a->conss;
    while (*pp) {
        kvc_cons_t *c = *pp;
        if (!c->dead) {
            pp = &c->next;
            continue;
        }
        if (c->ep) {
            c->close_req = ep_close_force(c->ep);
            c->ep = NULL;
        }
        if (c->close_req) { /* stays listed until the close completes */
            if (ucp_request_check_status(c->close_req) == UCS_INPROGRESS) {
                a->cons_check = true;
                kvc_wake(a);
                pp = &c->next;
                continue;
            }
            ucp_request_free(c->close_req);
            c->close_req = NULL;
        }
        *pp = c->next;
        kvc_cons_unref(c);
    }
}

void kvc_cons_close_all(kvc_agent_t *a) {
    for (kvc_cons_t *c = a->conss; c; c = c->next) {
        kvc_cons_retire(c);
        if (c->ep) {
            c->close_req = ep_close_force(c->ep);
            c->ep = NULL;
        }
    }
    /* Bounded: a close that does not complete is released with the worker. */
    uint64_t until = kvc_now_ns() + 1000000000ull;
    for (;;) {
        bool busy = false;
        for (kvc_cons_t *c = a->conss; c; c = c->next)
            if (c->close_req) {
                if (ucp_request_check_status(c->close_req) == UCS_INPROGRESS) {
                    busy = true;
                    continue;
                }
                ucp_request_free(c->close_req);
                c->close_req = NULL;
            }
        if (!busy || kvc_now_ns() >= until) break;
        ucp_worker_progress(a->worker);
    }
}

void kvc_cons_destroy(kvc_agent_t *a) {
    while (a->conss) {
        kvc_cons_t *c = a->conss;
        a->conss = c->next;
        cons_free(c); /* jobs that referenced it are gone already */
    }
    a->n_cons = 0;
}
