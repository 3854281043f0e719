/* SPDX-License-Identifier: Apache-2.0 */
/* k8s:// backend URLs (k8s.h): their form alone, so that configuration
 * checks need nothing else of the Kubernetes client. */
#include "proxy/k8s_url.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------- URLs ---------- */

int px_k8s_is_url(const char *url) {
    return !strncmp(url, "k8s://", 6);
}

static int unhex(int c) {
    return isdigit(c) ? c - '0' : isxdigit(c) ? (tolower(c) - 'a' + 10) : -1;
}

/* %XX decoded copy of s[0..n) into out (cap). -1 when malformed or long. */
static int pct_decode(const char *s, size_t n, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int c = (unsigned char)s[i];
        if (c == '%') {
            if (i + 2 >= n) return -1;
            int h = unhex((unsigned char)s[i + 1]), l = unhex((unsigned char)s[i + 2]);
            if (h < 0 || l < 0) return -1;
            c = h * 16 + l;
            i += 2;
        }
        if (o + 1 >= cap) return -1;
        out[o++] = (char)c;
    }
    out[o] = '\0';
    return 0;
}

static int name_ok(const char *s, size_t max) {
    size_t n = strlen(s);
    if (n > max) return 0;
    for (size_t i = 0; i < n; i++)
        if (!islower((unsigned char)s[i]) && !isdigit((unsigned char)s[i]) && s[i] != '-' &&
            s[i] != '.')
            return 0;
    return 1;
}

/* Splits a k8s:// URL. sel gets the selector (a Service's as
 * kubernetes.io/service-name=NAME). */
int px_k8s_url_parse(const char *url, char *ns, size_t nscap, char *sel, size_t selcap, char *port,
                     size_t portcap, char *err, size_t errlen) {
    const char *p = url + 6, *slash = strchr(p, '/');
    ns[0] = sel[0] = port[0] = '\0';
    if (!px_k8s_is_url(url) || !slash) goto bad;
    if ((size_t)(slash - p) >= nscap) goto bad;
    memcpy(ns, p, (size_t)(slash - p));
    ns[slash - p] = '\0';
    if (ns[0] && !name_ok(ns, 63)) goto bad;
    const char *q = strchr(slash + 1, '?');
    char svc[254];
    size_t sl = q ? (size_t)(q - slash - 1) : strlen(slash + 1);
    if (sl >= sizeof svc) goto bad;
    memcpy(svc, slash + 1, sl);
    svc[sl] = '\0';
    if (svc[0] && !name_ok(svc, 253)) goto bad;
    for (const char *a = q ? q + 1 : NULL; a && *a;) {
        const char *amp = strchr(a, '&');
        size_t al = amp ? (size_t)(amp - a) : strlen(a);
        if (al > 9 && !strncmp(a, "selector=", 9)) {
            if (pct_decode(a + 9, al - 9, sel, selcap) < 0) goto bad;
        } else if (al > 5 && !strncmp(a, "port=", 5)) {
            if (pct_decode(a + 5, al - 5, port, portcap) < 0 || !name_ok(port, 63)) goto bad;
        } else {
            goto bad;
        }
        a = amp ? amp + 1 : NULL;
    }
    if (!svc[0] == !sel[0]) goto bad; /* one of the two */
    if (svc[0] && (size_t)snprintf(sel, selcap, "kubernetes.io/service-name=%s", svc) >= selcap)
        goto bad;
    return 0;
bad:
    snprintf(err, errlen,
             "backend URL '%s': expected k8s://[NAMESPACE]/SERVICE[?port=PORT] or "
             "k8s://[NAMESPACE]/?selector=LABELS[&port=PORT]",
             url);
    return -1;
}

int px_k8s_url_check(const char *url, char *err, size_t errlen) {
    char ns[254], sel[1024], port[64];
    return px_k8s_url_parse(url, ns, sizeof ns, sel, sizeof sel, port, sizeof port, err, errlen);
}

