/* SPDX-License-Identifier: Apache-2.0 */
/* Inside the settings (config.h), one section per file: the option table
 * and how a value's text becomes a setting (config_opts.c), allowlist
 * entries (config_allow.c), pools and backends (config_pools.c), the
 * --config file (config_file.c), --help and its Markdown (config_help.c),
 * the dump and the reload's comparison (config_dump.c); config.c reads the
 * command line and the environment over them. Calls run one way: config.c
 * -> file, help, dump -> pools -> opts -> allow. Not for outside the
 * config_*.c files. */
#ifndef PX_CONFIG_INT_H
#define PX_CONFIG_INT_H

#include <stddef.h>
#include <stdio.h>

#include "proxy/config.h"

#define PX_POLICIES                                                                                \
    "round_robin|least_inflight|power_of_two|prefix_affinity|load_aware|kv_aware|"                 \
    "prefix_affinity_bytes|latency"

typedef enum {
    CT_STR,
    CT_INT,
    CT_SECONDS,
    CT_LIST,
    CT_URLS,
    CT_FLAG,
    CT_ENUM,
    CT_SECRET,
    CT_POOL,  /* --pool: starts a pool; flag and file only */
    CT_WORDS, /* a list that may be empty */
} ctype_t;

/* --help's groups (config_help.c names them and orders them). A row that
 * names none is G_OTHER, listed last. */
typedef enum {
    G_OTHER = 0,
    G_BACKENDS,
    G_ROUTING,
    G_DISAGG,
    G_HEALTH,
    G_LISTEN,
    G_UPSTREAM,
    G_SECURITY,
    G_SIDECAR,
    G_METRICS,
    G_OPERATIONS,
    G_COUNT
} opt_group;

/* One option, every column of it. */
typedef struct opt {
    const char *name;  /* long flag without dashes */
    const char *alias; /* second spelling (toy proxy's singular forms), or NULL */
    ctype_t type;
    size_t off;
    const char *def; /* default, as text */
    double min, max; /* bounds for numbers */
    const char *help;
    const char *choices; /* CT_ENUM: "a|b|c" */
    int reloads;         /* RELOADS: a reload applies it (it makes the generation of pools);
                          * AT_START: read at start only */
    unsigned char group; /* opt_group: where --help lists it */
    const char *metavar; /* the name of its value in --help; NULL: by type */
} opt;

#define RELOADS 1
#define AT_START 0
#define OFF(f) offsetof(px_config, f)
/* The most options px_config.set can mark. */
#define PX_CFG_MAX_OPTS sizeof(((px_config *)0)->set)

/* ---------- config_opts.c ---------- */
extern const opt px_cfg_opts[];
extern const size_t px_cfg_nopts;
/* The option named name[0..n) or by its alias; NULL when none. */
const opt *px_cfg_find_opt(const char *name, size_t n);
/* Sets a scalar option (and, in their text form, a list) from text. 0, or
 * -1 with "--flag 'value': reason" in err. */
int px_cfg_set_value(px_config *c, const opt *o, const char *v, char *err, size_t errlen);
/* Replaces *l by the comma- or space-separated items of v, each checked
 * by `check`. 0, or -1 with err. */
int px_cfg_split_list(const opt *o, px_strlist *l, const char *v,
                      int (*check)(const opt *, const char *, char *, size_t), char *err,
                      size_t errlen);
/* Item checks for px_cfg_split_list: a toy list's host or port, a
 * backend URL, a model name. */
int px_cfg_check_list_item(const opt *o, const char *v, char *err, size_t errlen);
int px_cfg_check_url(const opt *o, const char *v, char *err, size_t errlen);
int px_cfg_check_model(const opt *o, const char *v, char *err, size_t errlen);
/* Whether v is one of "a|b|c". */
int px_cfg_in_choices(const char *choices, const char *v);
void px_cfg_list_push(px_strlist *l, const char *s, size_t n);
void px_cfg_list_copy(px_strlist *to, const px_strlist *from);

/* ---------- config_allow.c ---------- */
/* Checks an allowlist entry HOST:PORTS of the option `name`. 0, or -1
 * with err. */
int px_cfg_allow_check(const char *name, const char *v, char *err, size_t errlen);

/* ---------- config_pools.c ---------- */
/* A new pool spec NAME[=MODEL,...] (v, len bytes) at the end of c's. */
px_pool_spec *px_cfg_pool_new(px_config *c, const char *v, size_t len);
/* Whether the toy host/port lists of the role make backends. */
int px_cfg_toy_in_effect(const px_config *c, int prefill);
/* The pools are named, distinct, and serve distinct models. 0, or -1. */
int px_cfg_validate_pools(px_config *c, char *err, size_t errlen);

/* ---------- config_file.c ---------- */
/* Applies the --config file at `path` over c, each setting marked as
 * given. 0, or -1 with "path:line: ..." in err. */
int px_cfg_load_file(px_config *c, const char *path, char *err, size_t errlen);

/* ---------- config_help.c ---------- */
void px_cfg_usage(FILE *out);
void px_cfg_markdown(FILE *out);
/* PDPROXY_<NAME> of the option. */
void px_cfg_env_name(const opt *o, char *buf, size_t n);

#endif
