"""Benchmark (a script, not a test): what bf16 costs against float32 on this CPU, and what a vLLM engine start costs
in vLLM's three processes against one.

    .venv/bin/python tests/bench/cpu_dtype.py [--engine-request RUN/eval/baseline.request.json]

1. The CPU's bf16 flags (avx512_bf16, amx_bf16) and torch's view of it.
2. A 1024 x 576 x 1536 matmul (SmolLM2's hidden x MLP width, 1,024 tokens) in float32 and bf16: ms and GFLOP/s.
3. Muon's Newton-Schulz orthogonalization of a 576 x 1728 gradient (the draft's fc layer): torch's own (bf16) against
   the float32 one the train step installs on the CPU (pipeline/engines/speculators_train.py).
4. With --engine-request (a request.json the eval step wrote): the same vLLM eval run as vLLM's default engine-core
   and worker processes and in-process (pipeline/engines/vllm_eval.py's CPU default): start-up and generation
   seconds, whether the outputs and spec-decode counters agree.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def timed(fn, repeats: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def engine_runs(request: Path) -> None:
    out = REPO / ".cache" / "bench-cpu-dtype"
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, engine in (("three processes", {"distributed_executor_backend": "mp"}), ("in-process", {})):
        req = json.loads(request.read_text())
        req["engine"] = {**req.get("engine", {}), **engine}
        rq, rs = out / f"{name.replace(' ', '-')}.request.json", out / f"{name.replace(' ', '-')}.result.json"
        rq.write_text(json.dumps(req))
        t = time.time()
        with open(out / f"{name.replace(' ', '-')}.log", "w") as log:
            subprocess.run([sys.executable, "-m", "pipeline.engines.vllm_eval", str(rq), str(rs)], cwd=REPO,
                           stdout=log, stderr=subprocess.STDOUT, check=True)
        r = json.loads(rs.read_text())
        results[name] = r
        print(f"  {name:16s} process {time.time() - t:6.1f} s, engine start {r['startup_s']:5.1f} s, "
              f"generation {r['generation_s']:5.1f} s ({r['output_tokens'] / r['generation_s']:.1f} tok/s)")
    a, b = results.values()
    print(f"  same outputs: {a['outputs'] == b['outputs']}; same spec-decode counters: "
          f"{a['spec_decode'] == b['spec_decode']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-request", type=Path, help="an eval request.json to run both ways")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from pipeline.env import BF16_FLAGS, cpu_flags, setup_env
    from pipeline.manifest import host_facts

    setup_env()
    import torch
    import torch.optim._muon as muon

    from pipeline.engines.speculators_train import float32_newton_schulz_on_cpu

    flags, host = cpu_flags(), host_facts()
    print(f"CPU: {host.get('cpu_model', '?')}, {host['cpus']} cores; bf16 flags: {sorted(flags & BF16_FLAGS) or 'none'}; "
          f"torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(1024, 576, generator=g).to(dtype)
        b = torch.randn(576, 1536, generator=g).to(dtype)
        s = timed(lambda: a @ b, args.repeats)
        print(f"  matmul 1024x576x1536 {str(dtype):15s} {s * 1e3:9.2f} ms  {2 * 1024 * 576 * 1536 / s / 1e9:7.1f} GFLOP/s")
    grad = torch.randn(576, 1728, generator=g)
    coeffs = (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C)
    torch_ns = muon._zeropower_via_newtonschulz
    s_torch = timed(lambda: torch_ns(grad, coeffs, 5, 1e-7), max(1, args.repeats // 2))
    installed = float32_newton_schulz_on_cpu()
    s_ours = timed(lambda: muon._zeropower_via_newtonschulz(grad, coeffs, 5, 1e-7), args.repeats)
    cos = torch.nn.functional.cosine_similarity(torch_ns(grad, coeffs, 5, 1e-7).float().flatten(),
                                                muon._zeropower_via_newtonschulz(grad, coeffs, 5, 1e-7).flatten(), dim=0)
    print(f"  Muon Newton-Schulz 576x1728: torch (bf16) {s_torch:.3f} s, float32 {s_ours:.3f} s "
          f"(installed: {installed}), cosine {float(cos):.5f}")
    if args.engine_request:
        engine_runs(args.engine_request)


if __name__ == "__main__":
    main()
