"""transformers directories in and out, for every family: config.json -> our family config,
safetensors (one file, or shards with model.safetensors.index.json) -> our parameters, and back.

Reading is by slice: :func:`load_hf` fills each parameter of a module from the file, and when
the parameter is a DTensor (FSDP or tensor-parallel shard) it reads only this rank's block (by
positioned reads of its bytes; other shapes through ``safe_open(...).get_slice``), so a rank
never holds a full tensor it does not own. (The GPT-2
path regroups fused rows, so it reads whole tensors; the reference GPT is small.)

Python API: :func:`from_hf` builds our module from a directory; :func:`to_hf` writes one that
``AutoModelForCausalLM.from_pretrained`` opens offline.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.nn as nn

from allhands.errors import CheckpointError, ConfigError
from allhands.models import gpt_hf, llama_hf, moe_hf
from allhands.models.build import build_model
from allhands.models.gpt import GPT, GPTConfig
from allhands.models.init import local_block
from allhands.models.llama import Llama, LlamaConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
FAMILIES = ("gpt2", *llama_hf.ARCHITECTURES, *moe_hf.KINDS)
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def is_hf_dir(path: Path) -> bool:
    path = Path(path)
    return (path / CONFIG).is_file() and ((path / WEIGHTS).is_file() or (path / INDEX).is_file())


def read_config(path: Path) -> dict:
    try:
        c = json.loads((Path(path) / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint.init_from: {str(path)!r} has no readable {CONFIG} ({e})") from None
    if c.get("model_type") not in FAMILIES:
        raise ConfigError(f"checkpoint.init_from: config.json model_type={c.get('model_type')!r} "
                          f"is not supported (supported: {', '.join(FAMILIES)})")
    return c


def hf_config(path: Path, seq_len: int | None = None, bias: bool = True,
              dropout: float = 0.0) -> tuple[GPTConfig | LlamaConfig, int]:
    """(our family config, config.json's max positions) of a transformers directory.
    ``seq_len``: the Llama family's RoPE table (default: max_position_embeddings, or the sliding
    window when smaller); ``bias``/``dropout``: what the GPT keeps of the run's own config."""
    c = read_config(path)
    if c["model_type"] == "gpt2":
        fc = gpt_hf.from_gpt2_config(c, bias=bias, dropout=dropout)
        return fc, fc.seq_len
    positions = int(c.get("max_position_embeddings") or 0)
    if seq_len is None and c.get("sliding_window") and c.get("use_sliding_window", True):
        seq_len = min(positions or c["sliding_window"], c["sliding_window"])
    if c["model_type"] in moe_hf.KINDS:
        return moe_hf.from_hf_config(c, seq_len), positions
    return llama_hf.from_hf_config(c, seq_len), positions


