/* pdproxy's settings. One static table (config.c) drives the command-line
 * flags, the PDPROXY_* environment variables, --help and --print-config. */
#ifndef PX_CONFIG_H
#define PX_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct px_strlist {
    char **v; /* owned, each string owned */
    size_t n;
} px_strlist;

typedef struct px_config {
    char *host;
    int64_t port;
    px_strlist prefiller_hosts;
    px_strlist prefiller_ports;
    px_strlist decoder_hosts;
    px_strlist decoder_ports;
    int64_t threads;          /* 0: one per CPU */
    int64_t max_body_bytes;
    double connect_timeout;   /* seconds */
    double prefill_timeout;   /* seconds, 0: none */
    double client_header_timeout;
    double keepalive_timeout;
    char *log_level;
    int print_config;
} px_config;

typedef enum { PX_CONFIG_RUN = 0, PX_CONFIG_EXIT_OK = 1, PX_CONFIG_ERROR = -1 } px_config_result;

/* Fills c from defaults, then PDPROXY_* variables of `envp`, then argv.
 * --help and --version print to `out` and return PX_CONFIG_EXIT_OK. On a bad
 * flag or value returns PX_CONFIG_ERROR with "--flag 'value': reason" in err.
 * c must be released with px_config_cleanup() whatever the result. */
px_config_result px_config_load(px_config *c, int argc, char **argv, char **envp, FILE *out,
                                char *err, size_t errlen);

void px_config_cleanup(px_config *c);

/* Writes the effective configuration, one "name = value" line per setting. */
void px_config_dump(const px_config *c, FILE *out);

#endif
