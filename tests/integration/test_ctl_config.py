#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""--config FILE (YAML): every flag as a key, pools as a list; the
environment and flags win over it; --print-config writes YAML that reads
back to the same settings; a bad file names file, line and key; SIGHUP
reads it again, keeping the running configuration when it is wrong."""

import json
import os
import threading
import unittest

from pdharness.ctl import pools_yaml, ready, sighup, tmpdir, wait_generation, write_yaml
from pdharness.mocks import Respond, completion_body, decode_handler, prefill_handler
from pdharness.net import wait_until, wait_value
from pdharness.procs import run_pdproxy
from pdharness.prod import ProdCase


class FileTest(ProdCase):
    def test_settings_from_file_and_what_wins(self):
        d = tmpdir(self)
        f = os.path.join(d, "pdproxy.yaml")
        write_yaml(f, "max_inflight: 7\nprefill-policy: least_inflight\nconnect-timeout: 1.5\n"
                      "decode: [http://127.0.0.1:9]\nprefill:\n  - http://127.0.0.1:8\n")
        p = run_pdproxy(["--config", f, "--print-config"])
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("max-inflight: 7\n", p.stdout)
        self.assertIn('prefill-policy: "least_inflight"\n', p.stdout)
        self.assertIn('prefill: ["http://127.0.0.1:8"]\n', p.stdout)
        self.assertNotIn("prefiller-hosts", p.stdout, "toy defaults shown although URLs replace them")
        p = run_pdproxy(["--config", f, "--print-config", "--max-inflight", "9"],
                        env={"PDPROXY_PREFILL_POLICY": "power_of_two"})
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("max-inflight: 9\n", p.stdout, "a flag must win over the file")
        self.assertIn('prefill-policy: "power_of_two"\n', p.stdout,
                      "the environment must win over the file")
        self.assertIn("connect-timeout: 1.5\n", p.stdout)
        # PDPROXY_CONFIG names the file too.
        p = run_pdproxy(["--print-config"], env={"PDPROXY_CONFIG": f})
        self.assertIn("max-inflight: 7\n", p.stdout)

    def test_print_config_round_trips(self):
        d = tmpdir(self)
        args = ["--pool", "llama=llama,llama-chat", "--prefill", "http://127.0.0.1:8100",
                "--decode", "http://127.0.0.1:8200", "--decode", "http://d.example:8201",
                "--pool", "qwen", "--decode", "http://127.0.0.1:8300", "--port", "9123",
                "--max-body-bytes", "4096", "--connect-timeout", "0.125", "--metrics-auth",
                "--api-key", "do-not-print-me", "--log-format", "json",
                "--prefiller-allowlist", "10.0.0.0/8:*,prefill.example:8000"]
        p1 = run_pdproxy(args + ["--print-config"])
        self.assertEqual(p1.returncode, 0, p1.stderr)
        self.assertNotIn("do-not-print-me", p1.stdout)
        f = os.path.join(d, "dump.yaml")
        write_yaml(f, p1.stdout)
        # Secrets are never printed (a comment says one is set): they come
        # from the environment or a key file.
        p2 = run_pdproxy(["--config", f, "--print-config"],
                         env={"PDPROXY_API_KEY": "do-not-print-me"})
        self.assertEqual(p2.returncode, 0, p2.stderr)
        self.assertEqual(p2.stdout, p1.stdout, "--print-config's output does not read back the same")
        # The defaults round-trip too (toy lists in effect).
        p1 = run_pdproxy(["--print-config"])
        write_yaml(f, p1.stdout)
        p2 = run_pdproxy(["--config", f, "--print-config"])
        self.assertEqual(p2.stdout, p1.stdout)

    def test_bad_files_name_file_line_and_key(self):
        d = tmpdir(self)
        f = os.path.join(d, "bad.yaml")
        cases = [
            ("host: 127.0.0.1\nport: eighty\n", ":2: key 'port'", "not an integer"),
            ("port: 8000\n\nconnect_timeoutt: 1\n", ":3: unknown key 'connect-timeout", ""),
            ("port: [1, 2\n", ":2:", "flow sequence"),
            ("- a\n- b\n", ":1:", "expected a mapping"),
            ("pools:\n  - name: a\n    decodes: [http://127.0.0.1:1]\n", ":3: unknown key 'decodes'",
             "in a pool"),
            ("pools:\n  - name: a\n    decode: [ftp://x]\n", ":3: key 'decode'", "http://host:port"),
            ("prefill-policy: fastest\n", ":1: key 'prefill-policy'", "expected one of"),
            ("pools:\n  - name: a\n    decode: [http://127.0.0.1:1]\n  - name: a\n", ":4: pool 'a'",
             "two pools have this name"),
        ]
        for text, where, why in cases:
            with self.subTest(text=text):
                write_yaml(f, text)
                p = run_pdproxy(["--config", f, "--print-config"])
                self.assertEqual(p.returncode, 2, p.stdout)
                self.assertIn(f + where, p.stderr)
                self.assertIn(why, p.stderr)
        p = run_pdproxy(["--config", os.path.join(d, "missing.yaml")])
        self.assertEqual(p.returncode, 2)
        self.assertIn("missing.yaml", p.stderr)
        self.assertIn("No such file", p.stderr)


class ReloadTest(ProdCase):
    def start_with_file(self, text, extra=()):
        self.dir = tmpdir(self)
        self.file = os.path.join(self.dir, "pdproxy.yaml")
        write_yaml(self.file, text)
        return self.start(args=["--config", self.file] + list(extra))

    def test_sighup_swaps_backends(self):
        P = self.mock(prefill_handler(), name="P")
        D1 = self.mock(decode_handler(), name="D1")
        D2 = self.mock(decode_handler(), name="D2")
        px = self.start_with_file(pools_yaml([("m", ["m"], [P], [D1])]))
        self.assertEqual(self.post(px).status, 200)
        write_yaml(self.file, pools_yaml([("m", ["m", "m2"], [P], [D2])]))
        sighup(px)
        wait_generation(self, px, 2)
        for body in (completion_body(), completion_body(model="m2")):
            self.assertEqual(self.post(px, body).status, 200)
        self.assertEqual(len(D1.requests), 1)
        self.assertEqual(len(D2.requests), 2)
        self.assertIn("configuration swapped", px.stderr())
        self.assertIn("backend removed by reload", px.stderr())

    def test_bad_reload_keeps_running_config(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start_with_file(pools_yaml([("m", ["m"], [P], [D])]))
        write_yaml(self.file, "pools:\n  - name: m\n    decode: [http://127.0.0.1:1]\n"
                              "max-inflight: lots\n")
        sighup(px)
        wait_until(lambda: "reload on SIGHUP failed" in px.stderr(), 10, 0.02)
        err = px.stderr()
        self.assertIn("reload on SIGHUP failed", err)
        self.assertIn(self.file + ":4: key 'max-inflight'", err)
        self.assertEqual(wait_generation(self, px, 1)["generation"], 1)
        self.assertEqual(self.post(px).status, 200)
        self.assertEqual(len(D.requests), 1, "the running configuration was not kept")

    def test_inflight_request_finishes_on_its_config(self):
        P = self.mock(prefill_handler(), name="P")
        gate = threading.Event()

        def slow_decode(req):
            gate.wait(10)
            return Respond(200, [("Content-Type", "application/json")],
                           b'{"id":"old","choices":[{"text":"from-old"}]}')

        D1 = self.mock(slow_decode, name="D1")
        D2 = self.mock(decode_handler(), name="D2")
        px = self.start_with_file(pools_yaml([("m", ["m"], [P], [D1])]))
        out = {}
        t = threading.Thread(target=lambda: out.update(r=self.post(px, timeout=20)), daemon=True)
        t.start()
        D1.wait_requests(1)
        write_yaml(self.file, pools_yaml([("m", ["m"], [P], [D2])]))
        sighup(px)
        wait_generation(self, px, 2)
        self.assertEqual(self.post(px).status, 200)
        self.assertEqual(len(D2.requests), 1)
        gate.set()
        t.join(20)
        self.assertEqual(out["r"].status, 200)
        self.assertIn(b"from-old", bytes(out["r"].body))

    def test_rapid_reloads_with_backend_names(self):
        """Names are resolved by the generation's discovery; a reload retires
        it with lookups possibly in flight. Bursts of SIGHUP must neither
        crash nor leave a stale generation."""
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        names = ("name", ["name"], ["http://localhost:%d" % P.port],
                 ["http://localhost:%d" % D.port])
        px = self.start_with_file(pools_yaml([("m", ["m"], [P], [D]), names]))
        gen = 1
        for burst in range(5):
            write_yaml(self.file, pools_yaml([("m", ["m"], [P], [D]), names],
                                             extra="prefill-retries: %d" % burst))
            for _ in range(3):
                sighup(px)
            # Signals sent together may be delivered as one.
            g = wait_value(lambda: ready(px)[1]["generation"], lambda g: g > gen, 10, 0.01)
            self.assertGreater(g, gen)
            gen = g
        self.assertTrue(px.alive())
        self.assertEqual(self.post(px).status, 200)
        self.assertIn("take effect at restart only\" settings=prefill-retries", px.stderr())

    def test_sighup_without_file_is_ignored(self):
        P = self.mock(prefill_handler(), name="P")
        D = self.mock(decode_handler(), name="D")
        px = self.start([P], [D])
        sighup(px)
        wait_until(lambda: "nothing to reload" in px.stderr(), 10, 0.02)
        self.assertIn("nothing to reload", px.stderr())
        self.assertEqual(self.post(px).status, 200)


if __name__ == "__main__":
    unittest.main(verbosity=2)
