/* SPDX-License-Identifier: Apache-2.0 */
/* The --config file (YAML, libyaml): read bounded, then applied over the
 * defaults, below the environment and the flags; pools and backend
 * entries as mappings. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

#include "base/util.h"
#include "proxy/config_int.h"
#include "proxy/dispatch.h"

typedef struct yctx {
    yaml_document_t doc;
    const char *path;
    char *err;
    size_t errlen;
    px_config *c;
} yctx;

static size_t yline(const yaml_node_t *n) {
    return n->start_mark.line + 1;
}

/* The file's spelling of a key: flags' names, '_' read as '-'. */
static void ykey(const yaml_node_t *k, char *buf, size_t n) {
    size_t l = k->data.scalar.length < n - 1 ? k->data.scalar.length : n - 1;
    memcpy(buf, k->data.scalar.value, l);
    buf[l] = '\0';
    for (char *p = buf; *p; p++)
        if (*p == '_') *p = '-';
}

int px_config_kv_endpoint_check(const char *ep, char *err, size_t errlen) {
    const char *why = NULL;
    for (const char *p = ep; *p && !why; p++)
        if ((unsigned char)*p <= ' ' || *p == 0x7f) why = "no spaces or control characters";
    if (why) {
    } else if (!strncmp(ep, "ipc://", 6)) {
        size_t n = strlen(ep + 6);
        if (!n || n >= 108) why = "ipc:// needs a path of 1 to 107 bytes";
    } else if (strncmp(ep, "tcp://", 6)) {
        why = "expected tcp://HOST:PORT or ipc://PATH";
    } else {
        const char *h = ep + 6, *colon = strrchr(h, ':');
        size_t hl = colon ? (size_t)(colon - h) : 0;
        char *end = NULL;
        long port = colon && colon[1] >= '0' && colon[1] <= '9' ? strtol(colon + 1, &end, 10) : 0;
        if (!colon || !hl || !end || *end || port < 1 || port > 65535)
            why = "expected tcp://HOST:PORT with a port in [1, 65535]";
        else if (h[0] == '[' ? hl < 3 || h[hl - 1] != ']' || memchr(h + 1, ']', hl - 2)
                             : memchr(h, ':', hl) || memchr(h, '*', hl) || memchr(h, ';', hl))
            why = "the host is a name, an IPv4 address or [IPv6] (no wildcard: pdproxy connects)";
    }
    if (!why) return 0;
    snprintf(err, errlen, "'%.200s': %s", ep, why);
    return -1;
}

/* A backend entry of a prefill/decode list written as a mapping: {url: U,
 * dp_size: N, kv_events_endpoint: E, kv_events_replay_endpoint: R}, all
 * but url optional. N: the data-parallel ranks behind that API server,
 * 1..64, over --prefill-dp-size / --decode-dp-size; recorded in
 * c->backend_dp. E and R: where that engine publishes its KV events and
 * answers replays, over what --kv-events-port / --kv-events-replay-port
 * derive from its address; recorded in c->backend_kv. Returns the URL
 * (owned); NULL with the error set. */
