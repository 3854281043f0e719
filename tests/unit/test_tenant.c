/* SPDX-License-Identifier: Apache-2.0 */
/* proxy/tenant.c (issue 41): tenant keys from a file, matched in constant
 * time on digests; trusted gateways by address and CIDR; cache salts. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/http.h"
#include "proxy/tenant.h"

static char *write_file(const char *text)
{
    char *path = strdup("/tmp/test_tenant_XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

/* A head with one Authorization line (value may be NULL: none). */
static void head_with(px_http_head *h, const char *auth)
{
    memset(h, 0, sizeof *h);
    if (!auth) return;
    h->headers[0].name = "Authorization";
    h->headers[0].name_len = 13;
    h->headers[0].value = auth;
    h->headers[0].value_len = strlen(auth);
    h->nheaders = 1;
}

static void test_keys_map_to_tenants(void **state)
{
    (void)state;
    char *path = write_file("# keys\n\nalice: sk-alice-1 \nbob:sk-bob\r\nalice:sk-alice-2\n");
    px_tkeys *k = NULL;
    char err[256] = "";
    assert_int_equal(px_tkeys_load(path, &k, err, sizeof err), 0);
    assert_int_equal(px_tkeys_count(k), 3);
    static px_http_head h;
    unsigned char d[32];
    const struct {
        const char *auth;
        const char *tenant;
    } cases[] = {{"Bearer sk-alice-1", "alice"}, {"bearer sk-alice-2", "alice"},
                 {"Bearer sk-bob", "bob"},       {"Bearer sk-bob ", NULL},
                 {"Bearer SK-BOB", NULL},        {"Basic sk-bob", NULL},
                 {"Bearer ", NULL},              {NULL, NULL}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        head_with(&h, cases[i].auth);
        long e = px_tkeys_find(k, &h, d);
        if (cases[i].tenant)
            assert_string_equal(px_tkeys_tenant(k, e), cases[i].tenant);
        else
            assert_int_equal(e, -1);
    }
    px_tkeys_destroy(k);
    unlink(path);
    free(path);
}

static void test_key_file_errors_never_show_keys(void **state)
{
    (void)state;
    const char *bad[] = {"no-colon-secret-1\n", ":secret-2\n", "t:\n", "",
                         "a:secret-3\nb:secret-3\n"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char *path = write_file(bad[i]);
        px_tkeys *k = (px_tkeys *)1;
        char err[256] = "";
        assert_int_equal(px_tkeys_load(path, &k, err, sizeof err), -1);
        assert_null(k);
        assert_non_null(strstr(err, "--tenant-keys"));
        assert_null(strstr(err, "secret"));
        unlink(path);
        free(path);
    }
    px_tkeys *k = NULL;
    char err[256] = "";
    assert_int_equal(px_tkeys_load("", &k, err, sizeof err), 0);
    assert_null(k);
    assert_int_equal(px_tkeys_load("/nonexistent/keys", &k, err, sizeof err), -1);
}

static void test_gateways(void **state)
{
    (void)state;
    char *items[] = {"10.0.0.0/8", "192.0.2.7", "fd00::/8"};
    char err[200];
    for (size_t i = 0; i < 3; i++)
        assert_int_equal(px_cidr_check(items[i], err, sizeof err), 0);
    assert_int_equal(px_cidr_check("10.0.0.0/33", err, sizeof err), -1);
    assert_int_equal(px_cidr_check("gateway.example", err, sizeof err), -1);
    assert_int_equal(px_cidr_check("10.0.0.0/", err, sizeof err), -1);
    assert_true(px_cidr_list_match(items, 3, "10.1.2.3"));
    assert_true(px_cidr_list_match(items, 3, "::ffff:10.1.2.3"));
    assert_true(px_cidr_list_match(items, 3, "192.0.2.7"));
    assert_false(px_cidr_list_match(items, 3, "192.0.2.8"));
    assert_true(px_cidr_list_match(items, 3, "fd12::1"));
    assert_false(px_cidr_list_match(items, 3, "fe80::1"));
    assert_false(px_cidr_list_match(items, 3, ""));
    assert_false(px_cidr_list_match(NULL, 0, "10.1.2.3"));
}

static void test_salts(void **state)
{
    (void)state;
    char a[PX_SALT_LEN + 1], b[PX_SALT_LEN + 1], c[PX_SALT_LEN + 1];
    px_salt_derive("alice", NULL, NULL, 0, a);
    px_salt_derive("alice", NULL, NULL, 0, b);
    assert_string_equal(a, b); /* the same in every replica */
    assert_int_equal(strlen(a), PX_SALT_LEN);
    px_salt_derive("bob", NULL, NULL, 0, c);
    assert_string_not_equal(a, c);
    px_salt_derive("", NULL, NULL, 0, c);
    assert_string_not_equal(a, c);
    /* The client's own salt splits a tenant's share, never joins another. */
    px_salt_derive("alice", NULL, "\"x\"", 3, b);
    assert_string_not_equal(a, b);
    unsigned char key[32] = {1};
    px_salt_derive("alice", key, NULL, 0, c);
    assert_string_not_equal(a, c);
    const struct {
        const char *mode;
        int creds;
        px_salt_mode want;
    } modes[] = {{"key", 0, PX_SALT_KEY},       {"off", 1, PX_SALT_OFF},
                 {"tenant", 0, PX_SALT_TENANT}, {"auto", 0, PX_SALT_OFF},
                 {"auto", 1, PX_SALT_TENANT},   {NULL, 1, PX_SALT_TENANT}};
    for (size_t i = 0; i < sizeof modes / sizeof *modes; i++)
        assert_int_equal(px_salt_mode_of(modes[i].mode, modes[i].creds), modes[i].want);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_keys_map_to_tenants),
        cmocka_unit_test(test_key_file_errors_never_show_keys),
        cmocka_unit_test(test_gateways),
        cmocka_unit_test(test_salts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
