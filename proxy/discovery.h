/* Where the backends come from: the toy proxy's host/port lists and the
 * --prefill/--decode URLs. A URL whose host is a name is followed through
 * DNS: every address it resolves to is a backend, and the name is resolved
 * again every --dns-refresh seconds (Kubernetes headless services), on a
 * thread of its own since resolution blocks. */
#ifndef PX_DISCOVERY_H
#define PX_DISCOVERY_H

#include <stddef.h>

struct px_server;
typedef struct px_discovery px_discovery;

/* Fills the server's pools (names resolved once, synchronously) and starts
 * the refresh thread when some backend is a name. NULL with err on a
 * malformed URL. */
px_discovery *px_discovery_start(struct px_server *s, char *err, size_t errlen);
void px_discovery_stop(px_discovery *d);

#endif
