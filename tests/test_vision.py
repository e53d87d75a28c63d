"""Vision-language rows through both stages, on a tiny LLaVA built here (no hub): tokens as trl's vision collators
make them, cached reference log-probs equal to an independent full-logits computation (packed and padded alike),
step-1 rewards exactly 0, the images checked again at train time, and each bad input refused naming its row with
nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from vision_trl import read_vision_jsonl, trl_vision_tokens, vision_rows, write_vision_jsonl

from kto_pipeline.cache import open_cache
from kto_pipeline.config import PrecomputeConfig, TrainConfig
from kto_pipeline.demo.tiny_vision import save_tiny_vlm, toy_images
from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.images import tokenize_image_row
from kto_pipeline.scoring import plan as plan_module
from kto_pipeline.stages.precompute.stage import precompute
from kto_pipeline.stages.train.stage import train

MAX_LENGTH = 80


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return save_tiny_vlm("llava", tmp_path_factory.mktemp("llava") / "model")


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory):
    return save_tiny_vlm("idefics3", tmp_path_factory.mktemp("idefics3") / "model")


@pytest.fixture(params=["llava", "idefics3"])
def vlm_dir(request):
    """Each tiny family: LLaVA (CLIP tower, projector, Llama) and Idefics3 (SigLIP-style tower, pixel shuffle)."""
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="module")
def unpaired_file(tmp_path_factory):
    return write_vision_jsonl(vision_rows(12, seed=1), tmp_path_factory.mktemp("vision-unpaired"))


@pytest.fixture(scope="module")
def paired_file(tmp_path_factory):
    return write_vision_jsonl(vision_rows(8, seed=2, paired=True), tmp_path_factory.mktemp("vision-paired"))


def _precompute(model_dir, data_file, out, **more) -> Path:
    settings = dict(model=str(model_dir), dataset=str(data_file), output=str(out), max_length=MAX_LENGTH)
    return precompute(PrecomputeConfig(**{**settings, "dtype": "float32", **more}))


def _train(cache, out, **more) -> list[dict]:
    settings = dict(cache=str(cache), output_dir=str(out), per_device_train_batch_size=4, max_steps=2, bf16=False)
    settings["logging_steps"] = 1
    train(TrainConfig(**{**settings, "learning_rate": 5e-3, "warmup_ratio": 0.0, **more}))
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _full_logits_logp(model, processor, row: dict, completion_ids: list[int], prompt_ids: list[int]) -> float:
    """Sum of completion log-probs from the full logits of model(input_ids, pixel_values): no packing, no chunking."""
    pixels = dict(processor.image_processor(images=row["images"], return_tensors="pt"))
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logps = model(input_ids=ids, **pixels).logits[0, :-1].float().log_softmax(-1)
    token_logps = logps.gather(-1, ids[0, 1:, None])[:, 0]
    return float(token_logps[len(prompt_ids) - 1 :].sum())


# ------------------------------------------------------------------------------------------------ tokens


@pytest.mark.parametrize("paired", [False, True], ids=["unpaired", "paired"])
def test_tokens_match_trl(llava_dir, unpaired_file, paired_file, paired):
    """The prompt (image tokens expanded) and completion tokens of each row are trl's vision collators'."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(llava_dir)
    rows = read_vision_jsonl(paired_file if paired else unpaired_file)
    expected = trl_vision_tokens(llava_dir, rows, None)
    for i, (row, theirs) in enumerate(zip(rows, expected, strict=True)):
        answers = {"chosen": "chosen_ids", "rejected": "rejected_ids"} if paired else {"completion": "completion_ids"}
        for key, their_key in answers.items():
            prompt_ids, completion_ids, image_end = tokenize_image_row(
                processor, {"prompt": row["prompt"], "completion": row[key]}, row["images"], i
            )
            assert prompt_ids == theirs["prompt_ids"], i
            assert completion_ids == theirs[their_key], (i, key)
            assert sum(t == processor.image_token_id for t in prompt_ids) == theirs["num_image_tokens"] == 16
            assert image_end == max(j for j, t in enumerate(prompt_ids) if t == processor.image_token_id) + 1


