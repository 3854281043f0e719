/* SPDX-License-Identifier: Apache-2.0 */
/* Unit test: the pure choices of libkvconnector's CUDA path.  The copy plan
 * (block ids -> as few cudaMemcpyAsync / cudaMemcpy2DAsync calls as the
 * layout allows), the UCX transport names -> KVC_TRANSPORT_* bits, and the
 * per-producer choice between a one-sided get and a producer push. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
/* cmocka needs the headers above first */
#include <cmocka.h>

#include <stdlib.h>

#include "connector/kvc_int.h"

static void plan(const uint64_t *ids, size_t n, size_t bl, kvc_crun_t **r, size_t *nr) {
    assert_int_equal(kvc_cuda_plan(ids, n, bl, r, nr), KVC_OK);
}

static void test_plan_runs(void **state) {
    kvc_crun_t *r;
    size_t nr;
    plan(NULL, 0, 4096, &r, &nr);
    assert_null(r);
    assert_int_equal(nr, 0);

    /* Any order, repeats dropped: one run. */
    uint64_t a[] = {7, 5, 6, 5, 8};
    plan(a, 5, 4096, &r, &nr);
    assert_int_equal(nr, 1);
    assert_true(r[0].start == 5 && r[0].len == 4 && r[0].count == 1 && r[0].stride == 0);
    free(r);

    /* Three runs of four at stride ten: one 2D copy; then a lone block. */
    uint64_t b[] = {20, 21, 22, 23, 0, 1, 2, 3, 10, 11, 12, 13, 40};
    plan(b, 13, 4096, &r, &nr);
    assert_int_equal(nr, 2);
    assert_true(r[0].start == 0 && r[0].len == 4 && r[0].stride == 10 && r[0].count == 3);
    assert_true(r[1].start == 40 && r[1].len == 1 && r[1].count == 1);
    free(r);

    /* 2,048 scattered single blocks at stride 2: one 2D copy. */
    uint64_t *c = malloc(2048 * sizeof(*c));
    assert_non_null(c);
    for (size_t i = 0; i < 2048; i++)
        c[i] = 2 * (2047 - i);
    plan(c, 2048, 32768, &r, &nr);
    assert_int_equal(nr, 1);
    assert_true(r[0].start == 0 && r[0].len == 1 && r[0].stride == 2 && r[0].count == 2048);
    free(r);

    /* A pitch beyond the 2D limit falls back to one copy per run. */
    uint64_t d[] = {0, 40000, 80000};
    plan(d, 3, 32768, &r, &nr);
    assert_int_equal(nr, 3);
    free(r);

    /* Unequal runs never share a 2D copy; the series restarts. */
    uint64_t e[] = {0, 1, 5, 6, 7, 20, 21, 22, 35, 36, 37};
    plan(e, 11, 4096, &r, &nr);
    assert_int_equal(nr, 2);
    assert_true(r[0].start == 0 && r[0].len == 2 && r[0].count == 1);
    assert_true(r[1].start == 5 && r[1].len == 3 && r[1].stride == 15 && r[1].count == 3);
    free(r);
    free(c);
}

static void test_transport_bits(void **state) {
    assert_int_equal(kvc_transport_bits(""), 0);
    assert_int_equal(kvc_transport_bits("tcp"), KVC_TRANSPORT_TCP);
    assert_int_equal(kvc_transport_bits("self,posix,tcp,cma"),
                     KVC_TRANSPORT_SHM | KVC_TRANSPORT_TCP);
    assert_int_equal(kvc_transport_bits("rc_mlx5,cuda_ipc,cuda_copy,gdr_copy"),
                     KVC_TRANSPORT_RDMA | KVC_TRANSPORT_CUDA_IPC | KVC_TRANSPORT_CUDA_COPY |
                         KVC_TRANSPORT_GDR_COPY);
    assert_int_equal(kvc_transport_bits("dc_mlx5,ud_verbs"), KVC_TRANSPORT_RDMA);
    /* Prefixes match whole families only. */
    assert_int_equal(kvc_transport_bits("rocm_ipc"), KVC_TRANSPORT_OTHER);
    assert_int_equal(kvc_transport_bits("tcpx"), KVC_TRANSPORT_OTHER);
}

