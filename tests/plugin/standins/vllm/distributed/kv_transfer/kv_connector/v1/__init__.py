# SPDX-License-Identifier: Apache-2.0
"""Stand-in package (tests/plugin): not vLLM."""
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
    KVConnectorBase_V1, KVConnectorRole, SupportsHMA)
