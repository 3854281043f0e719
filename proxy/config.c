/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/config.h"

#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "proxy/config_int.h"
#include "proxy/version.h"

/* The command line and the environment, over the --config file and the
 * defaults (config_file.c), by the option table (config_opts.c). */

/* The --config file named by PDPROXY_CONFIG or --config (the flag wins),
 * or NULL. */
static const char *file_named(int argc, char **argv, char **envp) {
    const char *file = NULL;
    for (char **e = envp; e && *e; e++)
        if (!strncmp(*e, "PDPROXY_CONFIG=", 15)) file = *e + 15;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--config") && i + 1 < argc)
            file = argv[++i];
        else if (!strncmp(argv[i], "--config=", 9))
            file = argv[i] + 9;
    }
    return file;
}

/* The PDPROXY_* variables over what is set. 0, or -1 with err. */
static int load_env(px_config *c, char **envp, char *err, size_t errlen) {
    for (size_t i = 0; envp && i < px_cfg_nopts; i++) {
        char name[96];
        px_cfg_env_name(&px_cfg_opts[i], name, sizeof name);
        size_t nl = strlen(name);
        for (char **e = envp; *e; e++) {
            if (strncmp(*e, name, nl) == 0 && (*e)[nl] == '=') {
                c->set[i] = 1;
                if (px_cfg_set_value(c, &px_cfg_opts[i], *e + nl + 1, err, errlen) < 0) {
                    size_t l = strlen(err);
                    snprintf(err + l, errlen - l, " (from %s)", name);
                    return -1;
                }
            }
        }
    }
    return 0;
}

/* --help, --help-markdown, --version: printed to out. Returns 1 when `a`
 * is one of them. */
static int informational(const char *a, FILE *out) {
    if (!strcmp(a, "--help") || !strcmp(a, "-h"))
        px_cfg_usage(out);
    else if (!strcmp(a, "--help-markdown"))
        px_cfg_markdown(out);
    else if (!strcmp(a, "--version") || !strcmp(a, "-V"))
        px_version_print(out);
    else
        return 0;
    return 1;
}

/* What the flags seen so far decide for the next ones. */
typedef struct flag_state {
    unsigned char
        seen_urls[PX_CFG_MAX_OPTS]; /* the command line's URLs replace the environment's */
    px_pool_spec *cur;              /* the pool the --prefill/--decode flags go to */
} flag_state;

/* A flag's value: after '=' or the next argument (*i moves past it). */
static const char *flag_value(const char *eq, int argc, char **argv, int *i) {
    return eq ? eq + 1 : (*i + 1 < argc ? argv[++*i] : NULL);
}

/* --pool NAME: the flags after it describe that pool. */
static int flag_pool(px_config *c, const opt *o, const char *v, flag_state *st, char *err,
                     size_t errlen) {
    if (!v || !*v || *v == '=') {
        snprintf(err, errlen, "--%s: missing pool name", o->name);
        return -1;
    }
    if (!st->cur) { /* the command line's pools replace the file's */
        px_pool_specs_free(c->pools, c->npools);
        c->pools = NULL;
        c->npools = 0;
    }
    st->cur = px_cfg_pool_new(c, v, strlen(v));
    return 0;
}

/* --prefill / --decode URL, to the current pool or the unnamed one. */
static int flag_url(px_config *c, const opt *o, const char *v, flag_state *st, char *err,
                    size_t errlen) {
    if (!v) {
        snprintf(err, errlen, "--%s: missing value", o->name);
        return -1;
    }
    if (st->cur) {
        if (px_cfg_check_url(o, v, err, errlen) < 0) return -1;
        px_strlist_push(o->off == OFF(prefill_urls) ? &st->cur->prefill : &st->cur->decode, v);
        return 0;
    }
    px_strlist *l = (px_strlist *)((char *)c + o->off);
    if (!st->seen_urls[o - px_cfg_opts]) px_strlist_clear(l);
    st->seen_urls[o - px_cfg_opts] = 1;
    px_cfg_list_push(l, v, strlen(v));
    return px_cfg_check_url(o, v, err, errlen);
}

/* A list flag, nargs='+' as in the toy proxy: values until the next flag. */
static int flag_list(px_config *c, const opt *o, const char *eq, int argc, char **argv, int *i,
                     char *err, size_t errlen) {
    px_strlist *l = (px_strlist *)((char *)c + o->off);
    px_strlist_clear(l);
    if (eq) return px_cfg_set_value(c, o, eq + 1, err, errlen);
    while (*i + 1 < argc && strncmp(argv[*i + 1], "--", 2) != 0) {
        px_cfg_list_push(l, argv[*i + 1], strlen(argv[*i + 1]));
        if (px_cfg_check_list_item(o, argv[*i + 1], err, errlen) < 0) return -1;
        ++*i;
    }
    if (!l->n) {
        snprintf(err, errlen, "--%s: needs at least one value", o->name);
        return -1;
    }
    return 0;
}

/* The flag argv[*i] (with its values; *i moves past them). 0, or -1 with
 * err. */
