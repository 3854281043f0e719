#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""pdkv.lib, the ctypes binding: where the library comes from (and a clear
error when it is nowhere), caller tokens, publish/fetch byte-exact between
torch tensors, TP slices, cancel; in the style of a Python library (enums,
error subclasses, the library's log in `logging`, typed); ports refused,
never wrapped; the secret file's permissions; pip install offline with any
interpreter that has pip."""
import dataclasses
import json
import logging
import os
import stat
import subprocess
import sys
import unittest

import harness

harness.need_torch()
sys.path.insert(0, os.path.join(harness.ROOT, "connector", "python"))
os.environ.update({k: v for k, v in harness.lib_env().items() if k.startswith(("PDKV", "KVC"))})

import torch  # noqa: E402

import pdkv  # noqa: E402
from pdkv import lib as kvc  # noqa: E402


def shutil_which(name):
    import shutil
    return shutil.which(name)


def wait_events(evs, n, timeout=10):
    """The fetches' end events in `evs` (filled by the agent's callback),
    once there are n of them or timeout s have gone by."""
    def ends():
        return [e for e in list(evs)
                if e.type in (kvc.EventType.FETCH_DONE, kvc.EventType.FETCH_FAILED)]
    return harness.wait_value(ends, lambda got: len(got) >= n, timeout, 0.01)


class Lib(unittest.TestCase):
    def agents(self, n, tp=1):
        out = []
        for i in range(n):
            a = pdkv.Agent("E%d" % i, tp_size=tp)
            self.addCleanup(a.close)
            out.append(a)
        return out

    def test_library_found_and_named(self):
        self.assertEqual(pdkv.library_path(), os.path.realpath(os.environ["PDKV_LIBRARY"]))

    def test_library_missing_is_explained(self):
        code = "import pdkv\ntry:\n    pdkv.load_library()\nexcept OSError as e:\n    print(e)\n"
        env = dict(os.environ, PDKV_LIBRARY="/nonexistent/libkvconnector.so",
                   PYTHONPATH=os.path.join(harness.ROOT, "connector", "python"))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=30).stdout
        self.assertIn("libkvconnector not found", out)
        self.assertIn("/nonexistent/libkvconnector.so ($PDKV_LIBRARY): no such file", out)
        self.assertIn("Set PDKV_LIBRARY", out)

    def pip_install(self, python, isolation):
        """pip install ./connector/python as a user would, offline; returns
        the folder it went to (skips where python has no pip)."""
        import shutil
        import tempfile
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp, True)
        src = os.path.join(tmp, "src")
        shutil.copytree(os.path.join(harness.ROOT, "connector", "python"), src,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        cmd = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
               os.path.join(tmp, "t"), src]
        if not isolation:
            cmd.insert(4, "--no-build-isolation")
        env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        env.pop("PYTHONPATH", None)
        # pip never loads libkvconnector: without the sanitizer runtimes (-DSANITIZE)
        build_env = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", "LSAN_OPTIONS")}
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=build_env,
                           cwd=tmp)
        if "No module named pip" in r.stderr:
            self.skipTest("pip is not installed for %s" % python)
        self.assertEqual(r.returncode, 0, (python, r.stdout[-1500:], r.stderr[-2000:]))
        code = ("import pdkv, pdkv.upstream, os; print(pdkv.library_path()); print(pdkv.__file__);"
                "print(os.path.exists(os.path.join(os.path.dirname(pdkv.__file__), 'py.typed')))")
        out = subprocess.run([python, "-c", code], capture_output=True, text=True,
                             env=dict(env, PYTHONPATH=os.path.join(tmp, "t")), cwd=tmp,
                             timeout=60)
        lines = out.stdout.split("\n")
        self.assertEqual(lines[0], os.path.realpath(os.environ["PDKV_LIBRARY"]), out.stderr)
        self.assertTrue(lines[1].startswith(os.path.join(tmp, "t")), lines)
        self.assertEqual(lines[2], "True")

    def test_pip_installs_offline_everywhere(self):
        """No build requirement: isolated builds need nothing from an index,
        and a setuptools without `wheel` (the case that failed with
        "invalid command 'bdist_wheel'") is not asked for anything."""
        pythons = {os.path.realpath(p) for p in (sys.executable, "/usr/bin/python3",
                                                  shutil_which("python3")) if p}
        for py in sorted(pythons):
            for isolation in (True, False):
                with self.subTest(python=py, isolation=isolation):
                    self.pip_install(py, isolation)

    def test_enums_errors_events(self):
        self.assertIsInstance(kvc.Status.ERR_DENIED, int)
        self.assertEqual(int(kvc.FetchField.WAIT | kvc.FetchField.REMOTE_RANK), 192)
        p, = self.agents(1)
        src = torch.zeros(4, 64, dtype=torch.uint8)
        p.register_regions(4, [(src.data_ptr(), src.numel())])
        with self.assertRaises(kvc.InvalidParamError) as cm:
            p.publish("x", [0], token="not-hex")
        self.assertIsInstance(cm.exception, kvc.KvcError)
        self.assertIsInstance(cm.exception, ValueError)
        self.assertIs(cm.exception.status, kvc.Status.ERR_INVALID_PARAM)
        p.publish("x", [0])
        with self.assertRaises(kvc.ExistsError):
            p.publish("x", [1])
        self.assertEqual(p.stat(kvc.Stat.PUBLISHED_NOW), 1)
        self.assertEqual(p.stat("published_now"), 1)
        self.assertIs(p.unpublish("nope"), kvc.Status.ERR_NOT_FOUND)
        self.assertTrue(dataclasses.is_dataclass(kvc.Event))
        self.assertTrue(os.path.exists(os.path.join(os.path.dirname(pdkv.__file__), "py.typed")))

    def test_library_log_goes_to_logging(self):
        """Its lines reach logging at their level, filtered by the logger's
        level (KVC_LOG_LEVEL, when set, decides instead)."""
        saved = os.environ.pop("KVC_LOG_LEVEL", None)
        self.addCleanup(lambda: saved is None or os.environ.update(KVC_LOG_LEVEL=saved))
        for level, want in ((logging.INFO, {"INFO"}), (logging.WARNING, set())):
            with self.assertLogs("pdkv.kvc", logging.DEBUG) as cm:
                logging.getLogger("pdkv.kvc").warning("marker")
                logging.getLogger("pdkv.kvc").setLevel(level)
                try:
                    a = pdkv.Agent("LOG", tp_size=1)
                    a.close()
                finally:
                    logging.getLogger("pdkv.kvc").setLevel(logging.NOTSET)
            lib_lines = [r for r in cm.records if r.getMessage() != "marker"]
            self.assertEqual({r.levelname for r in lib_lines}, want, cm.output)
            if want:
                self.assertTrue(any("engine=LOG agent up" in r.getMessage() for r in lib_lines))

    def test_port_never_wrapped(self):
        p, d = self.agents(2)
        src = torch.zeros(4, 64, dtype=torch.uint8)
        dst = torch.zeros(4, 64, dtype=torch.uint8)
        p.register_regions(4, [(src.data_ptr(), src.numel())])
        d.register_regions(4, [(dst.data_ptr(), dst.numel())])
        kv = json.loads(p.publish("w", [1], token=kvc.new_token()))
        for bad in (65536 + p.port, -1, 0, str(p.port), True, 70000.0):
            with self.assertRaises(kvc.InvalidParamError, msg=repr(bad)):
                d.fetch(dict(kv, remote_port=bad), [2])
        with self.assertRaises(kvc.InvalidParamError):   # rank 1 would be port 65536
            d.fetch(dict(kv, remote_port=65535), [2], remote_rank=1)
        self.assertEqual(d.stat(kvc.Stat.HANDSHAKES), 0)

    def test_secret_file_permissions(self):
        import tempfile
        from pdkv.config import SecretFileError, read_secret
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "secret")
            with open(path, "wb") as f:
                f.write(b"s3cret\n")
            for mode in (0o644, 0o640, 0o604, 0o660, 0o602):
                os.chmod(path, mode)
                with self.assertRaises(SecretFileError, msg=oct(mode)) as cm:
                    read_secret(path)
                self.assertIn("%04o" % mode, str(cm.exception))
            os.chmod(path, 0o400)
            got = read_secret(path)
            self.assertEqual((type(got), bytes(got)), (bytearray, b"s3cret"))
            os.chmod(path, 0o600)
            link = os.path.join(tmp, "link")   # as Kubernetes mounts secrets
            os.symlink(path, link)
            self.assertEqual(bytes(read_secret(link)), b"s3cret")
            with open(path, "wb") as f:
                f.write(b"\n")
            with self.assertRaises(SecretFileError):
                read_secret(path)
            with self.assertRaises(SecretFileError):
                read_secret(tmp)

    def test_caller_token_and_bytes(self):
        p, d = self.agents(2)
        src = torch.randint(0, 255, (16, 256), dtype=torch.uint8)
        dst = torch.zeros(16, 256, dtype=torch.uint8)
        p.register_regions(16, [(src.data_ptr(), src.numel())])
        d.register_regions(16, [(dst.data_ptr(), dst.numel())])
        evs = []
        p.start(evs.append)
        d.start(evs.append)
        tok = kvc.new_token()
        self.assertRegex(tok, "^[0-9a-f]{32}$")
        kv = json.loads(p.publish("req", [3, 4, 5], token=tok))
        self.assertEqual(kv["remote_kv_token"], tok)
        d.fetch(kv, [10, 11, 12])
        got = wait_events(evs, 1)
        self.assertEqual([e.name for e in got], ["FETCH_DONE"], [e.message for e in got])
        self.assertTrue(torch.equal(dst[10:13], src[3:6]))
        self.assertEqual(int(dst[:10].sum()) + int(dst[13:].sum()), 0)

    # Runs of several blocks, each block into one half of a local block.
    def test_slice_into_local_parts(self):
        """TP 2->1: two producers' blocks into the halves of local blocks."""
        nb, bl, n = 8, 64, 3
        p0, p1, d = self.agents(3)
        pt = [torch.randint(0, 255, (nb, bl), dtype=torch.uint8) for _ in range(2)]
        dt = torch.zeros(nb, 2 * bl, dtype=torch.uint8)
        for a, t in zip((p0, p1), pt):
            a.register_regions(nb, [(t.data_ptr(), t.numel())])
        d.register_regions(nb, [(dt.data_ptr(), dt.numel())])
        evs = []
        for a in (p0, p1, d):
            a.start(evs.append)
        tok = kvc.new_token()
        kvs = [json.loads(a.publish("r", list(range(2, 2 + n)), token=tok)) for a in (p0, p1)]
        for j, kv in enumerate(kvs):
            d.fetch(kv, list(range(1, 1 + n)), parts=(1, 0, 2, j))
        got = wait_events(evs, 2)
        self.assertEqual([e.name for e in got], ["FETCH_DONE"] * 2, [e.message for e in got])
        for i in range(n):
            for j in range(2):
                self.assertTrue(torch.equal(dt[1 + i, j * bl:(j + 1) * bl], pt[j][2 + i]))

    def test_cancel(self):
        p, d = self.agents(2)
        src = torch.zeros(4, 64, dtype=torch.uint8)
        dst = torch.zeros(4, 64, dtype=torch.uint8)
        p.register_regions(4, [(src.data_ptr(), src.numel())])
        d.register_regions(4, [(dst.data_ptr(), dst.numel())])
        evs = []
        d.start(evs.append)
        p.start(evs.append)
        kv = {"remote_engine_id": "E0", "remote_request_id": "later", "remote_host": "127.0.0.1",
              "remote_port": p.port, "remote_block_ids": [1], "remote_kv_token": kvc.new_token()}
        xid = d.fetch(kv, [2], wait_ms=10000)  # held by the producer: not published yet
        self.assertEqual(d.cancel(xid), kvc.Status.OK)
        got = wait_events(evs, 1)
        self.assertEqual([(e.name, kvc.status_str(e.status)) for e in got],
                         [("FETCH_FAILED", "KVC_ERR_CANCELED")])
        self.assertEqual(d.cancel(xid), kvc.Status.ERR_NOT_FOUND)


if __name__ == "__main__":
    unittest.main(verbosity=2)
