"""Document-masked packing (data.packing): rows of whole documents, attention and positions kept
inside each document, and a packed row's loss equal to its documents' losses one at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from allhands.data.packing import IGNORE, PackedDataset, pack_rows
from allhands.models.layers import document_mask
from allhands.models.llama import Llama, LlamaConfig

EOT = 9


def _model(doc_token: int = EOT) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32,
                             doc_token=doc_token))


def test_rows_hold_whole_documents_in_stream_order():
    # documents of 3, 5, 2 and 12 tokens (with their end tokens) in rows of 8
    ends = np.array([2, 7, 9, 21])
    assert pack_rows(ends, 22, 8, one_per_row=False).tolist() == [[0, 8], [8, 2], [10, 8], [18, 4]]
    assert pack_rows(ends, 22, 8, one_per_row=True).tolist() == [[0, 3], [3, 5], [8, 2], [10, 8], [18, 4]]


def test_positions_restart_and_attention_stays_in_its_document():
    idx = torch.tensor([[1, 2, EOT, 3, 4, 5, EOT, 6]])
    pos, mask = document_mask(idx, EOT)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    m = mask[0, 0] == 0  # additive: 0 where attention is allowed, -inf elsewhere
    assert m[4].tolist() == [False, False, False, True, True, False, False, False]
    assert m[2].tolist() == [True, True, True, False, False, False, False, False]  # its end token is its own


def test_no_information_flows_across_a_document_boundary():
    """Changing a token of one document leaves every other document's logits unchanged."""
    model = _model().eval()
    row = torch.tensor([[1, 2, 3, EOT, 4, 5, 6, 7, EOT, 2, 2, EOT]])
    other = row.clone()
    other[0, 5] = 11  # inside the second document
    with torch.no_grad():
        a, b = model(row), model(other)
    assert torch.equal(a[0, :4], b[0, :4])  # the first document, before the change
    assert torch.equal(a[0, 9:], b[0, 9:])  # the third, after it
    assert not torch.equal(a[0, 5:9], b[0, 5:9])  # the changed one does change


def test_the_packed_loss_is_the_sum_of_the_documents_losses(tmp_path):
    docs = [[1, 2, 3, 4], [5, 6], [7, 1, 2, 3, 4, 5, 6]]
    stream = np.array([t for d in docs for t in (*d, EOT)], dtype=np.uint16)
    path = tmp_path / "train-000.bin"
    stream.tofile(path)
    ds = PackedDataset([(path, len(stream))], np.uint16, seq_len=19, eot=EOT)
    assert len(ds) == 1 and [d.tolist() for d in ds.documents(0)] == [[*d, EOT] for d in docs]
    x, y = ds[0]
    model = _model()
    with torch.no_grad():
        packed = F.cross_entropy(model(x[None])[0], y, reduction="sum")
        plain = _model(doc_token=-1)  # the same weights, no mask: one document at a time
        plain.load_state_dict(model.state_dict())
        total = sum(F.cross_entropy(plain(torch.tensor([d]))[0], torch.tensor([*d[1:], EOT]),
                                    reduction="sum") for d in docs)
    torch.testing.assert_close(packed, total, rtol=1e-5, atol=1e-5)
    assert int((y != IGNORE).sum()) == sum(len(d) for d in docs)


def test_padding_gives_each_document_a_row(tmp_path):
    stream = np.array([1, 2, EOT, 3, EOT, 4, 5, 6, EOT], dtype=np.uint16)
    path = tmp_path / "train-000.bin"
    stream.tofile(path)
    ds = PackedDataset([(path, len(stream))], np.uint16, seq_len=7, eot=EOT, packing="pad")
    assert len(ds) == 3
    x, y = ds[1]
    assert x.tolist() == [3, EOT, EOT, EOT, EOT, EOT, EOT]
    assert y.tolist() == [EOT] + [IGNORE] * 6


def test_mask_packing_needs_the_llama_family():
    from allhands.config import Config, ConfigError, apply_override, validate

    cfg = Config()
    apply_override(cfg, "data.packing=mask")
    with pytest.raises(ConfigError, match="data.packing: 'mask' needs the Llama family"):
        validate(cfg, need_data=False)


def test_two_workers_train_packed_documents_like_one_process(token_dir, tmp_path):
    """Rows hold different numbers of counted targets: the loss is the mean over the global
    batch's, so 2 data-parallel workers end where one process does."""
    from allhands.launch.launcher import LaunchSpec, train_job

    from conftest import tiny_config
    from test_parity import assert_matches_reference

    cfg = tiny_config(token_dir, tmp_path / "run", "model.family=llama", "model.n_kv_head=1",
                      "model.seq_len=32", "data.packing=mask")
    assert_matches_reference(train_job(cfg, LaunchSpec(nproc=2)), "2 workers, packed documents")
