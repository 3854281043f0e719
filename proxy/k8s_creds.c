/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/k8s_creds.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <yaml.h>

#include "base/util.h"

/* The first line of a small file, whitespace trimmed, into out. 0, or -1
 * with errno set. */
static int read_line(const char *path, char *out, size_t cap) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(out, 1, cap - 1, f);
    int e = ferror(f);
    fclose(f);
    if (e) {
        errno = EIO;
        return -1;
    }
    out[n] = '\0';
    while (n && (out[n - 1] == '\n' || out[n - 1] == '\r' || out[n - 1] == ' '))
        out[--n] = '\0';
    return 0;
}

/* ---------- kubeconfig (YAML) ---------- */

static yaml_node_t *get(yaml_document_t *d, yaml_node_t *m, const char *key) {
    if (!m || m->type != YAML_MAPPING_NODE) return NULL;
    for (yaml_node_pair_t *p = m->data.mapping.pairs.start; p < m->data.mapping.pairs.top; p++) {
        yaml_node_t *k = yaml_document_get_node(d, p->key);
        if (k && k->type == YAML_SCALAR_NODE && !strcmp((char *)k->data.scalar.value, key))
            return yaml_document_get_node(d, p->value);
    }
    return NULL;
}

static const char *scalar(yaml_node_t *n) {
    return n && n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value : NULL;
}

/* The entry of list `key` (clusters, contexts, users) named `name`, its
 * inner mapping under `inner`. */
static yaml_node_t *named(yaml_document_t *d, yaml_node_t *root, const char *key, const char *name,
                          const char *inner) {
    yaml_node_t *l = get(d, root, key);
    if (!l || l->type != YAML_SEQUENCE_NODE || !name) return NULL;
    for (yaml_node_item_t *it = l->data.sequence.items.start; it < l->data.sequence.items.top; it++) {
        yaml_node_t *e = yaml_document_get_node(d, *it);
        const char *n = scalar(get(d, e, "name"));
        if (n && !strcmp(n, name)) return get(d, e, inner);
    }
    return NULL;
}

/* A path in a kubeconfig is relative to the file's directory. */
static void rel_path(const char *kubeconfig, const char *p, char *out, size_t cap) {
    if (p[0] == '/') {
        snprintf(out, cap, "%s", p);
        return;
    }
    const char *slash = strrchr(kubeconfig, '/');
    snprintf(out, cap, "%.*s%s", slash ? (int)(slash - kubeconfig + 1) : 0, kubeconfig, p);
}

static int load_kubeconfig(px_k8s_creds *c, const char *path, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "--kubeconfig '%s': %s", path, strerror(errno));
        return -1;
    }
    yaml_parser_t p;
    yaml_document_t d;
    yaml_parser_initialize(&p);
    yaml_parser_set_input_file(&p, f);
    int ok = yaml_parser_load(&p, &d);
    yaml_parser_delete(&p);
    fclose(f);
    if (!ok) {
        snprintf(err, errlen, "--kubeconfig '%s': not YAML", path);
        return -1;
    }
    int rc = -1;
    yaml_node_t *root = yaml_document_get_root_node(&d);
    const char *cur = scalar(get(&d, root, "current-context"));
    yaml_node_t *ctx = named(&d, root, "contexts", cur, "context");
    yaml_node_t *cl = named(&d, root, "clusters", scalar(get(&d, ctx, "cluster")), "cluster");
    yaml_node_t *us = named(&d, root, "users", scalar(get(&d, ctx, "user")), "user");
    const char *server = scalar(get(&d, cl, "server"));
    if (!server) {
        snprintf(err, errlen, "--kubeconfig '%s': no server for the current context '%s'", path,
                 cur ? cur : "");
        goto out;
    }
    if (get(&d, cl, "certificate-authority-data") || get(&d, us, "client-certificate-data") ||
        get(&d, us, "client-certificate") || get(&d, us, "exec")) {
        snprintf(err, errlen,
                 "--kubeconfig '%s': only server, certificate-authority (a file), "
                 "insecure-skip-tls-verify, token and tokenFile are understood; put the CA in a "
                 "file (--k8s-ca-file) and use a token, or run `kubectl proxy` and give "
                 "--k8s-api http://127.0.0.1:8001",
                 path);
        goto out;
    }
    snprintf(c->server, sizeof c->server, "%s", server);
    const char *ca = scalar(get(&d, cl, "certificate-authority"));
    if (ca) rel_path(path, ca, c->ca_file, sizeof c->ca_file);
    const char *ins = scalar(get(&d, cl, "insecure-skip-tls-verify"));
    c->insecure = ins && !strcmp(ins, "true");
    const char *tok = scalar(get(&d, us, "token")), *tf = scalar(get(&d, us, "tokenFile"));
    if (tok) c->token = px_xstrdup(tok);
    if (tf) rel_path(path, tf, c->token_file, sizeof c->token_file);
    const char *ns = scalar(get(&d, ctx, "namespace"));
    if (ns) snprintf(c->ns, sizeof c->ns, "%s", ns);
    rc = 0;
