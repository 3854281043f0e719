/* SPDX-License-Identifier: Apache-2.0 */
#include "proxy/endpoint.h"

#include <string.h>

#define ANY_METHOD (PX_M_GET | PX_M_POST | PX_M_OTHER)
#define ALLOW_ANY "Allow: GET, POST, PUT, PATCH, DELETE\r\n"
#define LOCAL(p)                                                                                   \
    { p, p, PX_M_GET | PX_M_HEAD, "Allow: GET, HEAD\r\n", "method not allowed: use GET", 1 }

const px_endpoint_def px_endpoints[PX_EP_COUNT] = {
    [PX_EP_COMPLETIONS] = {"/v1/completions", "/v1/completions", PX_M_POST, "Allow: POST\r\n",
                           "method not allowed: use POST", 0},
    [PX_EP_CHAT] = {"/v1/chat/completions", "/v1/chat/completions", PX_M_POST, "Allow: POST\r\n",
                    "method not allowed: use POST", 0},
    [PX_EP_MODELS] = {"/v1/models", "/v1/models", PX_M_GET, "Allow: GET\r\n",
                      "method not allowed: use GET", 0},
    [PX_EP_HEALTHCHECK] = LOCAL("/healthcheck"),
    [PX_EP_HEALTH] = LOCAL("/health"),
    [PX_EP_READY] = LOCAL("/ready"),
    [PX_EP_METRICS] = LOCAL("/metrics"),
    [PX_EP_OTHER] = {NULL, "other", 0, NULL, NULL, 0},
    /* The engine's other endpoints: /v1/messages and /v1/responses
     * disaggregated, the rest (/v1/responses/{id} and its cancel among
     * them) passed to a decode as they are. */
    [PX_EP_MESSAGES] = {"/v1/messages", "/v1/messages", PX_M_POST, "Allow: POST\r\n",
                        "method not allowed", 0},
    [PX_EP_RESPONSES] = {"/v1/responses", "/v1/responses", PX_M_POST, "Allow: POST\r\n",
                         "method not allowed: use POST", 0},
    [PX_EP_PASSTHROUGH] = {NULL, "passthrough", ANY_METHOD, ALLOW_ANY, "method not allowed", 0},
    [PX_EP_GENERATE] = {"/inference/v1/generate", "/inference/v1/generate", PX_M_POST,
                        "Allow: POST\r\n", "method not allowed: use POST", 0},
};

int px_endpoint_method(const px_http_head *h) {
    static const struct {
        const char *name;
        size_t len;
        int bit;
    } m[] = {{"GET", 3, PX_M_GET},     {"POST", 4, PX_M_POST},    {"PUT", 3, PX_M_OTHER},
             {"PATCH", 5, PX_M_OTHER}, {"DELETE", 6, PX_M_OTHER}, {"HEAD", 4, PX_M_HEAD}};
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
        if (h->method_len == m[i].len && !memcmp(h->method, m[i].name, m[i].len)) return m[i].bit;
    return 0;
}

int px_endpoint_passthrough_path(const char *path, size_t len) {
    static const char *const exact[] = {"/tokenize", "/detokenize", "/pooling",  "/score",
                                        "/rerank",   "/classify",   "/v2/rerank"};
    if (len > 4 && !memcmp(path, "/v1/", 4)) return 1;
    for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++)
        if (strlen(exact[i]) == len && !memcmp(path, exact[i], len)) return 1;
    return 0;
}

int px_endpoint_passthrough(px_endpoint ep) {
    return ep == PX_EP_PASSTHROUGH;
}
