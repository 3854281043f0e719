/* SPDX-License-Identifier: Apache-2.0 */
/* pdproxy --version: what was built, from what, with what.  The commit and
 * the build options come from CMake (proxy/CMakeLists.txt), the library
 * versions from the libraries themselves at run time where they say. */
#include "proxy/version.h"

#include <event2/event.h>
#include <openssl/crypto.h>
#include <openssl/opensslv.h>
#include <string.h>

#ifndef PDPROXY_COMMIT
#define PDPROXY_COMMIT "unknown"
#endif
#ifndef PX_BUILD_TYPE
#define PX_BUILD_TYPE ""
#endif
#ifndef PX_CUDA
#define PX_CUDA "off"
#endif
#ifndef PX_UCX_VERSION
#define PX_UCX_VERSION "unknown"
#endif
#ifndef PX_SANITIZE
#define PX_SANITIZE ""
#endif
#ifndef PX_LTO_ON
#define PX_LTO_ON 0
#endif

void px_version_print(FILE *out) {
    fprintf(out, "pdproxy %s\n", PDPROXY_VERSION);
    fprintf(out, "commit: %s\n", PDPROXY_COMMIT);
    fprintf(out, "build: %s%s%s%s\n", PX_BUILD_TYPE[0] ? PX_BUILD_TYPE : "default",
            PX_LTO_ON ? ", link-time optimised" : "", PX_SANITIZE[0] ? ", sanitizers " : "",
            PX_SANITIZE);
    const char *ssl = OpenSSL_version(OPENSSL_VERSION);
    fprintf(out, "TLS: %s", ssl);
    if (strcmp(ssl, OPENSSL_VERSION_TEXT)) fprintf(out, " (built against %s)", OPENSSL_VERSION_TEXT);
    fprintf(out, "\nlibcurl: loaded on first use (https:// upstreams, OTLP export)\n");
    fprintf(out, "libevent: %s\n", event_get_version());
    fprintf(out, "libkvconnector: CUDA %s, UCX %s (engine side; the proxy loads neither)\n",
            PX_CUDA, PX_UCX_VERSION);
}