out:
    yaml_document_delete(&d);
    return rc;
}

/* ---------- entry points ---------- */

int px_k8s_creds_load(px_k8s_creds *c, const px_k8s_cfg *cfg, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    snprintf(c->ns, sizeof c->ns, "default");
    if (read_line(PX_K8S_SA_DIR "/namespace", c->ns, sizeof c->ns) < 0 || !c->ns[0])
        snprintf(c->ns, sizeof c->ns, "default");
    const char *host = getenv("KUBERNETES_SERVICE_HOST"), *port = getenv("KUBERNETES_SERVICE_PORT");
    if (cfg->api && cfg->api[0]) {
        snprintf(c->server, sizeof c->server, "%s", cfg->api);
    } else if (cfg->kubeconfig && cfg->kubeconfig[0]) {
        if (load_kubeconfig(c, cfg->kubeconfig, err, errlen) < 0) return -1;
    } else if (host && *host) {
        int v6 = strchr(host, ':') != NULL;
        snprintf(c->server, sizeof c->server, "https://%s%s%s:%s", v6 ? "[" : "", host,
                 v6 ? "]" : "", port && *port ? port : "443");
        snprintf(c->token_file, sizeof c->token_file, "%s/token", PX_K8S_SA_DIR);
        snprintf(c->ca_file, sizeof c->ca_file, "%s/ca.crt", PX_K8S_SA_DIR);
    } else {
        snprintf(err, errlen,
                 "k8s:// backends need the Kubernetes API: run pdproxy in a pod (service "
                 "account), or give --kubeconfig or --k8s-api");
        return -1;
    }
    if (cfg->token_file && cfg->token_file[0])
        snprintf(c->token_file, sizeof c->token_file, "%s", cfg->token_file);
    if (cfg->ca_file && cfg->ca_file[0]) snprintf(c->ca_file, sizeof c->ca_file, "%s", cfg->ca_file);
    if (strncmp(c->server, "http://", 7) && strncmp(c->server, "https://", 8)) {
        snprintf(err, errlen, "Kubernetes API server '%s': expected http(s)://host:port",
                 c->server);
        px_k8s_creds_cleanup(c);
        return -1;
    }
    /* The token is read before each request; an unreadable one now is a
     * configuration error, not a reason to retry forever. */
    char tok[64];
    if (c->token_file[0] && read_line(c->token_file, tok, sizeof tok) < 0) {
        snprintf(err, errlen, "Kubernetes token file '%s': %s", c->token_file, strerror(errno));
        px_k8s_creds_cleanup(c);
        return -1;
    }
    if (c->ca_file[0] && access(c->ca_file, R_OK) < 0) {
        snprintf(err, errlen, "Kubernetes CA file '%s': %s", c->ca_file, strerror(errno));
        px_k8s_creds_cleanup(c);
        return -1;
    }
    return 0;
}

int px_k8s_creds_token(const px_k8s_creds *c, char *out, size_t cap, char *err, size_t errlen) {
    out[0] = '\0';
    if (c->token_file[0]) {
        if (read_line(c->token_file, out, cap) < 0) {
            snprintf(err, errlen, "token file '%s': %s", c->token_file, strerror(errno));
            return -1;
        }
    } else if (c->token) {
        snprintf(out, cap, "%s", c->token);
    }
    for (char *p = out; *p; p++)
        if ((unsigned char)*p < 0x21 || *p == 0x7f) {
            snprintf(err, errlen, "the Kubernetes token holds a space or control character");
            return -1;
        }
    return 0;
}

void px_k8s_creds_cleanup(px_k8s_creds *c) {
    free(c->token);
    c->token = NULL;
}
