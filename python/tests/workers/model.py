"""The small CNN and the data of the DDP test (test_ddp.py) and of the
benchmark (benches/peers/torch_compare.py): 2 conv + 1 linear layer on
generated 1x16x16 "images", labelled by a fixed random linear teacher on
their 4x4-pooled pixels, so that the loss falls within a few steps. Everything is seeded: the same (seed, rank, step)
gives the same batch on any machine."""

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


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(forward, opt, rank: int, steps: int) -> list:
    """`steps` steps of `opt` on `rank`'s batches through `forward` (the
    model, or its DDP wrapper); returns the losses."""
    losses = []
    for x, y in batches(rank, steps):
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
