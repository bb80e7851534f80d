"""The shapes the planner prices, for either shipped family (the reference GPT, the Llama family):
the matrices of one block and how tensor parallelism cuts them, the parameters every rank keeps
whole, the activations a block saves for backward and the element-wise traffic of a block.

One list of a block's matrices (:meth:`Decoder.matmuls`) gives its parameter count, its FLOPs
(``flops.decoder_flops_per_token``) and, on this machine, the matmul shapes the calibrated step
times. The Llama family differs from the GPT where it costs: grouped-query attention makes the
k and v projections ``n_kv_head x head_dim`` wide, SwiGLU has three ``C x H`` matrices, Llama 3
has an untied vocabulary head, and RMSNorm's separate scale, RoPE on q and k and SiLU-times-up
add element-wise passes.

A mixture of experts (``moe`` section) replaces the feed-forward of its MoE layers: a router
(``C x E``), ``E`` routed SwiGLU experts of width ``He`` of which each token passes ``top_k``,
and optionally a shared SwiGLU (width ``Hs``, Qwen2-MoE's sigmoid gate ``C``). Total parameters
count every expert, active ones (per token) ``top_k``; FLOPs are the active ones'. The routed
experts are split by ``parallel.ep``, not by tp: the layer runs whole on every tp rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from allhands.config import ModelConfig, MoEConfig
from allhands.flops import decoder_flops_per_token
from allhands.models.build import moe_args


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
    moe_layers: tuple[int, ...] = ()  # the layers whose feed-forward is a mixture of experts
    n_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0  # one routed expert's SwiGLU width
    shared_ffn: int = 0  # the shared experts' SwiGLU width (0: none)
    shared_gate: bool = False

    @classmethod
    def of(cls, m: ModelConfig, e: MoEConfig | None = None) -> "Decoder":
        """From a resolved ``model`` section (a preset already applied) and ``moe`` section;
        vocabulary 0 is the byte tokenizer's 257."""
        llama = m.family == "llama"
        hd = (m.head_dim or m.n_embd // m.n_head) if llama else m.n_embd // m.n_head
        ffn = m.ffn_hidden or ((-(-8 * m.n_embd // 3 // 64) * 64) if llama else 4 * m.n_embd)
        a = moe_args(e if llama else None)
        moe = dict(moe_layers=tuple(i for i in range(m.n_layer) if a.is_moe(i)), n_experts=a.n_experts,
                   top_k=a.top_k, expert_ffn=a.expert_hidden(ffn), shared_ffn=a.shared_width(ffn),
                   shared_gate=a.shared_gate) if a.n_experts else {}
        return cls(m.family, m.n_layer, m.n_embd, m.seq_len, m.vocab_size or 257, m.n_head,
                   (m.n_kv_head or m.n_head) if llama else m.n_head, hd, ffn,
                   m.bias and not llama, m.qkv_bias and llama, m.qk_norm and llama, m.tie_embeddings,
                   **moe)

    def moe_in(self, layers: range) -> int:
        """How many of ``layers`` are MoE layers."""
        return sum(1 for i in self.moe_layers if i in layers)

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

    def block_params(self, tp: int, moe: bool = False) -> tuple[int, int]:
        """(parameters of one block on a tp rank, its tensor count): matrices and the biases of
        column-parallel ones / tp; norms and row-parallel biases whole (parallel/tensor.py).
        An MoE block (``moe``) without its routed experts (:meth:`expert_params`): attention
        as a dense block's, the router, shared experts and their gate whole on every tp rank."""
        mats = self.matmuls()[:4] if moe else self.matmuls()
        numel = sum(i * o for i, o, _ in mats) // tp
        tensors = len(mats) + 2  # and two norms' scales
        if moe:
            numel += self.c * self.n_experts + 3 * self.c * self.shared_ffn + self.c * self.shared_gate
            tensors += 1 + 3 * (self.shared_ffn > 0) + self.shared_gate
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

    def expert_params(self) -> int:
        """Routed-expert parameters of one MoE layer, all ``E`` of them (three ``E x He x C``
        tensors, cut by ep over the experts)."""
        return 3 * self.n_experts * self.expert_ffn * self.c

    def layer_params(self, layer: int, tp: int = 1) -> int:
        """All parameters of ``layer`` on a tp rank, its routed experts included."""
        if layer in self.moe_layers:
            return self.block_params(tp, True)[0] + self.expert_params()
        return self.block_params(tp)[0]

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
        """All parameters of the model (tp = pp = 1), every expert of an MoE layer."""
        return (sum(self.layer_params(i) for i in range(self.n_layer)) + self.first_params(1)[0]
                + self.last_params(1, 1)[0])

    def active_params(self) -> int:
        """The parameters one token passes through: an MoE layer's ``top_k`` experts, not all."""
        routed = len(self.moe_layers) * 3 * (self.n_experts - self.top_k) * self.expert_ffn * self.c
        return self.params() - routed

    def moe_ffn_flops(self) -> int:
        """Training FLOPs per token of an MoE feed-forward: ``6 x`` its active matmul weights
        (router, ``top_k`` routed and the shared SwiGLU, the shared gate)."""
        return 6 * self.c * (3 * (self.top_k * self.expert_ffn + self.shared_ffn) + self.n_experts
                             + self.shared_gate)

    def flops_per_token(self, n_layer: int | None = None, head: bool = True,
                        moe_layers: int | None = None) -> int:
        """Training FLOPs per token of ``n_layer`` blocks (default: all) of which ``moe_layers``
        (default: the model's) are MoE layers, with the head or not."""
        n = self.n_layer if n_layer is None else n_layer
        k = len(self.moe_layers) if moe_layers is None else moe_layers
        dense = decoder_flops_per_token(
            n_layer=n, n_embd=self.c, seq_len=self.t, vocab_size=self.v if head else 0,
            n_head=self.n_head, n_kv_head=self.n_kv, head_dim=self.hd, ffn_hidden=self.ffn,
            gated=self.llama)
        return dense + k * (self.moe_ffn_flops() - 6 * 3 * self.c * self.ffn)

    def act_values(self, ac: str, gpt_table: dict[str, float]) -> float:
        """Values a block saves per token, in units of C, by ``parallel.ac`` (without dropout).
        The GPT's are ``gpt_table`` (Korthikanti et al.'s counts). A Llama block, counted the
        same way from what autograd saves: each RMSNorm its input and its unscaled output
        (the scale is a separate multiply), each projection its input, SDPA q, k, v (k and v
        ``n_kv x hd`` wide) and its output, and the feed-forward's (:meth:`ffn_act_values`);
        RoPE saves only its cos/sin tables, shared by every token's layer."""
        if not self.llama:
            return gpt_table[ac]
        if ac == "block":
            return 1.0
        c, q, kv = self.c, self.n_head * self.hd, self.n_kv * self.hd
        qk = 2 * (q + kv) / c if self.qk_norm else 0.0
        if ac == "selective":  # the block input and each matmul's and attention's output
            return 1 + (q + 2 * kv + q + c) / c + qk + self.ffn_act_values(ac)
        return 2 * 3 + (q + 2 * kv + q) / c + qk + self.ffn_act_values(ac)

    def ffn_act_values(self, ac: str, moe: bool = False) -> float:
        """A Llama feed-forward's part of :meth:`act_values` (units of C): SwiGLU's gate,
        silu(gate), up and their product (4 H), under the selective policy the gate's, up's and
        down's outputs. An MoE layer (``moe``) saves its router's scores (E) and, for each of a
        token's ``top_k`` routed rows, the row gathered for its expert and the expert's output
        (2 C) with the expert's SwiGLU (4 He), and the shared SwiGLU's 4 Hs."""
        c, k, he, hs, e = self.c, self.top_k, self.expert_ffn, self.shared_ffn, self.n_experts
        if ac == "block":
            return 0.0
        if ac == "selective":
            return ((k * (2 * he + c) + 2 * hs + e) if moe else 2 * self.ffn + c) / c
        return ((k * (4 * he + 2 * c) + 4 * hs + e) if moe else 4 * self.ffn) / c

    def moe_ew_values(self) -> float:
        """Values an MoE layer's element-wise work reads and writes per token, forward and
        backward (about twice the forward): a token's ``top_k`` rows gathered into expert order
        and scattered back (k C read and written each way), SwiGLU's silu and product over
        k He, the weighted combine of the k outputs."""
        k = self.top_k
        return 3 * (4 * k * self.c + 3 * k * self.expert_ffn + 2 * k * self.c)

    def layers_flops(self, layers: range, tp: int) -> float:
        """Training FLOPs per token of ``layers`` on a tp rank: tp splits attention and a dense
        feed-forward; an MoE feed-forward runs whole on every tp rank."""
        k = self.moe_in(layers)
        dense = self.flops_per_token(n_layer=len(layers), head=False, moe_layers=0)
        return (dense - k * 18 * self.c * self.ffn) / tp + k * self.moe_ffn_flops()

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


def flops_per_sample(m: ModelConfig, e: MoEConfig | None, vocab_size: int) -> int:
    """Training FLOPs of one ``seq_len`` sample of a shipped decoder from its shapes: the count of
    a model torch's counter cannot run on meta tensors (an MoE router's per-expert bincount);
    for the dense families it equals the counter's (tests/test_plan_llama.py)."""
    m = dataclasses.replace(m, vocab_size=m.vocab_size or vocab_size)
    return Decoder.of(m, e).flops_per_token() * m.seq_len
