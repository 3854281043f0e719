# SPDX-License-Identifier: Apache-2.0
"""Stand-in for vllm/v1/request.py: RequestStatus (the members the scheduler
sets on the paths the driver runs) and a Request with the attributes the
connector reads (__slots__: reading anything else raises).  As upstream, a
request may carry prompt embeddings instead of token ids: prompt_token_ids
is then None and num_prompt_tokens counts the embeddings."""
import enum


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status):
        return status > RequestStatus.PREEMPTED


class Request:
    __slots__ = ("request_id", "prompt_token_ids", "prompt_embeds", "num_prompt_tokens",
                 "kv_transfer_params", "status", "num_computed_tokens", "max_tokens",
                 "output_token_ids", "num_tokens")

    def __init__(self, request_id, prompt_token_ids, max_tokens, kv_transfer_params=None,
                 prompt_embeds=None):
        self.request_id = request_id
        self.prompt_token_ids = None if prompt_token_ids is None else list(prompt_token_ids)
        self.prompt_embeds = prompt_embeds
        self.num_prompt_tokens = (len(prompt_embeds) if self.prompt_token_ids is None
                                  else len(self.prompt_token_ids))
        self.num_tokens = self.num_prompt_tokens
        self.max_tokens = max_tokens
        self.kv_transfer_params = kv_transfer_params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.output_token_ids = []
