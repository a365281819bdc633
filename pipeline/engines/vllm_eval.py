"""One vLLM evaluation run in its own process: greedy generation, with or without an EAGLE-3 draft.

`python -m pipeline.engines.vllm_eval request.json result.json`. The request names the target, the
prompts (token ids), max_tokens and an optional speculative_config; the result holds the output token
ids, the generation wall time and vLLM's spec-decode counters (the same numbers its Prometheus
endpoint exports: vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
_num_accepted_tokens_per_pos). A process per run keeps engines from sharing state or memory.

On a CPU-only host the engine runs inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni"
executor) instead of vLLM's default engine-core and worker processes: each of those imports vLLM and torch
again, ~19 s apiece on a 2-core AMD EPYC, so an engine start took 48 s there and 8.6 s in-process, with the
same outputs and the same spec-decode counters (NOTES.md, "CPU dtype and engine starts"). Generation was
faster too, mostly because vLLM's worker is bound to one core of two (the other is reserved for its scheduler)
while in-process torch uses both, unbound: on a large multi-socket CPU host, where vLLM's NUMA binding
matters, set EAGLE3_VLLM_ENGINE_PROCESSES=1 to keep vLLM's processes. GPU hosts keep vLLM's default (tensor
parallelism needs the worker processes).
"""
from __future__ import annotations

import json
import os
import sys
import time

from .vllm_offline import in_process_engine  # shared with prepare's engine (vllm_offline.make_llm)


def counters(metrics) -> dict:
    from vllm.v1.metrics.reader import Counter, Vector

    out = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    for m in metrics:
        if isinstance(m, Counter) and m.name in names:
            out[names[m.name]] += int(m.value)
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(map(int, m.values))
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * len(vals), vals)] if acc else vals
    return out


def main(request_path: str, result_path: str) -> None:
    from ..env import setup_env

    setup_env()
    req = json.loads(open(request_path).read())
    in_process = in_process_engine(req.get("engine", {}))
    print(f"[vllm_eval] engine {'in this process' if in_process else 'in vLLM processes'}", flush=True)
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(
        model=req["model"], max_model_len=req["max_model_len"], dtype=req["dtype"], seed=req.get("seed", 0),
        enforce_eager=req.get("enforce_eager", True), disable_log_stats=False,
        trust_remote_code=req.get("trust_remote_code", False),
    )
    kw.update(req.get("engine", {}))  # the config's [engine]: tensor parallel size, memory, ...
    if in_process:
        kw["distributed_executor_backend"] = "uni"
    if req.get("speculative_config"):
        kw["speculative_config"] = req["speculative_config"]
    t0 = time.time()
    llm = LLM(**kw)
    startup = time.time() - t0
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    before = counters(llm.get_metrics())
    t1 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.time() - t1
    after = counters(llm.get_metrics())
    spec = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
    pos_before = before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
    spec["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], pos_before)]
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "generation_s": seconds,
        "startup_s": startup,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "spec_decode": spec,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