class HFReader:
    """The tensors of a transformers directory by name, read whole or by slice, each file
    opened once."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if (self.path / INDEX).is_file():
            try:
                self.files = dict(json.loads((self.path / INDEX).read_text())["weight_map"])
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"checkpoint.init_from: {str(self.path / INDEX)!r} is not a "
                                      f"safetensors index ({e})") from None
        else:
            self.files = None
        self._open: dict[str, object] = {}
        self._headers: dict[str, tuple[int, dict]] = {}

    def _handle(self, file: str):
        if file not in self._open:
            # safetensors only where weights are read or written: training runs without it
            from safetensors import SafetensorError, safe_open
            try:
                self._open[file] = safe_open(str(self.path / file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"checkpoint.init_from: {str(self.path / file)!r} is not a "
                                      f"readable safetensors file ({e})") from None
        return self._open[file]

    def names(self) -> list[str]:
        if self.files is not None:
            return list(self.files)
        return list(self._handle(WEIGHTS).keys())

    def file_of(self, name: str) -> str:
        return self.files[name] if self.files is not None else WEIGHTS

    def _of(self, name: str):
        return self._handle(self.file_of(name))

    def close(self, file: str) -> None:
        """Unmap ``file``: the pages read through its memory map count in this process's RSS
        until then."""
        self._open.pop(file, None)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._of(name).get_slice(name).get_shape())

    def _layout(self, file: str) -> tuple[int, dict]:
        """(where the data starts, the header) of a safetensors file: an 8-byte little-endian
        header length, then a JSON header of ``{name: {dtype, shape, data_offsets}}``."""
        if file not in self._headers:
            with open(self.path / file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._headers[file] = (8 + n, json.loads(f.read(n)))
        return self._headers[file]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``name``, or its block ``index`` (one slice per dimension). A block of a
        matrix or vector is read with positioned reads of just its bytes, not through the
        memory map, so the rest of the file never enters this process's memory."""
        if index is None:
            return self._of(name).get_tensor(name)
        file = self.file_of(name)
        start, header = self._layout(file)
        meta = header[name]
        shape, dtype = meta["shape"], _DTYPES.get(meta["dtype"])
        if dtype is None or len(shape) > 2 or len(index) != len(shape):
            return self._of(name).get_slice(name)[index]
        rows, cols = (index[0], index[1]) if len(shape) == 2 else (slice(0, 1), index[0])
        width = shape[1] if len(shape) == 2 else shape[0]
        item = torch.empty((), dtype=dtype).element_size()
        base = start + meta["data_offsets"][0]
        n_cols = cols.stop - cols.start
        n_rows = rows.stop - rows.start
        buf = bytearray(n_rows * n_cols * item)  # filled in place: no second copy of the bytes
        with open(self.path / file, "rb") as f:
            if n_cols == width:  # whole rows: one contiguous range
                os.preadv(f.fileno(), [buf], base + rows.start * width * item)
            else:
                view = memoryview(buf)
                for i, r in enumerate(range(rows.start, rows.stop)):
                    os.preadv(f.fileno(), [view[i * n_cols * item:(i + 1) * n_cols * item]],
                              base + (r * width + cols.start) * item)
        out = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        return out.view(n_rows, n_cols) if len(shape) == 2 else out


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


def _fit_error(path: Path, missing: list[str], shapes: list[tuple[str, tuple, tuple]]) -> CheckpointError:
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {missing[0]!r})")
    if shapes:
        k, file, model = shapes[0]
        parts.append(f"{len(shapes)} of another shape (e.g. {k!r}: file {file}, model {model})")
    return CheckpointError(f"checkpoint.init_from: {str(path)!r} does not fit the model: "
                           f"{', '.join(parts)} tensors; use the model config it was exported from")


def _whole(m: Llama) -> bool:
    return m.tok_emb is not None and m.lm_head is not None and len(m.blocks) == m.cfg.n_layers


