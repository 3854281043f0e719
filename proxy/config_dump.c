/* SPDX-License-Identifier: Apache-2.0 */
/* The settings written out: --print-config's YAML (it reads back as a
 * --config file) and which settings a reload changed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proxy/config_int.h"

/* One setting's value as text, for comparisons. */
static void value_text(const px_config *c, const opt *o, FILE *f) {
    const void *field = (const char *)c + o->off;
    switch (o->type) {
    case CT_STR:
    case CT_ENUM:
    case CT_SECRET:
        fputs(*(char *const *)field, f);
        break;
    case CT_INT:
        fprintf(f, "%lld", (long long)*(const int64_t *)field);
        break;
    case CT_SECONDS:
        fprintf(f, "%.17g", *(const double *)field);
        break;
    case CT_FLAG:
        fputc(*(const int *)field ? '1' : '0', f);
        break;
    case CT_LIST:
    case CT_URLS:
    case CT_WORDS:
        for (size_t j = 0; j < ((const px_strlist *)field)->n; j++)
            fprintf(f, "%s\n", ((const px_strlist *)field)->v[j]);
        break;
    case CT_POOL:
        break;
    }
}

void px_config_changed(const px_config *a, const px_config *b, char *out, size_t cap) {
    size_t len = 0;
    out[0] = '\0';
    for (size_t i = 0; i < px_cfg_nopts; i++) {
        const opt *o = &px_cfg_opts[i];
        int skipped = o->type == CT_POOL || o->reloads;
        if (skipped) continue;
        char *ta = NULL, *tb = NULL;
        size_t la = 0, lb = 0;
        FILE *fa = open_memstream(&ta, &la), *fb = open_memstream(&tb, &lb);
        if (fa) {
            value_text(a, o, fa);
            fclose(fa);
        }
        if (fb) {
            value_text(b, o, fb);
            fclose(fb);
        }
        if (ta && tb && strcmp(ta, tb) && len + strlen(o->name) + 2 < cap)
            len += (size_t)snprintf(out + len, cap - len, "%s%s", len ? "," : "", o->name);
        free(ta);
        free(tb);
    }
}

static void yaml_str(FILE *out, const char *v) {
    fputc('"', out);
    for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(out, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(out, "\\x%02x", *p);
        else
            fputc(*p, out);
    }
    fputc('"', out);
}

static void yaml_list(FILE *out, const px_strlist *l) {
    fputc('[', out);
    for (size_t j = 0; j < l->n; j++) {
        if (j) fputs(", ", out);
        yaml_str(out, l->v[j]);
    }
    fputc(']', out);
}

/* A prefill/decode list: an entry that declared dp_size or KV-event
 * endpoints as a mapping, so that the output reads back to the same
 * declarations. */
static void yaml_backends(FILE *out, const px_config *c, const px_strlist *l) {
    fputc('[', out);
    for (size_t j = 0; j < l->n; j++) {
        if (j) fputs(", ", out);
        long dp = 0;
        const char *kv = NULL;
        size_t ul = strlen(l->v[j]);
        for (size_t k = 0; k < c->backend_dp.n && !dp; k++) {
            const char *sp = strchr(c->backend_dp.v[k], ' ');
            if (sp && !strcmp(sp + 1, l->v[j])) dp = strtol(c->backend_dp.v[k], NULL, 10);
        }
        for (size_t k = 0; k < c->backend_kv.n && !kv; k++)
            if (!strncmp(c->backend_kv.v[k], l->v[j], ul) && c->backend_kv.v[k][ul] == ' ')
                kv = c->backend_kv.v[k] + ul + 1;
        if (dp || kv) fputs("{url: ", out);
        yaml_str(out, l->v[j]);
        if (dp) fprintf(out, ", dp_size: %ld", dp);
        if (kv) {
            char ep[2][600] = {"", ""};
            if (sscanf(kv, "%599s %599s", ep[0], ep[1]) == 2)
                for (int e = 0; e < 2; e++) {
                    if (!strcmp(ep[e], "-")) continue;
                    fputs(e ? ", kv_events_replay_endpoint: " : ", kv_events_endpoint: ", out);
                    yaml_str(out, ep[e]);
                }
        }
        if (dp || kv) fputc('}', out);
    }
    fputc(']', out);
}

void px_config_dump(const px_config *c, FILE *out) {
    fprintf(out, "# pdproxy %s: the effective configuration (file, environment, flags)\n",
            PDPROXY_VERSION);
    for (size_t i = 0; i < px_cfg_nopts; i++) {
        const opt *o = &px_cfg_opts[i];
        const void *field = (const char *)c + o->off;
        if (o->type == CT_POOL || !strcmp(o->name, "print-config") || !strcmp(o->name, "config"))
            continue;
        /* Toy lists shown only when they make backends: read back, a
         * shown list counts as given. */
        if (!strcmp(o->name, "prefiller-hosts") || !strcmp(o->name, "prefiller-ports")) {
            if (!px_cfg_toy_in_effect(c, 1)) continue;
        } else if (!strcmp(o->name, "decoder-hosts") || !strcmp(o->name, "decoder-ports")) {
            if (!px_cfg_toy_in_effect(c, 0)) continue;
        }
        if (o->type == CT_SECRET) {
            /* A comment: a masked value must not read back as the key. */
            fprintf(out, "# %s: %s\n", o->name, (*(char *const *)field)[0] ? "(set)" : "(not set)");
            continue;
        }
        fprintf(out, "%s: ", o->name);
        switch (o->type) {
        case CT_STR:
        case CT_ENUM:
            yaml_str(out, *(char *const *)field);
            break;
        case CT_INT:
            fprintf(out, "%lld", (long long)*(const int64_t *)field);
            break;
        case CT_SECONDS:
            fprintf(out, "%.15g", *(const double *)field);
            break;
        case CT_FLAG:
            fprintf(out, "%s", *(const int *)field ? "true" : "false");
            break;
        case CT_LIST:
        case CT_URLS:
        case CT_WORDS:
            if (o->type == CT_URLS && (!strcmp(o->name, "prefill") || !strcmp(o->name, "decode")))
                yaml_backends(out, c, field);
            else
                yaml_list(out, field);
            break;
        case CT_SECRET:
        case CT_POOL:
            break;
        }
        fputc('\n', out);
    }
    if (!c->npools) {
        fprintf(out, "pools: []\n");
        return;
    }
    fprintf(out, "pools:\n");
    for (size_t i = 0; i < c->npools; i++) {
        const px_pool_spec *p = &c->pools[i];
        fprintf(out, "  - name: ");
        yaml_str(out, p->name);
        fprintf(out, "\n    models: ");
        yaml_list(out, &p->models);
        fprintf(out, "\n    prefill: ");
        yaml_backends(out, c, &p->prefill);
        fprintf(out, "\n    decode: ");
        yaml_backends(out, c, &p->decode);
        fputc('\n', out);
        if (p->prefill_policy[0]) {
            fprintf(out, "    prefill-policy: ");
            yaml_str(out, p->prefill_policy);
            fputc('\n', out);
        }
        if (p->decode_policy[0]) {
            fprintf(out, "    decode-policy: ");
            yaml_str(out, p->decode_policy);
            fputc('\n', out);
        }
        if (p->dispatch[0]) {
            fprintf(out, "    dispatch: ");
            yaml_str(out, p->dispatch);
            fputc('\n', out);
        }
    }
}
