/* SPDX-License-Identifier: Apache-2.0 */
/* The form of k8s:// backend URLs (k8s.h says what they stand for), apart
 * from the client so that configuration checks depend on nothing else. */
#ifndef PX_K8S_URL_H
#define PX_K8S_URL_H

#include <stddef.h>

/* Whether `url` is a k8s:// backend URL. */
int px_k8s_is_url(const char *url);
/* Checks a k8s:// URL's form. 0, or -1 with err. */
int px_k8s_url_check(const char *url, char *err, size_t errlen);
/* Splits a k8s:// URL: its namespace ("" for the default), label selector
 * (a Service's as kubernetes.io/service-name=NAME) and port. 0, or -1 with
 * err. */
int px_k8s_url_parse(const char *url, char *ns, size_t nscap, char *sel, size_t selcap, char *port,
                     size_t portcap, char *err, size_t errlen);

#endif