static int parse_flag(px_config *c, int argc, char **argv, int *i, flag_state *st, char *err,
                      size_t errlen) {
    const char *a = argv[*i];
    if (strncmp(a, "--", 2) != 0) {
        snprintf(err, errlen, "unexpected argument '%s'", a);
        return -1;
    }
    const char *name = a + 2, *eq = strchr(name, '=');
    size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
    const opt *o = px_cfg_find_opt(name, nlen);
    if (!o) {
        snprintf(err, errlen, "unknown flag '%.*s' (see --help)", (int)(nlen + 2), a);
        return -1;
    }
    c->set[o - px_cfg_opts] = 1;
    if (o->type == CT_FLAG && !eq) {
        *(int *)((char *)c + o->off) = 1;
        return 0;
    }
    if (o->type == CT_POOL) return flag_pool(c, o, flag_value(eq, argc, argv, i), st, err, errlen);
    if (o->type == CT_URLS) return flag_url(c, o, flag_value(eq, argc, argv, i), st, err, errlen);
    if (o->type == CT_LIST) return flag_list(c, o, eq, argc, argv, i, err, errlen);
    const char *v = flag_value(eq, argc, argv, i);
    if (!v) {
        snprintf(err, errlen, "--%s: missing value", o->name);
        return -1;
    }
    return px_cfg_set_value(c, o, v, err, errlen);
}

/* The settings that only make sense together. 0, or -1 with err. */
static int check_together(px_config *c, char *err, size_t errlen) {
    if (!c->tls_cert[0] != !c->tls_key[0]) {
        snprintf(err, errlen, "--tls-cert and --tls-key go together: give both or neither");
        return -1;
    }
    if (c->tls_client_ca[0] && !c->tls_cert[0]) {
        snprintf(err, errlen, "--tls-client-ca verifies HTTPS clients: give --tls-cert and "
                 "--tls-key too");
        return -1;
    }
    if (c->tenant_certs[0] && !c->tls_client_ca[0]) {
        snprintf(err, errlen, "--tenant-certs names tenants by verified client certificates: "
                 "give --tls-client-ca (and --tls-cert, --tls-key) too");
        return -1;
    }
    if (c->prefiller_hosts.n != c->prefiller_ports.n) {
        snprintf(err, errlen,
                 "--prefiller-hosts has %zu value(s) but --prefiller-ports has %zu: give one port "
                 "per host",
                 c->prefiller_hosts.n, c->prefiller_ports.n);
        return -1;
    }
    if (c->decoder_hosts.n != c->decoder_ports.n) {
        snprintf(err, errlen,
                 "--decoder-hosts has %zu value(s) but --decoder-ports has %zu: give one port per "
                 "host",
                 c->decoder_hosts.n, c->decoder_ports.n);
        return -1;
    }
    if (px_cfg_validate_pools(c, err, errlen) < 0) return -1;
    if (c->admin_port && !c->admin_token_file[0]) {
        snprintf(err, errlen,
                 "--admin-port needs --admin-token-file: every admin call is "
                 "authenticated with its token");
        return -1;
    }
    if (c->prefiller_from_header && !c->prefiller_allowlist.n) {
        snprintf(err, errlen,
                 "--prefiller-from-header needs --prefiller-allowlist: the hosts "
                 "x-prefiller-host-port may name");
        return -1;
    }
    return 0;
}

px_config_result px_config_load(px_config *c, int argc, char **argv, char **envp, FILE *out,
                                char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    err[0] = '\0';
    for (size_t i = 0; i < px_cfg_nopts; i++)
        if (px_cfg_set_value(c, &px_cfg_opts[i], px_cfg_opts[i].def, err, errlen) < 0)
            return PX_CONFIG_ERROR;
    /* The file first, so that the environment and flags win over it. */
    const char *file = file_named(argc, argv, envp);
    if (file && *file && px_cfg_load_file(c, file, err, errlen) < 0) return PX_CONFIG_ERROR;
    if (load_env(c, envp, err, errlen) < 0) return PX_CONFIG_ERROR;
    flag_state st = {{0}, NULL};
    for (int i = 1; i < argc; i++) {
        if (informational(argv[i], out)) return PX_CONFIG_EXIT_OK;
        if (parse_flag(c, argc, argv, &i, &st, err, errlen) < 0) return PX_CONFIG_ERROR;
    }
    if (check_together(c, err, errlen) < 0) return PX_CONFIG_ERROR;
    if (c->print_config) {
        px_config_dump(c, out);
        return PX_CONFIG_EXIT_OK;
    }
    return PX_CONFIG_RUN;
}

void px_config_cleanup(px_config *c) {
    px_strlist_clear(&c->backend_dp);
    px_strlist_clear(&c->backend_kv);
    px_pool_specs_free(c->pools, c->npools);
    c->pools = NULL;
    c->npools = 0;
    for (size_t i = 0; i < px_cfg_nopts; i++) {
        void *field = (char *)c + px_cfg_opts[i].off;
        if (px_cfg_opts[i].type == CT_STR || px_cfg_opts[i].type == CT_ENUM ||
            px_cfg_opts[i].type == CT_SECRET) {
            free(*(char **)field);
            *(char **)field = NULL;
        } else if (px_cfg_opts[i].type == CT_LIST || px_cfg_opts[i].type == CT_URLS ||
                   px_cfg_opts[i].type == CT_WORDS) {
            px_strlist_clear(field);
        }
    }
}