# --------------------------------------------------------------------------------------------- precompute


@pytest.fixture(scope="module", params=["llava", "idefics3"])
def caches(request, unpaired_file, tmp_path_factory):
    """(model, packed cache, padded cache) of the unpaired rows, for each family: packed (the default) and padded (as
    a model whose attention takes no packing)."""
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    work = tmp_path_factory.mktemp("vision-caches")
    packed = _precompute(model_dir, unpaired_file, work / "packed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_module, "packing_unsupported", lambda model: "attention implementation 'x'")
        padded = _precompute(model_dir, unpaired_file, work / "padded")
    return model_dir, packed, padded


def test_cache_records_images_not_pixels(caches, unpaired_file):
    cache = open_cache(caches[1], verify=True)
    manifest = cache.manifest
    assert manifest.format_version == 3
    assert manifest.images["column"] == "images" and manifest.images["processor_hash"].startswith("sha256:")
    assert manifest.fingerprint["processor_hash"] == manifest.images["processor_hash"]
    assert manifest["reference_pass"]["prefix_shared"] is True
    rows = read_vision_jsonl(unpaired_file)
    from kto_pipeline.images import pixel_hash

    for r in cache.table.to_pylist():
        assert r["image_hashes"] == [pixel_hash(image) for image in rows[r["image_row"]]["images"]]
    assert not any(t == pytest.approx(0) for t in cache.table.column("ref_logp").to_pylist())
    assert all(
        not str(f).endswith((".png", ".npy")) for f in Path(caches[1]).rglob("*")
    )  # no pixels: shards, keys, manifest
    # two rows sharing a picture (rows 2 and 3) share its hash; others differ
    hashes = {r["image_row"]: r["image_hashes"][0] for r in cache.table.to_pylist()}
    assert hashes[2] == hashes[3] and hashes[1] != hashes[2]


def test_reference_logps_equal_full_logits(caches, unpaired_file):
    """Each cached completion and KL completion log-prob (the KL completion under this row's image and prompt)
    equals the full-logits computation, packed and padded (rel 1e-4)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir, *both = caches
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    rows = read_vision_jsonl(unpaired_file)
    tables = [open_cache(c).table.to_pylist() for c in both]
    assert [r["example_id"] for r in tables[0]] == [r["example_id"] for r in tables[1]]
    for packed, padded in zip(*tables, strict=True):
        row = rows[packed["image_row"]]
        expected = _full_logits_logp(model, processor, row, packed["completion_ids"], packed["prompt_ids"])
        expected_kl = _full_logits_logp(model, processor, row, packed["kl_completion_ids"], packed["prompt_ids"])
        for r in (packed, padded):
            assert r["ref_logp"] == pytest.approx(expected, rel=1e-4)
            assert r["ref_kl_logp"] == pytest.approx(expected_kl, rel=1e-4)
            assert r["kl_example_id"] != r["example_id"]


# ------------------------------------------------------------------------------------------------ train


@pytest.mark.parametrize("loss_type", ["kto", "sigmoid"])
def test_step_one_rewards_zero_packed_equals_padded(llava_dir, unpaired_file, paired_file, tmp_path, loss_type):
    """Step 1's rewards are exactly 0 (the policy is the reference, the images the same), and a packed run's
    metrics equal a padded run's."""
    data = paired_file if loss_type == "sigmoid" else unpaired_file
    packed = _precompute(llava_dir, data, tmp_path / "packed")
    sequential = dict(loss_type=loss_type, train_sampling_strategy="sequential")  # the same batches both ways
    logs = _train(packed, tmp_path / "run-packed", **sequential)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_module, "packing_unsupported", lambda model: "attention implementation 'x'")  # both stages
        padded = _precompute(llava_dir, data, tmp_path / "padded")
        padded_logs = _train(padded, tmp_path / "run-padded", **sequential)
    first = logs[0]
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0, first
    assert first["rewards/margins"] == 0.0
    assert logs[-1]["rewards/margins"] != 0.0  # it trains
    for ours, theirs in zip(logs, padded_logs, strict=True):
        for name in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            if name in ours:
                assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), (name, ours, theirs)


