"""Images of vision-language rows: read, hashed, tokenized with the model's processor, and read again for training.

A row of vision-language data holds trl's `images` column (a list of images a row) or `image` (one). In a JSON,
JSON-lines or CSV file the images are file paths, relative to the data file; in a Parquet file, an Arrow file or a
saved dataset, a `datasets` Image feature; a hub dataset by name. The cache never holds pixels: it records each
row's image content hashes (of the decoded pixels, not of the path) and the processor's settings, and training
reads the images again from the dataset the manifest names, checked against those hashes.

    image_column       which column holds a dataset's images (None: a text dataset)
    images_hash        the content of every image file a dataset names (part of its content hash)
    open_images        a row's images as PIL images, a clear error naming the row and the file otherwise
    pixel_hash         sha256 of an image's decoded pixels
    tokenize_image_row trl's vision collators' tokens of one row: the prompt through the processor (image tokens
                       expanded), the completion through the tokenizer
    ImageRows          a dataset's images by source row, as the model takes them (`pixels`), checked (`check`)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from kto_pipeline.errors import KTOPipelineError

IMAGE_COLUMNS = ("images", "image")


def image_column(dataset) -> str | None:
    """The column that holds `dataset`'s images (trl's `images`, a list a row, or `image`), or None."""
    found = [c for c in IMAGE_COLUMNS if c in dataset.column_names]
    if len(found) > 1:
        raise KTOPipelineError(
            "the dataset has both an 'images' and an 'image' column: keep one (trl's 'images' holds a list of images "
            "a row, 'image' one)."
        )
    return found[0] if found else None


def base_dir(name: str) -> Path | None:
    """The folder that relative image paths start from: a local data file's own folder (None: not a local file)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path.resolve().parent
    if path.is_dir():
        return path.resolve()
    return None


def _as_list(value: Any, column: str) -> list:
    if column == "image":
        return [] if value is None else [value]
    return [] if value is None else list(value)


