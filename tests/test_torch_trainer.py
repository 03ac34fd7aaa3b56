"""``transformers.Trainer`` trains on an Ember peer with no patching of transformers or accelerate.

``ACCELERATE_TORCH_DEVICE=ember`` (accelerate's own switch for a device it does not know by name; ``ember
run`` sets it) and ``import ember.torch``: ``TrainingArguments`` reports ``ember`` and the Trainer moves
the model there. A tiny GPT-2 (built locally, nothing downloaded) trains equal to CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ember.torch  # noqa: E402,F401
from accelerate.state import AcceleratorState  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def train(tmp: Path, cpu: bool, monkeypatch: Any) -> tuple[list[float], str]:
    if cpu:
        monkeypatch.delenv("ACCELERATE_TORCH_DEVICE", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "ember")
    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's state is per process; two runs here
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # (ember's generator is not the CPU's)
    model = transformers.GPT2LMHeadModel(cfg)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(64, (24, 16))]
    args = transformers.TrainingArguments(output_dir=str(tmp), per_device_train_batch_size=4, num_train_epochs=1,
                                          logging_steps=1, report_to=[], save_strategy="no", seed=0,
                                          use_cpu=cpu, disable_tqdm=True)
    device = str(args.device)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert next(model.parameters()).device.type == device.split(":")[0]
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], device


def test_trainer_trains_a_tiny_gpt2_on_ember_equal_to_cpu(tmp_path: Path, monkeypatch: Any) -> None:
    cpu, where = train(tmp_path / "cpu", True, monkeypatch)
    got, device = train(tmp_path / "ember", False, monkeypatch)
    assert where == "cpu" and device.startswith("ember")
    assert len(got) == len(cpu) == 6
    assert got == pytest.approx(cpu, abs=1e-5)


def _checkpointing_run(tmp: Path, cpu: bool, monkeypatch: Any) -> tuple[list[float], list[float], list[float]]:
    """Checkpoints every 3 steps, gradient accumulation, clipping and evaluation; then a new Trainer resumes
    from the first checkpoint: (losses, eval losses, the resumed run's losses)."""
    if cpu:
        monkeypatch.delenv("ACCELERATE_TORCH_DEVICE", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "ember")
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(64, (48, 16), generator=g)]

    def trainer() -> Any:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        args = transformers.TrainingArguments(
            output_dir=str(tmp), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=6,
            logging_steps=1, report_to=[], save_strategy="steps", save_steps=3, eval_strategy="steps", eval_steps=3,
            max_grad_norm=1.0, seed=0, use_cpu=cpu, disable_tqdm=True, dataloader_pin_memory=False)
        return transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=data,
                                    eval_dataset=data[:8])
    t = trainer()
    t.train()
    hist = t.state.log_history
    t2 = trainer()
    t2.train(resume_from_checkpoint=str(tmp / "checkpoint-3"))
    return [h["loss"] for h in hist if "loss" in h], [h["eval_loss"] for h in hist if "eval_loss" in h], \
        [h["loss"] for h in t2.state.log_history if "loss" in h]


def test_trainer_checkpoints_evaluates_and_resumes_on_ember_as_on_cpu(tmp_path: Path, monkeypatch: Any) -> None:
    """Saving a checkpoint (``save_pretrained``: safetensors tells tied weights apart by storage ``data_ptr``)
    raised on ember; now the run saves, evaluates and resumes from its checkpoint with CPU's own losses."""
    cpu = _checkpointing_run(tmp_path / "cpu", True, monkeypatch)
    got = _checkpointing_run(tmp_path / "ember", False, monkeypatch)
    assert got == cpu and len(got[0]) == 6 and len(got[1]) == 2
    assert (tmp_path / "ember" / "checkpoint-6" / "model.safetensors").exists()
