/* SPDX-License-Identifier: Apache-2.0 */
/* What the connector's parsers and auth.c need from loop.c, for fuzz
 * targets that link only the pure sources. */
#include <time.h>

#include "connector/kvc_int.h"

uint64_t kvc_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void kvc_log(kvc_agent_t *a, kvc_log_level_t lvl, const char *fmt, ...) {
    (void)a;
    (void)lvl;
    (void)fmt;
}
