/* The admin API: a listener of its own (--admin-host, --admin-port) on the
 * control thread, every call authenticated with the token of
 * --admin-token-file (never the client API key). It lists the backends,
 * adds, removes, drains and undrains them, shows the configuration and
 * reloads the --config file. Changes made through it last until the next
 * reload from the file; every change is logged with who made it. */
#ifndef PX_ADMIN_H
#define PX_ADMIN_H

#include <stddef.h>

struct px_server;
typedef struct px_admin px_admin;

/* With --admin-port: reads the token and listens, setting s->admin. 0, or
 * -1 with err (unreadable or empty token file, port taken). */
int px_admin_start(struct px_server *s, char *err, size_t errlen);
/* Closes the listener and its connections. NULL is a no-op. */
void px_admin_stop(px_admin *a);

#endif
