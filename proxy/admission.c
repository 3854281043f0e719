/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/admission.h"

#include <stdlib.h>

#include "base/util.h"

int px_adm_class_of(long long priority) {
    if (priority < 0) return 0;
    if (priority >= PX_ADM_CLASSES) return PX_ADM_CLASSES - 1;
    return (int)priority;
}

void px_admq_init(px_admq *q, const uint32_t *weights, size_t ntenants, size_t max_n,
                  size_t max_bytes) {
    *q = (px_admq){.weights = weights, .ntenants = ntenants, .max_n = max_n,
                   .max_bytes = max_bytes};
    for (int c = 0; c < PX_ADM_CLASSES; c++)
        q->cls[c].flows = px_xcalloc(ntenants ? ntenants : 1, sizeof(px_adm_flow));
}

void px_admq_cleanup(px_admq *q) {
    for (int c = 0; c < PX_ADM_CLASSES; c++) {
        free(q->cls[c].flows);
        q->cls[c].flows = NULL;
    }
}

static void activate(px_adm_class *c, px_adm_flow *f) {
    f->active = 1;
    f->anext = NULL;
    f->aprev = c->atail;
    if (c->atail)
        c->atail->anext = f;
    else
        c->ahead = f;
    c->atail = f;
    c->nactive++;
}

static void deactivate(px_adm_class *c, px_adm_flow *f) {
    if (f->aprev)
        f->aprev->anext = f->anext;
    else
        c->ahead = f->anext;
    if (f->anext)
        f->anext->aprev = f->aprev;
    else
        c->atail = f->aprev;
    f->anext = f->aprev = NULL;
    f->active = 0;
    f->credit = 0;
    c->nactive--;
}

/* The head flow to the tail of the active list: its turn is over. */
static void rotate(px_adm_class *c) {
    px_adm_flow *f = c->ahead;
    if (!f || c->nactive < 2) return;
    deactivate(c, f);
    uint32_t credit = f->credit;
    activate(c, f);
    f->credit = credit;
}

int px_admq_push(px_admq *q, px_adm_item *it) {
    if (q->n + 1 > q->max_n || (q->max_bytes && q->bytes + it->bytes > q->max_bytes)) {
        q->dropped++;
        return -1;
    }
    if (it->cls < 0 || it->cls >= PX_ADM_CLASSES) it->cls = px_adm_class_of(it->cls);
    if (it->tenant >= q->ntenants) it->tenant = q->ntenants ? q->ntenants - 1 : 0;
    px_adm_class *c = &q->cls[it->cls];
    px_adm_flow *f = &c->flows[it->tenant];
    it->next = NULL;
    it->prev = f->tail;
    if (f->tail)
        f->tail->next = it;
    else
        f->head = it;
    f->tail = it;
    if (!f->active) activate(c, f);
    it->queued = 1;
    c->n++;
    q->n++;
    q->bytes += it->bytes;
    q->pushed++;
    return 0;
}

void px_admq_remove(px_admq *q, px_adm_item *it) {
    if (!it->queued) return;
    px_adm_class *c = &q->cls[it->cls];
    px_adm_flow *f = &c->flows[it->tenant];
    if (it->prev)
        it->prev->next = it->next;
    else
        f->head = it->next;
    if (it->next)
        it->next->prev = it->prev;
    else
        f->tail = it->prev;
    it->prev = it->next = NULL;
    it->queued = 0;
    if (!f->head) deactivate(c, f);
    c->n--;
    q->n--;
    q->bytes -= it->bytes;
}

px_adm_item *px_admq_pop(px_admq *q, int (*ok)(void *arg, px_adm_item *it), void *arg) {
    for (int ci = 0; ci < PX_ADM_CLASSES && q->n; ci++) {
        px_adm_class *c = &q->cls[ci];
        /* Each active flow is looked at once at most. */
        for (size_t i = 0, n = c->nactive; i < n; i++) {
            px_adm_flow *f = c->ahead;
            if (!f->credit) {
                uint32_t w = q->weights ? q->weights[f - c->flows] : 1;
                f->credit = w ? w : 1;
            }
            px_adm_item *it = f->head;
            if (ok && !ok(arg, it)) {
                rotate(c); /* keeps its credit for its next turn */
                continue;
            }
            f->credit--;
            int spent = f->credit == 0;
            px_admq_remove(q, it); /* deactivates f when it empties */
            if (f->active && spent) rotate(c);
            return it;
        }
    }
    return NULL;
}
