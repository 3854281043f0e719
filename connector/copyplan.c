/* SPDX-License-Identifier: Apache-2.0 */
/* Copy planning for CUDA staging (pure, built with or without CUDA): the
 * block ids of a publish or fetch become as few copies as the layout
 * allows, one cudaMemcpyAsync per run of consecutive blocks, or one
 * cudaMemcpy2DAsync per series of equal runs at a constant stride. */
#include "connector/kvc_int.h"

#include <stdlib.h>
#include <string.h>

/* Largest pitch given to cudaMemcpy2DAsync; below every device's limit
 * (cudaDevAttrMaxPitch, 2^31 - 1 on current GPUs). */
#define MAX_PITCH ((size_t)1 << 30)

static int cmp_u64(const void *p, const void *q) {
    uint64_t x = *(const uint64_t *)p, y = *(const uint64_t *)q;
    return x < y ? -1 : x > y;
}

kvc_status_t kvc_cuda_plan(const uint64_t *ids, size_t n, size_t block_len, kvc_crun_t **out,
                           size_t *nout) {
    *out = NULL;
    *nout = 0;
    if (n == 0) return KVC_OK;
    uint64_t *s = malloc(n * sizeof(*s));
    kvc_crun_t *runs = malloc(n * sizeof(*runs));
    if (!s || !runs) {
        free(s);
        free(runs);
        return KVC_ERR_NO_MEMORY;
    }
    memcpy(s, ids, n * sizeof(*s));
    qsort(s, n, sizeof(*s), cmp_u64);
    /* Maximal runs of consecutive ids (repeats dropped)... */
    size_t nr = 0;
    for (size_t i = 0; i < n; i++) {
        if (nr && s[i] < runs[nr - 1].start + runs[nr - 1].len) continue; /* repeated */
        if (nr && s[i] == runs[nr - 1].start + runs[nr - 1].len) {
            runs[nr - 1].len++;
            continue;
        }
        runs[nr++] = (kvc_crun_t){.start = s[i], .len = 1, .stride = 0, .count = 1};
    }
    free(s);
    /* ...then equal runs at a constant stride folded into one 2D copy. */
    size_t k = 0;
    for (size_t i = 0; i < nr;) {
        kvc_crun_t g = runs[i];
        size_t j = i + 1;
        if (j < nr && runs[j].len == g.len && (runs[j].start - g.start) * block_len <= MAX_PITCH) {
            g.stride = runs[j].start - g.start;
            while (j < nr && runs[j].len == g.len && runs[j].start - runs[j - 1].start == g.stride)
                j++;
            g.count = j - i;
        }
        if (g.count == 1) g.stride = 0;
        runs[k++] = g;
        i = j;
    }
    *out = runs;
    *nout = k;
    return KVC_OK;
}
