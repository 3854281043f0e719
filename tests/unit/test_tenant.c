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
#include <openssl/x509.h>
#include <openssl/x509v3.h>

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

/* A certificate (unsigned: only its names matter here) with the subject CN
 * cn (cn_len bytes, may hold a NUL; NULL: none) and subjectAltNames of
 * the given types and values. */
static X509 *cert_with(const char *cn, int cn_len, const int *types, const char *const *sans,
                       size_t nsans)
{
    X509 *x = X509_new();
    assert_non_null(x);
    if (cn)
        assert_int_equal(X509_NAME_add_entry_by_NID(X509_get_subject_name(x), NID_commonName,
                                                    MBSTRING_UTF8, (const unsigned char *)cn,
                                                    cn_len, -1, 0),
                         1);
    if (nsans) {
        GENERAL_NAMES *gs = sk_GENERAL_NAME_new_null();
        for (size_t i = 0; i < nsans; i++) {
            GENERAL_NAME *g = GENERAL_NAME_new();
            ASN1_IA5STRING *v = ASN1_IA5STRING_new();
            ASN1_STRING_set(v, sans[i], (int)strlen(sans[i]));
            GENERAL_NAME_set0_value(g, types[i], v);
            sk_GENERAL_NAME_push(gs, g);
        }
        assert_int_equal(X509_add1_ext_i2d(x, NID_subject_alt_name, gs, 0, 0), 1);
        GENERAL_NAMES_free(gs);
    }
    return x;
}

