"""The shapes the planner prices, for either shipped family (the reference GPT, the Llama family):
the matrices of one block and how tensor parallelism cuts them, the parameters every rank keeps
whole, the activations a block saves for backward and the element-wise traffic of a block.

One list of a block's matrices (:meth:`Decoder.matmuls`) gives its parameter count, its FLOPs
(``flops.decoder_flops_per_token``) and, on this machine, the matmul shapes the calibrated step
times. The Llama family differs from the GPT where it costs: grouped-query attention makes the
k and v projections ``n_kv_head x head_dim`` wide, SwiGLU has three ``C x H`` matrices, Llama 3
has an untied vocabulary head, and RMSNorm's separate scale, RoPE on q and k and SiLU-times-up
add element-wise passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from allhands.config import ModelConfig
from allhands.flops import decoder_flops_per_token


@dataclass(frozen=True)
class Decoder:
    family: str
    n_layer: int
    c: int  # model width
    t: int  # sequence length
    v: int  # vocabulary
    n_head: int
    n_kv: int
    hd: int  # head width
    ffn: int
    bias: bool  # gpt: biases on every linear and norm
    qkv_bias: bool  # llama: Qwen2's q/k/v bias
    qk_norm: bool  # llama: Qwen3's per-head q/k RMSNorm
    tie: bool

    @classmethod
    def of(cls, m: ModelConfig) -> "Decoder":
        """From a resolved ``model`` section (a preset already applied); vocabulary 0 is the byte
        tokenizer's 257."""
        llama = m.family == "llama"
        hd = (m.head_dim or m.n_embd // m.n_head) if llama else m.n_embd // m.n_head
        ffn = m.ffn_hidden or ((-(-8 * m.n_embd // 3 // 64) * 64) if llama else 4 * m.n_embd)
        return cls(m.family, m.n_layer, m.n_embd, m.seq_len, m.vocab_size or 257, m.n_head,
                   (m.n_kv_head or m.n_head) if llama else m.n_head, hd, ffn,
                   m.bias and not llama, m.qkv_bias and llama, m.qk_norm and llama, m.tie_embeddings)

    @property
    def llama(self) -> bool:
        return self.family == "llama"

    def matmuls(self) -> list[tuple[int, int, bool]]:
        """A block's matrices as ``(in, out, column-parallel)``: the column-parallel ones are cut
        over their outputs by tp (q/k/v, fc or gate/up), the others over their inputs."""
        c, q, kv = self.c, self.n_head * self.hd, self.n_kv * self.hd
        if not self.llama:
            return [(c, 3 * c, True), (c, c, False), (c, self.ffn, True), (self.ffn, c, False)]
        return [(c, q, True), (c, kv, True), (c, kv, True), (q, c, False),
                (c, self.ffn, True), (c, self.ffn, True), (self.ffn, c, False)]

    def block_params(self, tp: int) -> tuple[int, int]:
        """(parameters of one block on a tp rank, its tensor count): matrices and the biases of
        column-parallel ones / tp; norms and row-parallel biases whole (parallel/tensor.py)."""
        mats = self.matmuls()
        numel = sum(i * o for i, o, _ in mats) // tp
        tensors = len(mats) + 2  # and two norms' scales
        numel += 2 * self.c
        if self.bias:  # GPT: qkv and fc biases sharded; proj biases and the norms' biases whole
            numel += sum(o for _, o, col in mats if col) // tp + 2 * self.c + 2 * self.c
            tensors += 6
        if self.qkv_bias:
            numel += (self.n_head + 2 * self.n_kv) * self.hd // tp
            tensors += 3
        if self.qk_norm:  # one head's width each, replicated
            numel += 2 * self.hd
            tensors += 2
        return numel, tensors

    def first_params(self, tp: int) -> tuple[int, int]:
        """The first stage's extra: the token embedding (over the vocabulary) and the GPT's
        learned positions (replicated)."""
        if self.llama:
            return self.v * self.c // tp, 1
        return self.v * self.c // tp + self.t * self.c, 2

    def last_params(self, tp: int, pp: int) -> tuple[int, int]:
        """The last stage's extra: the final norm and the head (a separate tensor when untied,
        or the tied copy on the last of several stages)."""
        numel, tensors = self.c + self.c * self.bias, 1 + self.bias
        if not self.tie or pp > 1:
            numel, tensors = numel + self.v * self.c // tp, tensors + 1
        return numel, tensors

    def params(self) -> int:
        """All parameters of the model (tp = pp = 1)."""
        return (self.n_layer * self.block_params(1)[0] + self.first_params(1)[0]
                + self.last_params(1, 1)[0])

    def flops_per_token(self, n_layer: int | None = None, head: bool = True) -> int:
        """Training FLOPs per token of ``n_layer`` blocks (default: all), with the head or not."""
        return decoder_flops_per_token(
            n_layer=self.n_layer if n_layer is None else n_layer, n_embd=self.c, seq_len=self.t,
            vocab_size=self.v if head else 0, n_head=self.n_head, n_kv_head=self.n_kv,
            head_dim=self.hd, ffn_hidden=self.ffn, gated=self.llama)

    def act_values(self, ac: str, gpt_table: dict[str, float]) -> float:
        """Values a block saves per token, in units of C, by ``parallel.ac`` (without dropout).
        The GPT's are ``gpt_table`` (Korthikanti et al.'s counts). A Llama block, counted the
        same way from what autograd saves: each RMSNorm its input and its unscaled output
        (the scale is a separate multiply), each projection its input, SDPA q, k, v (k and v
        ``n_kv x hd`` wide) and its output, SwiGLU gate, silu(gate), up and their product
        (4 H); RoPE saves only its cos/sin tables, shared by every token's layer."""
        if not self.llama:
            return gpt_table[ac]
        if ac == "block":
            return 1.0
        c, q, kv, h = self.c, self.n_head * self.hd, self.n_kv * self.hd, self.ffn
        qk = 2 * (q + kv) / c if self.qk_norm else 0.0
        if ac == "selective":  # the block input and each matmul's and attention's output
            return 1 + (q + 2 * kv + q + c + 2 * h + c) / c + qk
        return 2 * 3 + (q + 2 * kv + q + 4 * h) / c + qk

    def ew_width(self) -> float:
        """Widths (in units of C) a block's element-wise ops read and write: the GPT's two norms,
        GELU over 4 C and two residual adds make 8, the width the planner's measured element-wise
        passes are counted against; a Llama block's two RMSNorms with their separate scale (4),
        RoPE's four ops over q and k, SiLU and the gate-times-up product over H and two adds."""
        if not self.llama:
            return 2 + self.ffn / self.c + 2
        rope = 4 * (self.n_head + self.n_kv) * self.hd / self.c
        return 4 + rope + 2 * self.ffn / self.c + 2 + (2 * rope / 4 if self.qk_norm else 0.0)

    def eager_ops(self) -> float:
        """Eager ops per block relative to the GPT's (the planner's measured per-op cost): a
        Llama block runs about twice as many (three projections and their views instead of one,
        RMSNorm's casts and scale, RoPE's six ops on q and on k, the gated feed-forward)."""
        return 2.0 if self.llama else 1.0

    def tp_modules(self, blocks: int, first: bool, last: bool) -> int:
        """Modules the TP plan parallelizes on a stage: the GPT's six a block (ln1, qkv, proj,
        ln2, fc, proj), a Llama's nine (two norms, q, k, v, o, gate, up, down; Qwen3's q/k norms
        two more); the embeddings (GPT: tokens and positions) and the final norm and head."""
        per = 9 + 2 * self.qk_norm if self.llama else 6
        return per * blocks + (1 if self.llama else 2) * first + 2 * last

    def partial_grads(self, blocks: int, last: bool, sequence_parallel: bool) -> int:
        """Parameters of a stage whose gradient is a Partial DTensor under TP: the sequence-
        parallel norms' (two a block, the final one on the last stage; the GPT's biases too) and,
        with or without sequence parallelism, Qwen3's per-head q/k norms, whose heads are split."""
        sp = (2 * blocks + last) * (1 + self.bias) if sequence_parallel else 0
        return sp + (2 * blocks if self.qk_norm else 0)