static char *ybackend(yctx *y, const char *key, yaml_node_t *m) {
    char *url = NULL, *ep[2] = {NULL, NULL};
    static const char *const epkey[2] = {"kv-events-endpoint", "kv-events-replay-endpoint"};
    long dp = 0;
    for (yaml_node_pair_t *pr = m->data.mapping.pairs.start; pr < m->data.mapping.pairs.top; pr++) {
        yaml_node_t *k = yaml_document_get_node(&y->doc, pr->key);
        yaml_node_t *v = yaml_document_get_node(&y->doc, pr->value);
        char f[32] = "";
        if (k && k->type == YAML_SCALAR_NODE) ykey(k, f, sizeof f);
        int e = !strcmp(f, epkey[0]) ? 0 : !strcmp(f, epkey[1]) ? 1 : -1;
        if (!v || v->type != YAML_SCALAR_NODE ||
            (strcmp(f, "url") && strcmp(f, "dp-size") && e < 0) || (!strcmp(f, "url") && url) ||
            (e >= 0 && ep[e])) {
            snprintf(y->err, y->errlen,
                     "%s:%zu: key '%s': a backend entry is a URL or a mapping of url and "
                     "dp_size, kv_events_endpoint, kv_events_replay_endpoint (each once)",
                     y->path, yline(k ? k : m), key);
            goto fail;
        }
        char *t = px_xstrndup((char *)v->data.scalar.value, v->data.scalar.length);
        if (f[0] == 'u') {
            url = t;
            continue;
        }
        if (e >= 0) {
            char why[300];
            ep[e] = t;
            if (px_config_kv_endpoint_check(t, why, sizeof why) < 0) {
                snprintf(y->err, y->errlen, "%s:%zu: key '%s': %s %s", y->path, yline(v), key,
                         e ? "kv_events_replay_endpoint" : "kv_events_endpoint", why);
                goto fail;
            }
            continue;
        }
        char *end;
        dp = strtol(t, &end, 10);
        int bad = !t[0] || *end || dp < 1 || dp > 64;
        free(t);
        if (bad) {
            snprintf(y->err, y->errlen, "%s:%zu: key '%s': dp_size must be an integer in [1, 64]",
                     y->path, yline(v), key);
            goto fail;
        }
    }
    if (!url || !url[0] || strchr(url, ' ') || strchr(url, ',')) {
        snprintf(y->err, y->errlen, "%s:%zu: key '%s': a backend entry needs one url", y->path,
                 yline(m), key);
        goto fail;
    }
    if (dp > 0) {
        char item[600];
        snprintf(item, sizeof item, "%ld %s", dp, url);
        px_strlist_push(&y->c->backend_dp, item);
    }
    if (ep[0] || ep[1]) {
        px_buf b;
        px_buf_init(&b);
        px_buf_printf(&b, "%s %s %s", url, ep[0] ? ep[0] : "-", ep[1] ? ep[1] : "-");
        px_strlist_push(&y->c->backend_kv, b.data);
        px_buf_cleanup(&b);
    }
    free(ep[0]);
    free(ep[1]);
    return url;
fail:
    free(url);
    free(ep[0]);
    free(ep[1]);
    return NULL;
}

/* A setting's text: a scalar as is, a sequence of scalars joined by spaces
 * (the lists' text form). Returns NULL with the error set otherwise. */
static char *yvalue(yctx *y, const char *key, yaml_node_t *v) {
    if (v->type == YAML_SCALAR_NODE)
        return px_xstrndup((char *)v->data.scalar.value, v->data.scalar.length);
    if (v->type == YAML_SEQUENCE_NODE) {
        px_buf b;
        px_buf_init(&b);
        px_buf_appends(&b, "");
        for (yaml_node_item_t *it = v->data.sequence.items.start; it < v->data.sequence.items.top;
             it++) {
            yaml_node_t *e = yaml_document_get_node(&y->doc, *it);
            if (e && e->type == YAML_MAPPING_NODE && y->c &&
                (!strcmp(key, "prefill") || !strcmp(key, "decode"))) {
                char *u = ybackend(y, key, e);
                if (!u) {
                    px_buf_cleanup(&b);
                    return NULL;
                }
                if (b.len) px_buf_appends(&b, " ");
                px_buf_appends(&b, u);
                free(u);
                continue;
            }
            if (!e || e->type != YAML_SCALAR_NODE ||
                memchr(e->data.scalar.value, ' ', e->data.scalar.length) ||
                memchr(e->data.scalar.value, ',', e->data.scalar.length)) {
                snprintf(y->err, y->errlen, "%s:%zu: key '%s': list items must be plain values",
                         y->path, e ? yline(e) : yline(v), key);
                px_buf_cleanup(&b);
                return NULL;
            }
            if (b.len) px_buf_appends(&b, " ");
            px_buf_append(&b, (char *)e->data.scalar.value, e->data.scalar.length);
        }
        return b.data;
    }
    snprintf(y->err, y->errlen, "%s:%zu: key '%s': expected a value or a list", y->path, yline(v),
             key);
    return NULL;
}

/* set_value's message names the flag ("--port 'x': ..."); in the file the
 * key and line say more. */
static void yerr_from(yctx *y, const char *key, size_t line, const char *msg) {
    char m[512];
    snprintf(m, sizeof m, "%s", msg);
    const char *r = m;
    if (!strncmp(r, "--", 2)) {
        const char *sp = strchr(r, ' ');
        if (sp) r = sp + 1;
    }
    snprintf(y->err, y->errlen, "%s:%zu: key '%s': %s", y->path, line, key, r);
}

static int ylist(yctx *y, const char *key, yaml_node_t *v, px_strlist *l, const opt *chk) {
    char *t = yvalue(y, key, v);
    if (!t) return -1;
    char e[400];
    int rc = px_cfg_split_list(chk, l, t, px_cfg_check_url, e, sizeof e);
    free(t);
    if (rc < 0) yerr_from(y, key, yline(v), e);
    return rc;
}

