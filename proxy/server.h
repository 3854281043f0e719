/* SPDX-License-Identifier: Apache-2.0 */
/* The HTTP front: worker threads with their listeners and routes, and the
 * control loop on the main thread (signals, drain, reloads, health checks).
 * What the rest of the proxy sees of a running server is ctx.h's context;
 * the server itself is opaque. */
#ifndef PX_SERVER_H
#define PX_SERVER_H

#include <stddef.h>

#include "proxy/config.h"

typedef struct px_server px_server;

/* Binds the listeners, resolves the backends and builds the workers;
 * nothing runs yet. Returns NULL with a message in err on failure. */
px_server *px_server_create(const px_config *cfg, char *err, size_t errlen);
/* --check-config: everything px_server_create() checks and would refuse
 * (files, keys, certificates, pools, backends that are this proxy, names,
 * hosts and ports), with no listener opened and no thread started. 0, or
 * -1 with err. */
int px_server_check(const px_config *cfg, char *err, size_t errlen);
/* Where reloads read the settings again: main's arguments (borrowed; they
 * must outlive the server). Without it reloads use cfg's file alone. */
void px_server_set_args(px_server *s, int argc, char **argv, char **envp);
/* Runs until SIGTERM (graceful drain) or SIGINT (prompt stop); returns the
 * exit status. */
int px_server_run(px_server *s);
void px_server_destroy(px_server *s);

#endif
