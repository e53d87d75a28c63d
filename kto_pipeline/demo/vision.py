"""`kto-pipeline demo --vision` (`make demo-vision`): the pipeline on images, in about a minute on a CPU.

No small vision-language model's weights can be fetched here (the package index serves none), so the demo builds a
tiny LLaVA locally (`tiny_vision.py`: a CLIP vision tower, a projector and a 2-layer Llama, random weights) and
toy pictures: noisy squares of one colour. Each picture asks "What colour is this picture?"; the right colour is
the chosen answer, another colour the rejected one. The demo runs what a user runs on vision-language feedback:

    pictures + paired rows (JSON lines, image paths relative to the file)
    -> precompute (train and held-out caches: tokens, pixel hashes, reference log-probs; no pixels)
    -> train KTO, then trl.DPOTrainer's sigmoid loss from the same cache (vision tower frozen)
    -> held-out pair accuracy of each: does the policy now prefer the right colour on pictures it never saw?

The rows are paired, so one cache trains both loss families: KTO reads each answer as an unpaired row (with its
KL completion under its own picture), the pair loss reads the pairs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

COLOURS = {"red": (200, 40, 40), "green": (40, 170, 60), "blue": (50, 70, 210)}
PROMPT = "What colour is this picture?"


def colour_pictures(directory: Path, count: int, seed: int) -> list[dict]:
    """`count` paired rows, each a noisy square of one colour (PNG files in `directory/images`, 24-48 pixels a
    side), the right colour chosen and another colour rejected; image paths relative to `directory`."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    names, rows = list(COLOURS), []
    for i in range(count):
        right = names[i % len(names)]
        wrong = names[(i + 1 + int(rng.integers(0, 2))) % len(names)]
        size = tuple(int(s) for s in rng.integers(24, 49, 2))
        pixels = np.clip(np.array(COLOURS[right]) + rng.normal(0, 40, (*size, 3)), 0, 255).astype(np.uint8)
        path = f"images/{i:04d}.png"
        Image.fromarray(pixels).save(directory / path)
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
        rows.append(
            {
                "images": [path],
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": f"{right.capitalize()}."}],
                "rejected": [{"role": "assistant", "content": f"{wrong.capitalize()}."}],
            }
        )
    return rows


def run_vision_demo(workdir: str | Path = ".demo-vision", train_pairs: int = 96, heldout_pairs: int = 48) -> dict:
    from kto_pipeline.config import PrecomputeConfig, TrainConfig
    from kto_pipeline.demo.tiny_vision import save_tiny_vlm
    from kto_pipeline.stages.precompute.stage import precompute
    from kto_pipeline.stages.train.stage import train

    workdir = Path(workdir)
    started = time.perf_counter()
    model_dir = workdir / "tiny-llava"
    if not (model_dir / "config.json").exists():
        save_tiny_vlm("llava", model_dir)
    for split, count, seed in (("train", train_pairs, 0), ("test", heldout_pairs, 1)):
        data = workdir / split
        rows = colour_pictures(data, count, seed)
        (data / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        precompute(
            PrecomputeConfig(
                model=str(model_dir),
                dataset=str(data / "data.jsonl"),
                output=str(workdir / f"cache-{split}"),
                max_length=64,
            )
        )
    results, compared = {}, {}
    for loss_type, accuracy in (("kto", "eval_pair_accuracy"), ("sigmoid", "eval_rewards/accuracies")):
        result = train(
            TrainConfig(
                cache=str(workdir / "cache-train"),
                output_dir=str(workdir / f"run-{loss_type}"),
                loss_type=loss_type,
                beta=0.1,
                learning_rate=1e-3,
                per_device_train_batch_size=8,
                num_train_epochs=3.0,
                warmup_ratio=0.1,
                logging_steps=5,
                eval_cache=str(workdir / "cache-test"),
                overwrite_output_dir=True,
            )
        )
        (final,) = [m for m in result.metrics if "eval_loss" in m]
        results[loss_type] = final[accuracy]
        compared[loss_type] = final.get("eval_pairs", heldout_pairs)  # KTO: pairs of rows on one prompt and picture
    cache_bytes = sum(f.stat().st_size for f in (workdir / "cache-train").rglob("*") if f.is_file())
    image_bytes = sum(f.stat().st_size for f in (workdir / "train" / "images").glob("*.png"))
    summary = {
        "heldout_accuracy_kto": results["kto"],
        "heldout_accuracy_sigmoid": results["sigmoid"],
        "heldout_pairs_kto": compared["kto"],
        "cache_bytes": cache_bytes,
        "image_bytes": image_bytes,
        "seconds": time.perf_counter() - started,
    }
    print(
        "\nvision demo summary (a tiny LLaVA built here, random weights; toy pictures of one colour)\n"
        f"  held-out pair accuracy     KTO {summary['heldout_accuracy_kto']:.1%}, "
        f"DPO sigmoid {summary['heldout_accuracy_sigmoid']:.1%} of {heldout_pairs} pictures never trained on\n"
        "                             (the right colour's reward above the wrong one's; 50% is chance)\n"
        f"  one cache, two losses      {workdir / 'cache-train'}: {cache_bytes / 1024:.0f} KiB of tokens, hashes and "
        f"reference log-probs; the {image_bytes / 1024:.0f} KiB of pictures stay in the dataset\n"
        f"  wall time                  {summary['seconds']:.0f} s\n"
        f"  models, metrics            {(workdir / 'run-kto').resolve()}, {(workdir / 'run-sigmoid').resolve()}"
    )
    return summary