/* A pool's dispatch: serial|concurrent (dispatch.h). */
static int ypool_dispatch(yctx *y, px_pool_spec *p, yaml_node_t *v) {
    if (v->type != YAML_SCALAR_NODE) {
        snprintf(y->err, y->errlen, "%s:%zu: key 'dispatch': expected a value", y->path, yline(v));
        return -1;
    }
    char *t = px_xstrndup((char *)v->data.scalar.value, v->data.scalar.length);
    if (px_dispatch_parse(t) < 0) {
        snprintf(y->err, y->errlen, "%s:%zu: key 'dispatch': '%s' is none of %s", y->path, yline(v),
                 t, PX_DISPATCH_MODES);
        free(t);
        return -1;
    }
    free(p->dispatch);
    p->dispatch = t;
    return 0;
}

static int ypool(yctx *y, px_config *c, yaml_node_t *m) {
    if (m->type != YAML_MAPPING_NODE) {
        snprintf(y->err, y->errlen,
                 "%s:%zu: key 'pools': each pool is a mapping (name, models, "
                 "prefill, decode)",
                 y->path, yline(m));
        return -1;
    }
    px_pool_spec *p = px_cfg_pool_new(c, "", 0);
    p->line = yline(m);
    for (yaml_node_pair_t *pr = m->data.mapping.pairs.start; pr < m->data.mapping.pairs.top; pr++) {
        yaml_node_t *k = yaml_document_get_node(&y->doc, pr->key);
        yaml_node_t *v = yaml_document_get_node(&y->doc, pr->value);
        if (!k || !v || k->type != YAML_SCALAR_NODE) continue;
        char key[64];
        ykey(k, key, sizeof key);
        if (!strcmp(key, "prefill") || !strcmp(key, "decode")) {
            if (ylist(y, key, v, key[0] == 'p' ? &p->prefill : &p->decode,
                      px_cfg_find_opt(key, strlen(key))) < 0)
                return -1;
        } else if (!strcmp(key, "models")) {
            char *t = yvalue(y, key, v);
            if (!t) return -1;
            char e[400];
            int rc = px_cfg_split_list(px_cfg_find_opt("pool", 4), &p->models, t,
                                       px_cfg_check_model, e, sizeof e);
            free(t);
            if (rc < 0) {
                yerr_from(y, "models", yline(v), e);
                return -1;
            }
        } else if (!strcmp(key, "name") || !strcmp(key, "prefill-policy") ||
                   !strcmp(key, "decode-policy")) {
            if (v->type != YAML_SCALAR_NODE) {
                snprintf(y->err, y->errlen, "%s:%zu: key '%s': expected a value", y->path, yline(v),
                         key);
                return -1;
            }
            char *t = px_xstrndup((char *)v->data.scalar.value, v->data.scalar.length);
            char **field = key[0] == 'n'   ? &p->name
                           : key[0] == 'p' ? &p->prefill_policy
                                           : &p->decode_policy;
            if (key[0] != 'n' && !px_cfg_in_choices(PX_POLICIES, t)) {
                snprintf(y->err, y->errlen, "%s:%zu: key '%s': '%s' is none of %s", y->path,
                         yline(v), key, t, PX_POLICIES);
                free(t);
                return -1;
            }
            free(*field);
            *field = t;
        } else if (!strcmp(key, "dispatch")) {
            if (ypool_dispatch(y, p, v) < 0) return -1;
        } else {
            snprintf(y->err, y->errlen,
                     "%s:%zu: unknown key '%s' in a pool (name, models, prefill, decode, "
                     "prefill-policy, decode-policy, dispatch)",
                     y->path, yline(k), key);
            return -1;
        }
    }
    return 0;
}

/* Applies the file's settings, each marked as given. */
/* Reads the whole --config file, refusing at once what would cost too
 * much: anything but a regular file (a FIFO would block the control
 * thread), more than PX_CONFIG_MAX_BYTES, or nesting deeper than
 * PX_CONFIG_MAX_DEPTH (checked on libyaml's events, before any document
 * is built). Returns the bytes (owned) or NULL with err set. */
