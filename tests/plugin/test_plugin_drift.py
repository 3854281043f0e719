#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The connector against the vLLM stand-ins: every name it imports from vllm
is one the stand-ins define (so a new dependency shows up here, not in a
vLLM deployment), it implements every abstract method of the stand-in
KVConnectorBase_V1 (the upstream list at commit 00f4240e), and the
stand-ins' signatures are the ones the driver calls."""
import ast
import importlib
import inspect
import os
import sys
import unittest

import harness

harness.need_torch()
sys.path.insert(0, os.path.join(harness.HERE, "standins"))
sys.path.insert(0, os.path.join(harness.ROOT, "connector", "python"))
SRC = os.path.join(harness.ROOT, "connector", "python", "pdkv", "connector.py")

# KVConnectorBase_V1's abstract methods upstream (vllm commit 00f4240e,
# vllm/distributed/kv_transfer/kv_connector/v1/base.py)
UPSTREAM_ABSTRACT = {"start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                     "get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta"}


class Drift(unittest.TestCase):
    def test_vllm_imports_are_standins(self):
        with open(SRC) as f:
            tree = ast.parse(f.read())
        seen = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
                mod = importlib.import_module(node.module)
                self.assertIn(os.path.join("tests", "plugin", "standins"), mod.__file__)
                for a in node.names:
                    self.assertTrue(hasattr(mod, a.name), "%s.%s: not in the stand-ins" %
                                    (node.module, a.name))
                    seen.append("%s.%s" % (node.module, a.name))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    self.assertFalse(a.name.startswith("vllm"), a.name)
        self.assertEqual(len(seen), 5, seen)

    def test_connector_implements_the_abstract_methods(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        from pdkv.connector import PdkvConnector
        self.assertEqual(set(KVConnectorBase_V1.__abstractmethods__), UPSTREAM_ABSTRACT)
        self.assertEqual(PdkvConnector.__abstractmethods__, frozenset())
        for name in UPSTREAM_ABSTRACT | {"request_finished", "get_finished",
                                         "get_block_ids_with_load_errors", "register_kv_caches",
                                         "shutdown", "update_connector_output"}:
            base = inspect.signature(getattr(KVConnectorBase_V1, name))
            ours = inspect.signature(getattr(PdkvConnector, name))
            self.assertEqual(list(base.parameters), list(ours.parameters), name)

    def test_request_standin_refuses_unknown_attributes(self):
        from vllm.v1.request import Request
        r = Request("x", [1, 2], 1)
        with self.assertRaises(AttributeError):
            r.not_in_vllm = 1

    def test_required_layout(self):
        import types
        from pdkv.connector import PdkvConnector
        cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(use_mla=False))
        self.assertEqual(PdkvConnector.get_required_kvcache_layout(cfg), "HND")
        cfg.model_config.use_mla = True
        self.assertIsNone(PdkvConnector.get_required_kvcache_layout(cfg))


if __name__ == "__main__":
    unittest.main(verbosity=2)
