/* SPDX-License-Identifier: Apache-2.0 */
/* Where the backends come from: the toy proxy's host/port lists and the
 * --prefill/--decode URLs. A URL whose host is a name is followed through
 * DNS: every address it resolves to is a backend, and the name is resolved
 * again every --dns-refresh seconds (Kubernetes headless services).
 * Resolution is asynchronous (libevent's evdns, with /etc/resolv.conf's
 * servers, search list and timeouts, and /etc/hosts re-read on each round)
 * on the control thread's loop: a slow or silent DNS server delays nothing
 * but the name's own backends. */
#ifndef PX_DISCOVERY_H
#define PX_DISCOVERY_H

#include <event2/event.h>
#include <stddef.h>
#include <stdint.h>

#include "base/util.h"
#include "proxy/k8s.h"

struct px_gen;
struct px_pool_spec;
typedef struct px_discovery px_discovery;

/* Fills the generation's pools from `specs` (one per pool, in g's order):
 * IP literals and toy-style hosts at once; names are resolved on `base`
 * (borrowed: the control loop, which must outlive discovery), every
 * dns_refresh seconds. Backends of `old` (the generation replaced, or NULL)
 * made for a URL that stays are kept, with their health and counters.
 * wait: block up to a second for the first answers (at start, never from a
 * callback of `base`). NULL with err on a malformed URL or when the
 * resolver cannot be set up. k8s:// URLs are followed through the
 * Kubernetes API (k8s.h) with `k8s`'s settings; their backends, like a
 * name's, are kept across a reload until the new generation's first list.
 * wait also covers those first lists. */
px_discovery *px_discovery_start(struct px_gen *g, const struct px_pool_spec *specs,
                                 struct px_gen *old, double dns_refresh, const px_k8s_cfg *k8s,
                                 struct event_base *base, int wait, char *err, size_t errlen);
/* Stops refreshing and cancels what is in flight without running the loop
 * (callable from its callbacks); px_discovery_stop() frees it later, on a
 * later loop turn. */
void px_discovery_retire(px_discovery *d);
/* Whether no lookup of d awaits its callback: a retired discovery may then
 * be stopped from inside the loop. */
int px_discovery_idle(const px_discovery *d);
/* Cancels resolutions in flight and frees. NULL is a no-op. */
void px_discovery_stop(px_discovery *d);

/* Appends ,"unresolved":["name",...] to a JSON object under construction
 * when some backend name did not resolve on its last try. Any thread. */
void px_discovery_ready_json(px_discovery *d, px_buf *out);
/* Failed resolutions so far, and names whose last resolution failed. Any
 * thread. */
uint64_t px_discovery_failures(px_discovery *d);
size_t px_discovery_unresolved(px_discovery *d);

#endif