static char *read_config(const char *path, size_t *len, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) {
        snprintf(err, errlen, "--config '%s': %s", path, strerror(errno));
        if (fd >= 0) close(fd);
        return NULL;
    }
    if (!S_ISREG(st.st_mode) || st.st_size > PX_CONFIG_MAX_BYTES) {
        if (!S_ISREG(st.st_mode))
            snprintf(err, errlen, "--config '%s': not a regular file", path);
        else
            snprintf(err, errlen, "--config '%s': larger than %d bytes", path, PX_CONFIG_MAX_BYTES);
        close(fd);
        return NULL;
    }
    char *buf = px_xmalloc((size_t)st.st_size + 1);
    size_t n = 0;
    while (n < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + n, (size_t)st.st_size - n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break; /* a file that shrank: parse what was read */
        n += (size_t)r;
    }
    close(fd);
    yaml_parser_t parser;
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_string(&parser, (const unsigned char *)buf, n);
    int depth = 0, ok = 1;
    for (;;) {
        yaml_event_t ev;
        if (!yaml_parser_parse(&parser, &ev)) break; /* the load below reports it */
        yaml_event_type_t t = ev.type;
        size_t line = ev.start_mark.line + 1;
        yaml_event_delete(&ev);
        if (t == YAML_SEQUENCE_START_EVENT || t == YAML_MAPPING_START_EVENT) {
            if (++depth > PX_CONFIG_MAX_DEPTH) {
                snprintf(err, errlen, "%s:%zu: nested deeper than %d levels", path, line,
                         PX_CONFIG_MAX_DEPTH);
                ok = 0;
                break;
            }
        } else if (t == YAML_SEQUENCE_END_EVENT || t == YAML_MAPPING_END_EVENT) {
            depth--;
        } else if (t == YAML_STREAM_END_EVENT) {
            break;
        }
    }
    yaml_parser_delete(&parser);
    if (!ok) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

int px_cfg_load_file(px_config *c, const char *path, char *err, size_t errlen) {
    size_t len;
    char *text = read_config(path, &len, err, errlen);
    if (!text) return -1;
    yaml_parser_t parser;
    yctx y = {.path = path, .err = err, .errlen = errlen, .c = c};
    yaml_parser_initialize(&parser);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    int rc = -1;
    if (!yaml_parser_load(&parser, &y.doc)) {
        snprintf(err, errlen, "%s:%zu: %s%s%s", path, parser.problem_mark.line + 1,
                 parser.problem ? parser.problem : "malformed YAML", parser.context ? " " : "",
                 parser.context ? parser.context : "");
        yaml_parser_delete(&parser);
        free(text);
        return -1;
    }
    yaml_node_t *root = yaml_document_get_root_node(&y.doc);
    if (!root) {
        rc = 0; /* an empty file: nothing set */
        goto out;
    }
    if (root->type != YAML_MAPPING_NODE) {
        snprintf(err, errlen, "%s:%zu: expected a mapping of settings (key: value)", path,
                 yline(root));
        goto out;
    }
    for (yaml_node_pair_t *pr = root->data.mapping.pairs.start; pr < root->data.mapping.pairs.top;
         pr++) {
        yaml_node_t *k = yaml_document_get_node(&y.doc, pr->key);
        yaml_node_t *v = yaml_document_get_node(&y.doc, pr->value);
        if (!k || !v) continue;
        if (k->type != YAML_SCALAR_NODE) {
            snprintf(err, errlen, "%s:%zu: keys are plain names", path, yline(k));
            goto out;
        }
        char key[64];
        ykey(k, key, sizeof key);
        if (!strcmp(key, "pools")) {
            if (v->type != YAML_SEQUENCE_NODE) {
                snprintf(err, errlen, "%s:%zu: key 'pools': expected a list of pools", path,
                         yline(v));
                goto out;
            }
            for (yaml_node_item_t *it = v->data.sequence.items.start;
                 it < v->data.sequence.items.top; it++) {
                yaml_node_t *m = yaml_document_get_node(&y.doc, *it);
                if (m && ypool(&y, c, m) < 0) goto out;
            }
            continue;
        }
        const opt *o = px_cfg_find_opt(key, strlen(key));
        if (!o || o->type == CT_POOL || !strcmp(o->name, "config") ||
            !strcmp(o->name, "print-config")) {
            snprintf(err, errlen,
                     "%s:%zu: unknown key '%s' (keys are the flags' names, see --help)", path,
                     yline(k), key);
            goto out;
        }
        char *t = yvalue(&y, key, v);
        if (!t) goto out;
        /* "~" and an empty value: the setting's empty text. */
        if (v->type == YAML_SCALAR_NODE && v->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
            (!strcmp(t, "~") || !strcmp(t, "null"))) {
            free(t);
            t = px_xstrdup("");
        }
        char e[400];
        int bad = px_cfg_set_value(c, o, t, e, sizeof e) < 0;
        free(t);
        if (bad) {
            yerr_from(&y, key, yline(v), e);
            goto out;
        }
        c->set[o - px_cfg_opts] = 1;
    }
    rc = 0;
out:
    yaml_document_delete(&y.doc);
    yaml_parser_delete(&parser);
    free(text);
    return rc;
}
