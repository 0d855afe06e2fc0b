"""The models and data of the tests and of the benchmark
(benches/peers/torch_compare.py):

- SmallCNN (test_ddp.py): 2 conv + 1 linear layer on generated 1x16x16
  "images", labelled by a fixed random linear teacher on their 4x4-pooled
  pixels, so that the loss falls within a few steps;
- TinyTransformer (FSDP, the fused DistributedOptimizer): a token
  embedding, encoder layers (12 parameter tensors each) and a head, on
  next-token batches of a sequence that steps by 3; with DEEP_LAYERS
  layers it has 207 parameter tensors.

Everything is seeded: the same (seed, rank, step) gives the same batch on
any machine."""

import hashlib
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

CLASSES = 10
SIDE = 16


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * (SIDE // 4) ** 2, CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def make_model(seed: int = 0) -> SmallCNN:
    """A model initialised from `seed` alone (the global RNG is left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return SmallCNN()


def batches(rank: int, steps: int, batch: int = 16, seed: int = 0):
    """`steps` batches (x: batch x 1 x 16 x 16, y: batch labels) of `rank`."""
    teacher = torch.randn(CLASSES, (SIDE // 4) ** 2, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 100003 + rank + 1)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 1, SIDE, SIDE, generator=g)
        y = (F.avg_pool2d(x, 4).flatten(1) @ teacher.t()).argmax(1)
        out.append((x, y))
    return out


VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 12
DEEP_LAYERS = 17  # 17 * 12 + 3 = 207 parameter tensors


class TinyTransformer(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=64, dropout=0.0,
                                       batch_first=True)
            for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_transformer(layers: int = 2, seed: int = 0) -> TinyTransformer:
    """A TinyTransformer initialised from `seed` alone."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TinyTransformer(layers)


def token_batches(rank: int, steps: int, batch: int = 8):
    """Next-token batches of `rank`: a sequence shifted by one."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (batch, 1), generator=g)
        seq = (start + torch.arange(SEQ + 1) * 3) % VOCAB
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def token_loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(forward, opt, rank: int, steps: int) -> list:
    """`steps` steps of `opt` on `rank`'s batches through `forward` (the
    model, or its DDP wrapper); returns the losses."""
    return fit(forward, opt, batches(rank, steps))


def fit(forward, opt, data) -> list:
    """A step of `opt` (cross entropy through `forward`) per (x, y) of
    `data`; returns the losses."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def save_result(outdir, tag: str, rank: int, size: int, losses: list, flat, equal: bool,
                **extra) -> str:
    """Writes OUTDIR/<tag>-rank<R>.json (losses, the parameters' SHA-256,
    whether the ranks' parameters are equal, `extra`) and .pt (the
    flattened parameters); returns the digest."""
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    torch.save(flat, outdir / f"{tag}-rank{rank}.pt")
    (outdir / f"{tag}-rank{rank}.json").write_text(json.dumps({
        "rank": rank, "size": size, "backend": tag, "losses": losses,
        "params_sha256": digest, "params_equal_across_ranks": equal, **extra,
    }))
    return digest
