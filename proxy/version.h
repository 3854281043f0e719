/* SPDX-License-Identifier: Apache-2.0 */
/* pdproxy --version / -V: what was built, from what, with what. */
#ifndef PX_VERSION_H
#define PX_VERSION_H

#include <stdio.h>

/* The version, the source commit and the build options (TLS library,
 * libevent, CUDA and UCX of libkvconnector); the commit and the options
 * come from CMake (proxy/CMakeLists.txt). */
void px_version_print(FILE *out);

#endif
