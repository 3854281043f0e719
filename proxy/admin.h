/* SPDX-License-Identifier: Apache-2.0 */
/* The admin API: a listener of its own (--admin-host, --admin-port) on the
 * control thread, every call authenticated with the token of
 * --admin-token-file (never the client API key). It lists the backends,
 * adds, removes, drains and undrains them, shows the configuration and
 * reloads the --config file. Changes made through it last until the next
 * reload from the file; every change is logged with who made it. */
#ifndef PX_ADMIN_H
#define PX_ADMIN_H

#include <event2/event.h>
#include <stddef.h>

#include "proxy/config.h"
#include "proxy/ctx.h"

typedef struct px_admin px_admin;

/* A change the admin API made to the backends. */
typedef struct px_api_op {
    int add;     /* 1: add, 0: remove */
    int prefill; /* role */
    char *pool;  /* owned: pool name ("" the unnamed one) */
    char *url;   /* owned */
} px_api_op;

/* What the admin API acts on: the running proxy's context, and the control
 * plane that swaps configurations (reload.c), reached through these calls
 * only. All on the control thread. */
typedef struct px_admin_host {
    px_ctx *ctx;             /* borrowed: the current generation */
    struct event_base *base; /* borrowed: the control loop, where the listener runs */
    void *arg;               /* passed to the calls */
    /* Builds and swaps in a new generation: from_file reads the --config
     * file again (dropping the API's changes), else `op` is applied to the
     * current settings. 0, or -1 / -2 (no such pool or backend) / -3
     * (already there) with err; on error nothing changes. */
    int (*reload)(void *arg, int from_file, const px_api_op *op, char *err, size_t errlen);
    /* A reload from the file without blocking the loop: done(done_arg, rc,
     * err, generation, ms) follows on the loop; forget(arg, done_arg) drops
     * the call (the client left). -1 when it cannot start (then `reload`). */
    int (*reload_async)(void *arg, void (*done)(void *, int, const char *, uint64_t, double),
                        void *done_arg);
    void (*forget)(void *arg, void *done_arg);
    /* The settings the current generation was built from. */
    const px_config *(*config)(void *arg);
    /* The API's changes since the last reload from the file. */
    const px_api_op *(*changes)(void *arg, size_t *n);
} px_admin_host;

/* With cfg's --admin-port: reads the token and listens. 0 with *out set
 * (NULL without --admin-port), or -1 with err (unreadable or short token
 * file, port taken). `host` is copied. */
int px_admin_start(const px_admin_host *host, const px_config *cfg, px_admin **out, char *err,
                   size_t errlen);
/* Closes the listener and its connections. NULL is a no-op. */
/* --check-config: the token file read and the admin port tested free, as
 * px_admin_start would; nothing listens. 0, or -1 with err. */
int px_admin_check(const px_config *cfg, char *err, size_t errlen);
void px_admin_stop(px_admin *a);

#endif
