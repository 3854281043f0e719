/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: pdproxy's flag and PDPROXY_* environment parsing
 * (proxy/config.c and config_*.c), table-driven and full of number conversions.
 *
 * Input: NUL-separated strings. The first byte of the first string says how
 * many of the following strings are argv entries (after "pdproxy"); the
 * rest are environment entries ("PDPROXY_PORT=80"). Output (--help,
 * --print-config) goes to /dev/null. px_config_cleanup runs whatever the
 * result, so LeakSanitizer sees every allocation the loader makes. */
#include <string.h>

#include "proxy/config.h"
#include "tests/fuzz/fuzz_common.h"

#define MAX_PARTS 64

static FILE *devnull;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    devnull = fopen("/dev/null", "w");
    if (!devnull) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *parts[MAX_PARTS];
    size_t nparts = 0, off = 0;
    while (off <= size && nparts < MAX_PARTS) {
        const uint8_t *z = memchr(data + off, '\0', size - off);
        size_t len = z ? (size_t)(z - (data + off)) : size - off;
        /* Each string in its own exact-size allocation (with its NUL). */
        char *s = malloc(len + 1);
        if (!s) abort();
        memcpy(s, data + off, len);
        s[len] = '\0';
        parts[nparts++] = s;
        off += len + 1;
        if (!z) break;
    }
    size_t rest = nparts - 1;
    size_t nargs = rest ? (unsigned char)parts[0][0] % (rest + 1) : 0;

    char *argv[MAX_PARTS + 1], *envp[MAX_PARTS + 1];
    char prog[] = "pdproxy";
    int argc = 0;
    argv[argc++] = prog;
    for (size_t i = 0; i < nargs; i++)
        argv[argc++] = parts[1 + i];
    argv[argc] = NULL;
    size_t nenv = 0;
    for (size_t i = 1 + nargs; i < nparts; i++)
        envp[nenv++] = parts[i];
    envp[nenv] = NULL;

    px_config c;
    char err[256];
    memset(err, 'x', sizeof err);
    px_config_result r = px_config_load(&c, argc, argv, envp, devnull, err, sizeof err);
    FZ_CHECK(memchr(err, '\0', sizeof err) != NULL);
    FZ_CHECK(r == PX_CONFIG_RUN || r == PX_CONFIG_EXIT_OK || r == PX_CONFIG_ERROR);
    if (r == PX_CONFIG_ERROR) FZ_CHECK(err[0] != '\0');
    if (r == PX_CONFIG_RUN) {
        FZ_CHECK(c.host != NULL);
        FZ_CHECK(c.port >= 1 && c.port <= 65535);
        FZ_CHECK(c.prefiller_hosts.n == c.prefiller_ports.n);
        FZ_CHECK(c.decoder_hosts.n == c.decoder_ports.n);
        FZ_CHECK(c.max_body_bytes >= 1);
        px_config_dump(&c, devnull);
    }
    px_config_cleanup(&c);
    for (size_t i = 0; i < nparts; i++)
        free(parts[i]);
    return 0;
}