def _copy_rows(local: torch.Tensor, index: tuple[slice, ...] | None, read) -> None:
    """Fill ``local``, the block ``index`` of a global tensor (None: all of it), from
    ``read(block)``, rows in chunks of about 8 MiB, so the buffer a read fills stays small."""
    if index is None:
        index = tuple(slice(0, n) for n in local.shape)
    if local.dim() == 0:
        local.copy_(read(index))
        return
    step = max(1, (8 << 20) // max(1, local[:1].numel() * local.element_size()))
    for r in range(0, max(1, local.shape[0]), step):
        rows = slice(index[0].start + r, min(index[0].stop, index[0].start + r + step))
        local[r:r + step].copy_(read((rows, *index[1:])))


def load_hf(module: nn.Module, path: Path) -> nn.Module:
    """Copy the weights of transformers directory ``path`` into ``module`` (our model of the
    same family, whole, a pipeline stage of it, or with DTensor parameters: each rank reads
    only its own blocks). Every parameter of ``module`` must be in the file with its shape."""
    path = Path(path)
    c = read_config(path)
    reader = HFReader(path)
    own = module.state_dict()
    missing, shapes = [], []
    if c["model_type"] == "gpt2":  # fused, transposed rows: whole tensors through the name map
        full = {k: v.shape for k, v in own.items()}
        sd = gpt_hf.from_gpt2({n: reader.read(n) for n in reader.names()}, c.get("n_layer", 12),
                              c.get("n_head", 12), full)
        sources = {k: (lambda idx, k=k: sd[k][idx]) for k in sd}
        shape_of = {k: tuple(v.shape) for k, v in sd.items()}
        files = {}
    else:
        names = set(reader.names())
        sources, shape_of, files = {}, {}, {}
        experts = c.get("num_local_experts") or c.get("num_experts") or 0
        for k in own:
            if c["model_type"] in moe_hf.KINDS and moe_hf.is_moe_name(k):
                _moe_source(k, own[k], moe_hf.expert_names(k, c["model_type"], experts), names,
                            reader, sources, shape_of)
                continue
            try:
                theirs = llama_hf.hf_name(k)
            except KeyError:
                continue  # named as missing below
            if theirs not in names and theirs == llama_hf.TIED[0]:
                theirs = llama_hf.TIED[1]
            if theirs in names:
                sources[k] = lambda idx, n=theirs: reader.read(n, idx)
                shape_of[k] = reader.shape(theirs)
                files[k] = reader.file_of(theirs)
    if isinstance(module, Llama) and _whole(module):  # a stage holds a subset of the file
        used = {llama_hf.TIED[1]}
        for k in own:
            if c["model_type"] in moe_hf.KINDS and moe_hf.is_moe_name(k):
                used |= set(moe_hf.expert_names(k, c["model_type"], experts) or ())
            else:
                used.add(llama_hf.hf_name(k))
        extra = sorted(n for n in names - used if not n.endswith("rotary_emb.inv_freq"))
        if extra:
            raise CheckpointError(f"checkpoint.init_from: {str(path)!r} does not fit the model: "
                                  f"{len(extra)} unexpected (e.g. {extra[0]!r}) tensors; use the "
                                  f"model config it was exported from")
    for k, t in own.items():
        if k not in sources:
            missing.append(k)
        elif shape_of[k] != tuple(t.shape):
            shapes.append((k, shape_of[k], tuple(t.shape)))
    if missing or shapes:
        raise _fit_error(path, missing, shapes)
    # file by file, each unmapped when done, so at most one shard's pages are resident
    order = sorted(own, key=lambda k: files.get(k, ""))
    with torch.no_grad():
        for i, k in enumerate(order):
            _copy_rows(*local_block(own[k]), sources[k])
            if k in files and (i + 1 == len(order) or files.get(order[i + 1]) != files[k]):
                reader.close(files[k])
    return module


def _moe_source(k: str, t: torch.Tensor, theirs: list[str] | None, names: set[str],
                reader: HFReader, sources: dict, shape_of: dict) -> None:
    """How to read our MoE tensor ``k`` (like ``t``): one tensor of theirs, a stack of one per
    expert (a slice of ours reads the experts of its first index, each sliced by the rest), or,
    for the balancing bias, zeros."""
    if theirs is None:
        sources[k] = lambda idx, t=t: torch.zeros_like(t if idx is None else t[idx])
        shape_of[k] = tuple(t.shape)
    elif len(theirs) == 1 or not set(theirs) <= names:
        if theirs[0] in names:
            sources[k] = lambda idx, n=theirs[0]: reader.read(n, idx)
            shape_of[k] = reader.shape(theirs[0])
    else:
        def read(idx, ns=theirs):
            if idx is None:
                return torch.stack([reader.read(n) for n in ns])
            return torch.stack([reader.read(n, idx[1:]) for n in ns[idx[0]]])
        sources[k] = read
        shape_of[k] = (len(theirs), *reader.shape(theirs[0]))


def hf_tensors(sd: dict[str, torch.Tensor], fc: GPTConfig | LlamaConfig) -> dict[str, torch.Tensor]:
    """transformers' tensors of our full state dict ``sd``."""
    if isinstance(fc, GPTConfig):
        return gpt_hf.to_gpt2(sd, fc.n_layer, fc.n_head, fc.tie_embeddings)
    kind = moe_hf.kind_of(fc) if fc.moe.n_experts else ""
    out = {}
    for k, v in sd.items():
        if fc.tie_embeddings and k == "lm_head.weight":
            continue
        if kind and moe_hf.is_moe_name(k):
            theirs = moe_hf.expert_names(k, kind, fc.moe.n_experts)
            if theirs is not None:  # the balancing bias has no place in their files
                out.update(zip(theirs, [e.contiguous() for e in v] if len(theirs) > 1
                               else [v.contiguous()]))
            continue
        out[llama_hf.hf_name(k)] = v.contiguous()
    return out


def hf_config_json(fc: GPTConfig | LlamaConfig, max_positions: int = 0, bos: int | None = None,
                   eos: int | None = None) -> dict:
    if isinstance(fc, GPTConfig):
        return gpt_hf.gpt2_config(fc, fc.vocab_size, eos)
    if fc.moe.n_experts:
        return moe_hf.to_hf_config(fc, max_positions, bos, eos)
    return llama_hf.to_hf_config(fc, max_positions, bos, eos)


def shard_bytes(text: str | int) -> int:
    """``--max-shard-size``: bytes, or a number with KB/MB/GB (powers of 1000, as transformers)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", str(text).upper())
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size: {text!r} is not a size; pass e.g. 5GB, 500MB or bytes")
    unit = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9}[m.group(2)]
    return int(float(m.group(1)) * unit)


def write_hf_dir(out: Path, tensors: dict[str, torch.Tensor], config: dict,
                 max_shard_size: str | int = "5GB", metadata: dict | None = None) -> Path:
    """Write config.json and the weights: one model.safetensors, or
    model-0000i-of-0000n.safetensors shards of at most ``max_shard_size`` bytes each (a larger
    single tensor gets a shard of its own) with model.safetensors.index.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():  # shards of an earlier export would sit beside the new index
        if old.name in (WEIGHTS, INDEX) or _SHARD.match(old.name):
            old.unlink()
    limit = shard_bytes(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    meta = {"format": "pt", **(metadata or {})}
    from safetensors.torch import save_file  # only to export: training runs without safetensors

    if len(shards) == 1:
        save_file(shards[0], str(out / WEIGHTS), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / file), metadata=meta)
            weight_map.update({name: file for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": weight_map}, indent=1))
    # no generation_config.json: transformers derives it from config.json's token ids
    (out / CONFIG).write_text(json.dumps(config, indent=1))
    return out


def from_hf(path: str | os.PathLike, seq_len: int | None = None,
            dtype: torch.dtype = torch.float32) -> nn.Module:
    """Our module with the weights of the transformers directory ``path`` (LlamaForCausalLM,
    MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM,
    Qwen3MoeForCausalLM, Qwen2MoeForCausalLM or GPT2LMHeadModel), in ``dtype``."""
    fc, _ = hf_config(Path(path), seq_len)
    with torch.device("meta"):
        model = build_model(fc)
    model = model.to_empty(device="cpu").to(dtype)
    if isinstance(model, Llama):
        model.init_buffers()
    return load_hf(model, Path(path)).eval()


def to_hf(model: nn.Module, path: str | os.PathLike, max_shard_size: str | int = "5GB",
          bos: int | None = None, eos: int | None = None) -> Path:
    """Write our ``model`` (a Llama or GPT, whole and not parallelized) as a transformers
    directory ``path``."""
    if not isinstance(model, (Llama, GPT)):
        raise TypeError(f"to_hf takes allhands' Llama or GPT, not {type(model).__name__}")
    fc = model.cfg
    config = hf_config_json(fc, 0, bos, eos)
    config["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return write_hf_dir(Path(path), hf_tensors(model.state_dict(), fc), config, max_shard_size)