def test_vision_tower_frozen_by_default(llava_dir, unpaired_file, tmp_path):
    from transformers import AutoModelForImageTextToText

    cache = _precompute(llava_dir, unpaired_file, tmp_path / "cache")
    _train(cache, tmp_path / "frozen", max_steps=1)
    _train(cache, tmp_path / "trained", max_steps=1, freeze_vision_tower=False)
    base = AutoModelForImageTextToText.from_pretrained(llava_dir)
    frozen = AutoModelForImageTextToText.from_pretrained(tmp_path / "frozen")
    trained = AutoModelForImageTextToText.from_pretrained(tmp_path / "trained")

    def tower(model):
        return torch.cat([p.flatten() for p in model.model.vision_tower.parameters()])

    def language(model):
        return torch.cat([p.flatten() for p in model.model.language_model.parameters()])

    assert torch.equal(tower(frozen), tower(base))
    assert not torch.equal(tower(trained), tower(base))
    assert not torch.equal(language(frozen), language(base))


def test_lora_targets_the_language_model(llava_dir):
    from transformers import AutoModelForImageTextToText

    from kto_pipeline.stages.train.policy import language_model_targets

    model = AutoModelForImageTextToText.from_pretrained(llava_dir)
    targets = language_model_targets(model, "all-linear")
    assert targets and all(".language_model." in t for t in targets)
    assert any(t.endswith("q_proj") for t in targets)
    named = language_model_targets(model, ["q_proj", "v_proj"])
    assert named and all(".language_model." in t and t.rsplit(".", 1)[1] in ("q_proj", "v_proj") for t in named)
    # the vision tower has q_proj layers too: none is a target
    assert any("vision_tower" in n and n.endswith("q_proj") for n, _ in model.named_modules())


# ------------------------------------------------------------------------------------ images at train time


