# SPDX-License-Identifier: Apache-2.0
"""pdkv's transfers in vLLM's own metrics (what vllm:nixl_* is for NIXL).

Each TP worker records into a PdkvKVConnectorStats; vLLM collects it every
step (get_kv_connector_stats), merges the workers' (aggregate), logs a
summary line ("KV Transfer metrics: ...", reduce) and feeds PdkvPromMetrics,
which /metrics shows as:

  vllm:pdkv_xfer_time_seconds        histogram: a load's duration, from the
                                     fetch's start (waiting at the producer
                                     included) to its last byte
  vllm:pdkv_bytes_transferred        histogram: bytes per load
  vllm:pdkv_num_blocks               histogram: blocks per load
  vllm:pdkv_num_failed_transfers     counter: loads that failed (any cause)
  vllm:pdkv_num_kv_expired_reqs      counter: hand-offs prefill freed unclaimed
  vllm:pdkv_num_lease_renewals_sent      counter: renewals decode sent
  vllm:pdkv_num_lease_renewals_accepted  counter: renewals prefill accepted

GB/s over a window: rate(vllm:pdkv_bytes_transferred_sum[1m]) /
rate(vllm:pdkv_xfer_time_seconds_sum[1m]) / 1e9.  Every metric carries
vLLM's labels (model_name, engine)."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, List, Union

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["PdkvKVConnectorStats", "PdkvPromMetrics", "HISTOGRAMS", "COUNTERS"]

# data key -> (metric name, help, buckets)
HISTOGRAMS = {
    "transfer_duration": ("vllm:pdkv_xfer_time_seconds",
                          "Duration of pdkv KV-cache loads (libkvconnector), seconds.",
                          [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0,
                           2.5, 5.0, 10.0, 30.0]),
    "bytes_transferred": ("vllm:pdkv_bytes_transferred",
                          "Bytes per pdkv KV-cache load.",
                          [2 ** (10 + i) for i in range(1, 25, 2)]),
    "num_blocks": ("vllm:pdkv_num_blocks", "KV-cache blocks per pdkv load.",
                   [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]),
}
COUNTERS = {
    "num_failed_transfers": ("vllm:pdkv_num_failed_transfers",
                             "pdkv KV-cache loads that failed."),
    "num_kv_expired_reqs": ("vllm:pdkv_num_kv_expired_reqs",
                            "Hand-offs whose blocks prefill freed unclaimed (lease or expiry). "
                            "Counted on the prefill instance."),
    "num_lease_renewals_sent": ("vllm:pdkv_num_lease_renewals_sent",
                                "Lease renewals decode sent for queued requests."),
    "num_lease_renewals_accepted": ("vllm:pdkv_num_lease_renewals_accepted",
                                    "Lease renewals prefill accepted."),
}


@dataclasses.dataclass
class PdkvKVConnectorStats(KVConnectorStats):
    """Observations of one interval: lists, so workers' stats concatenate."""

    def __post_init__(self):
        if not self.data:
            self.reset()
        else:  # from another process: every key present
            for k in list(HISTOGRAMS) + list(COUNTERS):
                self.data.setdefault(k, [])

    def reset(self) -> None:
        self.data: Dict[str, List[Union[int, float]]] = {
            k: [] for k in list(HISTOGRAMS) + list(COUNTERS)}

    def record_transfer(self, seconds: float, nbytes: int, nblocks: int) -> None:
        self.data["transfer_duration"].append(float(seconds))
        self.data["bytes_transferred"].append(int(nbytes))
        self.data["num_blocks"].append(int(nblocks))

    def count(self, key: str, n: int = 1) -> None:
        if n:
            self.data[key].append(int(n))

    def clone_and_reset(self) -> "PdkvKVConnectorStats":
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> "PdkvKVConnectorStats":
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> Dict[str, Union[int, float]]:
        t = self.data["transfer_duration"]
        b = self.data["bytes_transferred"]
        n = len(t)
        total_t = sum(t)
        out: Dict[str, Union[int, float]] = {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(total_t / n * 1e3, 3) if n else 0,
            "Avg MB per transfer": round(sum(b) / n / 2**20, 3) if n else 0,
            "Throughput (MB/s)": round(sum(b) / 2**20 / total_t, 3) if total_t else 0,
        }
        for k in COUNTERS:
            out[k.replace("_", " ").capitalize()] = sum(self.data[k])
        return out

    @property
    def num_successful_transfers(self) -> int:
        return len(self.data["transfer_duration"])


class PdkvPromMetrics(KVConnectorPromMetrics):
    """The vllm:pdkv_* metrics, one child per engine label set."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric):
            return {idx: metric.labels(*vals) for idx, vals in per_engine_labelvalues.items()}
        self.histograms = {
            key: per_engine(self._histogram_cls(name=name, documentation=doc, buckets=buckets,
                                                labelnames=labelnames))
            for key, (name, doc, buckets) in HISTOGRAMS.items()}
        self.counters = {
            key: per_engine(self._counter_cls(name=name, documentation=doc,
                                              labelnames=labelnames))
            for key, (name, doc) in COUNTERS.items()}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for key, per in self.histograms.items():
            for v in transfer_stats_data.get(key, ()):
                per[engine_idx].observe(v)
        for key, per in self.counters.items():
            for v in transfer_stats_data.get(key, ()):
                per[engine_idx].inc(v)
