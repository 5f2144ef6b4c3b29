"""How large the cached tokens are where they enter the joint encoder, and whether their scale hides
the frame order.

The joint encoder (``models.reranker.joint_encoder``) adds its learned position and token-type
embeddings to [word embeddings; Z(v)] and applies its embedding LayerNorm. The order of the frames
reaches the encoder only through those positions: cached token k always sits at position
``max_text_tokens + k``. Measured here, on the demo profile's joint encoder (the bundled
all-MiniLM-L6-v2, 3 layers) and an untrained compressor: the norms of the word, position and
token-type embeddings and of a cached token, and how much the LayerNorm-ed input of a token changes
when it moves by 8 positions, for a caption's tokens and for cached tokens.

``--probe``: the tiny random BERT of the tests learns to tell a clip from its reversed twin from the
cache alone (tokens that encode a rising position, "walking to the right" against "to the left", a
softmax over the clip and its twin), with the cache as the compressor leaves it and scaled to the
word embeddings' norm (cache × mean word norm / √d, what the encoder would need for the positions to
show). Pair accuracy on held-out clips per seed. The probe trains in train mode, as ``train_vedje``
does, with the encoder's dropout off; ``--dropout`` adds the table against that dropout (the tiny
BERT at 300 and 2000 steps, the demo's pretrained encoder cut to one block at the recipe's 3e-4).

    .venv/bin/python experiments/vedje_cache_scale.py [--probe [--dropout]] [--seeds 2] [--steps 300]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from models.reranker.compressor import FrameCompressor
from models.reranker.joint_encoder import BUNDLED_MINILM, JointReranker, load_bert


def input_scales(layers: int = 3, shift: int = 8) -> dict[str, float]:
    """Norms at the encoder's input and the relative change of a LayerNorm-ed input moved by ``shift``
    positions: for the first 8 tokens of a caption, and for 8 cached tokens of an untrained compressor."""
    torch.manual_seed(0)
    bert, tokenizer = load_bert(BUNDLED_MINILM, layers=layers)
    emb = bert.embeddings
    words, positions, types = (emb.word_embeddings.weight, emb.position_embeddings.weight,
                               emb.token_type_embeddings.weight)
    d = words.shape[1]
    ids = tokenizer(["a person in a black top walking to the left"], return_tensors="pt")["input_ids"][0][:8]
    cache = FrameCompressor(1280, d, 4, 8)(torch.randn(1, 8, 49, 1280))[0, :8].detach()
    start = 64  # max_text_tokens: the first cached position

    def moved(x: torch.Tensor, at: int, kind: int) -> float:
        a = emb.LayerNorm(x + positions[at:at + len(x)] + types[kind])
        b = emb.LayerNorm(x + positions[at + shift:at + shift + len(x)] + types[kind])
        return float(((a - b).norm(dim=1) / a.norm(dim=1)).mean())

    with torch.no_grad():
        return {"word": float(words[ids].norm(dim=1).mean()), "position": float(positions[:96].norm(dim=1).mean()),
                "token type": float(types.norm(dim=1).mean()), "cached token": float(cache.norm(dim=1).mean()),
                "text moved": moved(words[ids], 0, 0), "cache moved": moved(cache, start, 1),
                "scaled cache moved": moved(cache * words.norm(dim=1).mean() / d ** 0.5, start, 1)}


def probe_clips(n: int, frames: int = 4, d: int = 32, seed: int = 0) -> torch.Tensor:
    """``n`` clips of cached tokens (LayerNorm-ed, as the compressor leaves them) whose content holds
    a position rising over the frames (a person walking right; reversed: left), plus noise. The
    direction that holds the position is the same in every set; ``seed`` draws the clips."""
    direction = torch.randn(d, generator=torch.Generator().manual_seed(12345))
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, generator=g) * 2 - 1)[:, None] + torch.linspace(0, 1, frames)[None]
    return F.layer_norm(x[..., None] * direction * 2 + torch.randn(n, frames, d, generator=g), (d,))


def probe(encoder: str | Path, scaled: bool, seed: int, steps: int = 300, batch: int = 32,
          dropout: float | None = None, lr: float = 1e-3, layers: int | None = None) -> float:
    """Pair accuracy on held-out clips after ``steps`` steps (the clip above its reversed twin),
    trained in train mode as ``train_vedje`` trains: the encoder's dropout active at ``dropout``
    (None: the encoder's own)."""
    torch.manual_seed(seed)
    bert, tokenizer = load_bert(str(encoder), layers=layers)
    reranker = JointReranker(bert, tokenizer, item_dim=8, max_text_tokens=16, dropout=dropout)
    with torch.no_grad():
        words = bert.embeddings.word_embeddings.weight.norm(dim=1).mean()
    factor = float(words / reranker.d ** 0.5) if scaled else 1.0
    texts = reranker.tokenize(["a person walking to the right", "a person walking to the left"])
    optim = torch.optim.AdamW(reranker.parameters(), lr=lr)
    train, test = (probe_clips(512, d=reranker.d, seed=2 * seed), probe_clips(256, d=reranker.d, seed=2 * seed + 1))

    def scores(query: torch.Tensor, clips: torch.Tensor) -> torch.Tensor:
        own = torch.where(query[:, None, None] == 0, clips, clips.flip(1))
        cache = torch.cat([own, own.flip(1)]) * factor
        return reranker.score(texts, torch.cat([query, query]), cache, torch.zeros(len(cache))).view(2, -1).T

    reranker.train()
    for _ in range(steps):
        rows = torch.randint(0, len(train), (batch,))
        loss = F.cross_entropy(scores(torch.randint(0, 2, (batch,)), train[rows]), torch.zeros(batch, dtype=torch.long))
        optim.zero_grad()
        loss.backward()
        optim.step()
    reranker.eval()
    with torch.no_grad():
        s = scores(torch.arange(len(test)) % 2, test)
    return float((s[:, 0] > s[:, 1]).float().mean())


def dropout_table(tiny: Path, seeds: int) -> None:
    """Pair accuracy against the encoder's dropout: the tests' tiny random BERT (lr 1e-3) at 300 and
    2000 steps, and the demo's pretrained encoder cut to one block at the recipe's peak lr (3e-4)."""
    print("| encoder | lr | dropout | steps | pair accuracy per seed |\n|---|---|---|---|---|")
    runs = [(tiny, "tiny random BERT", None, 1e-3, p, n) for n in (300, 2000) for p in (0.1, 0.02, 0.0)]
    runs += [(BUNDLED_MINILM, "all-MiniLM-L6-v2, 1 block", 1, 3e-4, p, 300) for p in (0.1, 0.0)]
    for encoder, name, layers, lr, p, steps in runs:
        accs = [probe(encoder, False, seed, steps, dropout=p, lr=lr, layers=layers) for seed in range(seeds)]
        print(f"| {name} | {lr:g} | {p:g} | {steps} | {', '.join(f'{100 * a:.1f} %' for a in accs)} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--dropout", action="store_true", help="the probe against the joint encoder's dropout")
    args = parser.parse_args()
    torch.set_num_threads(2)
    m = input_scales()
    print("| word | position | token type | cached token | moved 8 positions: text | cache | cache scaled |\n"
          "|---|---|---|---|---|---|---|")
    print(f"| {m['word']:.2f} | {m['position']:.2f} | {m['token type']:.2f} | {m['cached token']:.1f} | "
          f"{100 * m['text moved']:.1f} % | {100 * m['cache moved']:.1f} % | {100 * m['scaled cache moved']:.1f} % |")
    if args.probe:
        from entry.tiny_models import build_tiny_bert

        with tempfile.TemporaryDirectory() as tmp:
            folder = build_tiny_bert(Path(tmp) / "bert")
            for scaled in (False, True):
                accs = [probe(folder, scaled, seed, args.steps, dropout=0.0) for seed in range(args.seeds)]
                print(f"cache {'scaled' if scaled else 'as stored'}: pair accuracy per seed "
                      f"{', '.join(f'{100 * a:.1f} %' for a in accs)}", flush=True)
            if args.dropout:
                dropout_table(folder, args.seeds)


if __name__ == "__main__":
    main()
