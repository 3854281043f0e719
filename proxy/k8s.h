/* SPDX-License-Identifier: Apache-2.0 */
/* Backends from the Kubernetes API: a backend URL
 *
 *     k8s://[NAMESPACE]/SERVICE[?port=PORT]
 *     k8s://[NAMESPACE]/?selector=LABEL_SELECTOR[&port=PORT]
 *
 * in --prefill, --decode or a pool of the --config file stands for the
 * ready endpoints of the EndpointSlices (discovery.k8s.io/v1) of a Service
 * (label kubernetes.io/service-name) or matching a label selector, followed
 * by list + watch: resource versions, bookmarks, a re-list after 410 Gone,
 * back-off on errors. NAMESPACE defaults to the pod's own (or the
 * kubeconfig context's); PORT is a port name or number of the slices
 * (default: the port named "http", else the first).
 *
 * Each endpoint is a backend http://IP:PORT, added and removed in place
 * through the admin API's path (px_pool_insert, px_pool_remove_src): no
 * generation is rebuilt and the data path never pauses. Ready endpoints
 * take requests; terminating ones are drained (requests on them finish,
 * none is sent); endpoints neither ready nor terminating are not members.
 * Per-engine facts: the slice's ports named "kv-events" and
 * "kv-events-replay" are the engine's KV-event endpoints
 * (tcp://IP:PORT), and the label pdproxy.io/dp-size (a Service label,
 * which Kubernetes copies onto its slices) its data-parallel size.
 *
 * Credentials: in a pod, the service account's token (read again on every
 * request, so a rotated token is used) and CA; else --kubeconfig (server,
 * certificate-authority, insecure-skip-tls-verify, token, tokenFile of the
 * current context) or --k8s-api with --k8s-token-file / --k8s-ca-file.
 * RBAC: list and watch on endpointslices (deploy/k8s/components/
 * k8s-discovery). Everything runs on the control thread's loop. */
#ifndef PX_K8S_H
#define PX_K8S_H

#include <event2/event.h>
#include <stddef.h>

#include "proxy/k8s_creds.h"
#include "proxy/k8s_url.h"

struct px_pool;
typedef struct px_k8s px_k8s;


/* The API client of one generation's discovery, on `base` (borrowed: the
 * control loop). NULL with err when no API server can be found. */
px_k8s *px_k8s_create(struct event_base *base, const px_k8s_cfg *cfg, char *err, size_t errlen);
/* Follows `url` into `pool` (borrowed; outlives k). `old` (NULL or the
 * replaced generation's client): the backends its source of the same URL
 * made are adopted by the caller; they are this source's until its first
 * list says otherwise. 0, or -1 with err (a malformed URL). */
int px_k8s_watch(px_k8s *k, struct px_pool *pool, const char *url, px_k8s *old, char *err,
                 size_t errlen);
/* The backend URLs (http://IP:PORT) the source `url` of k holds now, for
 * adoption by the next generation; *n set. Borrowed until k changes. */
const char *const *px_k8s_members(px_k8s *k, const char *url, size_t *n);
/* Starts every source's first list. */
void px_k8s_start(px_k8s *k);
/* Sources whose first list has not completed. */
size_t px_k8s_unlisted(const px_k8s *k);
/* Stops every transfer and timer (callable from the loop's callbacks). */
void px_k8s_retire(px_k8s *k);
/* Retires and frees. NULL is a no-op. */
void px_k8s_destroy(px_k8s *k);

#endif
