/* SPDX-License-Identifier: Apache-2.0 */
/* --help and --help-markdown (docs/flags.md's tables, pdproxy(1)), from
 * the option table: grouped by topic, 80 columns. */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "proxy/config_int.h"

/* The groups' names, and the order --help lists them in (a flag whose
 * row names no group comes last, under "Other": a test fails on that). */
static const char *const group_names[G_COUNT] = {
    [G_BACKENDS] = "Backends",
    [G_ROUTING] = "Routing",
    [G_DISAGG] = "Conditional disaggregation and usage",
    [G_HEALTH] = "Health and failover",
    [G_LISTEN] = "Listening and client limits",
    [G_UPSTREAM] = "Upstream connections",
    [G_SECURITY] = "Security",
    [G_SIDECAR] = "Sidecar mode (llm-d)",
    [G_METRICS] = "Metrics and logs",
    [G_OPERATIONS] = "Operations",
    [G_OTHER] = "Other",
};
static const unsigned char group_order[G_COUNT] = {G_BACKENDS, G_ROUTING,    G_DISAGG,   G_HEALTH,
                                                   G_LISTEN,   G_UPSTREAM,   G_SECURITY, G_SIDECAR,
                                                   G_METRICS,  G_OPERATIONS, G_OTHER};

static const char *opt_metavar(const opt *o) {
    if (o->metavar) return o->metavar;
    switch (o->type) {
    case CT_LIST:
        return "V [V...]";
    case CT_WORDS:
        return "LIST";
    case CT_POOL:
        return "NAME[=MODELS]";
    case CT_URLS:
        return "URL";
    case CT_ENUM:
        return "CHOICE";
    case CT_FLAG:
        return "";
    case CT_SECONDS:
        return "SECONDS";
    case CT_INT:
        return "N";
    default:
        return "VALUE";
    }
}

/* Writes `text` from column `col`, wrapped at 80 columns, continuation
 * lines indented to `indent`. */
static void wrap(FILE *out, const char *text, int col, int indent) {
    const int width = 80;
    const char *p = text;
    while (*p) {
        while (*p == ' ')
            p++;
        size_t n = strcspn(p, " ");
        if (!n) break;
        if (col > indent && col + 1 + (int)n > width) {
            fprintf(out, "\n%*s", indent, "");
            col = indent;
        } else if (col > indent) {
            fputc(' ', out);
            col++;
        }
        fprintf(out, "%.*s", (int)n, p);
        col += (int)n;
        p += n;
    }
    fputc('\n', out);
}

void px_cfg_usage(FILE *out) {
    fprintf(out, "Usage: pdproxy [OPTION]...\n"
                 "Prefill/decode disaggregation proxy for OpenAI-compatible engines.\n\n");
    wrap(out,
         "Every option is also read from the environment as PDPROXY_<NAME> (dashes become "
         "underscores: PDPROXY_PORT=8000) and, but --config, as a key of the --config file; "
         "flags win over the environment, which wins over the file.",
         0, 0);
    const int col = 30; /* where descriptions start */
    for (unsigned gi = 0; gi < G_COUNT; gi++) {
        unsigned g = group_order[gi];
        int any = 0;
        for (size_t i = 0; i < px_cfg_nopts; i++) {
            const opt *o = &px_cfg_opts[i];
            if (o->group != g) continue;
            if (!any) fprintf(out, "\n%s:\n", group_names[g]);
            any = 1;
            char names[128], text[1024];
            const char *mv = opt_metavar(o);
            int n = snprintf(names, sizeof names, "  --%s%s%s", o->name, *mv ? " " : "", mv);
            if (o->type == CT_ENUM) {
                /* a|b|c as "a, b, c": wrap points */
                char ch[256];
                size_t k = 0;
                for (const char *q = o->choices; *q && k + 3 < sizeof ch; q++) {
                    if (*q == '|') {
                        ch[k++] = ',';
                        ch[k++] = ' ';
                    } else {
                        ch[k++] = *q;
                    }
                }
                ch[k] = '\0';
                snprintf(text, sizeof text, "%s: %s (default: %s)", o->help, ch, o->def);
            } else if (!o->def[0] || o->type == CT_FLAG)
                snprintf(text, sizeof text, "%s", o->help);
            else
                snprintf(text, sizeof text, "%s (default: %s)", o->help, o->def);
            if (o->alias) {
                size_t l = strlen(text);
                snprintf(text + l, sizeof text - l, "; also --%s", o->alias);
            }
            fputs(names, out);
            if (n + 2 <= col) {
                fprintf(out, "%*s", col - n, "");
                wrap(out, text, col, col);
            } else {
                fprintf(out, "\n%*s", col, "");
                wrap(out, text, col, col);
            }
        }
    }
    fprintf(out, "\nInformation:\n");
    fprintf(out, "  %-28s%s\n", "-h, --help", "show this help and exit");
    fprintf(out, "  %-28s%s\n", "--help-markdown", "the options as Markdown tables");
    fprintf(out, "  %-28s%s\n", "-V, --version", "show the version, commit and build options");
}

void px_cfg_env_name(const opt *o, char *buf, size_t n) {
    size_t j = (size_t)snprintf(buf, n, "PDPROXY_");
    for (const char *p = o->name; *p && j + 1 < n; p++)
        buf[j++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    buf[j] = '\0';
}

/* The flags tables of docs/flags.md (and pdproxy(1)), one per group, from the
 * same table as --help. */
void px_cfg_markdown(FILE *out) {
    for (unsigned k = 0; k < G_COUNT; k++) {
        unsigned g = group_order[k];
        int any = 0;
        for (size_t i = 0; i < px_cfg_nopts; i++) {
            const opt *o = &px_cfg_opts[i];
            if (o->group != g) continue;
            if (!any)
                fprintf(out,
                        "%s**%s**\n\n| flag | environment | default | meaning |\n"
                        "|---|---|---|---|\n",
                        k ? "\n" : "", group_names[g]);
            any = 1;
            char env[96];
            px_cfg_env_name(o, env, sizeof env);
            const char *mv = opt_metavar(o);
            fprintf(out, "| `--%s`%s%s", o->name, *mv ? " " : "", mv);
            if (o->alias) fprintf(out, " / `--%s`", o->alias);
            /* Pools are given as flags or in the file: PDPROXY_POOL is refused. */
            if (o->type == CT_POOL)
                fprintf(out, " | (none: flag and file only)");
            else
                fprintf(out, " | `%s`", env);
            fprintf(out, " | %s%s%s | %s", o->def[0] ? "`" : "", o->def, o->def[0] ? "`" : "",
                    o->help);
            if (o->type == CT_ENUM) fprintf(out, ": `%s`", o->choices);
            if (o->type == CT_URLS || o->type == CT_POOL) fprintf(out, " (repeatable)");
            if (o->type == CT_LIST) fprintf(out, " (one or more values)");
            fprintf(out, " |\n");
        }
    }
}
