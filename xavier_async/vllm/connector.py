"""``XavierConnector``: vLLM's KV connector (``KVConnectorBase_V1``) over xavier_async.

One instance per role. The scheduler role (EngineCore process) answers prefix lookups
from its directory and plans each step (:mod:`~xavier_async.vllm.scheduler`); the worker
role (each worker process) owns one endpoint and runs the plan
(:mod:`~xavier_async.vllm.worker`). Configure it with::

    kv_transfer_config = {
        "kv_connector": "XavierConnector",
        "kv_connector_module_path": "xavier_async.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"rank": 0, "listen": "127.0.0.1:7311",
                                      "peers": ["127.0.0.1:7312"]},
    }
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)

from .directory import Directory
from .feed import FeedServer, feed_name
from .metadata import StepPlan
from .scheduler import SchedulerSide
from .settings import ConnectorSettings
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger("xavier_async.vllm")


class XavierConnectorMetadata(KVConnectorMetadata):
    """One step's :class:`~xavier_async.vllm.metadata.StepPlan`, as vLLM carries it."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _tp(vllm_config: Any) -> tuple[int, int]:
    size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    rank = 0
    if size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        rank = int(get_tensor_model_parallel_rank())
    return rank, size


class XavierConnector(KVConnectorBase_V1):
    """Shares prefix blocks between vLLM replicas: every full block a replica computes is
    published under its vLLM block hash; a request whose prefix a peer holds loads it
    instead of computing it (failed loads are recomputed with
    ``kv_load_failure_policy="recompute"``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = ConnectorSettings.parse(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail") != "recompute":
            log.warning("XavierConnector: kv_load_failure_policy is not 'recompute': a failed "
                        "load (a peer lost mid-load) fails its request instead of recomputing")
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._feed: FeedServer | None = None
        if role == KVConnectorRole.SCHEDULER:
            directory, lock = Directory(), threading.Lock()
            self._sched = SchedulerSide(directory, self.block_size,
                                        sync=self.settings.load_mode == "sync",
                                        min_load_blocks=self.settings.min_load_blocks, lock=lock,
                                        blocks_of=self._blocks_of)
            self._feed = FeedServer(feed_name(self.settings.listen), directory, lock)
        else:
            tp_rank, _ = _tp(vllm_config)
            self._worker = WorkerSide(self.settings, tp_rank)
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)

    # -- scheduler side ----------------------------------------------------------------
    def _blocks_of(self, req_id: str) -> list[int]:
        manager = self._kv_cache_manager
        if manager is None:
            return []
        return list(manager.get_blocks(req_id).get_block_ids()[0])

    def on_new_request(self, request: Any) -> None:
        assert self._sched is not None
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else ()
        self._sched.after_alloc(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._sched is not None
        return XavierConnectorMetadata(self._sched.build(dict(scheduler_output.num_scheduled_tokens)))

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.loads_finished(connector_output.finished_recving)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.finished(request), None

    # -- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        num_blocks = self._num_blocks or int(next(iter(kv_caches.values())).shape[0])
        self._worker.start(kv_caches, num_blocks)

    def _plan(self) -> StepPlan:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, XavierConnectorMetadata) else StepPlan()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._feed is not None:
            self._feed.close()
            self._feed = None


__all__ = ["XavierConnector", "XavierConnectorMetadata"]
