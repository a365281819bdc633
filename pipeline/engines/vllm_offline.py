"""vLLM offline engine (the `LLM` class) for generation: regenerating answers with the target.

On a CPU-only host with one worker (in_process_engine) make_llm starts the engine in one child process
that hosts it in-process (EngineProcess, pipeline.engines.vllm_generate) instead of vllm.LLM here: vLLM's
default engine-core and worker processes each import vLLM and torch again (~19 s apiece on a 2-core AMD EPYC),
and the worker is bound to one core of two (see pipeline.engines.vllm_eval, which runs its engine the same
way). A child, not this process, because the caller may be a test session whose process goes on to load
other models: the engine and its torch.distributed state end with the child. GPU hosts, tensor or pipeline
parallelism, a distributed_executor_backend asked for, or EAGLE3_VLLM_ENGINE_PROCESSES=1 keep vllm.LLM here.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass

from ..config import REPO_ROOT


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str


def cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def in_process_engine(engine: dict) -> bool:
    """Whether a vLLM engine runs inside its process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor):
    CPU-only, one worker, no executor asked for by the config, and no EAGLE3_VLLM_ENGINE_PROCESSES=1 (which
    keeps vLLM's own processes, e.g. for its NUMA binding on a large multi-socket CPU host). `engine` holds
    vllm.LLM keyword arguments (the config's [engine] at least). The one rule for prepare's engine (make_llm),
    the extraction server's worker (pipeline.extract) and the eval engines (pipeline.engines.vllm_eval)."""
    import torch

    if torch.cuda.is_available() or engine.get("distributed_executor_backend") or os.environ.get("EAGLE3_VLLM_ENGINE_PROCESSES") == "1":
        return False
    return int(engine.get("tensor_parallel_size") or 1) * int(engine.get("pipeline_parallel_size") or 1) == 1


class EngineProcess:
    """vllm.LLM in one child process (`python -m pipeline.engines.vllm_generate`) that keeps it across
    generate() calls. One JSON line each way per call over the child's stdin and stdout; the child's logs
    go to the stderr it shares with this process. close() ends it (at exit at the latest)."""

    def __init__(self, llm_kwargs: dict):
        # stderr inherited: vLLM's log shows where this process's output goes
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.engines.vllm_generate"], cwd=REPO_ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.busy = False  # a request sent and not answered yet
        atexit.register(self.close)
        self._call(llm_kwargs, "start its engine")  # answers once the engine is up

    def _call(self, message: dict, what: str) -> dict:
        self.busy = True
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:  # the child is gone
            line = ""
        if not line:  # the child ended, or is ending: its exit code for the message
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
            self.close()
            raise RuntimeError(f"the vLLM engine process failed to {what} (exit code {self.proc.returncode}); "
                               f"its log is above")
        self.busy = False
        return json.loads(line)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 seed: int | list[int]) -> list[Generation]:
        request = {"prompts": prompts, "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
        return [Generation(*g) for g in self._call(request, "generate")["generations"]]

    def close(self) -> None:
        """EOF ends an idle engine (exit 0); one interrupted mid-request (an error, Ctrl-C, SIGTERM) is killed,
        and so is one still running when the wait for its exit is itself interrupted."""
        try:
            if self.proc.poll() is None and not self.busy:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            atexit.unregister(self.close)


def make_llm(model_path: str, *, max_model_len: int, dtype: str, seed: int, trust_remote_code: bool = False,
             enforce_eager: bool = False, **kw):
    """vllm.LLM, or an EngineProcess where the engine can run in-process (in_process_engine)."""
    args = dict(
        model=str(model_path),
        max_model_len=max_model_len,
        dtype=dtype,
        seed=seed,
        trust_remote_code=trust_remote_code,
        # always on CPU: torch.compile there costs a minute per start and gains little
        enforce_eager=cpu_only() or enforce_eager,
    )
    args.update(kw)
    if in_process_engine(args):
        return EngineProcess(args)
    from vllm import LLM

    return LLM(**args)


def target_llm(cfg, *, seed: int | None = None, dtype: str | None = None, **kw):
    """make_llm for the run's target as the config says (model, [engine]); seed defaults to run.seed and dtype to
    model.dtype; `kw` adds vllm.LLM arguments (prepare, pipeline.self_prompts, tests/bench)."""
    return make_llm(cfg.model_path, max_model_len=cfg.model.max_model_len, dtype=dtype or cfg.model.dtype,
                    seed=cfg.run.seed if seed is None else seed, trust_remote_code=cfg.model.trust_remote_code,
                    enforce_eager=cfg.engine.enforce_eager, **kw, **cfg.engine.llm_kwargs())


def generate(llm, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
             seed: int | list[int]) -> list[Generation]:
    """One Generation per prompt. `seed`: one for all (sampled prompts that are equal get equal answers), or a
    list with one seed per prompt (each request its own random stream: pipeline.self_prompts)."""
    if isinstance(seed, list) and len(seed) != len(prompts):
        raise ValueError(f"{len(seed)} seeds for {len(prompts)} prompts")
    if isinstance(llm, EngineProcess):
        return llm.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if isinstance(seed, list):
        params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=s) for s in seed]
    else:
        params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=True)
    return [Generation(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def close(llm) -> None:
    """End make_llm's engine process; a vllm.LLM is left to its own shutdown (when it is garbage)."""
    if isinstance(llm, EngineProcess):
        llm.close()