def test_changed_or_missing_image_stops_before_step_one(llava_dir, unpaired_file, tmp_path):
    data_dir = tmp_path / "data"
    shutil.copytree(unpaired_file.parent, data_dir)
    cache = _precompute(llava_dir, data_dir / "data.jsonl", tmp_path / "cache")
    image = data_dir / "images" / "0001.png"
    toy_images(1, seed=99)[0].save(image)  # another picture under the same name
    with pytest.raises(KTOPipelineError, match=r"row 1 of .*0001\.png.*changed since the cache was made"):
        _train(cache, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    image.unlink()
    with pytest.raises(KTOPipelineError, match=r"row 1: image file .*0001\.png does not exist"):
        _train(cache, tmp_path / "run2")
    assert not (tmp_path / "run2" / "metrics.jsonl").exists()


def test_same_pixels_in_another_format_still_match(llava_dir, unpaired_file, tmp_path):
    """The hash is of the decoded pixels, not of the file: a picture saved again losslessly (BMP) keeps its hash."""
    from PIL import Image

    data_dir = tmp_path / "data"
    shutil.copytree(unpaired_file.parent, data_dir)
    cache = _precompute(llava_dir, data_dir / "data.jsonl", tmp_path / "cache")
    image = data_dir / "images" / "0001.png"
    with Image.open(image) as opened:
        opened.load()
        opened.save(image, format="BMP")  # new bytes, same pixels
    logs = _train(cache, tmp_path / "run", max_steps=1)
    assert logs[0]["rewards/chosen"] == 0.0


# ------------------------------------------------------------------------------------------------ bad input


def _write(rows: list[dict], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows_with_images(directory: Path, n: int = 4) -> list[dict]:
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, image in enumerate(toy_images(n)):
        image.save(directory / "images" / f"{i}.png")
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What is {i}?"}]}]
        completion = [{"role": "assistant", "content": "Noise."}]
        rows.append({"images": [f"images/{i}.png"], "prompt": prompt, "completion": completion, "label": i % 2 == 0})
    return rows


def _refused(llava_dir, data_file, out: Path, match: str, **more) -> None:
    with pytest.raises(KTOPipelineError, match=match):
        _precompute(llava_dir, data_file, out, **more)
    assert not out.exists() or not any(out.iterdir()), "nothing is written"


def test_missing_and_unreadable_image_files(llava_dir, tmp_path):
    rows = _rows_with_images(tmp_path)
    rows[2]["images"] = ["images/nope.png"]
    _refused(llava_dir, _write(rows, tmp_path), tmp_path / "out", r"row 2: image file .*nope\.png does not exist")
    rows[2]["images"] = ["images/2.png"]
    (tmp_path / "images" / "3.png").write_bytes(b"not a png")
    _refused(llava_dir, _write(rows, tmp_path), tmp_path / "out2", r"row 3: image file .*3\.png could not be read")


def test_placeholders_must_number_the_images(llava_dir, tmp_path):
    rows = _rows_with_images(tmp_path)
    rows[1]["images"] = ["images/1.png", "images/2.png"]  # one placeholder, two images
    _refused(llava_dir, _write(rows, tmp_path), tmp_path / "out", r"row 1: the prompt has 1 image placeholder")
    rows = _rows_with_images(tmp_path)
    parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]  # two placeholders, one image
    rows[0]["prompt"] = [{"role": "user", "content": parts}]
    _refused(llava_dir, _write(rows, tmp_path), tmp_path / "out2", r"row 0: the prompt has 2 image placeholder")
    rows = [{**r, "prompt": "Describe <image>", "completion": "it"} for r in _rows_with_images(tmp_path)]
    rows[3]["prompt"] = "Describe <image> and <image>"  # standard (string) rows: the placeholder is written out
    _refused(llava_dir, _write(rows, tmp_path), tmp_path / "out3", r"row 3: the prompt holds 2 image placeholder")


def test_text_only_model_given_image_rows(tiny_model_dir, tmp_path):
    rows = _rows_with_images(tmp_path)
    _refused(
        tiny_model_dir, _write(rows, tmp_path), tmp_path / "out", "the dataset has images but --model .* text-only"
    )


def test_max_length_through_image_tokens(llava_dir, tmp_path):
    rows = _rows_with_images(tmp_path)
    data = _write(rows, tmp_path)
    _refused(
        llava_dir, data, tmp_path / "out", r"row 0: --max-length 20 would cut through its image tokens", max_length=20
    )


def test_append_refused_for_image_rows(llava_dir, tmp_path):
    rows = _rows_with_images(tmp_path)
    data = _write(rows, tmp_path)
    cache = _precompute(llava_dir, data, tmp_path / "cache")
    with pytest.raises(KTOPipelineError, match="--append: .* has images"):
        _precompute(llava_dir, data, cache, append=True)


# ------------------------------------------------------------------------------------------ parity with trl

PARITY = dict(learning_rate=5e-3, max_grad_norm=0.5, beta=0.1, seed=0, weight_decay=0.1)
COMPARED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


@pytest.mark.parametrize(
    "loss_type,batch_size", [("apo_zero_unpaired", 4), ("sigmoid", 2)], ids=["kto-apo_zero_unpaired", "dpo-sigmoid"]
)
def test_training_matches_trl_online(vlm_dir, unpaired_file, paired_file, tmp_path, loss_type, batch_size):
    """Ours from the cache = trl.KTOTrainer / trl.DPOTrainer with the reference online (which trl requires for
    images), on the same rows: 3 steps of loss, grad norm, rewards and log-probs (rel 2e-3), the vision tower
    trained as trl trains it. trl's KTO pairs KL completions within its batch, ours from the cache: apo_zero_unpaired
    has no KL term, so the two runs see the same numbers."""
    from vision_trl import trl_dpo_logs, trl_kto_logs

    paired = loss_type == "sigmoid"
    data = paired_file if paired else unpaired_file
    rows = read_vision_jsonl(data)
    oracle = trl_dpo_logs if paired else trl_kto_logs
    theirs = oracle(vlm_dir, rows, loss_type=loss_type, steps=3, batch_size=batch_size, max_length=MAX_LENGTH, **PARITY)
    cache = _precompute(vlm_dir, data, tmp_path / "cache", pairs_only=paired)
    ours = _train(
        cache,
        tmp_path / "ours",
        loss_type=loss_type,
        max_steps=3,
        per_device_train_batch_size=batch_size,
        train_sampling_strategy="sequential",
        freeze_vision_tower=False,
        **{k: v for k, v in PARITY.items() if k != "seed"},
        seed=PARITY["seed"],
    )
    assert [r["step"] for r in ours] == [h["step"] for h in theirs] == [1, 2, 3]
    assert theirs[0]["rewards/chosen"] == 0.0 and ours[0]["rewards/chosen"] == 0.0
    for step, (mine, expected) in enumerate(zip(ours, theirs, strict=True), start=1):
        for name in COMPARED:
            assert mine[name] == pytest.approx(expected[name], rel=2e-3, abs=1e-5), (step, name, mine, expected)
    assert abs(theirs[-1]["loss"] - theirs[0]["loss"]) > 0.02  # the policy moved beyond the tolerance
    assert max(h["grad_norm"] for h in theirs) > PARITY["max_grad_norm"]  # clipping exercised


# ------------------------------------------------------------------------------------------- two processes


@pytest.mark.slow
def test_fsdp2_two_processes_equal_one(llava_dir, unpaired_file, tmp_path):
    """Both stages of a tiny LLaVA sharded with FSDP2 over 2 processes (gloo) give one process's cache and steps:
    the vision tower, projector and language model sharded, the images read by each process for its rows."""
    from helpers import FSDP_ENV, SHARDED_REL, assert_same_rows, assert_same_steps, cli_args, launch, read_metrics

    one = _precompute(llava_dir, unpaired_file, tmp_path / "one-cache", shard_size=4)
    args = cli_args(model=llava_dir, dataset=unpaired_file, max_length=MAX_LENGTH, dtype="float32", shard_size=4)
    launch(2, "precompute", *args, "--output", str(tmp_path / "two-cache"), env=FSDP_ENV, log_dir=tmp_path / "logs")
    two = open_cache(tmp_path / "two-cache", verify=True)
    assert two.manifest["distributed"] == {"engine": "fsdp2", "world_size": 2}
    assert two.manifest.fingerprint == open_cache(one).manifest.fingerprint
    assert_same_rows(two.table.to_pylist(), open_cache(one).table.to_pylist())

    settings = dict(max_steps=3, logging_steps=1, train_sampling_strategy="sequential", learning_rate=5e-3, seed=3)
    _train(one, tmp_path / "one", per_device_train_batch_size=4, **settings)
    train_args = cli_args(cache=tmp_path / "two-cache", per_device_train_batch_size=2, no_bf16=True, **settings)
    launch(2, "train", *train_args, "--output-dir", str(tmp_path / "two"), env=FSDP_ENV, log_dir=tmp_path / "logs2")
    ours, sharded = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert sharded[0]["rewards/chosen"] == 0.0
    assert_same_steps(sharded, ours, SHARDED_REL)


def test_inspect_verify_names_changed_images(llava_dir, unpaired_file, tmp_path):
    from typer.testing import CliRunner

    from kto_pipeline.cli import app

    data_dir = tmp_path / "data"
    shutil.copytree(unpaired_file.parent, data_dir)
    cache = _precompute(llava_dir, data_dir / "data.jsonl", tmp_path / "cache")
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", str(cache), "--verify"])
    assert result.exit_code == 0, result.output
    assert "images (not held" in result.output and "OK (all checksums verified)" in result.output
    toy_images(1, seed=7)[0].save(data_dir / "images" / "0004.png")  # row 5's picture (rows 2 and 3 share 0002)
    result = runner.invoke(app, ["inspect", str(cache), "--verify"])
    assert result.exit_code == 1
    assert "problem: row 5 of" in result.output and "0004.png" in result.output and "changed" in result.output
    assert result.output.count("problem:") == 1


@pytest.mark.parametrize("form", ["parquet-images", "saved-image"])
def test_image_features_give_the_jsonl_cache(llava_dir, unpaired_file, tmp_path, form):
    """A Parquet file with a list of datasets Image features a row (`images`), and a saved dataset with one Image
    feature a row (`image`), give the cache of the same rows with image paths: the same tokens, pixel hashes and
    reference log-probs."""
    import datasets

    rows = read_vision_jsonl(unpaired_file)
    if form == "parquet-images":
        features = datasets.Features(
            images=datasets.List(datasets.Image()),
            prompt=datasets.List(
                {
                    "role": datasets.Value("string"),
                    "content": datasets.List({"type": datasets.Value("string"), "text": datasets.Value("string")}),
                }
            ),
            completion=datasets.List(
                {
                    "role": datasets.Value("string"),
                    "content": datasets.List({"type": datasets.Value("string"), "text": datasets.Value("string")}),
                }
            ),
            label=datasets.Value("bool"),
        )
        data = tmp_path / "data.parquet"
        datasets.Dataset.from_list(rows, features=features).to_parquet(str(data))
    else:
        single = [{"image": r["images"][0], **{k: v for k, v in r.items() if k != "images"}} for r in rows]
        data = tmp_path / "saved"
        datasets.Dataset.from_list(single).cast_column("image", datasets.Image()).save_to_disk(str(data))
    expected = open_cache(_precompute(llava_dir, unpaired_file, tmp_path / "from-jsonl")).table.to_pylist()
    cache = open_cache(_precompute(llava_dir, data, tmp_path / "cache"))
    assert cache.manifest.images["column"] == ("images" if form == "parquet-images" else "image")
    got = cache.table.to_pylist()
    for name in ("prompt_ids", "completion_ids", "image_row", "image_hashes", "kl_example_id"):
        assert [r[name] for r in got] == [r[name] for r in expected], name
    assert [r["ref_logp"] for r in got] == pytest.approx([r["ref_logp"] for r in expected], rel=1e-6)
    logs = _train(tmp_path / "cache", tmp_path / "run", max_steps=1)
    assert logs[0]["rewards/chosen"] == 0.0


def test_vision_demo(tmp_path):
    """`make demo-vision`: one cache of toy pictures trains KTO and DPO, and both prefer the right colour on held-out
    pictures (chance is 50%)."""
    from kto_pipeline.demo.vision import run_vision_demo

    summary = run_vision_demo(tmp_path / "demo")
    assert summary["heldout_accuracy_kto"] > 0.8 and summary["heldout_accuracy_sigmoid"] > 0.8
    assert summary["heldout_pairs_kto"] == 48  # KTO's pairs: the two answers on one prompt and one picture
    assert summary["cache_bytes"] < summary["image_bytes"]
    assert not list((tmp_path / "demo" / "cache-train").rglob("*.png"))


def test_rows_without_images_and_unsupported_families_are_refused(llava_dir, tmp_path):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from kto_pipeline.images import vision_unsupported

    rows = _rows_with_images(tmp_path)
    rows[1]["images"] = []
    message = r"row 1: no image in 'images'"
    _refused(llava_dir, _write(rows, tmp_path), tmp_path / "out", message)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    config = Qwen2VLConfig(text_config=dict(text, num_key_value_heads=1, rope_parameters=rope))
    with torch.device("meta"):
        qwen = Qwen2VLForConditionalGeneration(config)
    assert "M-RoPE" in vision_unsupported(qwen)
    from transformers import AutoModelForImageTextToText

    assert vision_unsupported(AutoModelForImageTextToText.from_pretrained(llava_dir)) is None


def test_estimate_memory_models_a_vision_step(llava_dir):
    """estimate-memory on a VLM: one picture a row (its image tokens in the prompt), the tower frozen or trained, and
    trl online beside it (its tower trained, every forward given the pictures)."""
    from kto_pipeline.config import MemoryEstimateConfig
    from kto_pipeline.memory.estimate import describe, estimate

    settings = dict(model=str(llava_dir), per_device_train_batch_size=4, max_length=64, against_trl=True)
    frozen = estimate(MemoryEstimateConfig(**settings))
    trained = estimate(MemoryEstimateConfig(**settings, freeze_vision_tower=False))
    assert frozen["image_tokens"] == 16 and frozen["image_size"] == 32
    assert "one 32px picture a row (16 image tokens of the prompt), vision tower frozen" in describe(frozen)
    assert frozen["peak_bytes"] < trained["peak_bytes"] < trained["trl_online_peak_bytes"]
    assert frozen["tokens_with_grad"] == trained["tokens_with_grad"] >= 4 * 16


def test_cached_reference_equals_trl_collated_full_logits(llava_dir, unpaired_file, tmp_path):
    """Each cached completion log-prob equals the full-logits log-prob of trl's own collated row (its tokens, its
    pixel values, truncated at max_length as trl truncates), rel 1e-4."""
    from vision_trl import reference_logps

    rows = read_vision_jsonl(unpaired_file)
    expected = reference_logps(llava_dir, rows, MAX_LENGTH)
    cache = open_cache(_precompute(llava_dir, unpaired_file, tmp_path / "cache")).table.to_pylist()
    assert len(cache) == len(rows)
    for r in cache:
        assert r["ref_logp"] == pytest.approx(expected[r["example_id"]], rel=1e-4), r["example_id"]


def test_lora_on_a_vlm_trains_the_language_model_only(llava_dir, unpaired_file, tmp_path):
    cache = _precompute(llava_dir, unpaired_file, tmp_path / "cache")
    logs = _train(cache, tmp_path / "lora", lora_r=4, lora_alpha=8, max_steps=2, learning_rate=1e-2)
    assert logs[0]["rewards/chosen"] == 0.0 and logs[-1]["rewards/margins"] != 0.0
    adapter = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert adapter["target_modules"] and all(".language_model." in t for t in adapter["target_modules"])


@pytest.mark.parametrize("loss_type", ["ipo", "hinge", "apo_zero", "sigmoid+sft"])
def test_every_pair_loss_trains_on_pictures(llava_dir, paired_file, tmp_path, loss_type):
    """trl.DPOTrainer's other pair losses (and a weighted sum) from a paired cache of pictures: step 1 exactly 0,
    then they train."""
    cache = _precompute(llava_dir, paired_file, tmp_path / "cache")
    logs = _train(cache, tmp_path / "run", loss_type=loss_type, per_device_train_batch_size=2)
    assert logs[0]["rewards/chosen"] == 0.0 and logs[0]["rewards/rejected"] == 0.0
    assert logs[-1]["rewards/margins"] != 0.0


def test_image_paths_are_read_from_arrow_without_the_held_bytes():
    import pyarrow as pa

    from kto_pipeline.images import _image_paths

    lists = pa.chunked_array([pa.array([["a.png"], ["b.png", "c.png"], []]), pa.array([["d.png"]])])
    assert list(_image_paths(lists)) == [(0, "a.png"), (1, "b.png"), (1, "c.png"), (3, "d.png")]
    structs = pa.array(
        [[{"bytes": None, "path": "q1"}], [{"bytes": b"held", "path": "q2"}, {"bytes": None, "path": "q3"}]]
    )
    assert list(_image_paths(pa.chunked_array([structs]))) == [(0, "q1"), (1, "q3")]  # q2's bytes are the data's own


def test_a_changed_picture_changes_the_caches_fingerprint(llava_dir, unpaired_file, tmp_path):
    """The dataset's content hash covers the image files a JSON-lines file names: precompute into the same output
    after a picture changed is refused as another dataset (or grown with --append for text), never taken as done."""
    data_dir = tmp_path / "data"
    shutil.copytree(unpaired_file.parent, data_dir)
    cache = _precompute(llava_dir, data_dir / "data.jsonl", tmp_path / "cache")
    toy_images(1, seed=11)[0].save(data_dir / "images" / "0000.png")
    with pytest.raises(KTOPipelineError, match="dataset_hash: cache has"):
        _precompute(llava_dir, data_dir / "data.jsonl", cache)
