/* SPDX-License-Identifier: Apache-2.0 */
/* Listening sockets for HTTP servers: resolve, bind, listen, and hand each
 * accepted connection to px_conn_accept(). The proxy's workers, its metrics
 * and admin listeners and engine-sim all listen through here. */
#ifndef PX_LISTEN_H
#define PX_LISTEN_H

#include <event2/event.h>
#include <stddef.h>

#include "base/conn.h"

typedef struct px_listener px_listener;

/* Listens on host:port on `base`; accepted connections are served with
 * `cfg` into `list` (both borrowed: they must outlive the listener).
 * reuse_port: SO_REUSEPORT, so that several listeners (one per worker) share
 * the port and the kernel spreads connections across them. Out of
 * descriptors (EMFILE) and the like, accepting pauses for 100 ms rather than
 * spinning on a listener that stays readable. `what` names the setting in
 * messages ("--port"). NULL with err on failure. */
px_listener *px_listen(struct event_base *base, const char *host, int port, int reuse_port,
                       const char *what, px_conn_cfg *cfg, px_conn_list *list, char *err,
                       size_t errlen);
/* One listening socket on host:port without SO_REUSEPORT, for several
 * listeners to share through px_listen_fd (no other process can join it:
 * Linux lets a socket join a port's SO_REUSEPORT group only when every
 * socket bound there set the option). The fd, or -1 with err. */
int px_listen_socket(const char *host, int port, const char *what, char *err, size_t errlen);

/* A listener on a duplicate of `fd` (from px_listen_socket; the caller
 * keeps and closes its own); host, port and what name it in messages. */
px_listener *px_listen_fd(struct event_base *base, int fd, const char *host, int port,
                          const char *what, px_conn_cfg *cfg, px_conn_list *list, char *err,
                          size_t errlen);

/* Stops accepting and closes the socket. NULL is a no-op. */
void px_listener_free(px_listener *l);

/* Whether host:port is served already by anyone: a bind without
 * SO_REUSEPORT fails then (another process with SO_REUSEPORT included).
 * Returns 0 when it is free or cannot be told (px_listen says why later),
 * -1 with a message naming `what` otherwise. */
int px_listen_port_free(const char *host, int port, const char *what, char *err, size_t errlen);

#endif
