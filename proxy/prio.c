/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/prio.h"

#include <ctype.h>
#include <stdatomic.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/util.h"

int px_adm_class_of(long long priority) {
    if (priority < 0) return 0;
    if (priority >= PX_ADM_CLASSES) return PX_ADM_CLASSES - 1;
    return (int)priority;
}

int px_prio_number(const char *s, const char *end, long long *out) {
    char num[24];
    if (end <= s || (size_t)(end - s) >= sizeof num) return -1;
    memcpy(num, s, (size_t)(end - s));
    num[end - s] = 0;
    char *e;
    errno = 0;
    long long v = strtoll(num, &e, 10);
    if (*e || errno || e == num) return -1;
    *out = v;
    return 0;
}

static int prio_one(const char *spec, char *name, long long *lo, long long *hi, unsigned *share,
                    char *err, size_t errlen) {
    char buf[128];
    int bad = strlen(spec) >= sizeof buf;
    if (!bad) snprintf(buf, sizeof buf, "%s", spec);
    char *colon = bad ? NULL : strchr(buf, ':');
    char *range = colon ? colon + 1 : NULL;
    char *opt = range ? strchr(range, ':') : NULL;
    if (opt) *opt++ = 0;
    const char *dots = range ? strstr(range, "..") : NULL;
    size_t nlen = colon ? (size_t)(colon - buf) : 0;
    bad = bad || !colon || !nlen || nlen >= PX_PRIO_NAME_MAX;
    for (size_t i = 0; !bad && i < nlen; i++)
        bad = !(isalnum((unsigned char)buf[i]) || buf[i] == '-' || buf[i] == '_');
    /* A name is not a number, so "x-priority: 3" is never read as a name. */
    if (!bad && (isdigit((unsigned char)buf[0]) || buf[0] == '-')) bad = 1;
    if (!bad && dots)
        bad = px_prio_number(range, dots, lo) < 0 ||
              px_prio_number(dots + 2, range + strlen(range), hi) < 0 || *lo > *hi;
    else if (!bad) {
        bad = px_prio_number(range, range + strlen(range), lo) < 0;
        *hi = *lo;
    }
    *share = 0;
    long long sh = 0;
    if (!bad && opt)
        bad = strncmp(opt, "share=", 6) || px_prio_number(opt + 6, opt + strlen(opt), &sh) < 0 ||
              sh < 1 || sh > 1000;
    if (bad) {
        snprintf(err, errlen,
                 "--priority-class '%s': expected NAME:LO..HI or NAME:P, then optionally "
                 ":share=N (NAME letters, digits, - and _, not starting with a digit or -, under "
                 "%d bytes; LO <= HI integers; N 1..1000)",
                 spec, PX_PRIO_NAME_MAX);
        return -1;
    }
    *share = (unsigned)sh;
    memcpy(name, buf, nlen);
    name[nlen] = 0;
    return 0;
}

int px_prio_spec_check(const char *spec, char *err, size_t errlen) {
    char name[PX_PRIO_NAME_MAX];
    long long lo, hi;
    unsigned share;
    return prio_one(spec, name, &lo, &hi, &share, err, errlen);
}

int px_prio_map_parse(char *const *specs, size_t n, px_prio_map *m, char *err, size_t errlen) {
    if (n > PX_ADM_CLASSES) {
        snprintf(err, errlen, "--priority-class: %zu classes, at most %d", n, PX_ADM_CLASSES);
        return -1;
    }
    px_prio_map t = {.n = n};
    for (size_t i = 0; i < n; i++) {
        if (prio_one(specs[i], t.c[i].name, &t.c[i].lo, &t.c[i].hi, &t.c[i].share, err,
                     errlen) < 0)
            return -1;
        if (i && !t.c[i].share != !t.c[0].share) {
            snprintf(err, errlen, "--priority-class '%s': give every class a share=, or none "
                     "(strict order)", specs[i]);
            return -1;
        }
        for (size_t j = 0; j < i; j++)
            if (!strcmp(t.c[j].name, t.c[i].name)) {
                snprintf(err, errlen, "--priority-class '%s': class '%s' is defined twice",
                         specs[i], t.c[i].name);
                return -1;
            }
    }
    *m = t;
    return 0;
}

int px_prio_map_class(const px_prio_map *m, long long priority) {
    if (!m || !m->n) return px_adm_class_of(priority);
    for (size_t i = 0; i < m->n; i++)
        if (priority >= m->c[i].lo && priority <= m->c[i].hi) return (int)i;
    return (int)m->n - 1;
}

int px_prio_map_named(const px_prio_map *m, const char *name, size_t len) {
    for (size_t i = 0; m && i < m->n; i++)
        if (strlen(m->c[i].name) == len && !memcmp(m->c[i].name, name, len)) return (int)i;
    return -1;
}

struct px_prio_node {
    px_prio_map m;
    struct px_prio_node *older;
};

int px_prio_publish(px_prio_head *head, char *const *specs, size_t n, char *err, size_t errlen) {
    struct px_prio_node *nd = px_xcalloc(1, sizeof *nd);
    if (px_prio_map_parse(specs, n, &nd->m, err, errlen) < 0) {
        free(nd);
        return -1;
    }
    struct px_prio_node *cur = atomic_load(head);
    if (cur && !memcmp(&cur->m, &nd->m, sizeof nd->m)) {
        free(nd);
        return 0;
    }
    nd->older = cur;
    atomic_store_explicit(head, nd, memory_order_release);
    if (cur) PX_LOG(PX_LOG_INFO, "msg=\"priority classes changed\" classes=%zu", n);
    return 0;
}

const px_prio_map *px_prio_current(px_prio_head *head) {
    struct px_prio_node *nd = atomic_load_explicit(head, memory_order_acquire);
    return nd ? &nd->m : NULL;
}

void px_prio_cleanup(px_prio_head *head) {
    for (struct px_prio_node *nd = atomic_load(head), *o; nd; nd = o) {
        o = nd->older;
        free(nd);
    }
    atomic_store(head, NULL);
}
