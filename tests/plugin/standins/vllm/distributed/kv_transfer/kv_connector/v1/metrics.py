# SPDX-License-Identifier: Apache-2.0
"""Stand-in for vllm/distributed/kv_transfer/kv_connector/v1/metrics.py (the
commit is in pdkv/upstream.py, SOURCES): KVConnectorStats (a dataclass
around a data dict) and KVConnectorPromMetrics (metric classes from vLLM,
labels per engine), with prometheus_client's metric types as upstream."""
import dataclasses
from typing import Any, TypeVar, Union

from prometheus_client import Counter, Gauge, Histogram

PromMetric = Union[Gauge, Counter, Histogram]
PromMetricT = TypeVar("PromMetricT", Gauge, Counter, Histogram)


@dataclasses.dataclass
class KVConnectorStats:
    data: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return self.data

    def reset(self):
        raise NotImplementedError

    def aggregate(self, other):
        raise NotImplementedError

    def reduce(self):
        raise NotImplementedError

    def is_empty(self):
        raise NotImplementedError


class KVConnectorPromMetrics:
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._gauge_cls = metric_types[Gauge]
        self._counter_cls = metric_types[Counter]
        self._histogram_cls = metric_types[Histogram]
        self._labelnames = labelnames
        self.per_engine_labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data: Any, engine_idx: int = 0):
        raise NotImplementedError
