# SPDX-License-Identifier: Apache-2.0
# Unit tests of the proxy's pure modules.
foreach(m util json rewrite http config log route trace access usage disagg pindex kvhold dp dispatch admission ratelimit kvindex tokenize tenant latency concurrent)
  px_unit_test(${m} pxcore)
endforeach()
# base/client.c against a scripted server thread on 127.0.0.1.
px_unit_test(client pxbase)
# base/listen.c: listeners serving through px_conn, their errors, the EMFILE pause.
px_unit_test(listen pxbase)
