"""A trained EAGLE head through small files and back: how a head trained on a lent GPU comes home.

A device call returns at most 16 MiB a file, and a head's ``model.safetensors`` holds a copy of the
target's input embedding (49,152 x 576 for SmolLM2). ``pack`` writes the head without that copy, in
bfloat16, split into parts small enough to come back; ``unpack`` puts the target's embedding back and
rebuilds an ordinary float32 head directory that ``draftsmith eval --draft`` loads. Used by
``bench/gpu_eagle3.py``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith import files

EMBEDDING = "embed_tokens.weight"
TEXT_FILES = ("config.json", "train_state.json", "train_config.yaml")


def embedding_digest(weight: torch.Tensor) -> str:
    """sha256 of an embedding rounded to bfloat16: a bf16 target on the GPU and the float32 one here agree."""
    data = weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def pack(draft_dir: Path, out: Path, max_mb: float) -> list[Path]:
    """The head minus the target's embedding, bfloat16 floats, in files of at most ``max_mb`` MB.

    A tensor larger than that is cut into row blocks named ``NAME@i``; ``manifest.json`` records the
    digest of the embedding left out, so ``unpack`` refuses a target whose embedding is another.
    """
    out.mkdir(parents=True, exist_ok=True)
    limit = int(max_mb * 1e6)
    pieces: list[tuple[str, torch.Tensor]] = []
    digest = None
    with safe_open(str(draft_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if name == EMBEDDING:
                digest = embedding_digest(tensor)
                continue
            if tensor.is_floating_point():
                tensor = tensor.to(torch.bfloat16)
            row_bytes = max(1, tensor[0].numel() * tensor.element_size()) if tensor.ndim else 1
            if tensor.ndim and tensor.numel() * tensor.element_size() > limit:
                rows = max(1, limit // row_bytes)
                pieces += [(f"{name}@{i}", block) for i, block in enumerate(tensor.split(rows))]
            else:
                pieces.append((name, tensor))
    if digest is None:
        raise ValueError(f"{draft_dir} holds no {EMBEDDING}: not an EAGLE head saved by `draftsmith train`")
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in pieces:
        nbytes = tensor.numel() * tensor.element_size()
        if parts[-1] and size + nbytes > limit:
            parts.append({})
            size = 0
        parts[-1][name] = tensor.contiguous()
        size += nbytes
    written = []
    for i, part in enumerate(parts):
        path = out / f"head-{i:02d}.safetensors"
        files.write_with(path, lambda tmp, part=part: save_file(part, str(tmp)))
        written.append(path)
    files.write_text(
        out / "manifest.json", json.dumps({"embedding_bf16_sha256": digest, "files": len(parts)})
    )
    for name in TEXT_FILES:
        if (draft_dir / name).exists():
            files.copy_file(draft_dir / name, out / name)
    return written


def unpack(parts_dir: Path, draft_dir: Path, target) -> Path:
    """Rebuild a float32 head directory from ``pack``'s files and ``target``'s own embedding."""
    from draftsmith.drafts import build_drafter

    manifest = json.loads((parts_dir / "manifest.json").read_text())
    paths = sorted(parts_dir.glob("head-*.safetensors"))
    if len(paths) != manifest["files"]:
        raise FileNotFoundError(f"{parts_dir} holds {len(paths)} of the {manifest['files']} head files")
    blocks: dict[str, dict[int, torch.Tensor]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                tensor = tensor.float() if tensor.is_floating_point() else tensor
                base, _, index = name.partition("@")
                if index:
                    blocks.setdefault(base, {})[int(index)] = tensor
                else:
                    tensors[name] = tensor
    for base, parts in blocks.items():
        tensors[base] = torch.cat([parts[i] for i in range(len(parts))])
    embedding = target.model.get_input_embeddings().weight.detach().clone().float()
    if embedding_digest(embedding) != manifest["embedding_bf16_sha256"]:
        raise ValueError(
            f"the head in {parts_dir} was trained with another token embedding than {target.name}'s "
            "(another target, or an embedding that changed in training): bring its model.safetensors whole"
        )
    tensors[EMBEDDING] = embedding

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        for name in TEXT_FILES:
            if (parts_dir / name).exists():
                shutil.copyfile(parts_dir / name, tmp / name)

    files.replace_dir(draft_dir, fill)
    build_drafter(str(draft_dir), target)  # loads it, checking it against this target
    return draft_dir
