/* Expiry of published requests: a list sorted by deadline (usually appended
 * at the tail, since most requests use the agent's expiry_ms), swept on each
 * progress; the head's deadline feeds the agent's timer. */
#include "kvc_int.h"

void kvc_expiry_insert(kvc_pubtab_t *t, kvc_pub_t *p) {
    kvc_pub_t *at = t->etail;
    while (at && at->deadline_ns > p->deadline_ns)
        at = at->eprev;
    p->eprev = at;
    p->enext = at ? at->enext : t->ehead;
    if (p->enext)
        p->enext->eprev = p;
    else
        t->etail = p;
    if (at)
        at->enext = p;
    else
        t->ehead = p;
}

void kvc_expiry_remove(kvc_pubtab_t *t, kvc_pub_t *p) {
    if (p->eprev)
        p->eprev->enext = p->enext;
    else
        t->ehead = p->enext;
    if (p->enext)
        p->enext->eprev = p->eprev;
    else
        t->etail = p->eprev;
    p->eprev = p->enext = NULL;
}

void kvc_expiry_run(kvc_agent_t *a, uint64_t now, uint64_t *next) {
    kvc_pub_t *p;
    while ((p = a->pubs.ehead) && p->deadline_ns <= now) {
        kvc_pubtab_remove(&a->pubs, p);
        a->stats[KVC_STAT_EXPIRED]++;
        KVC_LOG(a, KVC_LOG_WARN, "Releasing expired KV blocks for request req=%s blocks=%zu", p->id,
                p->n);
        kvc_event_push(a, KVC_EV_EXPIRED, KVC_ERR_TIMED_OUT, 0, p->user_data, p->id, p->blocks,
                       p->n, 0, "not claimed before expiry");
        kvc_pub_free(p);
    }
    if (p && p->deadline_ns < *next) *next = p->deadline_ns;
}
