/* SPDX-License-Identifier: Apache-2.0 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "proxy/config.h"

static px_config_result load(px_config *c, char **argv, char **envp, char *err)
{
    int argc = 0;
    while (argv[argc]) argc++;
    FILE *devnull = fopen("/dev/null", "w");
    px_config_result r = px_config_load(c, argc, argv, envp, devnull, err, 256);
    fclose(devnull);
    return r;
}

static void test_toy_defaults(void **state)
{
    char *argv[] = {"pdproxy", NULL};
    char err[256];
    px_config c;
    assert_int_equal(load(&c, argv, NULL, err), PX_CONFIG_RUN);
    assert_string_equal(c.host, "127.0.0.1");
    assert_int_equal(c.port, 8000);
    assert_int_equal(c.prefiller_hosts.n, 1);
    assert_string_equal(c.prefiller_hosts.v[0], "localhost");
    assert_string_equal(c.prefiller_ports.v[0], "8100");
    assert_string_equal(c.decoder_ports.v[0], "8200");
    assert_int_equal(c.max_body_bytes, 32 * 1024 * 1024);
    px_config_cleanup(&c);
}

static void test_lists_and_aliases(void **state)
{
    char *argv[] = {"pdproxy", "--prefiller-host", "a", "b", "--prefiller-ports", "1", "2",
                    "--decoder-hosts=x,y,z", "--decoder-port", "7", "8", "9", "--port=9000",
                    NULL};
    char err[256];
    px_config c;
    assert_int_equal(load(&c, argv, NULL, err), PX_CONFIG_RUN);
    assert_int_equal(c.prefiller_hosts.n, 2);
    assert_string_equal(c.prefiller_hosts.v[1], "b");
    assert_int_equal(c.decoder_hosts.n, 3);
    assert_string_equal(c.decoder_ports.v[2], "9");
    assert_int_equal(c.port, 9000);
    px_config_cleanup(&c);
}

static void test_env_then_flags(void **state)
{
    char *envp[] = {"PDPROXY_PORT=7000", "PDPROXY_CONNECT_TIMEOUT=0.25", "OTHER=1", NULL};
    char *argv[] = {"pdproxy", "--port", "7001", NULL};
    char err[256];
    px_config c;
    assert_int_equal(load(&c, argv, envp, err), PX_CONFIG_RUN);
    assert_int_equal(c.port, 7001);
    assert_true(c.connect_timeout > 0.24 && c.connect_timeout < 0.26);
    px_config_cleanup(&c);
}

static void test_errors_name_flag_and_value(void **state)
{
    char err[256];
    px_config c;
    char *a1[] = {"pdproxy", "--port", "99999", NULL};
    assert_int_equal(load(&c, a1, NULL, err), PX_CONFIG_ERROR);
    assert_non_null(strstr(err, "--port"));
    assert_non_null(strstr(err, "99999"));
    px_config_cleanup(&c);
    char *a2[] = {"pdproxy", "--prefiller-hosts", "a", "b", NULL};
    assert_int_equal(load(&c, a2, NULL, err), PX_CONFIG_ERROR);
    assert_non_null(strstr(err, "--prefiller-ports"));
    px_config_cleanup(&c);
    char *a3[] = {"pdproxy", "--bogus", NULL};
    assert_int_equal(load(&c, a3, NULL, err), PX_CONFIG_ERROR);
    px_config_cleanup(&c);
    char *a4[] = {"pdproxy", "--decoder-ports", NULL};
    assert_int_equal(load(&c, a4, NULL, err), PX_CONFIG_ERROR);
    px_config_cleanup(&c);
    char *envp[] = {"PDPROXY_THREADS=lots", NULL};
    char *a5[] = {"pdproxy", NULL};
    assert_int_equal(load(&c, a5, envp, err), PX_CONFIG_ERROR);
    assert_non_null(strstr(err, "PDPROXY_THREADS"));
    px_config_cleanup(&c);
    char *a6[] = {"pdproxy", "--log-level", "loud", NULL};
    assert_int_equal(load(&c, a6, NULL, err), PX_CONFIG_ERROR);
    px_config_cleanup(&c);
    /* A URL where a toy host flag wants a host; a pool without a name;
     * sidecar mode without an allowlist. */
    char *a7[] = {"pdproxy", "--prefiller-hosts", "http://p:8100", NULL};
    assert_int_equal(load(&c, a7, NULL, err), PX_CONFIG_ERROR);
    assert_non_null(strstr(err, "not a URL"));
    px_config_cleanup(&c);
    char *a8[] = {"pdproxy", "--pool", "", "--decode", "http://d:1", NULL};
    assert_int_equal(load(&c, a8, NULL, err), PX_CONFIG_ERROR);
    assert_non_null(strstr(err, "missing pool name"));
    px_config_cleanup(&c);
    char *a9[] = {"pdproxy", "--prefiller-from-header", NULL};
    assert_int_equal(load(&c, a9, NULL, err), PX_CONFIG_ERROR);
    assert_non_null(strstr(err, "--prefiller-allowlist"));
    px_config_cleanup(&c);
}

