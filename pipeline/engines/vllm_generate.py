"""A vLLM engine hosted in this process, for generation requests from its parent (vllm_offline.EngineProcess).

`python -m pipeline.engines.vllm_generate`: the first line on stdin holds the vllm.LLM keyword arguments; the
engine runs inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor; why in
pipeline.engines.vllm_offline) and one line {"ready": true} says it is up. Then each request line
{"prompts": [[ids]], "max_new_tokens", "temperature", "seed" (one, or a list: one per prompt)} gets one line
{"generations": [[text, token_ids, finish_reason], ...]}; EOF on stdin ends the process (exit 0).
The answers go to this process's original stdout; everything else printed here (vLLM's log, tqdm) goes to stderr.
"""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    # the protocol keeps the original stdout; fd 1 becomes stderr, so no log line can end up in an answer
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # die with the parent even when it is killed (SIGKILL: no cleanup there); strictly, with the parent's thread
    # that started this process, which is its main thread in prepare
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        # Ctrl-C reaches the whole process group: the parent's close() ends this process, without a second traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ..env import setup_env

    setup_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    print("[vllm_generate] engine in this process", file=sys.stderr, flush=True)
    from vllm import LLM

    from .vllm_offline import generate

    def answer(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    llm = LLM(**json.loads(sys.stdin.readline()), distributed_executor_backend="uni")
    answer({"ready": True})
    for line in sys.stdin:
        r = json.loads(line)
        gens = generate(llm, r["prompts"], max_new_tokens=r["max_new_tokens"], temperature=r["temperature"], seed=r["seed"])
        answer({"generations": [[g.text, g.token_ids, g.finish_reason] for g in gens]})


if __name__ == "__main__":
    main()
