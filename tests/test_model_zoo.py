"""Training loops of assorted models under ``replaygrad.enable()``, against eager in the same
process: recurrent layers (LSTM, bidirectional GRU), attention with its weights, norms and
resampling layers, dropout, both kinds of checkpointing, and an in-place write into a view.

Each step reseeds the RNG before the forward (dropout draws the same masks in both runs),
alternates ``zero_grad(set_to_none=...)`` (``.grad`` stolen or accumulated into) and takes an
SGD step with momentum, so later steps run on parameters both runs updated.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import replaygrad

from conftest import COMPILERS, assert_grads_equal, assert_replayed, grads_of


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.out = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(x))
        return self.out(h[:, -1])


class GRUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 12, bidirectional=True)
        self.out = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(x)
        return self.out(h).mean(0)


class AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 32, padding_idx=0)
        self.norm = nn.LayerNorm(32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.norm(self.emb(x))
        a, weights = self.attn(e, e, e, need_weights=True)
        return self.out(a.mean(1)) + weights.sum()


class ResampleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.bn = nn.BatchNorm2d(4)
        self.out = nn.Linear(256, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.gn(self.conv(x)))
        y = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False)
        y = self.bn(self.up(F.avg_pool2d(y, 2)))
        y = F.dropout(y, 0.2, training=True)
        y = F.adaptive_avg_pool2d(y, (8, 8))
        return self.out(y.flatten(1)[:, :256])


class CheckpointNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(self.a(t)), x, use_reentrant=False
        )
        return torch.utils.checkpoint.checkpoint(
            lambda t: torch.relu(self.b(t)), y, use_reentrant=True
        )


class OpsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))
        self.v = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x @ self.w).clamp(-1, 1) * self.v
        y[:, 0] = y[:, 0] * 2  # CopySlices
        y = torch.cat([y, y.flip(1)], 1)
        y = torch.where(y > 0, y, y * 0.1).cumsum(1)
        y = y.unsqueeze(0).expand(3, -1, -1).sum(0)
        q, r = torch.linalg.qr(self.w)
        y = y[:, :6] @ q + torch.logsumexp(y, 1, keepdim=True)
        target = torch.arange(y.shape[0]) % 6
        return F.cross_entropy(y, target) + torch.linalg.norm(r) + y.std()


def _tokens(high: int, shape: tuple[int, ...]):
    return lambda: torch.randint(1, high, shape)


MODELS = {
    "lstm": (LSTMNet, _tokens(50, (4, 7))),
    "gru": (GRUNet, lambda: torch.randn(5, 3, 8)),
    "attention": (AttentionNet, _tokens(30, (3, 6))),
    "resample": (ResampleNet, lambda: torch.randn(2, 3, 8, 8)),
    "checkpoint": (CheckpointNet, lambda: torch.randn(4, 16, requires_grad=True)),
    "ops": (OpsNet, lambda: torch.randn(5, 6)),
}


def _train(model: nn.Module, make_input, run_backward, steps: int) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    grads = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = make_input()
        opt.zero_grad(set_to_none=step % 2 == 0)
        out = model(x)
        run_backward(out.square().mean())
        grads.append(grads_of(model.parameters()))
        opt.step()
    return grads


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("name", list(MODELS))
def test_training_loop_matches_eager(name, compiler):
    make_model, make_input = MODELS[name]
    eager_model = make_model()
    rg_model = copy.deepcopy(eager_model)
    steps = 3
    expected = _train(eager_model, make_input, lambda loss: loss.backward(), steps)

    before = replaygrad.cache_info()

    def replayed(loss: torch.Tensor) -> None:
        with replaygrad.enable(compiler):
            loss.backward()

    got = _train(rg_model, make_input, replayed, steps)
    # (Reentrant checkpointing's inner backward runs inside the replay, in the engine.)
    assert_replayed(before, calls=steps)
    # aot_eager runs torch's own kernels on the replayed formulas: eager's bits. Inductor
    # reassociates float32 sums: entries that are small differences of large terms (cumsum,
    # logsumexp, norms) differ from eager's by about eager's own error against float64.
    for e, g in zip(expected, got):
        exact = compiler != "inductor"
        assert_grads_equal(e, g, exact=exact, scaled=not exact)