def _path_of(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("bytes") is None:
        return value.get("path")
    return None


def images_hash(dataset, column: str, root: Path | None) -> str:
    """sha256 over the bytes of every image file the column names by path, in row order (a missing file is named by
    `open_images` when its row is read). Images held in the dataset's own files (a datasets Image feature with its
    bytes) are covered by its content hash and never read here: only the paths leave Arrow, a chunk at a time."""
    h = hashlib.sha256()
    for row, path in _image_paths(dataset.data.column(column)):
        full = _resolve(path, root)
        h.update(f"{row}:{path}:".encode())
        if full.is_file():
            with open(full, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def _image_paths(column):
    """(row, path) of each image a column names by path: strings, or Image structs whose bytes are null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    first = 0
    for chunk in column.chunks:
        rows = np.arange(first, first + len(chunk))
        first += len(chunk)
        if pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type):
            rows = rows[pc.list_parent_indices(chunk).to_numpy()]
            chunk = pc.list_flatten(chunk)
        if pa.types.is_struct(chunk.type):
            if chunk.type.get_field_index("path") < 0:
                continue
            held = pc.is_valid(pc.struct_field(chunk, "bytes")) if chunk.type.get_field_index("bytes") >= 0 else None
            paths = pc.struct_field(chunk, "path")
            if held is not None:
                paths = pc.if_else(held, pa.scalar(None, paths.type), paths)
        elif pa.types.is_string(chunk.type) or pa.types.is_large_string(chunk.type):
            paths = chunk
        else:
            continue
        for row, path in zip(rows.tolist(), paths.to_pylist(), strict=True):
            if path is not None:
                yield row, path


def _resolve(path: str, root: Path | None) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() or root is None else root / p


def open_images(value: Any, column: str, root: Path | None, row: int) -> list:
    """Row `row`'s images (its `column` value) as PIL images: decoded already (a datasets Image feature), a
    {bytes, path} dict, or a path relative to `root`."""
    import io

    from PIL import Image

    out = []
    for item in _as_list(value, column):
        if isinstance(item, Image.Image):
            out.append(item)
            continue
        path = _path_of(item)
        try:
            if path is not None:
                full = _resolve(path, root)
                if not full.is_file():
                    raise KTOPipelineError(f"row {row}: image file {full} does not exist.")
                image = Image.open(full)
            elif isinstance(item, dict) and item.get("bytes") is not None:
                image = Image.open(io.BytesIO(item["bytes"]))
            else:
                raise KTOPipelineError(
                    f"row {row}: '{column}' holds a {type(item).__name__}; expected an image file path, a datasets "
                    "Image feature or {bytes, path}."
                )
            image.load()
        except KTOPipelineError:
            raise
        except Exception as exc:
            where = f"image file {_resolve(path, root)}" if path is not None else "its image bytes"
            raise KTOPipelineError(f"row {row}: {where} could not be read ({type(exc).__name__}: {exc}).") from None
        out.append(image)
    return out


def pixel_hash(image) -> str:
    """sha256 of an image's decoded pixels (mode, size and bytes): the same picture in another file or format hashes
    alike; a changed picture does not."""
    h = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()[:32]


# ------------------------------------------------------------------------------------------- processor


def is_image_processor(processor) -> bool:
    return getattr(processor, "image_processor", None) is not None and hasattr(processor, "tokenizer")


def load_processor(name: str, revision: str | None = None, trust_remote_code: bool = False, flag: str = "--model"):
    """The model's processor (`AutoProcessor`), for rows with images: it renders the chat template, expands each image
    placeholder into the model's image tokens and turns images into the vision tower's inputs. A model without an
    image processor (a text-only model) is refused."""
    from transformers import AutoProcessor

    from kto_pipeline.models import check_model_path

    check_model_path(name, flag)
    try:
        processor = AutoProcessor.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise KTOPipelineError(f"{flag} {name}: could not load its processor ({type(exc).__name__}: {exc})") from exc
    if not is_image_processor(processor):
        raise KTOPipelineError(
            f"the dataset has images but {flag} {name} is a text-only model (its processor, "
            f"{type(processor).__name__}, takes no images). Use a vision-language model (one with an image processor, "
            "such as LLaVA), or drop the image column."
        )
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


def image_token(processor) -> tuple[str, int]:
    """The processor's image placeholder (as a prompt writes it) and its token id."""
    token = getattr(processor, "image_token", None)
    if token is None:
        raise KTOPipelineError(f"{type(processor).__name__} names no image token; it cannot place images in prompts.")
    return token, processor.tokenizer.convert_tokens_to_ids(token)


def processor_hash(processor) -> str:
    """Hash of what decides a vision row's tokens and pixels besides the tokenizer: the image processor's settings and
    the processor's own (image token counts, placeholder strategy)."""
    own = {k: v for k, v in vars(processor).items() if isinstance(v, str | int | float | bool | type(None))}
    payload = {"image_processor": processor.image_processor.to_dict(), "processor": own}
    return "sha256:" + hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _placeholders(messages: list[dict]) -> int:
    count = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
    return count


def multimodal_prompt(prompt: list[dict], num_images: int, row: int) -> list[dict]:
    """trl's `prepare_multimodal_messages` for a prompt: string contents become text parts, and a prompt without
    image parts gets one `{"type": "image"}` per image before the text of its first user message. A prompt whose
    image parts do not number its images is refused (trl raises too)."""
    messages = [dict(m) for m in _text_parts(prompt)]
    given = _placeholders(messages)
    if given == 0 and num_images:
        for i, message in enumerate(messages):
            if message.get("role") == "user":
                parts = [{"type": "image"} for _ in range(num_images)] + list(message["content"])
                messages[i] = dict(message, content=parts)
                break
        else:
            raise KTOPipelineError(f"row {row}: the prompt has no user message to place its {num_images} image(s) in.")
    elif given != num_images:
        raise KTOPipelineError(
            f"row {row}: the prompt has {given} image placeholder(s) ({{'type': 'image'}}) but the row has "
            f"{num_images} image(s); give one image per placeholder."
        )
    return messages


def _text_parts(messages: list[dict]) -> list[dict]:
    """String contents as text parts (trl's `prepare_multimodal_messages`, without images)."""
    return [
        dict(m, content=[{"type": "text", "text": m["content"]}]) if isinstance(m.get("content"), str) else m
        for m in messages
    ]


def tokenize_image_row(
    processor, row: dict[str, Any], images: list, source_row: int
) -> tuple[list[int], list[int], int]:
    """(prompt_ids, completion_ids, image_end) of one vision row, as trl's vision collators make them: a
    conversational row is rendered with the chat template (prompt with the generation prompt; the prompt text is the
    common prefix of the prompt's and the whole conversation's renderings), the prompt and its images go through the
    processor, which expands each image placeholder into the model's image tokens, and the completion text through
    the processor alone. No EOS is appended to a standard row's completion (trl's vision path appends none).
    `image_end`: the prompt position after its last image token (0 without images)."""
    from itertools import takewhile

    prompt, completion = row["prompt"], row["completion"]
    placeholder, placeholder_id = image_token(processor)
    if isinstance(prompt, list):
        messages = multimodal_prompt(prompt, len(images), source_row)
        completion_messages = _text_parts(completion)
        extra = row.get("chat_template_kwargs") or {}
        try:
            last = messages[-1]["role"] if messages else "user"
            prompt_text = processor.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=last != "assistant",
                continue_final_message=last == "assistant",
                **extra,
            )
            whole = processor.apply_chat_template(messages + completion_messages, tokenize=False, **extra)
        except Exception as exc:
            raise KTOPipelineError(
                f"row {source_row}: the chat template refused its messages ({type(exc).__name__}: {exc})."
            ) from None
        same = takewhile(lambda ab: ab[0] == ab[1], zip(prompt_text, whole, strict=False))
        prompt_text = "".join(a for a, _ in same)
        completion_text = whole[len(prompt_text) :]
    else:
        prompt_text, completion_text = prompt, completion
        given = prompt_text.count(placeholder)
        if given != len(images):
            raise KTOPipelineError(
                f"row {source_row}: the prompt holds {given} image placeholder(s) ({placeholder}) but the row has "
                f"{len(images)} image(s); give one image per placeholder."
            )
    if placeholder in completion_text:
        raise KTOPipelineError(f"row {source_row}: the completion holds the image placeholder {placeholder}.")
    try:
        prompt_ids = processor(images=images or None, text=[prompt_text], add_special_tokens=False)["input_ids"][0]
    except Exception as exc:
        raise KTOPipelineError(
            f"row {source_row}: the processor refused its prompt and images ({type(exc).__name__}: {exc})."
        ) from None
    completion_ids = processor(text=[completion_text], add_special_tokens=False)["input_ids"][0]
    prompt_ids, completion_ids = [int(t) for t in prompt_ids], [int(t) for t in completion_ids]
    where = [i for i, t in enumerate(prompt_ids) if t == placeholder_id]
    return prompt_ids, completion_ids, (where[-1] + 1 if where else 0)


def vision_unsupported(model) -> str | None:
    """Why the scorer cannot place `model`'s image features (it merges them into the image tokens' embeddings and
    runs the language model on its own positions and attention), or None where it can: LLaVA-style models
    (`get_placeholder_mask`) and Idefics3-style ones (`inputs_merger`), with 1-D positions and causal attention."""
    body = getattr(model, "base_model", model)
    text = model.config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("mrope_section"):
        return "its positions are multimodal (M-RoPE: three position ids a token, from the image grid)"
    if getattr(model.config, "model_type", "").startswith("gemma3"):
        return "its image tokens attend to each other both ways (Gemma 3's token_type_ids)"
    if not hasattr(body, "get_image_features") or not (
        hasattr(body, "get_placeholder_mask") or hasattr(body, "inputs_merger")
    ):
        return "its backbone offers no way to compute image features and place them (get_image_features)"
    return None


# ------------------------------------------------------------------------------------------- re-reading


class ImageRows:
    """A dataset's images by source row, as the model takes them. Opened by both stages from the same dataset:
    precompute scores with them, train reads them again and checks them against the hashes the cache holds."""

    def __init__(self, dataset, column: str, root: Path | None, processor, name: str = "the dataset"):
        self.dataset, self.column, self.root, self.processor, self.name = dataset, column, root, processor, name

    @classmethod
    def of_cache(cls, manifest, trust_remote_code: bool = False) -> ImageRows:
        """The images of a cache of rows with images, read from the dataset its manifest names with the processor of
        its reference model, which must be the one the cache was made with."""
        from kto_pipeline.sources import load_source

        images, dataset = manifest.images, manifest["dataset"]
        name = dataset["name_or_path"]
        try:
            source = load_source(name, dataset["split"], dataset["config"])
        except KTOPipelineError as exc:
            raise KTOPipelineError(
                f"the cache's rows hold images, which train reads from the cache's dataset again: {exc}"
            ) from None
        processor = load_processor(manifest.tokenizer_name, manifest.reference_revision, trust_remote_code)
        if processor_hash(processor) != images["processor_hash"]:
            raise KTOPipelineError(
                f"the processor of {manifest.tokenizer_name} differs from the one the cache was made with (image size, "
                "normalisation or image token count): its images would not give the same inputs. Precompute a new "
                "cache."
            )
        root = None if images.get("root") is None else Path(images["root"])
        return cls(source, images["column"], root, processor, name)

    def problems(self, table) -> list[str]:
        """What is wrong with the images a cache table's rows use (`image_row`, `image_hashes`): one line per dataset
        row whose images are gone, unreadable or changed; empty when every one is as hashed."""
        import numpy as np

        image_rows = table.column("image_row").to_numpy()
        unique, first = np.unique(image_rows, return_index=True)
        hashes = table.column("image_hashes").take(first).to_pylist()
        found = []
        for row, hashed in zip(unique.tolist(), hashes, strict=True):
            if row >= len(self.dataset):
                found.append(f"row {row} of {self.name} is gone: the dataset now has {len(self.dataset)} rows.")
                continue
            try:
                self.check(row, hashed, self.name)
            except KTOPipelineError as exc:
                found.append(str(exc))
        return found

    def check_all(self, table) -> None:
        """Check every image a cache table's rows use before any step: stop naming the rows whose images changed."""
        found = self.problems(table)
        if found:
            more = f"\n  ... and {len(found) - 5} more" if len(found) > 5 else ""
            raise KTOPipelineError(
                "the cache's images cannot be read as they were hashed:\n  - " + "\n  - ".join(found[:5]) + more
            )

    def images(self, source_row: int) -> list:
        return open_images(self.dataset[int(source_row)][self.column], self.column, self.root, int(source_row))

    def check(self, source_row: int, hashes: list[str], where: str) -> None:
        """Stop with a message naming the row and its file where row `source_row`'s images are not the ones hashed."""
        images = self.images(source_row)
        now = [pixel_hash(image) for image in images]
        if now != list(hashes):
            value = self.dataset[int(source_row)][self.column]
            files = [p for p in (_path_of(v) for v in _as_list(value, self.column)) if p is not None]
            named = f" ({', '.join(str(_resolve(p, self.root)) for p in files)})" if files else ""
            raise KTOPipelineError(
                f"row {source_row} of {where}: its image(s){named} changed since the cache was made "
                f"({len(now)} image(s) now, {len(hashes)} hashed; the pixels differ). Restore the images, or "
                "precompute a new cache."
            )

    def filler(self) -> tuple[list[int], dict]:
        """(prompt ids, image tensors) of a one-image prompt of a blank picture: a sharded reference's filler forward
        must run the vision tower as the other processes' forwards do (each of its sharded layers gathers its weights
        in every process at once)."""
        from PIL import Image

        blank = Image.new("RGB", (32, 32))
        placeholder, _ = image_token(self.processor)
        ids = self.processor(images=[blank], text=[placeholder], add_special_tokens=False)["input_ids"][0]
        return [int(t) for t in ids], dict(self.processor.image_processor(images=[blank], return_tensors="pt"))

    def pixels(self, source_row: int) -> dict:
        """Row `source_row`'s images through the image processor: {name: tensor} with one entry per image along dim
        0 (for LLaVA: pixel_values (images, 3, H, W)). Read and processed at each call: nothing is held."""
        images = self.images(source_row)
        return dict(self.processor.image_processor(images=images, return_tensors="pt")) if images else {}