static void test_help_and_version(void **state)
{
    char err[256];
    px_config c;
    char *a1[] = {"pdproxy", "--help", NULL};
    assert_int_equal(load(&c, a1, NULL, err), PX_CONFIG_EXIT_OK);
    px_config_cleanup(&c);
    char *a2[] = {"pdproxy", "--version", NULL};
    assert_int_equal(load(&c, a2, NULL, err), PX_CONFIG_EXIT_OK);
    px_config_cleanup(&c);
}


/* Writes text to a fresh temporary file; returns its path (static buffer). */
static const char *yaml_file(const char *text)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/test_config_XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs(text, f);
    fclose(f);
    return path;
}

static void test_yaml_file_below_env_and_flags(void **state)
{
    const char *f = yaml_file("port: 7100\nmax_inflight: 5\nprefill-policy: least_inflight\n"
                              "decode:\n  - http://127.0.0.1:9\n  - http://127.0.0.1:10\n"
                              "prefiller-allowlist: [10.0.0.0/8:8000, p.example:*]\n");
    char *envp[] = {"PDPROXY_MAX_INFLIGHT=6", NULL};
    char *argv[] = {"pdproxy", "--config", (char *)f, "--port", "7101", NULL};
    char err[256];
    px_config c;
    assert_int_equal(load(&c, argv, envp, err), PX_CONFIG_RUN);
    assert_int_equal(c.port, 7101);          /* flag over file */
    assert_int_equal(c.max_inflight, 6);     /* environment over file */
    assert_string_equal(c.prefill_policy, "least_inflight");
    assert_int_equal(c.decode_urls.n, 2);
    assert_string_equal(c.decode_urls.v[1], "http://127.0.0.1:10");
    assert_int_equal(c.prefiller_allowlist.n, 2);
    assert_true(px_config_is_set(&c, "decode"));
    assert_false(px_config_is_set(&c, "threads"));
    px_config_cleanup(&c);
    unlink(f);
}

