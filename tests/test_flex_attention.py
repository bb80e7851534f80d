"""Document masks through FlexAttention (the CUDA path) and through SDPA's dense mask (the CPU
path): the path chosen by device, the two giving the same attention and logits on packed rows,
and the dense mask in the queries' dtype (bf16 under FSDP's mixed precision).

flex_attention runs forward on CPU (eager, torch 2.13) but has no backward there, so the flex
path is forced here under ``torch.no_grad``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from allhands.models import layers
from allhands.models.layers import Attention, attention_path, document_mask, rope_table, rope_frequencies
from allhands.models.llama import Llama, LlamaConfig

EOT = 9
# eager flex_attention says it is unfused; these tests want exactly that reference
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _packed(B: int, T: int, ends: list[list[int]], seed: int = 0) -> torch.Tensor:
    """Rows ``(B, T)`` of random tokens (never EOT) with EOT at ``ends[b]``: several documents
    a row, some crossing the 128-token blocks of a BlockMask."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(10, 60, (B, T), generator=g)
    for b, row in enumerate(ends):
        idx[b, row] = EOT
    return idx


ENDS = [[5, 40, 127, 128, 190, 199], [90, 150, 151, 160]]


def test_the_path_is_flex_on_cuda_and_sdpa_on_cpu():
    assert attention_path("cuda") == "flex"
    assert attention_path(torch.device("cuda", 1)) == "flex"
    assert attention_path("cpu") == "sdpa"
    assert attention_path(torch.device("meta")) == "sdpa"
    idx = _packed(2, 200, ENDS)
    _, dense = document_mask(idx, EOT)  # on CPU: the dense additive mask
    assert isinstance(dense, torch.Tensor) and dense.shape == (2, 1, 200, 200)
    _, block = document_mask(idx, EOT, path="flex")
    assert isinstance(block, BlockMask) and block.shape == (2, 1, 200, 200)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
def test_flex_attention_equals_the_dense_mask(heads, kv_heads):
    torch.manual_seed(0)
    T, hd = 200, 16
    attn = Attention(64, heads, kv_heads, hd).eval()
    idx = _packed(2, T, ENDS)
    pos, dense = document_mask(idx, EOT, path="sdpa")
    pos_f, block = document_mask(idx, EOT, path="flex")
    assert torch.equal(pos, pos_f)
    cos, sin = rope_table(rope_frequencies(hd, 10000.0), T)
    cos, sin = cos[pos], sin[pos]
    x = torch.randn(2, T, 64)
    with torch.no_grad():
        want = attn(x, cos, sin, dense)
        got = attn(x, cos, sin, block)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_llama_logits_are_the_same_on_both_paths(kv_heads, monkeypatch):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads,
                              seq_len=256, doc_token=EOT)).eval()
    idx = _packed(2, 200, ENDS)
    with torch.no_grad():
        want = model(idx)
        monkeypatch.setattr(layers, "attention_path", lambda device: "flex")
        got = model(idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_block_mask_keeps_each_token_in_its_document():
    idx = torch.tensor([[1, 2, EOT, 3, 4, 5, EOT, 6]])
    _, block = document_mask(idx, EOT, path="flex")
    _, dense = document_mask(idx, EOT, path="sdpa")
    allowed = block.mask_mod(torch.tensor(0), torch.tensor(0), torch.arange(8)[:, None],
                             torch.arange(8)[None, :])
    assert torch.equal(allowed, dense[0, 0] == 0)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_the_dense_mask_has_the_queries_dtype_in_bf16(kv_heads, monkeypatch):
    """Under FSDP's bf16 mixed precision the parameters, the hidden state and q are bf16: a
    float32 mask next to bf16 q is refused by SDPA's memory-efficient CUDA kernel (the MHA case),
    so the model builds its mask in bf16."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads,
                      seq_len=256, doc_token=EOT)
    ref = Llama(cfg).eval()
    model = Llama(cfg).eval()
    model.load_state_dict(ref.state_dict())
    model.to(torch.bfloat16)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, **kw):
        seen.append((q.dtype, None if attn_mask is None else attn_mask.dtype))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    idx = _packed(2, 200, ENDS)
    with torch.no_grad():
        want = ref(idx)
        monkeypatch.setattr(F, "scaled_dot_product_attention", record)
        got = model(idx)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * cfg.n_layers
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.0, atol=2e-2)


def test_attention_casts_a_float32_mask_to_bf16_queries():
    """A mask made in another dtype (e.g. float32 under bf16 autocast) still works."""
    torch.manual_seed(0)
    attn = Attention(64, 4, 4, 16).to(torch.bfloat16)
    idx = _packed(1, 64, [[10, 30]])
    pos, mask32 = document_mask(idx, EOT)
    _, mask16 = document_mask(idx, EOT, dtype=torch.bfloat16)
    cos, sin = rope_table(rope_frequencies(16, 10000.0), 64)
    x = torch.randn(1, 64, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(attn(x, cos[pos], sin[pos], mask32), attn(x, cos[pos], sin[pos], mask16))
