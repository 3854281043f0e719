#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The publication token libkvconnector puts in kv_transfer_params
("remote_kv_token", 32 hex digits) reaches decode byte for byte through the
proxy: without it decode cannot pull the blocks nor release them."""

import re

from pdharness.case import PxTestCase, main
from pdharness.client import http_request
from pdharness.mocks import (chat_body, completion_body, decode_handler, default_p_kv,
                             prefill_handler, sans_xfer)

TOKEN = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"


class KvTokenTest(PxTestCase):
    def setUp(self):
        super().setUp()
        kv = default_p_kv("tok")
        kv["remote_kv_token"] = TOKEN
        self.kv = kv
        self.P = self.mock(prefill_handler(kv=kv), name="P")
        self.D = self.mock(decode_handler(), name="D")

    def _one(self, path, body):
        px = self.start_proxy([self.P], [self.D])
        r = http_request(px.port, "POST", path, body)
        self.assertEqual(r.status, 200, r.body)
        self.assertEqual(len(self.D.requests), 1)
        dreq = self.D.requests[0]
        kv = sans_xfer(dreq.json()["kv_transfer_params"])
        self.assertEqual(kv, self.kv)
        self.assertEqual(kv["remote_kv_token"], TOKEN)
        # The same bytes, not merely an equal value.
        self.assertEqual(len(re.findall(rb'"remote_kv_token"\s*:\s*"' + TOKEN.encode() + rb'"',
                                        dreq.body)), 1, dreq.body)
        return px

    def test_token_survives_completions(self):
        self._one("/v1/completions", completion_body())

    def test_token_survives_chat_completions(self):
        self._one("/v1/chat/completions", chat_body(stream=False))

    def test_client_supplied_token_never_reaches_d(self):
        # A client cannot plant its own token: D sees P's.
        body = completion_body()
        body["kv_transfer_params"] = {"remote_kv_token": "ff" * 16, "remote_request_id": "x"}
        self._one("/v1/completions", body)
        self.assertNotIn(b"ff" * 16, self.D.requests[0].body)
        self.assertNotIn(b"ff" * 16, self.P.requests[0].body)


if __name__ == "__main__":
    main()
