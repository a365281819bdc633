"""train.mask_loops: the loss leaves an answer's terminal loop, nothing else (pipeline/loops.py, pipeline/train.py)."""
from __future__ import annotations

import os
import shutil

from pipeline.loops import answer_spans, mask_terminal_loops, terminal_loop
from tests.conftest import clone_run


def test_terminal_loop_is_masked_and_nothing_else():
    intro = list(range(100, 120))  # 20 distinct tokens
    cycle = list(range(200, 210))  # then a 10-token cycle, 8 times: the target stuck in a loop
    looping = intro + cycle * 8    # 100 tokens. The 8-gram ending at token p lies inside the cycle from p = 27
    # on and occurred 10 tokens earlier from p = 37 on: tokens 37..99 repeat, 63 of them; the longest tail with
    # >= 90 % repeats is the last 70 (63 / 70 = 0.9), so the loop starts at token 30.
    assert terminal_loop(looping) == 70
    plain = list(range(300, 340))  # an answer without a loop
    ids = [1, 2, 3] + looping + [4, 5] + plain + [6]
    mask = [0, 0, 0] + [1] * 100 + [0, 0] + [1] * 40 + [0]
    out, masked = mask_terminal_loops(ids, mask)
    assert masked == 70
    assert out == [0, 0, 0] + [1] * 30 + [0] * 70 + [0, 0] + [1] * 40 + [0]
    # a loop shorter than 32 tokens, or one the answer leaves again, is kept
    assert terminal_loop(intro + cycle * 3) == 0
    assert terminal_loop(intro + cycle * 8 + list(range(400, 440))) == 0


def test_mask_loops_is_in_the_fingerprint_only_when_on(repo):
    """Runs from before the key keep their train fingerprint (the hash below is the one the code before
    train.mask_loops gave configs/smollm2-quality.toml); turning it on makes a new one (the train folder is rebuilt)."""
    from pipeline.config import load_config

    path = repo / "configs" / "smollm2-quality.toml"
    assert load_config(path).section_hash("train") == "a0fc4f962504690b"
    assert load_config(path, {"train.mask_loops": True}).section_hash("train") != "a0fc4f962504690b"


def test_mask_loops_changes_only_the_train_rows(data_run, runs_dir):
    """Through the train step's data folder on a real prepared run: train rows lose exactly their terminal
    loops, eval rows (the val metrics) keep their mask, the token ids and the column types stay."""
    from datasets import load_from_disk

    from pipeline.train import build_data_dir

    cfg = clone_run(data_run, "maskloops", runs_dir, train={"mask_loops": True})
    # the tiny run's 64-token answers do not loop; the longest one is made to (the files are not read here)
    path = cfg.step_dir("prepare") / "train"
    train = load_from_disk(str(path))
    longest = max(range(len(train)), key=lambda i: sum(train[i]["loss_mask"]))
    span = answer_spans(train[longest]["loss_mask"])[0]
    assert span[1] - span[0] >= 48

    def loop(row, i):
        if i != longest:
            return row
        ids = list(row["input_ids"])
        ids[span[0]:span[1]] = ([7, 8, 9, 10, 11] * 40)[: span[1] - span[0]]
        return {**row, "input_ids": ids}

    train = train.map(loop, with_indices=True, features=train.features)
    train.save_to_disk(str(path) + ".new")
    shutil.rmtree(path)
    os.rename(str(path) + ".new", path)
    n_train, n_eval, loss = build_data_dir(cfg, cfg.run_dir / "data")
    built = load_from_disk(str(cfg.run_dir / "data"))
    train = load_from_disk(str(path))
    evals = load_from_disk(str(cfg.step_dir("prepare") / "eval"))
    assert (n_train, n_eval) == (len(train), len(evals)) and len(built) == n_train + n_eval
    assert built.features["loss_mask"] == train.features["loss_mask"]
    expect = [mask_terminal_loops(r["input_ids"], r["loss_mask"])[0] for r in train]
    rows = built.with_format(None)
    assert [r["loss_mask"] for r in rows.select(range(n_train))] == expect
    assert [r["loss_mask"] for r in rows.select(range(n_train, n_train + n_eval))] == list(evals["loss_mask"])
    assert list(rows["input_ids"]) == list(train["input_ids"]) + list(evals["input_ids"])
    before = sum(map(sum, list(train["loss_mask"])))
    assert loss["loop_masked_tokens"] >= span[1] - span[0] - 12  # all but the cycle's first 12 tokens
    assert loss["train_loss_tokens"] + loss["loop_masked_tokens"] == before


def test_compare_reads_a_key_at_its_default_as_absent():
    """A run made before train.mask_loops existed and one made after it with the key off compute the same thing:
    `compare` must not report their config as different (it does for the key turned on)."""
    from pipeline.compare import _what_it_computes

    old = {"config_sections": {"run": {"name": "a", "seed": 0}, "train": {"epochs": 4}}}
    new = {"config_sections": {"run": {"name": "b", "seed": 0}, "train": {"epochs": 4, "mask_loops": False}}}
    on = {"config_sections": {"run": {"name": "c", "seed": 0}, "train": {"epochs": 4, "mask_loops": True}}}
    assert _what_it_computes(old) == _what_it_computes(new) != _what_it_computes(on)
