#include "route.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

void px_pool_init(px_pool *p, const char *role, const px_strlist *hosts, const px_strlist *ports)
{
    p->role = role;
    p->n = hosts->n;
    p->b = px_xcalloc(p->n, sizeof *p->b);
    atomic_init(&p->rr, 0);
    for (size_t i = 0; i < p->n; i++) {
        const char *h = hosts->v[i];
        int v6 = strchr(h, ':') != NULL && h[0] != '[';
        px_buf b;
        px_buf_init(&b);
        px_buf_printf(&b, "%s%s%s:%s", v6 ? "[" : "", h, v6 ? "]" : "", ports->v[i]);
        p->b[i].name = px_xstrdup(b.data);
        px_buf_reset(&b);
        px_buf_printf(&b, "http://%s", p->b[i].name);
        p->b[i].url = b.data; /* ownership moves to the backend */
    }
}

void px_pool_cleanup(px_pool *p)
{
    for (size_t i = 0; i < p->n; i++) {
        free(p->b[i].name);
        free(p->b[i].url);
    }
    free(p->b);
    p->b = NULL;
    p->n = 0;
}

size_t px_pool_pick_rr(px_pool *p)
{
    return (size_t)(atomic_fetch_add_explicit(&p->rr, 1, memory_order_relaxed) % p->n);
}
