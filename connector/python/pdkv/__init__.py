# SPDX-License-Identifier: Apache-2.0
"""pdkv: libkvconnector (pdproxy's KV-cache mover) for Python and vLLM.

pdkv.lib        ctypes binding of include/kvconnector.h (Agent, Event, the
                status/event/stat enums and field flags, KvcError and its
                subclasses); the library's log lines go to logger "pdkv.kvc"
pdkv.config     settings, producer allow-list, secret file
pdkv.connector  PdkvConnector, a vLLM KVConnectorBase_V1 with SupportsHMA
                (imported lazily: it needs vllm and torch)
pdkv.upstream   the vLLM commit and interface pdkv is written against
"""
from pdkv.lib import (Agent, AuthError, BusyError, DeniedError, Event, EventType,  # noqa: F401
                      KvcError, LibraryNotFoundError, Stat, Status, library_path,
                      load_library, new_token)
from pdkv.upstream import VLLM_COMMIT  # noqa: F401

__all__ = ["Agent", "AuthError", "BusyError", "DeniedError", "Event", "EventType", "KvcError",
           "LibraryNotFoundError", "Stat", "Status", "VLLM_COMMIT", "library_path",
           "load_library", "new_token"]