static kvc_status_t choose(kvc_path_in_t in, kvc_path_t *out) {
    kvc_status_t st = kvc_choose_path(&in, out);
    assert_non_null(out->why);
    return st;
}

static void test_choose_path(void **state) {
    kvc_path_t p;
    /* Host memory mapped on one host: one-sided memcpy through the mapping. */
    kvc_path_in_t host_shm = {.want = KVC_PROTO_AUTO,
                              .keys = true,
                              .mapped = true,
                              .transports = KVC_TRANSPORT_TCP | KVC_TRANSPORT_SHM};
    assert_int_equal(choose(host_shm, &p), KVC_OK);
    assert_true(p.proto == KVC_PROTO_GET && p.mapped_copy);
    /* No rkeys: push, whatever was asked. */
    kvc_path_in_t nokeys = host_shm;
    nokeys.keys = false;
    nokeys.want = KVC_PROTO_GET;
    assert_int_equal(choose(nokeys, &p), KVC_OK);
    assert_int_equal(p.proto, KVC_PROTO_PUSH);
    /* Remote host memory over tcp: push. */
    kvc_path_in_t tcp = {.want = KVC_PROTO_AUTO, .keys = true, .transports = KVC_TRANSPORT_TCP};
    assert_int_equal(choose(tcp, &p), KVC_OK);
    assert_int_equal(p.proto, KVC_PROTO_PUSH);

    /* Device memory on both sides with cuda_ipc and RMA: a one-sided get
     * through UCX, never through a host mapping. */
    kvc_path_in_t ipc = {.want = KVC_PROTO_AUTO,
                         .keys = true,
                         .mapped = true,
                         .rma = true,
                         .local_dev = true,
                         .remote_dev = true,
                         .transports = KVC_TRANSPORT_CUDA_IPC | KVC_TRANSPORT_TCP};
    assert_int_equal(choose(ipc, &p), KVC_OK);
    assert_true(p.proto == KVC_PROTO_GET && !p.mapped_copy);
    /* The same over RDMA across hosts. */
    kvc_path_in_t rdma = ipc;
    rdma.transports = KVC_TRANSPORT_RDMA;
    rdma.mapped = false;
    assert_int_equal(choose(rdma, &p), KVC_OK);
    assert_int_equal(p.proto, KVC_PROTO_GET);
    /* Device memory with only tcp: the producer pushes (AUTO) ... */
    kvc_path_in_t devtcp = ipc;
    devtcp.transports = KVC_TRANSPORT_TCP | KVC_TRANSPORT_SHM;
    assert_int_equal(choose(devtcp, &p), KVC_OK);
    assert_true(p.proto == KVC_PROTO_PUSH && !p.mapped_copy);
    /* ... and a forced get is refused rather than emulated by a host memcpy
     * into device memory, on either side. */
    devtcp.want = KVC_PROTO_GET;
    assert_int_equal(choose(devtcp, &p), KVC_ERR_UNSUPPORTED);
    devtcp.local_dev = false;
    assert_int_equal(choose(devtcp, &p), KVC_ERR_UNSUPPORTED);
    devtcp.local_dev = true;
    devtcp.remote_dev = false;
    assert_int_equal(choose(devtcp, &p), KVC_ERR_UNSUPPORTED);
    /* Without RMA in the context AUTO cannot get: push. */
    kvc_path_in_t norma = ipc;
    norma.rma = false;
    assert_int_equal(choose(norma, &p), KVC_OK);
    assert_int_equal(p.proto, KVC_PROTO_PUSH);
    /* Push asked for is push. */
    kvc_path_in_t push = ipc;
    push.want = KVC_PROTO_PUSH;
    assert_int_equal(choose(push, &p), KVC_OK);
    assert_int_equal(p.proto, KVC_PROTO_PUSH);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plan_runs),
        cmocka_unit_test(test_transport_bits),
        cmocka_unit_test(test_choose_path),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
