"""vLLM offline engine (the `LLM` class) for generation: regenerating answers with the target."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str


def cpu_only() -> bool:
    import torch

    return not torch.cuda.is_available()


def make_llm(model_path: str, *, max_model_len: int, dtype: str, seed: int, trust_remote_code: bool = False,
             enforce_eager: bool = False, **kw):
    from vllm import LLM

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
    return LLM(**args)


def generate(llm, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, seed: int) -> list[Generation]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=True)
    return [Generation(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
