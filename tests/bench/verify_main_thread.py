"""Where verify's main thread spends its time per file, without the disk.

Session 25 measured verify on the H200 at 158.4 s of content checks for 28,528 files with the transformers
reference on the GPU and the reader threads ahead (2.7 s of waiting): ~5.5 ms a file on the main thread.

    .venv/bin/python tests/bench/verify_main_thread.py [--device cuda] [--files 2000] [--profile 25]

A random-weight model of the target's shape (SmolLM2-135M-Instruct: 30 layers, hidden 576, vocab 49,152, bf16),
files of about the run's mean length (455 tokens) sharing a 16-token prefix as chat-templated files do, layer ids
[2, 15, 27, 30]. It times `ContentChecks.add` and `finish` as `pipeline/verify.py` calls them, with each file's
facts made beforehand (the readers' share), and with --profile prints the functions that took the most time.
Each file's first positions hold the reference's own states, so the prefix check passes as on clean data.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYER_IDS = [2, 15, 27, 30]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="where the reference runs (verify.device): cpu or cuda")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=455, help="mean tokens per file (spread +-50 %%)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the N functions with most own time")
    ap.add_argument("--contend", action="store_true", help="also time it beside 8 busy reader-like threads (sha256 "
                    "and numpy, as verify's readers), with torch's default threads and with 1, 2 and 4")
    a = ap.parse_args()

    from pipeline.env import setup_env

    setup_env()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.engines.hf_reference import hidden_states, resolve_device
    from pipeline.verify_content import ContentChecks, file_facts

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).to(resolve_device(a.device)).eval()
    rng = random.Random(0)
    prefix = [rng.randrange(cfg.vocab_size) for _ in range(16)]
    ref = hidden_states(model, prefix, LAYER_IDS)  # [16, L, H] on the CPU
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    files = []
    for i in range(a.files):
        n = rng.randint(a.tokens // 2, a.tokens * 3 // 2)
        ids = prefix + [rng.randrange(vocab) for _ in range(n - 16)]
        hs = torch.randn(n, len(LAYER_IDS), hidden).to(torch.bfloat16)
        hs[:16] = ref
        mask = [0] * 40 + [1] * (n - 40)
        files.append((f"train/hs_{i}.safetensors", hs, ids, mask, file_facts(hs)))
    def checks():  # verify's defaults: 16 prefix tokens, 32 head positions, cosine 0.995, norms within 2 %
        return ContentChecks(model, LAYER_IDS, cfg.num_hidden_layers, 16, 32, 0.995, 0.02, 0)

    prof = cProfile.Profile() if a.profile else None
    dt, summary = timed(checks(), files, prof)
    print(f"device {a.device}, torch threads {torch.get_num_threads()}, {a.files} files, "
          f"{sum(len(f[2]) for f in files):,} tokens, prefix forwards {summary['prefix-parity']['reference_forwards']}")
    print(f"add + finish: {dt:.2f} s ({1000 * dt / a.files:.2f} ms a file)")
    if a.contend:
        default = torch.get_num_threads()
        for threads in (default, 1, 2, 4):
            torch.set_num_threads(threads)
            with busy_readers(8, files[0][1]):
                dt, _ = timed(checks(), files, None)
            print(f"beside 8 busy readers, torch threads {threads}: {dt:.2f} s ({1000 * dt / a.files:.2f} ms a file)")
        torch.set_num_threads(default)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)


def timed(checks, files, prof) -> tuple[float, dict]:
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for k, (name, hs, ids, mask, facts) in enumerate(files):
        checks.add(name, hs, ids, mask, calibrate=k < 8, facts=facts)
    summary = checks.finish(parity_passed={f[0] for f in files[:8]})
    if prof:
        prof.disable()
    return time.perf_counter() - t0, summary


class busy_readers:
    """n threads doing over and over what verify's readers do with each file they read: `file_facts` (sha256 of
    the values, the numpy zero-row test) of one file's states `hs`."""

    def __init__(self, n: int, hs):
        self.n, self.hs, self.stop = n, hs, False

    def work(self):
        from pipeline.verify_content import file_facts

        while not self.stop:
            file_facts(self.hs)

    def __enter__(self):
        import threading

        self.threads = [threading.Thread(target=self.work, daemon=True) for _ in range(self.n)]
        for t in self.threads:
            t.start()

    def __exit__(self, *exc):
        self.stop = True
        for t in self.threads:
            t.join()


if __name__ == "__main__":
    main()
