# SPDX-License-Identifier: Apache-2.0
"""Stand-in for vllm/distributed/parallel_state.py: the TP rank of the
calling worker.  The driver sets it (set_rank) before it builds each worker's
connector, as vLLM's worker process has its group initialised by then."""
_rank = 0


def set_rank(rank):  # stand-in only: the driver's hook
    global _rank
    _rank = int(rank)


def get_tensor_model_parallel_rank():
    return _rank