static void test_cert_names_map_to_tenants(void **state)
{
    (void)state;
    char *path = write_file("# tenant:name\nalice:spiffe://example.org/alice\n"
                            "bob: bob.example \ncarol:carol-client\ndave:dave@example.org\n"
                            "erin:alice\n");
    px_tcerts *c = NULL;
    char err[256] = "";
    assert_int_equal(px_tcerts_load(path, &c, err, sizeof err), 0);
    assert_int_equal(px_tcerts_count(c), 5);
    const int uri = GEN_URI, dns = GEN_DNS, email = GEN_EMAIL, dns2[] = {GEN_DNS, GEN_URI};
    const char *const a_uri[] = {"spiffe://example.org/alice"}, *b[] = {"bob.example"},
                      *d[] = {"dave@example.org"}, *late[] = {"zed.example", "alice"},
                      *near[] = {"spiffe://example.org/alice/x"}, *caps[] = {"BOB.example"};
    const struct {
        X509 *x;
        const char *tenant; /* NULL: none */
    } cases[] = {
        {cert_with("whatever", -1, &uri, a_uri, 1), "alice"}, /* by URI */
        {cert_with(NULL, 0, &dns, b, 1), "bob"},              /* by DNS */
        {cert_with("carol-client", -1, NULL, NULL, 0), "carol"}, /* by CN */
        {cert_with(NULL, 0, &email, d, 1), "dave"},           /* by email */
        /* A URI "alice" is erin's name, not alice's. */
        {cert_with(NULL, 0, dns2, late, 2), "erin"},
        /* Names of two lines: the earlier line (alice's) wins. */
        {cert_with("carol-client", -1, &uri, a_uri, 1), "alice"},
        /* Near misses: a longer name, another case, a CN with a NUL after
         * a mapped name (the old spoofing trick), no names at all. */
        {cert_with(NULL, 0, &uri, near, 1), NULL},
        {cert_with(NULL, 0, &dns, caps, 1), NULL},
        {cert_with("carol-client\0.evil", 17, NULL, NULL, 0), NULL},
        {cert_with(NULL, 0, NULL, NULL, 0), NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        long e = px_tcerts_find(c, cases[i].x);
        if (cases[i].tenant) {
            if (e < 0) fail_msg("case %zu: no tenant, expected %s", i, cases[i].tenant);
            assert_string_equal(px_tcerts_tenant(c, e), cases[i].tenant);
        } else if (e >= 0) {
            fail_msg("case %zu: tenant %s, expected none", i, px_tcerts_tenant(c, e));
        }
        X509_free(cases[i].x);
    }
    assert_int_equal(px_tcerts_find(c, NULL), -1);
    assert_int_equal(px_tcerts_find(NULL, NULL), -1);
    px_tcerts_destroy(c);
    unlink(path);
    free(path);
    /* The same name given to two tenants is refused; to one, twice, is not. */
    const char *files[] = {"a:n1\nb:n1\n", "a:n1\na:n1\n", "a n1\n", ""};
    const int ok[] = {0, 1, 0, 0};
    for (size_t i = 0; i < 4; i++) {
        path = write_file(files[i]);
        c = NULL;
        int rc = px_tcerts_load(path, &c, err, sizeof err);
        assert_int_equal(rc, ok[i] ? 0 : -1);
        if (!ok[i]) assert_non_null(strstr(err, "--tenant-certs"));
        px_tcerts_destroy(c);
        unlink(path);
        free(path);
    }
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
    px_cidr *nets;
    assert_int_equal(px_cidrs_parse(items, 3, &nets, err, sizeof err), 0);
    assert_true(px_cidr_match(nets, 3, "10.1.2.3"));
    assert_true(px_cidr_match(nets, 3, "::ffff:10.1.2.3"));
    assert_true(px_cidr_match(nets, 3, "192.0.2.7"));
    assert_false(px_cidr_match(nets, 3, "192.0.2.8"));
    assert_true(px_cidr_match(nets, 3, "fd12::1"));
    assert_false(px_cidr_match(nets, 3, "fe80::1"));
    assert_false(px_cidr_match(nets, 3, ""));
    assert_false(px_cidr_match(nets, 3, "10.1.2"));
    free(nets);
    /* Prefixes that end inside a byte, either side of the line. */
    char *odd[] = {"198.51.100.0/23", "2001:db8::/33"};
    assert_int_equal(px_cidrs_parse(odd, 2, &nets, err, sizeof err), 0);
    assert_true(px_cidr_match(nets, 2, "198.51.101.255"));
    assert_false(px_cidr_match(nets, 2, "198.51.102.0"));
    assert_true(px_cidr_match(nets, 2, "2001:db8:7fff::1"));
    assert_false(px_cidr_match(nets, 2, "2001:db8:8000::1"));
    free(nets);
    assert_int_equal(px_cidrs_parse(NULL, 0, &nets, err, sizeof err), 0);
    assert_null(nets);
    assert_false(px_cidr_match(nets, 0, "10.1.2.3"));
    /* A bad item anywhere in the list fails the parse, naming it. */
    char *bad[] = {"10.0.0.0/8", "10.0.0.0/33"};
    err[0] = 0;
    assert_int_equal(px_cidrs_parse(bad, 2, &nets, err, sizeof err), -1);
    assert_null(nets);
    assert_non_null(strstr(err, "10.0.0.0/33"));
}

static void test_salts(void **state)
{
    (void)state;
    char a[PX_SALT_LEN + 1], b[PX_SALT_LEN + 1], c[PX_SALT_LEN + 1];
    px_salt_derive("alice", NULL, NULL, 0, a);
    px_salt_derive("alice", NULL, NULL, 0, b);
    assert_string_equal(a, b); /* the same in every replica */
    assert_int_equal(strlen(a), PX_SALT_LEN);
    /* ... and in every version: SHA-256 of the tag, "t", the tenant and the
     * client's own salt (hashlib gives the same), its first 16 bytes. */
    assert_string_equal(a, "0210ed35013538a89cdc5fbaf5b88d55");
    px_salt_derive("bob", NULL, NULL, 0, c);
    assert_string_not_equal(a, c);
    px_salt_derive("", NULL, NULL, 0, c);
    assert_string_not_equal(a, c);
    /* The client's own salt splits a tenant's share, never joins another. */
    px_salt_derive("alice", NULL, "\"x\"", 3, b);
    assert_string_not_equal(a, b);
    assert_string_equal(b, "1417c880f1eefa8b43c178765bdcfb8e");
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
        cmocka_unit_test(test_cert_names_map_to_tenants),
        cmocka_unit_test(test_gateways),
        cmocka_unit_test(test_salts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
