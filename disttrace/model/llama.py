"""A LLaMA-style decoder as plain single-device PyTorch: RMSNorm, RoPE, SwiGLU, grouped-query attention,
untied embeddings, and optionally a mixture of experts in place of each block's FFN (token-choice top-k
routing over grouped SwiGLU experts, as torchtitan's MoE). No parallelism lives here: strategies apply it from outside (see disttrace/parallel/).
Module names follow torchtitan's LLaMA so a tensor-parallel plan can address them by path.
Head counts are read from weight shapes at run time, so a column-wise split of wq/wk/wv just works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    # x: (batch, seq, heads, head_dim); rotate each (even, odd) pair by its position's angle
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[1]][None, :, None, :], sin[: x.shape[1]][None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


def causal_attention(q, k, v):
    """Causal attention over (batch, heads, seq, head_dim). A strategy that splits the sequence replaces an
    Attention's `attend` with its own (keys and values gathered from the other ranks)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    attend = staticmethod(causal_attention)

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # -1: local heads under tensor parallel
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = (
            q.shape[2] // k.shape[2]
        )  # grouped-query attention: each kv head serves `group` q heads
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def grouped_linear(x, weight, counts: list[int]):
    """Rows of `x` sorted by expert, `counts[e]` of them for expert e: each block times its expert's matrix
    (weight: experts x out x in). A loop of plain matmuls, so it runs on any device and dtype."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(x[start : start + n] @ weight[e].t())
        start += n
    return torch.cat(outs) if outs else x.new_zeros((0, weight.shape[1]))


class ExpertLinear(nn.Module):
    """One matrix per expert, stacked (experts x out x in): what expert parallelism shards along dim 0."""

    def __init__(self, n_experts: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_out, d_in))

    def forward(self, x, counts):
        return grouped_linear(x, self.weight, counts)


class GroupedExperts(nn.Module):
    """E SwiGLU experts. Input: tokens sorted by expert and the number each expert gets (a list, or a
    tensor of counts); output: the experts' outputs in the same order."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = ExpertLinear(n_experts, dim, hidden)
        self.w2 = ExpertLinear(n_experts, hidden, dim)
        self.w3 = ExpertLinear(n_experts, dim, hidden)

    def forward(self, x, counts):
        counts = counts.tolist() if torch.is_tensor(counts) else list(counts)
        return self.w2(F.silu(self.w1(x, counts)) * self.w3(x, counts), counts)


class Router(nn.Module):
    """Token-choice top-k: softmax over the experts' scores, each token's k best, their weights renormalised
    to sum to one (Mixtral's rule)."""

    def __init__(self, dim: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)

    def forward(self, x):
        probs = F.softmax(self.gate(x), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        return probs, weights / weights.sum(-1, keepdim=True), experts


class MoE(nn.Module):
    """A mixture of experts in place of the dense FFN. Tokens are sorted by expert (a stable sort, so the
    order inside an expert's block is the tokens' order), handed to `experts` with the count per expert,
    and their outputs put back and summed with the router's weights. The hand-off to `experts` is where an
    expert-parallel strategy sends tokens to the ranks holding their experts and back."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.n_experts = n_experts
        self.router = Router(dim, n_experts, top_k)
        self.experts = GroupedExperts(n_experts, dim, hidden)
        self.aux_loss = None  # the last forward's load-balancing term (see load_balance)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, weights, experts = self.router(x)
        k = experts.shape[-1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        out = self.experts(x[order // k], counts)
        routed = torch.empty_like(out).index_copy(0, order, out)  # back in (token, choice) order
        y = (routed.view(-1, k, shape[-1]) * weights.unsqueeze(-1).to(out.dtype)).sum(1)
        self.aux_loss = load_balance(probs, counts)
        return y.view(shape)


def load_balance(probs, counts):
    """Switch Transformer's auxiliary loss, E * sum_e f_e P_e: f_e the share of routed slots expert e got
    (no gradient), P_e its mean router probability. 1 when balanced."""
    n_experts = probs.shape[-1]
    share = counts.to(probs.dtype) / counts.sum().clamp(min=1)
    return n_experts * (share.detach() * probs.mean(0)).sum()


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if getattr(cfg, "n_experts", 0):
            self.moe = MoE(cfg.dim, cfg.ffn_hidden, cfg.n_experts, cfg.top_k)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # a dict, not a ModuleList: pipeline stages delete layers and keep the others' names (torchtitan does the same)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.to(dtype)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_model(cfg, dtype=torch.float32, seed: int = 0) -> Transformer:
    """Same seed, same weights on every rank: data-parallel replicas start identical without a broadcast."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Transformer(cfg, dtype)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def aux_loss(model, coef: float):
    """`coef` times the sum of the MoE layers' load-balancing terms of the last forward (None: no MoE layer,
    or coef 0). Per micro-batch, like the language-model loss it is added to."""
    if not coef:
        return None
    terms = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return coef * torch.stack(terms).sum() if terms else None
