/* Backend pools and the choice of a backend for a request. */
#ifndef PX_ROUTE_H
#define PX_ROUTE_H

#include <stdatomic.h>
#include <stddef.h>

#include "config.h"

typedef struct px_backend {
    char *name; /* owned: "host:port" as configured */
    char *url;  /* owned: "http://host:port" (IPv6 literals bracketed) */
} px_backend;

typedef struct px_pool {
    const char *role;     /* "prefill" or "decode" */
    px_backend *b;        /* owned array */
    size_t n;
    atomic_ulong rr;      /* round-robin cursor, shared by all workers */
} px_pool;

/* Builds a pool from parallel host and port lists (equal lengths). */
void px_pool_init(px_pool *p, const char *role, const px_strlist *hosts, const px_strlist *ports);
void px_pool_cleanup(px_pool *p);

/* Round robin over the pool, strict across threads. p->n must be > 0. */
size_t px_pool_pick_rr(px_pool *p);

#endif
