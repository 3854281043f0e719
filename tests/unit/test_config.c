#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "config.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_toy_defaults),        cmocka_unit_test(test_lists_and_aliases),
        cmocka_unit_test(test_env_then_flags),      cmocka_unit_test(test_errors_name_flag_and_value),
        cmocka_unit_test(test_help_and_version),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