static void test_yaml_errors_name_line_and_key(void **state)
{
    static const struct {
        const char *text, *want;
    } cases[] = {
        {"port: 80\nthreads: many\n", ":2: key 'threads': 'many': not an integer"},
        {"# c\n\nbogus: 1\n", ":3: unknown key 'bogus'"},
        {"port: [1\n", ":2:"},
        {"pools:\n  - name: a\n    decode: http://x:1\n    weight: 3\n", ":4: unknown key 'weight'"},
        {"pools: 3\n", ":1: key 'pools'"},
        {"print-config: true\n", "unknown key 'print-config'"},
        {"prefill:\n  - [http://x:1]\n", ":2: key 'prefill': list items must be plain values"},
        {"port:\n  a: 1\n", "key 'port': expected a value or a list"},
        {"pools:\n  - http://x:1\n", ":2: key 'pools': each pool is a mapping"},
        {"pools:\n  - name: a\n    decode: http://x:1\n    prefill-policy: dice\n",
         ":4: key 'prefill-policy': 'dice' is none of"},
        {"[a]: 1\n", ":1: keys are plain names"},
        {"pools:\n  - decode: http://x:1\n", "a pool needs a name"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const char *f = yaml_file(cases[i].text);
        char *argv[] = {"pdproxy", "--config", (char *)f, NULL};
        char err[256];
        px_config c;
        assert_int_equal(load(&c, argv, NULL, err), PX_CONFIG_ERROR);
        assert_non_null(strstr(err, f));
        if (!strstr(err, cases[i].want)) fail_msg("case %zu: '%s' lacks '%s'", i, err, cases[i].want);
        px_config_cleanup(&c);
        unlink(f);
    }
}

static void test_pools_from_flags_and_lookup(void **state)
{
    char *argv[] = {"pdproxy", "--pool", "a=m1,m2", "--prefill", "http://127.0.0.1:1",
                    "--decode", "http://127.0.0.1:2", "--pool", "b", "--decode",
                    "http://127.0.0.1:3", NULL};
    char err[256];
    px_config c;
    assert_int_equal(load(&c, argv, NULL, err), PX_CONFIG_RUN);
    assert_int_equal(c.npools, 2);
    assert_int_equal(c.pools[0].models.n, 2);
    assert_string_equal(c.pools[1].models.v[0], "b"); /* the name by default */
    assert_int_equal(c.prefill_urls.n, 0);
    assert_int_equal(px_config_pool_for(&c, "m2", 2), 0);
    assert_int_equal(px_config_pool_for(&c, "b", 1), 1);
    assert_int_equal(px_config_pool_for(&c, "m", 1), -1);
    size_t n;
    px_pool_spec *v = px_config_effective_pools(&c, &n);
    assert_int_equal(n, 2);
    assert_string_equal(v[1].decode.v[0], "http://127.0.0.1:3");
    px_pool_specs_free(v, n);
    px_config_cleanup(&c);
    /* Without pools: one unnamed pool of the toy lists and the URLs. */
    char *a2[] = {"pdproxy", "--decode", "http://127.0.0.1:4", NULL};
    assert_int_equal(load(&c, a2, NULL, err), PX_CONFIG_RUN);
    v = px_config_effective_pools(&c, &n);
    assert_int_equal(n, 1);
    assert_string_equal(v[0].name, "");
    /* A URL of either role: no toy default applies (no phantom prefill). */
    assert_int_equal(v[0].prefill_toy.n, 0);
    assert_int_equal(v[0].decode_toy.n, 0);
    px_pool_specs_free(v, n);
    px_config_cleanup(&c);
    /* Toy flags alone: the other role keeps the toy default localhost:8200. */
    char *a3[] = {"pdproxy", "--prefiller-hosts", "10.0.0.1", NULL};
    assert_int_equal(load(&c, a3, NULL, err), PX_CONFIG_RUN);
    v = px_config_effective_pools(&c, &n);
    assert_int_equal(v[0].prefill_toy.n, 1);
    assert_int_equal(v[0].decode_toy.n, 1);
    px_pool_specs_free(v, n);
    px_config_cleanup(&c);
    /* Nothing given: both toy defaults. */
    char *a4[] = {"pdproxy", NULL};
    assert_int_equal(load(&c, a4, NULL, err), PX_CONFIG_RUN);
    v = px_config_effective_pools(&c, &n);
    assert_int_equal(v[0].prefill_toy.n, 1);
    assert_int_equal(v[0].decode_toy.n, 1);
    px_pool_specs_free(v, n);
    px_config_cleanup(&c);
}

static void test_print_config_round_trip(void **state)
{
    char *argv[] = {"pdproxy", "--pool", "a=x,y", "--decode", "http://127.0.0.1:2",
                    "--connect-timeout", "0.125", "--host", "we\"ird\\host", NULL};
    char err[256];
    px_config c;
    assert_int_equal(load(&c, argv, NULL, err), PX_CONFIG_RUN);
    char *t1 = NULL, *t2 = NULL;
    size_t l1 = 0, l2 = 0;
    FILE *m = open_memstream(&t1, &l1);
    px_config_dump(&c, m);
    fclose(m);
    px_config_cleanup(&c);
    const char *f = yaml_file(t1);
    char *a2[] = {"pdproxy", "--config", (char *)f, NULL};
    assert_int_equal(load(&c, a2, NULL, err), PX_CONFIG_RUN);
    assert_string_equal(c.host, "we\"ird\\host");
    m = open_memstream(&t2, &l2);
    px_config_dump(&c, m);
    fclose(m);
    assert_string_equal(t1, t2);
    px_config_cleanup(&c);
    unlink(f);
    free(t1);
    free(t2);
}

static void test_kv_endpoint_check(void **state) {
    (void)state;
    char err[256];
    static const char *const good[] = {"tcp://127.0.0.1:5557", "tcp://engine-0.svc:1",
                                       "tcp://[::1]:65535", "ipc:///tmp/kv.ipc"};
    static const char *const bad[] = {"", "tcp://", "tcp://h", "tcp://h:", "tcp://h:0",
                                      "tcp://h:65536", "tcp://h:5x", "tcp://:1", "tcp://*:1",
                                      "tcp://a:b:1", "tcp://[]:1", "tcp://[::1:1",
                                      "tcp://[::1]]:1", "udp://h:1", "ipc://", "tcp://h :1",
                                      "http://h:1"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++)
        assert_int_equal(px_config_kv_endpoint_check(good[i], err, sizeof err), 0);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        err[0] = '\0';
        assert_int_equal(px_config_kv_endpoint_check(bad[i], err, sizeof err), -1);
        assert_non_null(strstr(err, bad[i]));
    }
    char longp[200];
    memset(longp, 'a', sizeof longp - 1);
    longp[sizeof longp - 1] = '\0';
    memcpy(longp, "ipc:///", 7);
    assert_int_equal(px_config_kv_endpoint_check(longp, err, sizeof err), -1);
}

