"""Peak accelerator memory of a vision-language training step: kto-pipeline vs trl.KTOTrainer online, simulated.

    python benchmarks/bench_memory_vision.py     # writes its section of benchmarks/RESULTS-memory.md

A LLaVA-1.5-7B-shaped model from its config alone (`llava_15_7b`) on fake tensors: `kto_pipeline/memory` runs our
step as `train` runs it, tower frozen (train's default) and trained (`--no-freeze-vision-tower`), and its model of
trl's (`simulate_trl`): every forward (the policy's, its KL forward, the reference's two) gets the batch's pictures,
and trl trains the tower (it cannot freeze it). That model is held to the real trl on text by `bench_memory.py`; its
image side follows trl 1.16's vision collator and `_compute_loss` as read in its source, not run against the real trl.
"""

import argparse
import time
import warnings

from bench_memory import RESULTS, VISION_HEADING, breakdown_text, gib
from harness import provenance, publish, table
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

from kto_pipeline import memory
from kto_pipeline.memory.simulation import image_shape


def llava_15_7b():
    """LLaVA-1.5-7B's config: CLIP ViT-L/14-336 vision tower, GELU projector, Llama-2-7B."""
    vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16)
    vision |= dict(image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu")
    text = dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, pad_token_id=0)
    text |= dict(num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5)
    llava = dict(image_token_index=32000, vision_feature_select_strategy="default", vision_feature_layer=-2)
    llava |= dict(projector_hidden_act="gelu", image_seq_length=576)
    return LlavaConfig(vision_config=CLIPVisionConfig(**vision), text_config=LlamaConfig(**text), **llava)


CASES = ((1024, False), (1024, True), (2048, True))  # (max length, activation checkpointing)


def case(max_length: int, checkpointing: bool) -> dict:
    """Ours (tower frozen, tower trained) and trl online's model on 8 rows of one picture each."""
    config, started = llava_15_7b(), time.perf_counter()
    rows = memory.synthetic_rows(8, max_length, "kto-mix", config.text_config.vocab_size, image=image_shape(config))
    frozen = memory.StepSettings(gradient_checkpointing=checkpointing)
    trained = memory.StepSettings(gradient_checkpointing=checkpointing, freeze_vision_tower=False)
    out = {"max_length": max_length, "gradient_checkpointing": checkpointing}
    out["ours_frozen"] = memory.simulate_ours(config, rows, frozen).to_dict()
    out["ours_trained"] = memory.simulate_ours(config, rows, trained).to_dict()
    out["trl_online"] = memory.simulate_trl(config, rows, trained, online=True).to_dict()
    out["seconds"] = time.perf_counter() - started
    print(f"  {max_length} AC={checkpointing}: {out['seconds']:.0f} s", flush=True)
    return out


def render(results: list[dict], command: str, seconds: float) -> str:
    """The section: provenance, a row per case, and what the columns show."""
    rows = []
    for r in results:
        frozen, trained, trl = (r[k]["peak_bytes"] for k in ("ours_frozen", "ours_trained", "trl_online"))
        ac = "yes" if r["gradient_checkpointing"] else "no"
        ours = (r["max_length"], ac, f"**{gib(frozen)}**", breakdown_text(r["ours_frozen"]), gib(trained))
        rows.append((*ours, gib(trl), breakdown_text(r["trl_online"]), f"{frozen / trl:.2f}", f"{trained / trl:.2f}"))
    header = (
        "| max len | AC | ours, tower frozen | its breakdown | ours, tower trained | trl online (tower trained) | "
        "trl breakdown | ours frozen / trl | ours trained / trl |"
    )
    lines = [
        VISION_HEADING,
        "",
        *provenance(command, seconds, "transformers", "torch"),
        "",
        "GiB per device at the peak of one steady step (simulated; no accelerator measured), LLaVA-1.5-7B's shape "
        "(CLIP ViT-L/14-336, projector, Llama-2-7B), 8 rows, each one picture (576 image tokens) at the start of a "
        "kto-mix-like prompt, bf16 autocast over float32 weights, fused AdamW. Breakdown: parameters / gradients / "
        "optimizer / activations / temporaries. trl: `memory.simulate_trl`, its pictures handed to every forward as "
        "trl's vision collator does, its vision tower trained (trl has no option to freeze it); this model of trl's "
        "image side was not run against the real trl. How: benchmarks/bench_memory_vision.py.",
        "",
        *table(header, rows),
        "",
        "What the columns show: trl online holds a second LLaVA (the reference, float32, vision tower included) and "
        "runs each prompt with its 576 image tokens twice per model (completion, KL completion); ours holds the "
        "policy alone and runs each prompt once. With the tower frozen ours also keeps no gradients or AdamW moments "
        "for its 0.30B parameters.",
    ]
    for r in results:
        ours, theirs = (r[k]["breakdown"]["activations"] for k in ("ours_frozen", "trl_online"))
        if ours > theirs and not r["gradient_checkpointing"]:  # (checkpointed, LLaVA-7B keeps none: large keys/values)
            lines += [
                "",
                f"At max length {r['max_length']} without activation checkpointing ours keeps more activations than "
                f"trl ({gib(ours)} vs {gib(theirs)} GiB): the prompts' keys and values, kept (float32 under autocast) "
                "for the KL completions' forward on the cached prompts; with 576 image tokens every prompt is long, "
                "while trl reruns its prompts without gradients for its KL forward and keeps nothing of them.",
            ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    started, results = time.perf_counter(), [case(*c) for c in CASES]
    report = render(results, "python benchmarks/bench_memory_vision.py", time.perf_counter() - started)
    publish(report, args.out, heading=VISION_HEADING)


if __name__ == "__main__":
    main()
