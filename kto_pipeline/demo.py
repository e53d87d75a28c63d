"""`kto-pipeline demo` (`make demo`): the whole pipeline on the bundled data, offline, in about a minute.

A tiny Llama with a character-level tokenizer is built locally from a seed (kto_pipeline.tiny),
then: precompute the train and held-out caches -> train -> report the reward margin at the start
and the end, and the held-out fraction of rows whose implicit reward has the sign of their label.
The learning rate is far above KTO's usual 5e-7..5e-6 because the model is tiny and random.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kto_pipeline.config import PrecomputeConfig, TrainConfig
from kto_pipeline.precompute import precompute
from kto_pipeline.tiny import build_char_tokenizer, build_tiny_model
from kto_pipeline.train import train

BETA = 0.1


def demo_data(split: str) -> Path:
    return Path(str(resources.files("kto_pipeline") / "data" / f"demo_{split}.jsonl"))


def build_reference(path: Path, steps: int = 300, seed: int = 0) -> Path:
    """The demo's reference model: a tiny random Llama briefly fine-tuned (plain next-token SFT) on the
    train prompts and completions, desirable and undesirable alike.

    KTO starts from an SFT model in practice; from random weights the policy's first move is to learn
    the text itself, which raises every completion's log-prob and drowns the preference signal.
    """
    import json

    import torch

    if (path / "config.json").exists():
        return path
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    texts = [json.loads(line) for line in demo_data("train").read_text().splitlines()]
    encoded = [tokenizer(r["prompt"] + r["completion"] + tokenizer.eos_token)["input_ids"] for r in texts]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(encoded), (16,), generator=generator).tolist()
        width = max(len(encoded[i]) for i in idx)
        ids = torch.full((16, width), tokenizer.pad_token_id)
        labels = torch.full((16, width), -100)
        for row, i in enumerate(idx):
            ids[row, : len(encoded[i])] = torch.tensor(encoded[i])
            labels[row, : len(encoded[i])] = torch.tensor(encoded[i])
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"built the demo reference model: {steps} SFT steps, final LM loss {loss.item():.3f} -> {path}")
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_demo(workdir: str | Path = ".demo", epochs: float = 3.0) -> dict[str, float]:
    workdir = Path(workdir)
    model_dir = build_reference(workdir / "tiny-llama-sft")
    for split in ("train", "test"):
        precompute(
            PrecomputeConfig(
                model=str(model_dir),
                dataset=str(demo_data(split)),
                output=str(workdir / f"cache-{split}"),
                max_length=256,
            )
        )
    result = train(
        TrainConfig(
            cache=str(workdir / "cache-train"),
            output_dir=str(workdir / "run"),
            beta=BETA,
            learning_rate=1e-4,
            per_device_train_batch_size=8,
            num_train_epochs=epochs,
            warmup_ratio=0.1,
            logging_steps=5,
            eval_cache=str(workdir / "cache-test"),  # evaluated once, at the end
            overwrite_output_dir=True,
        )
    )
    logged = [m for m in result.metrics if "loss" in m]
    (final_eval,) = [m for m in result.metrics if "eval_loss" in m]
    summary = {
        "margin_start": logged[0].get("rewards/margins", float("nan")),
        "margin_end": logged[-1].get("rewards/margins", float("nan")),
        "heldout_accuracy_after": final_eval["eval_reward_accuracy"],
        "heldout_rows": final_eval["eval_rows"],
    }
    print(
        "\ndemo summary\n"
        f"  reward margin (chosen - rejected)   start {summary['margin_start']:+.4f}"
        f"  ->  end {summary['margin_end']:+.4f}"
        f"   (first and last logging step)\n"
        f"  held-out reward accuracy            {summary['heldout_accuracy_after']:.1%}"
        f" of {summary['heldout_rows']} rows"
        f"   (sign of beta * (policy - reference logp) vs label)\n"
        f"  model, metrics                      {(workdir / 'run').resolve()}"
    )
    return summary