static void test_allowlist(void **state)
{
    char *v[] = {"10.0.0.0/8:8000", "192.168.1.7:*", "Prefill.Example:8100-8101",
                 "[fd00::/16]:9000"};
    px_strlist l = {v, 4};
    assert_true(px_target_allowed(&l, "10.2.3.4", 8000));
    assert_false(px_target_allowed(&l, "10.2.3.4", 8001)); /* the host alone is not enough */
    assert_false(px_target_allowed(&l, "10.2.3.4", 22));
    assert_false(px_target_allowed(&l, "11.0.0.1", 8000));
    assert_true(px_target_allowed(&l, "192.168.1.7", 1));
    assert_true(px_target_allowed(&l, "192.168.1.7", 65535));
    assert_false(px_target_allowed(&l, "192.168.1.8", 8000));
    assert_true(px_target_allowed(&l, "prefill.example", 8100));
    assert_true(px_target_allowed(&l, "prefill.example", 8101));
    assert_false(px_target_allowed(&l, "prefill.example", 8102));
    assert_false(px_target_allowed(&l, "prefill.example.evil", 8100));
    assert_true(px_target_allowed(&l, "fd00::1", 9000));
    assert_false(px_target_allowed(&l, "fd00::1", 9001));
    assert_false(px_target_allowed(&l, "fe80::1", 9000));
    assert_false(px_target_allowed(&l, "::ffff:10.0.0.1", 8000)); /* v4-mapped is not v4 */
    char *w[] = {"10.1.2.0/23:*"};
    px_strlist l2 = {w, 1};
    assert_true(px_target_allowed(&l2, "10.1.3.255", 80));
    assert_false(px_target_allowed(&l2, "10.1.4.0", 80));
    /* Entries without a port (refused by the option's check) match nothing. */
    char *x[] = {"10.0.0.0/8", "fd00::1", "h.example:", "h.example:0", "h.example:9-8"};
    px_strlist l3 = {x, 5};
    assert_false(px_target_allowed(&l3, "10.0.0.1", 8000));
    assert_false(px_target_allowed(&l3, "h.example", 9));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_toy_defaults),        cmocka_unit_test(test_lists_and_aliases),
        cmocka_unit_test(test_env_then_flags),      cmocka_unit_test(test_errors_name_flag_and_value),
        cmocka_unit_test(test_help_and_version),
        cmocka_unit_test(test_yaml_file_below_env_and_flags),
        cmocka_unit_test(test_yaml_errors_name_line_and_key),
        cmocka_unit_test(test_pools_from_flags_and_lookup),
        cmocka_unit_test(test_print_config_round_trip),
        cmocka_unit_test(test_allowlist),
        cmocka_unit_test(test_kv_endpoint_check),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
