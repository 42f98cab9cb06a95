"""``tessera quality train`` runs end to end on the CPU and writes a directory every reader accepts."""

from __future__ import annotations

import json

import pytest
import torch

from loadgen.quality.config import TrainConfig, command_line
from loadgen.quality.train import _lr
from services.cli import main as tessera


def test_tiny_training_run_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "m"
    rc = tessera(["quality", "train", "-o", str(out), "--device", "cpu", "--layers", "2", "--hidden", "32",
                  "--heads", "2", "--kv-heads", "1", "--steps", "6", "--batch", "8", "--eval-every", "3",
                  "--eval-prompts", "8", "--workers", "0", "--seed", "5"])
    assert rc == 0
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "README.md", "training.json"}
    summary = json.loads((out / "training.json").read_text())
    assert summary["steps"] == 6 and [h["step"] for h in summary["history"]] == [3, 6]
    assert all(set(h["accuracy"]) == {"full", "reuse"} for h in summary["history"])
    assert "--seed 5" in summary["command"] and "--seed 5" in (out / "README.md").read_text()

    from services.engine import Engine
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    engine = Engine.load(out, device="cpu", dtype=torch.float32)
    ids = [2, 10, 20, 30, 40]
    r = engine.prefill(chunks=[ids[:3]], suffix=ids[3:], mode="full")
    with torch.no_grad():
        torch.testing.assert_close(r.logits, hf(torch.tensor([ids])).logits[0, -1], rtol=1e-4, atol=1e-4)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    cfg = TrainConfig(out="x", steps=1000, warmup=100, lr=1e-3)
    assert _lr(0, cfg) == pytest.approx(1e-5)
    assert _lr(99, cfg) == pytest.approx(1e-3)
    assert _lr(999, cfg) == pytest.approx(1e-4, rel=1e-2)
    assert _lr(500, cfg) < _lr(200, cfg)


def test_bad_training_config_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="induction"):
        TrainConfig(out="x", induction=1.0)
    with pytest.raises(ValueError, match="device"):
        TrainConfig(out="x", device="tpu")
    assert tessera(["quality", "train", "-o", str(tmp_path), "--device", "cpu", "--steps", "0"]) == 2
    assert "error" in capsys.readouterr().err
    assert command_line(TrainConfig(out="d", seed=3)) == "tessera quality train -o d --device cpu --seed 3"


def test_tiny_longgen_run_starts_from_init_and_writes_its_summary(tmp_path):
    from safetensors.torch import load_file

    from loadgen.quality.model import ModelConfig, TinyLlama, save_hf
    from loadgen.quality.vocab import vocab

    torch.manual_seed(0)
    start = save_hf(TinyLlama(ModelConfig(vocab_size=vocab().size, hidden=32, layers=1, heads=2, kv_heads=1,
                                          intermediate=80)), tmp_path / "start", dtype="float32")
    out = tmp_path / "lg"
    rc = tessera(["quality", "train", "--task", "longgen", "-o", str(out), "--init", str(start), "--device", "cpu",
                  "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--steps", "2", "--batch", "2",
                  "--eval-every", "2", "--eval-prompts", "2", "--workers", "0", "--lr", "1e-9", "--save-dtype", "float32"])
    assert rc == 0
    summary = json.loads((out / "training.json").read_text())
    assert summary["config"]["task"] == "longgen" and summary["steps"] == 2
    assert set(summary["history"][0]["loss"]) == {"longgen", "induction"}
    assert set(summary["history"][0]["accuracy"]["full"]) == {"name", "object", "end"}
    assert set(summary["final_heldout"]["greedy"]) == {"answers", "prompt_all_right"}
    assert len(summary["final_heldout"]["greedy_by_answer"]) == 16
    assert "--task longgen" in summary["command"] and summary["command"] in (out / "README.md").read_text()
    before, after = load_file(str(start / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name, w in before.items():  # a learning rate of 1e-9: the weights are the ones it started from
        torch.testing.assert_close(after[name], w, rtol=0, atol=1e-6)


def test_relay_form_and_its_bar_are_flags_of_longgen_only(tmp_path, capsys):
    assert command_line(TrainConfig(out="d", task="longgen", form="relay", bar_object=0.5)) == \
        "tessera quality train -o d --device cpu --task longgen --form relay --bar-object 0.5"
    with pytest.raises(ValueError, match="longgen's"):
        TrainConfig(out="d", form="relay")
    with pytest.raises(ValueError, match="form must be one of"):
        TrainConfig(out="d", task="longgen", form="triple")
    with pytest.raises(ValueError, match="probability"):
        TrainConfig(out="d", task="longgen", form="relay", bar_object=-0.1)
    out = tmp_path / "relay"
    rc = tessera(["quality", "train", "--task", "longgen", "--form", "relay", "-o", str(out), "--device", "cpu",
                  "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--steps", "2", "--batch", "2",
                  "--eval-every", "2", "--eval-prompts", "2", "--workers", "0", "--induction", "0"])
    assert rc == 0
    summary = json.loads((out / "training.json").read_text())
    assert summary["config"]["form"] == "relay" and summary["config"]["bar_object"] == 0.9
    assert set(summary["history"][0]["accuracy"]["full"]) == {"name", "think", "adj", "object", "end"}
    assert set(summary["final_heldout"]["greedy"]) == {"answers", "prompt_all_right", "adj"}
    assert "N_i IT A_i O_i" in (out / "README.md").read_text()
    capsys.readouterr()


def test_task_and_init_are_flags_of_the_command_line():
    assert command_line(TrainConfig(out="d", task="longgen", init="m")) == \
        "tessera quality train -o d --device cpu --task longgen --init m"
    with pytest.raises(ValueError, match="task"):
        TrainConfig(out="d", task="nope")
