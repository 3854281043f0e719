# SPDX-License-Identifier: Apache-2.0
# deploy/: Kubernetes manifests rendered and cross-checked, Grafana dashboard,
# the Dockerfile's build steps run into a scratch prefix (no Docker engine),
# and the wrk scripts run against engine-sim + pdproxy on loopback.
# Included from tests/CMakeLists.txt, hence PROJECT_SOURCE_DIR.
add_test(NAME integration.deploy COMMAND ${PROJECT_SOURCE_DIR}/deploy/check.sh)
set_tests_properties(integration.deploy PROPERTIES LABELS "integration;deploy" TIMEOUT 600
                     ENVIRONMENT "${PX_TEST_ENV}")

# Licence: LICENSE is Apache-2.0 and every source file carries the SPDX
# identifier (tools/spdx.sh --check, the script that --fix adds it with).
px_py_test(license TIMEOUT 120)
set_tests_properties(integration.license PROPERTIES LABELS "integration;deploy")

# Debian packages (cpack -G DEB), installed with dpkg -i and used: the
# installed pdproxy, its man page and unit, and programs built against the
# installed libkvconnector with pkg-config and find_package.  Root only
# (a throwaway CI machine); skipped (77) elsewhere.
add_test(NAME integration.packages COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_packages.sh)
set_tests_properties(integration.packages PROPERTIES LABELS "integration;deploy" TIMEOUT 300
                     SKIP_RETURN_CODE 77 ENVIRONMENT "${PX_TEST_ENV}" RUN_SERIAL TRUE)

# The documentation site (mkdocs.yml, docs/): `mkdocs build --strict` and
# every page in the nav.
add_test(NAME docs.site COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_docs_site.py)
set_tests_properties(docs.site PROPERTIES LABELS "integration;docs;deploy" TIMEOUT 180
                     ENVIRONMENT "${PX_TEST_ENV}")
