"""A CPU-safe hidden-states KV connector for vLLM's ``extract_hidden_states`` speculative method.

Why: vLLM's stock ``ExampleHiddenStatesConnector`` copies the captured hidden states off the device on
a CUDA stream into pinned memory (``_submit_async_write``), which crashes on the CPU build. This
subclass does the same extraction synchronously when the cache lives on the CPU (and defers to the
stock path on CUDA), keeping the file format, the ``.lock`` flock protocol that ``load_hidden_states``
waits on, and the completion bookkeeping of ``get_finished``.

Loaded *inside the vLLM process* (``--kv-transfer-config`` ``kv_connector_module_path``), so it imports
only vLLM, torch and safetensors -- nothing else of kimi-perf.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["KimiPerfCPUHiddenStatesConnector"]


class _Done:
    """Stands in for the CUDA copy-done event: the synchronous copy is complete when it exists."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class KimiPerfCPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is not None and self._kv_cache.device.type == "cuda":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).contiguous().clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers blocked in load_hidden_states proceed
        self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]
