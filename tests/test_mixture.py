"""data.mix: sources drawn by weight, in an order that is the sampler's pure function, so a
mixture trains like one process and resumes exactly at another world size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from allhands.config import validate
from allhands.data import GlobalSampler, load_training_data, prepare
from allhands.data.mixture import MixtureDataset
from allhands.data.shards import embedded_text
from allhands.errors import ConfigError, DataError
from allhands.launch.launcher import LaunchSpec, train_job

from conftest import tiny_config
from test_parity import max_rel_diff, reference_params, trained_params


@pytest.fixture(scope="module")
def second_dir(tmp_path_factory) -> Path:
    """Another byte-tokenized source: different text, fewer samples than the fixture's."""
    out = tmp_path_factory.mktemp("code")
    prepare([d.upper() for d in embedded_text().split("\n\n")[300:360]], out, val_fraction=0.1)
    return out


def mix_config(token_dir, second_dir, run_dir, *extra):
    return tiny_config(token_dir, run_dir, "data.path=", f"data.mix={token_dir}:3,{second_dir}:1",
                       *extra)


def test_per_source_counts_match_the_weights(token_dir, second_dir, tmp_path):
    cfg = mix_config(token_dir, second_dir, tmp_path)
    train, val, vocab = load_training_data(cfg)
    assert isinstance(train, MixtureDataset) and isinstance(val, MixtureDataset) and vocab == 257
    n = [len(s) for s in train.sources]
    assert n[0] > 3 * n[1]  # the small source is up-weighted: its samples repeat
    # one epoch of the sampler draws each source exactly by weight (3:1 of all slots)
    sampler = GlobalSampler(len(train), 8, cfg.data.seed)
    drawn = [train.source_of(i)[0] for i in sampler.indices(0, len(train))]
    assert [drawn.count(0), drawn.count(1)] == train.shares
    assert abs(train.shares[0] / len(train) - 0.75) < 1 / len(train)
    # and any window of steps close to it
    window = [train.source_of(i)[0] for i in sampler.indices(8 * 40, 8 * 50)]
    assert abs(window.count(1) / len(window) - 0.25) < 0.05
    # slots map onto every sample of the small source, near-equally often
    picks = [train.source_of(i)[1] for i in range(len(train)) if train.source_of(i)[0] == 1]
    counts = torch.bincount(torch.tensor(picks), minlength=n[1])
    assert int(counts.min()) >= 1 and int(counts.max() - counts.min()) <= 1
    for slot in (0, train.shares[0], len(train) - 1):  # a slot holds its source's sample
        s, j = train.source_of(slot)
        assert torch.equal(train[slot][0], train.sources[s][j][0])


def test_mixture_trains_like_one_process_and_resumes_at_another_world_size(token_dir, second_dir,
                                                                          tmp_path):
    cfg = mix_config(token_dir, second_dir, tmp_path / "full", "checkpoint.interval=2",
                     "checkpoint.keep_last=5")
    done = train_job(cfg, LaunchSpec(nproc=2))
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000004")
    train_job(cfg, LaunchSpec(nproc=1), resume=str(cut))  # 2 workers -> 1 at step 2
    ref = reference_params(done)
    assert max_rel_diff(trained_params(done), ref) <= 1e-5
    done.run.dir = str(cut)
    assert max_rel_diff(trained_params(done), ref) <= 1e-5
    # the mixture changes what is learned: not the same run as the first source alone
    alone = tiny_config(token_dir, tmp_path / "alone")
    assert max_rel_diff(reference_params(alone), ref) > 1e-3


def test_bad_mixtures_are_named(token_dir, second_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"^data.mix: .* replaces data.path"):
        validate(tiny_config(token_dir, tmp_path, f"data.mix={second_dir}:1"))
    with pytest.raises(ConfigError, match=r"^data.mix: '.*:0' is not allowed; each item is DIR:WEIGHT"):
        validate(tiny_config(token_dir, tmp_path, "data.path=", f"data.mix={token_dir}:1,{second_dir}:0"))
    with pytest.raises(ConfigError, match=r"^data.mix: '/nonexistent' has no meta.json"):
        validate(tiny_config(token_dir, tmp_path, "data.path=", "data.mix=/nonexistent:1"))
    other = tmp_path / "other"
    shutil.copytree(second_dir, other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps(meta | {"tokenizer_id": "another"}))
    with pytest.raises(DataError, match="different tokenizers"):
        load_training_data(tiny_config(token_dir, tmp_path, "data.path=",
                                       f"data.mix={token_dir}:1,{other}:1"))
