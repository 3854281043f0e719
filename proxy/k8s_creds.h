/* SPDX-License-Identifier: Apache-2.0 */
/* Where the Kubernetes API server is and how to authenticate to it
 * (k8s.h): --k8s-api with --k8s-token-file / --k8s-ca-file, else
 * --kubeconfig's current context, else the pod's service account
 * (KUBERNETES_SERVICE_HOST/PORT, /var/run/secrets/kubernetes.io/
 * serviceaccount/{token,ca.crt,namespace}). */
#ifndef PX_K8S_CREDS_H
#define PX_K8S_CREDS_H

#include <stddef.h>


/* What the flags say (--k8s-api, --k8s-token-file, --k8s-ca-file,
 * --kubeconfig); "" or NULL when unset. */
typedef struct px_k8s_cfg {
    const char *api;        /* API server URL, or "" */
    const char *token_file; /* bearer token file, or "" */
    const char *ca_file;    /* CA bundle, or "" */
    const char *kubeconfig; /* kubeconfig file, or "" */
    /* borrowed: where an endpoint's own facts are declared (the registry's
     * tables: dp.h, kvevents.h) */
    struct px_dp_table *dp;
    struct px_kv_decls *kv_decls;
} px_k8s_cfg;

#define PX_K8S_SA_DIR "/var/run/secrets/kubernetes.io/serviceaccount"

typedef struct px_k8s_creds {
    char server[512];      /* http(s)://host:port */
    char token_file[4096]; /* read on every request (rotated tokens), or "" */
    char *token;           /* owned: a kubeconfig's literal token, or NULL */
    char ca_file[4096];    /* "" : the system store */
    int insecure;          /* insecure-skip-tls-verify */
    char ns[254];          /* the default namespace */
} px_k8s_creds;

/* 0, or -1 with err (no API server found, an unreadable kubeconfig, a
 * form it cannot use). */
int px_k8s_creds_load(px_k8s_creds *c, const px_k8s_cfg *cfg, char *err, size_t errlen);
/* The bearer token now (the token file read again), "" when none. 0, or
 * -1 with err. */
int px_k8s_creds_token(const px_k8s_creds *c, char *out, size_t cap, char *err, size_t errlen);
void px_k8s_creds_cleanup(px_k8s_creds *c);

#endif
