/* SPDX-License-Identifier: Apache-2.0 */
/* engine-sim's KV links (--kv-peer-cost): what moving a prefill's KV to
 * this decode costs beyond the loopback copy, per prefill. Each link has a
 * fixed delay and a bandwidth cap; transfers on one link share its
 * bandwidth one after the other, so a slow link also queues. Lets a test
 * (or bench/latency_routing.py) give one prefill-decode pair a slow
 * network and watch the proxy learn it. */
#ifndef SIM_LINK_H
#define SIM_LINK_H

#include <stddef.h>
#include <stdint.h>

typedef struct sim_links sim_links;

/* Parses "PEER=DELAY_MS[/MB_PER_S],..." (PEER: the prefill's engine id,
 * its KV side channel's "host:port", or "*" for any other prefill;
 * MB_PER_S 0 or absent: no cap). Returns NULL with err on a bad spec;
 * an empty spec gives an empty set. */
sim_links *sim_links_parse(const char *spec, char *err, size_t errlen);
void sim_links_free(sim_links *l); /* NULL is a no-op */

/* Nanoseconds after `now_ns` at which `bytes` fetched from the prefill
 * named by `engine_id` (or NULL) and `host_port` (or NULL) have crossed
 * its link, and the link is taken until then. 0 when no link matches
 * (nothing to add). */
uint64_t sim_link_land(sim_links *l, const char *engine_id, const char *host_port, uint64_t bytes,
                       uint64_t now_ns);

#endif
