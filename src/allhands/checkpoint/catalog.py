"""What a checkpoint directory holds, read without loading it: the committed ``step-N``
directories, ``allhands.json`` (format version, step, resolved config) and whether a config may
resume from it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from allhands.errors import CheckpointError, ConfigError, first_line

_STEP_DIR = re.compile(r"^step-(\d{8})$")
# allhands.json in every checkpoint: the format version, the step and the resolved config.
META_NAME = "allhands.json"
FORMAT_VERSION = 2  # 2: optimizer param_groups packed per parameter (_pack_param_groups)


def committed(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / ".metadata").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)



# Fields that change the shapes of saved tensors or the meaning of the saved data cursor (the
# sample order is a function of data.seed and run.global_batch) or of the sync strategy's state.
# Everything else (optim.*, run.steps, intervals, fault.*, world size) may change on resume.
INCOMPATIBLE = ("model.n_layer", "model.n_head", "model.n_embd", "model.seq_len", "model.vocab_size",
                "model.bias", "data.seed", "run.global_batch", "parallel.sync")


def check_compatible(path: Path, config: dict[str, dict[str, Any]]) -> None:
    """Refuse to resume ``path`` with a config whose incompatible fields differ from the saved
    one, naming every differing field in one line. Checkpoints without ``allhands.json`` pass."""
    meta_file = path / META_NAME
    if not meta_file.is_file():
        return
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(meta_file)!r} is unreadable ({first_line(e)}); use another "
                              f"checkpoint") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format {meta.get('format')!r}, this "
                              f"allhands reads format {FORMAT_VERSION}; use a matching allhands")
    saved = meta.get("config") or {}
    diffs = []
    for dotted in INCOMPATIBLE:
        sec, name = dotted.split(".")
        if name not in saved.get(sec, {}) or name not in config.get(sec, {}):
            continue
        if saved[sec][name] != config[sec][name]:
            diffs.append(f"{dotted} (saved {saved[sec][name]!r}, now {config[sec][name]!r})")
    if diffs:
        raise ConfigError(f"{diffs[0].split(' ')[0]}: the config differs from checkpoint "
                          f"{str(path)!r} in {', '.join(diffs)}; these change the model or data "
                          f"order, so resume with the saved values or start a new run.dir")
