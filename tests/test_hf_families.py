"""Each family against transformers' own implementation, on tiny random models built offline and
saved with save_pretrained: our logits equal theirs in fp32, import then export gives back the
same tensors bit for bit, transformers loads what we write (also sharded), both spellings of
the RoPE settings parse, and a field we do not implement is one line naming it."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from allhands.errors import ConfigError  # noqa: E402
from allhands.models.hf import INDEX, from_hf, to_hf  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}),
    "llama2-mha": lambda: transformers.LlamaConfig(**{**COMMON, "num_key_value_heads": 4},
                                                   tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**{**COMMON, "num_key_value_heads": 1},
                                              tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                            n_positions=64, activation_function="gelu_new"),
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _saved(tmp_path, name: str, families: dict | None = None, noise: float = 0.05):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config((families or FAMILIES)[name]()).eval()
    with torch.no_grad():
        for p in hf.parameters():  # norms and biases away from their init, so each one counts
            p.add_(noise * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    return hf, tmp_path / "hf"


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_equal_transformers_and_tensors_round_trip(tmp_path, name):
    hf, src = _saved(tmp_path, name)
    ours = from_hf(src)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    want = _logits(hf, ids)
    assert (_logits(ours, ids) - want).abs().max() <= 1e-5
    to_hf(ours, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True)
    assert (_logits(again.eval(), ids) - want).abs().max() <= 1e-5


def test_sharded_export_loads_in_transformers_and_back(tmp_path):
    hf, src = _saved(tmp_path, "llama3")
    ours = from_hf(src)
    to_hf(ours, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    ids = torch.randint(0, 96, (1, 20))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", local_files_only=True)
    assert (_logits(again.eval(), ids) - _logits(hf, ids)).abs().max() <= 1e-5
    back = from_hf(tmp_path / "sharded")
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_transformers4_rope_spelling_parses(tmp_path):
    hf, src = _saved(tmp_path, "llama3")
    c = json.loads((src / "config.json").read_text())
    rope = c.pop("rope_parameters")
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}  # the oldest spelling: "type"
    (src / "config.json").write_text(json.dumps(c))
    ids = torch.randint(0, 96, (2, 30))
    assert (_logits(from_hf(src), ids) - _logits(hf, ids)).abs().max() <= 1e-5


@pytest.mark.parametrize("name, edit, field", [
    ("llama3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type"),
    ("llama3", {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"rope_type": "dynamic",
                                                                            "factor": 2.0}},
     "rope_scaling.rope_type"),
    ("mistral", {"sliding_window": 16}, "sliding_window"),
    ("llama3", {"attention_bias": True}, "attention_bias"),
    ("llama3", {"hidden_act": "gelu"}, "hidden_act"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"model_type": "falcon"}, "model_type"),
])
def test_an_unsupported_field_is_one_line_naming_it(tmp_path, name, edit, field):
    _, src = _saved(tmp_path, name)
    c = json.loads((src / "config.json").read_text())
    c.update(edit)
    (src / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError) as e:
        from_hf(src, seq_len=64)  # longer than the sliding window: it would be active
    msg = str(e.value)
    assert msg.startswith("checkpoint.init_from: config.json ") and f" {field}=" in msg, msg
    assert "\n" not in msg


def _sharded_rank(rank: int, src: str, store_path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from allhands.models.build import build_model
    from allhands.models.hf import HFReader, hf_config, load_hf, local_block

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    reads: list[tuple] = []  # (name, [(start, stop) per dimension] or None) of every read
    real = HFReader.read
    HFReader.read = lambda self, name, index=None: reads.append(
        (name, index and [(i.start, i.stop) for i in index])) or real(self, name, index)
    fc, _ = hf_config(src)
    with torch.device("meta"):
        model = build_model(fc)
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_buffers()
    load_hf(model, src)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    HFReader.read = real
    # a column-sharded tensor (tensor parallel's row-wise split of o_proj) reads its columns
    name = "model.layers.0.self_attn.o_proj.weight"
    col = distribute_tensor(torch.zeros(fc.dim, fc.dim), mesh, [Shard(1)])
    local, index = local_block(col)
    local.copy_(HFReader(src).read(name, index))
    cols, o_proj = (index[1].start, index[1].stop), col.full_tensor()
    torch.save({"full": full, "reads": reads, "o_proj": o_proj, "cols": cols}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_each_rank_reads_only_its_own_slices(tmp_path):
    import torch.multiprocessing as mp

    from allhands.models.hf import HFReader

    hf, src = _saved(tmp_path, "qwen2")
    mp.spawn(_sharded_rank, args=(str(src), str(tmp_path / "store"), str(tmp_path / "out.pt")),
             nprocs=2, join=True)
    want = from_hf(src).state_dict()
    reader = HFReader(src)
    shapes = {n: reader.shape(n) for n in reader.names()}
    o_proj = load_file(str(src / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"out.pt.{rank}")
        for k, v in want.items():
            assert torch.equal(got["full"][k], v), (rank, k)
        # every tensor of the file read (the tied embedding once per parameter that holds it),
        # as this rank's rows of dimension 0 only (FSDP2's Shard(0): rank 0 the first
        # ceil(n / 2) rows, rank 1 the rest) and whole in the other dimensions
        assert {name for name, _ in got["reads"]} == set(shapes), rank
        for name, index in got["reads"]:
            n = shapes[name][0]
            rows = (0, -(-n // 2)) if rank == 0 else (-(-n // 2), n)
            assert index is not None and index[0] == rows, (rank, name, index)
            assert all(ix == (0, m) for ix, m in zip(index[1:], shapes[name][1:])), (rank, name, index)
        # and a column-sharded tensor (Shard(1)) its columns only
        assert got["cols"] == ((0, 16) if rank == 0 else (16, 32)), rank
        assert torch.equal(got["o_proj"], o_proj), rank


def test_train_from_a_transformers_llama_then_export_it(tmp_path, token_dir):
    """`allhands train` with checkpoint.init_from = a saved Llama (no model section), 2 steps on
    2 workers, then `allhands export --format hf`, which transformers loads."""
    from allhands.checkpoint import committed
    from allhands.checkpoint.export import checkpoint_weights
    from allhands.cli import main
    from conftest import tiny_config

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**COMMON, "vocab_size": 300}, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                    "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 16})
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    items = [f"{k}" for k in ("run.steps=2", "optim.warmup_steps=0")]
    c = tiny_config(token_dir, run, f"checkpoint.init_from={tmp_path / 'hf'}", *items)
    args = ["train", "--nproc", "2"] + [a for item in _sets(c) for a in ("--set", item)]
    assert main(args) == 0
    resolved = (run / "config.resolved.toml").read_text()
    assert 'family = "llama"' in resolved and "n_kv_head = 2" in resolved and 'rope_scaling = "llama3"' in resolved
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert type(back).__name__ == "LlamaForCausalLM" and back.config.rope_parameters["rope_type"] == "llama3"
    trained = checkpoint_weights(committed(run / "checkpoints")[-1][1])
    start = load_file(str(tmp_path / "hf" / "model.safetensors"))
    got = back.state_dict()
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], trained["blocks.0.mlp.up_proj.weight"])
    assert not torch.equal(got["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    # the resolved config alone builds the model (no init_from), and a resume continues the run
    from allhands.config import load_config
    from allhands.trainer import build_reference_model

    alone = load_config(run / "config.resolved.toml", ["checkpoint.init_from="])
    shapes = {k: v.shape for k, v in build_reference_model(alone, 257).state_dict().items()}
    assert shapes == {k: v.shape for k, v in trained.items()}
    assert main(["train", "--resume", str(run), "--set", "run.steps=4"]) == 0
    assert len(committed(run / "checkpoints")) >= 1 and committed(run / "checkpoints")[-1][0] == 4


def _sets(cfg) -> list[str]:
    """``--set`` items of every field that differs from the defaults."""
    from allhands.config import Config

    out, default = [], Config()
    for section, fields in cfg.to_dict().items():
        for name, value in fields.items():
            if getattr(getattr(default, section), name) != value:
                v = json.dumps(value) if not isinstance(value, str) else value
                out.append(f"{section}.{name}={v}")
    return out


@pytest.mark.parametrize("layout", [(), ("parallel.dp_shard=2", "parallel.dp_replicate=1", "parallel.zero=3"),
                                    ("parallel.pp=2", "parallel.pp_split=blocks.1")],
                         ids=["ddp", "fsdp", "pp"])
def test_init_from_fills_every_layout_with_the_file(tmp_path, token_dir, layout):
    """Each rank loads its cut of the model (whole, FSDP shards, a pipeline stage) from the
    directory; after one step at lr 1e-9 the weights are still the file's."""
    from allhands.checkpoint import committed
    from allhands.checkpoint.export import checkpoint_weights
    from allhands.launch.launcher import LaunchSpec, train_job
    from allhands.models.llama_hf import hf_name
    from conftest import tiny_config

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**{**COMMON, "vocab_size": 300}, head_dim=16)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    c = tiny_config(token_dir, tmp_path / "run", f"checkpoint.init_from={tmp_path / 'hf'}",
                    "run.steps=1", "optim.name=sgd", "optim.lr=1e-9", "optim.warmup_steps=0", *layout)
    train_job(c, LaunchSpec(nproc=2))
    trained = checkpoint_weights(committed(tmp_path / "run" / "checkpoints")[-1][1])
    file = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert len(trained) == len(file)
    for k, v in trained.items():
        assert torch.allclose(v, file[hf_name(k)], atol=1e-6, rtol=0), k


def test_a_file_with_more_than_the_model_holds_is_refused(tmp_path):
    import dataclasses

    from allhands.errors import CheckpointError
    from allhands.models import Llama
    from allhands.models.hf import hf_config, load_hf

    _, src = _saved(tmp_path, "llama3")
    fc, _ = hf_config(src)
    with pytest.raises(CheckpointError, match=r"1 unexpected|unexpected \(e\.g\. 'model\.layers\.1\."):
        load_hf(Llama(dataclasses.replace(fc, n_layers=1)), src)
    with pytest.raises(CheckpointError, match=r"of another shape"):
        load_hf(Llama(dataclasses.replace(fc, ffn_hidden=64)), src)
