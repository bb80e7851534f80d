"""Consolidated full weights in and out: ``allhands export RUN_DIR --out model.safetensors``
(or ``--format hf``: a transformers directory of the run's family, hf.py), ``checkpoint.init_from`` and
:func:`load_weights`, the one way to put saved weights (a .safetensors file, a transformers
directory or a committed checkpoint directory) into a plain module.

Export needs neither processes nor the model's code: the checkpoint's DCP metadata lists every
model tensor with its global shape and dtype, so empty tensors of those shapes are allocated and
DCP fills them from whatever layout wrote the checkpoint (shards of FSDP, TP, ZeRO-1 or plain
replicas), in this one process. The result is ``{fqn: tensor}`` with the single-device module's
parameter names, the format ``nn.Module.load_state_dict`` and Hugging Face tools read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


from allhands.checkpoint.catalog import committed
from allhands.checkpoint.hf import write_hf
from allhands.checkpoint.manifest import MANIFEST_NAME, verify_manifest
from allhands.checkpoint.safe import SafeFileSystemReader, checkpoint_error_from
from allhands.config import load_config, parse_mix
from allhands.data.tokenizer import CHAT_TEMPLATE_FILE, EOT, TOKENIZER_CONFIG, byte_tokenizer_json
from allhands.errors import CheckpointError, ConfigError, cannot_write
from allhands.models.hf import is_hf_dir, load_hf

# ModelOptimState saves {"model": model_state, "optim": ...} under the checkpoint key "model".
_PREFIX = "model.model."


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full model tensors of the committed checkpoint directory ``path``."""
    verify_manifest(path)
    reader = SafeFileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    sd = {k[len(_PREFIX):]: torch.empty(m.size, dtype=m.properties.dtype)
          for k, m in meta.items() if k.startswith(_PREFIX) and isinstance(m, TensorStorageMetadata)}
    if not sd:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no model tensors; it was not written "
                              f"by `allhands train`")
    reader = SafeFileSystemReader(path)
    try:
        dcp.load({"model": {"model": sd}}, storage_reader=reader, no_dist=not dist.is_initialized())
    except BaseException as e:  # DCP's CheckpointException, wrapping a refused item, is one
        refused = None if isinstance(e, (KeyboardInterrupt, SystemExit)) else checkpoint_error_from(e, reader)
        if refused is None:
            raise
        raise refused from None
    return sd


def _saved(run_dir: str | os.PathLike, step: int | None) -> tuple[int, Path]:
    """(step, directory) of ``run_dir``'s latest committed checkpoint, or of ``step``'s."""
    found = committed(Path(run_dir) / "checkpoints")
    if not found:
        raise ConfigError(f"export: {str(run_dir)!r} has no committed checkpoint; pass a run "
                          f"directory of `allhands train` that saved one")
    if step is not None:
        found = [(s, p) for s, p in found if s == step]
        if not found:
            raise ConfigError(f"--step: {str(run_dir)!r} has no committed checkpoint at step {step}")
    return found[-1]


def export_weights(run_dir: str | os.PathLike, out: str | os.PathLike, step: int | None = None) -> Path:
    """Write the model weights of ``run_dir``'s latest (or ``step``'s) checkpoint to ``out``, a
    .safetensors file: any other suffix is refused, since the file would not be what it says."""
    if Path(out).suffix != ".safetensors":
        raise ConfigError(f"--out: {str(out)!r} does not end in .safetensors, the format export "
                          f"writes; name it e.g. {Path(out).stem or 'model'}.safetensors")
    saved_step, path = _saved(run_dir, step)
    sd = checkpoint_weights(path)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    try:  # Python's open names the cause (safetensors' own I/O error does not, in one line)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb"):
            pass
    except OSError as e:
        raise ConfigError(f"--out: {cannot_write(out, e)}; pass a path in a writable "
                          f"directory") from None
    from safetensors.torch import save_file  # only to export: training runs without safetensors

    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp),
              metadata={"format": "pt", "allhands_step": str(saved_step)})
    os.replace(tmp, out)  # a reader never sees half a file
    return out


def _run_tokenizer(cfg) -> tuple[tuple[str, str, int] | None, str]:
    """(tokenizer.json text, end-of-document token, id) of the data a run trained on, or None
    and why not."""
    data = parse_mix(cfg.data.mix)[0][0] if cfg.data.mix else cfg.data.path
    try:
        meta = json.loads((Path(data) / "meta.json").read_text())
    except (OSError, ValueError):
        return None, f"no tokenizer written: the run's data {data!r} is gone"
    if meta.get("tokenizer") == "byte":
        return (byte_tokenizer_json(), EOT, meta.get("eot", 256)), ""
    return ((Path(data) / meta["tokenizer_file"]).read_text(), meta["eot_token"], meta["eot"]), ""


