# SPDX-License-Identifier: Apache-2.0
"""pdkv: libkvconnector (pdproxy's KV-cache mover) for Python and vLLM.

pdkv.lib        ctypes binding of include/kvconnector.h (Agent, errors)
pdkv.connector  PdkvConnector, a vLLM KVConnectorBase_V1 (imported lazily:
                it needs vllm and torch)
"""
from pdkv.lib import Agent, KvcError, library_path, load_library  # noqa: F401

__all__ = ["Agent", "KvcError", "library_path", "load_library"]
