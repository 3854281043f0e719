/* SPDX-License-Identifier: Apache-2.0 */
/* Configuration generations on the control thread: the first one at
 * start, then reloads (the --config file read again on SIGHUP or through
 * the admin API, or the admin API's changes to the backends) in named
 * steps: build the new generation, apply the admin API's changes, swap it
 * in for new requests, diff it against the old one in the log, retire the
 * old one (requests on it finish there; its discovery is stopped once its
 * lookups are idle). */
#ifndef PX_RELOAD_H
#define PX_RELOAD_H

#include <event2/event.h>
#include <stddef.h>
#include <stdint.h>

#include "proxy/admin.h"
#include "proxy/config.h"
#include "proxy/ctx.h"

typedef struct px_reloader {
    px_ctx *ctx;             /* borrowed: whose generation is swapped */
    struct event_base *base; /* borrowed: the control loop (discovery's lookups) */
    /* Called after each swap: the workers close connections to backends
     * the new generation dropped. */
    void (*retired)(void *arg);
    void *arg;
    /* Where a reload reads the settings again: main's arguments (borrowed),
     * or argv NULL: the --config file alone. */
    int argc;
    char **argv;
    char **envp;
    uint64_t last_gen;
    px_config *file_cfg; /* owned: the last reload's settings, or NULL: ctx->cfg */
    px_api_op *ops;      /* owned: admin API changes since the last file reload */
    size_t nops;
    /* The backend URLs of the current generation and of the API's changes,
     * by pool, role and spelling-free key: what lets one admin API change
     * apply in place, in O(1) instead of a rebuild of every pool. NULL
     * until the first generation. */
    struct url_set *urls;               /* owned */
    struct px_reload_async *async;      /* owned: the parse thread's state, NULL until a request */
    struct px_discovery **retired_disc; /* owned: replaced generations' discoveries whose
                                           cancelled lookups may still call back */
    size_t nretired;
} px_reloader;

/* Builds the first generation from ctx->cfg, waiting for its names to
 * resolve, and makes it ctx->gen (id 1). 0, or -1 with err. */
int px_reload_start(px_reloader *rl, char *err, size_t errlen);

/* Builds and swaps in a new generation (px_admin_host's reload). 0, or -1 /
 * -2 (no such pool or backend) / -3 (already there) with err; on error
 * nothing changes. */
int px_reload(px_reloader *rl, int from_file, const px_api_op *op, char *err, size_t errlen);

/* Called on the control loop when a reload from the file answered a
 * request: rc 0 (the generation now running) or -1 with err. */
typedef void (*px_reload_done_fn)(void *arg, int rc, const char *err, uint64_t generation,
                                  double ms);

/* Asks for a reload from the file (SIGHUP, POST /admin/reload) without
 * blocking the control loop: the file is read on a helper thread, the new
 * generation built and swapped on the control loop. A newer request
 * supersedes one being read: the older read is dropped, the file read again,
 * and every request waiting is answered by the newest result. `done` (may be
 * NULL) is called once, on the control loop (at cleanup with rc -1 if still
 * waiting). Returns 0, or -1 when there is no --config file or no thread. */
int px_reload_request(px_reloader *rl, px_reload_done_fn done, void *arg);
/* The request made with `arg` is answered without calling its done. */
void px_reload_forget(px_reloader *rl, void *arg);

/* The settings the current generation was built from. */
const px_config *px_reload_config(const px_reloader *rl);

/* Fills the admin API's reload, config and changes calls with rl's. */
void px_reload_admin_calls(px_reloader *rl, px_admin_host *h);

/* Stops the current generation's discovery and every retired one, drops
 * ctx->gen and frees what rl holds. */
void px_reload_cleanup(px_reloader *rl);

#endif