def export_hf(run_dir: str | os.PathLike, out: str | os.PathLike, step: int | None = None,
              max_shard_size: str | int = "5GB") -> tuple[Path, str]:
    """Write ``run_dir``'s model as a transformers directory ``out`` (sharded above
    ``max_shard_size``) with the tokenizer it was trained with; returns (out, a note when the
    tokenizer could not be found)."""
    resolved = Path(run_dir) / "config.resolved.toml"
    if not resolved.is_file():
        raise ConfigError(f"export: {str(run_dir)!r} has no config.resolved.toml; pass a run "
                          f"directory made by `allhands train`")
    cfg = load_config(resolved)
    saved_step, path = _saved(run_dir, step)
    tokenizer, note = _run_tokenizer(cfg)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {str(out)!r} is a file; --format hf writes a directory")
    write_hf(out, checkpoint_weights(path), cfg.model, saved_step, tokenizer, max_shard_size,
             cfg.moe)
    if tokenizer is not None:
        _copy_tokenizer_config(cfg, out)
    return out, note


def _copy_tokenizer_config(cfg, out: Path) -> None:
    """A tokenizer directory's own config and chat template (``prepare --tokenizer HF_DIR``
    stores them beside the data) over the generic config written above, so that the exported
    model keeps its special tokens and chat template."""
    data = Path(parse_mix(cfg.data.mix)[0][0] if cfg.data.mix else cfg.data.path)
    for name in (TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE):
        if (data / name).is_file():
            shutil.copyfile(data / name, out / name)


def sharded_loader(path: str | os.PathLike,
                   device: torch.device | str = "cpu") -> Callable[[nn.Module], nn.Module] | None:
    """For a transformers directory, the function that fills a model already cut for this rank
    (a pipeline stage, FSDP or tensor-parallel DTensor shards) with just the slices it holds,
    read from the files by slice (models/hf.py); a part still on the meta device is first
    allocated on ``device``, shards only. None for the other sources, which
    :func:`load_weights` reads whole into the uncut model."""
    if not is_hf_dir(Path(path)):
        return None

    def load(part: nn.Module) -> nn.Module:
        if any(t.is_meta for t in part.parameters()):
            part.to_empty(device=device)
            for m in part.modules():  # buffers computed from the config (the RoPE table)
                if callable(getattr(m, "init_buffers", None)):
                    m.init_buffers()
        return load_hf(part, Path(path))

    return load


def check_init_from(path: str | os.PathLike) -> None:
    """Before any worker starts: a directory in ``checkpoint.init_from`` is one that
    :func:`load_weights` reads, a transformers directory or a committed checkpoint; anything else
    is a ConfigError saying what was looked for and what the directory holds instead."""
    p = Path(path)
    if not path or not p.is_dir() or is_hf_dir(p) or (p / MANIFEST_NAME).is_file() or (p / ".metadata").is_file():
        return  # a file, or a directory load_weights reads (and names what is wrong inside it)
    names = sorted(f.name for f in p.iterdir())
    fix = "pass one of those, or a .safetensors file from `allhands export`"
    saved = committed(p / "checkpoints")
    if saved:
        holds, fix = "it is a run directory", f"pass one of its checkpoints, e.g. {str(saved[-1][1])!r}"
    elif "config.json" in names:
        holds = "it has config.json but no safetensors weights"
        if any(n.endswith(".bin") for n in names):  # transformers' pickled weights: never loaded
            fix = "save the model again with save_pretrained(..., safe_serialization=True)"
    elif names:
        holds = "it holds " + ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    else:
        holds = "it is empty"
    raise ConfigError(f"checkpoint.init_from: {str(p)!r} is neither a transformers directory "
                      f"(config.json with model.safetensors or model.safetensors.index.json) nor an "
                      f"allhands checkpoint (manifest.json, as in RUN/checkpoints/step-N): {holds}; "
                      f"{fix}")


def load_weights(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Copy saved weights into a plain (not yet parallelized) ``model``: ``path`` is a
    .safetensors file (``allhands export``), a transformers directory of the model's family
    (``allhands export --format hf``, or one from the Hub: models/hf.py reads it tensor by tensor)
    or a committed checkpoint directory. Every parameter and buffer must be there with its shape."""
    if is_hf_dir(Path(path)):
        return load_hf(model, Path(path))
    own = model.state_dict()
    if Path(path).is_dir():
        sd = checkpoint_weights(Path(path))
    else:
        from safetensors import SafetensorError  # only for a .safetensors init_from
        from safetensors.torch import load_file
        try:
            sd = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"checkpoint.init_from: {str(path)!r} is not a readable "
                                  f".safetensors file ({e}); pass a file written by `allhands "
                                  f"export`") from None
    missing = sorted(set(own) - set(sd))
    unexpected = sorted(set(sd) - set(own))
    shapes = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (e.g. {missing[0]!r})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]!r})")
        if shapes:
            k = shapes[0]
            parts.append(f"{len(shapes)} of another shape (e.g. {k!r}: file {tuple(sd[k].shape)}, "
                         f"model {tuple(own[k].shape)})")
        raise CheckpointError(f"checkpoint.init_from: {str(path)!r} does not fit the model: "
                              f"{', '.join(parts)} tensors; use the model config it was exported from")
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(sd[k])
    return model
