"""Issue 16's questions asked of the CPU path (torchrun, gloo), where no 2-GPU machine is lent:
1 vs 2 training ranks on the same data, and a kill of one rank mid-run followed by a resume.

    .venv/bin/python tests/bench/ranks_cpu.py [--config configs/smollm2-cpu-tiny.toml] [--epochs 4]
    python3 tests/bench/ranks_cpu.py --ranks 1 --config configs/smollm2-quality-h200.toml --set KEY=VALUE ...
        (the lent single H200: np1 and np1-kill only, through tests/bench/h200/run.sh ranks1)

The config's run must be complete through `vocab` (`make demo CONFIG=...` or its steps). Four training runs share
its data (runs/ranks-*/ link its upstream steps), each through `python -m pipeline train` with --set only:
  np1        1 rank,  train.total_seq_len = T      (the config's)
  np2-half   2 ranks, T/2 tokens per rank          (the same tokens per optimizer step as np1)
  np2        2 ranks, T per rank                   (uninterrupted reference for the kill)
  np2-kill   2 ranks, T per rank; rank 1 SIGKILLed once epoch 1's checkpoint exists, then the same command again
and it prints per-epoch validation loss of each and the largest difference between the final weights of np2 and
np2-kill. What agreement to expect: np1 and np2-half see the same samples per epoch but packed into different
batches (each rank packs its own shard), so their curves agree only statistically; np2 and np2-kill run the same
ranks on the same shards from the same epoch checkpoint, so on CPU (deterministic kernels) they should agree exactly.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from pipeline.env import setup_env  # noqa: E402

setup_env()
from pipeline.config import load_config  # noqa: E402

UPSTREAM = ("model", "prepare", "extract", "verify", "vocab")


def link_run(base: Path, name: str) -> Path:
    run = base.parent / name
    if run.exists():
        subprocess.run(["rm", "-rf", str(run)], check=True)
    run.mkdir(parents=True)
    for s in UPSTREAM:
        (run / s).symlink_to(Path("..") / base.name / s)
    return run


def train_cmd(config: str, name: str, nproc: int, seq: int, epochs: int, sets: list[str]) -> list[str]:
    return [sys.executable, "-m", "pipeline", "train", "--config", config, *[a for kv in sets for a in ("--set", kv)],
            "--set", f"run.name={name}", "--set", f"train.nproc_per_node={nproc}",
            "--set", f"train.total_seq_len={seq}", "--set", f"train.epochs={epochs}"]


def descendants_with_rank(root_pid: int, rank: int) -> list[int]:
    """Descendants of root_pid whose environment says RANK=<rank> (torchrun's workers start their own sessions,
    so the process tree is followed through the parent ids)."""
    parent = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found = []
    for pid in parent:
        q = pid
        while q in parent and q != root_pid and q > 1:
            q = parent[q]
        if q != root_pid or pid == root_pid:
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            found.append(pid)
    return found


def val_losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    return [round(r["val"]["loss_epoch"], 4) for r in rows if "val" in r]


def final_weights(run: Path):
    from safetensors.torch import load_file

    return load_file(str(run / "train" / "checkpoint" / "model.safetensors"))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm2-cpu-tiny.toml")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--ranks", type=int, choices=(1, 2), default=2,
                    help="2: the four runs above; 1: np1 and np1-kill only (the single-GPU half of issue 16: the "
                         "one training process is SIGKILLed after epoch 1's checkpoint, then resumed)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config overrides for every run (the same ones the upstream steps ran with)")
    args = ap.parse_args(argv)
    from pipeline.__main__ import parse_set

    cfg = load_config(args.config, parse_set(args.sets))
    base = cfg.run_dir
    if not (base / "vocab" / "manifest.json").exists():
        sys.exit(f"{base}: run the pipeline through vocab first (make demo CONFIG={args.config})")
    seq, tag = cfg.train.total_seq_len, f"ranks-{cfg.run.name}"
    plan = {"np1": (1, seq), "np2-half": (2, seq // 2), "np2": (2, seq)} if args.ranks == 2 else {"np1": (1, seq)}
    seconds = {}
    for name, (nproc, s) in plan.items():
        link_run(base, f"{tag}-{name}")
        t0 = time.time()
        subprocess.run(train_cmd(args.config, f"{tag}-{name}", nproc, s, args.epochs, args.sets), cwd=REPO,
                       check=True, stdout=subprocess.DEVNULL)
        seconds[name] = round(time.time() - t0, 1)

    ref, kill = ("np2", "np2-kill") if args.ranks == 2 else ("np1", "np1-kill")
    kill_run = link_run(base, f"{tag}-{kill}")
    cmd = train_cmd(args.config, f"{tag}-{kill}", args.ranks, seq, args.epochs, args.sets)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt1 = kill_run / "train" / "checkpoints" / "1" / "model.safetensors"
    deadline = time.time() + 1800
    while time.time() < deadline and not ckpt1.exists() and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1)
    if args.ranks == 2:
        victims = descendants_with_rank(proc.pid, 1)
        assert victims, "no rank-1 process found"
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
    else:  # one rank: the training process and the step around it, all in the step's own session
        victims = [proc.pid]
        os.killpg(proc.pid, signal.SIGKILL)
    rc = proc.wait()
    done_at_kill = sorted(p.name for p in (kill_run / "train" / "checkpoints").iterdir() if p.name.isdigit())
    print(f"[ranks] killed {'rank 1' if args.ranks == 2 else 'the training'} (pid {victims}); the job exited {rc}; "
          f"checkpoints then: {done_at_kill}")
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    seconds[f"{kill} resume"] = round(time.time() - t0, 1)
    log = (kill_run / "train" / "train.log").read_text()
    resumed = "Resuming training on epoch" in log

    runs = {n: base.parent / f"{tag}-{n}" for n in [*plan, kill]}
    print("| run | ranks x tokens per rank | val loss per epoch | train tokens/s (all ranks) | seconds |")
    print("|---|---|---|---|---|")
    for n, r in runs.items():
        m = json.loads((r / "train" / "manifest.json").read_text())
        nproc, s = plan.get(n, (args.ranks, seq))
        print(f"| {n} | {nproc} x {s} | {val_losses(r)} | {m['summary']['train_tokens_per_s']} | "
              f"{seconds.get(n, seconds.get(f'{kill} resume'))} |")
    a, b = final_weights(runs[ref]), final_weights(runs[kill])
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    print(f"resumed from a checkpoint: {resumed}; {ref} vs {kill} final weights: max abs difference {diff:g} "
          f"({'identical' if diff == 0 else 'different'})")
    if args.ranks == 2:
        l1, l2 = val_losses(runs["np1"])[-1], val_losses(runs["np2-half"])[-1]
        print(f"final val loss np1 {l1} vs np2-half {l2}: relative difference {abs(l1 - l2) / l1:.3%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
