"""AdamW over fp32 parameters with its two moments kept in bfloat16, stochastically rounded.

AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019), per step t with
gradient g of a parameter p:

    p <- p - lr * wd * p
    m <- b1 m + (1 - b1) g            v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

exactly as `torch.optim.AdamW` computes it, in fp32, one chunk of `CHUNK` elements at a time.
Only the stored m and v are bfloat16: half the optimizer's memory (for SmolLM2-135M, 538 MB
instead of 1076 MB), with the parameters and the update itself in fp32 (an update of 1e-6 of a
weight still lands; pure-bf16 weights would lose it).

Why stochastic rounding: v's change per step is (1 - b2) = 0.1% of v, below bfloat16's spacing
(2^-8 to 2^-7 of the value), so rounding to nearest would leave v where it is once t is past a
few hundred steps and it could no longer decay. Rounding up with probability equal to the
remainder's share of the spacing keeps E[stored] = exact value, so v follows the same average
path as in fp32 (the rule of AnyPrecisionAdamW and torchao's bf16 optimizers). The random bits
come from a fixed table of uniform 16-bit values read at a random offset per chunk, drawn from a
generator seeded by (seed, step): a replayed step rounds the same way.

torchao's `AdamW8bit` (a well-kept alternative with 8-bit moments) compiles its step with
torch.compile: on this project's 2-core CPU the first step took 28 s and each later one 1.3 s
for 67 M parameters. This step takes 0.25-0.31 s for 134 M parameters against 0.065 s for
torch's fused fp32 AdamW (SmolLM2-135M-shaped tensors, quiet machine).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

CHUNK = 1 << 20
"""Elements per chunk: fp32 temporaries stay at a few MiB however large a parameter is."""
_TABLE = 1 << 21
_LOW16 = -(1 << 16)  # int32 mask 0xFFFF0000: keeps sign, exponent and bf16's 7 mantissa bits


def stochastic_round_bf16(x: Tensor, noise: Tensor, out: Tensor | None = None) -> Tensor:
    """`x` (fp32, any shape, finite) rounded to bfloat16, up or down at random.

    Adds `noise` (int32 in [0, 65536), same number of elements) to the low 16 bits of each
    value's bit pattern and drops them: the value moves to the next bfloat16 away from zero with
    probability (dropped bits) / 2^16, else to the one toward zero.

    Worked example: x = 1 + 2^-10 has bits 0x3F802000; bf16 neighbours are 1.0 (0x3F80) and
    1 + 2^-7 (0x3F81); the dropped bits are 0x2000 = 8192, so x rounds up when noise >= 65536 -
    8192, i.e. with probability 1/8, and E = 1 + 2^-7 / 8 = 1 + 2^-10 = x.

    Args:
        x: float32 tensor; overwritten (its bits are the scratch space).
        noise: int32 tensor of `x.numel()` values in [0, 65536).
        out: a bfloat16 tensor of `x`'s shape to write into (a view of the optimizer's state);
            a new one when None.

    Returns:
        `out` (or the new bfloat16 tensor).
    """
    bits = x.view(torch.int32)
    bits.add_(noise.view_as(bits)).bitwise_and_(_LOW16)
    if out is None:
        return x.to(torch.bfloat16)
    return out.copy_(x)  # exact: the dropped bits are zero


class AdamWBf16State(torch.optim.Optimizer):
    """`torch.optim.AdamW` with bfloat16 `exp_avg` / `exp_avg_sq` (module docstring).

    The parameters must be plain fp32 tensors (not FSDP2's DTensor shards: use fp32 state
    there). The state dict has torch AdamW's keys (`step`, `exp_avg`, `exp_avg_sq`), so a
    checkpoint of either optimizer loads into the other (moments cast on load).

    Raises:
        ValueError: a parameter that is not a plain float32 tensor; lr, eps or betas out of range.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        seed: int = 0,
    ) -> None:
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr} eps={eps} betas={betas}")
        params = list(params)
        for p in params:
            if type(p.data) is not torch.Tensor or p.dtype != torch.float32:
                raise ValueError(
                    "bfloat16 optimizer state needs plain float32 parameters, got "
                    f"{type(p.data).__name__} {p.dtype}; set trainer.optim.state_dtype = "
                    '"float32"'
                )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.seed = seed
        table = torch.Generator().manual_seed(seed)
        self._noise = torch.randint(0, 1 << 16, (_TABLE,), dtype=torch.int32, generator=table)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading casts the moments to the parameter's dtype (fp32); cast them back."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != torch.bfloat16:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One AdamW step of every parameter with a gradient (formula in the module docstring)."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["step"] += 1
                t = int(state["step"].item())
                self._update(p, p.grad, state, t, lr, beta1, beta2, eps, wd)
        return loss

    def _update(
        self,
        p: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        t: int,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        wd: float,
    ) -> None:
        step_size = lr / (1 - beta1**t)
        sqrt_bc2 = math.sqrt(1 - beta2**t)
        flat_p, flat_g = p.view(-1), grad.reshape(-1)
        flat_m, flat_v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        offsets = torch.Generator().manual_seed(self.seed * 1_000_003 + t)
        for start in range(0, flat_p.numel(), CHUNK):
            rows = slice(start, start + CHUNK)
            p_c, g_c = flat_p[rows], flat_g[rows]
            m32 = flat_m[rows].float().lerp_(g_c, 1 - beta1)
            v32 = flat_v[rows].float().mul_(beta2).addcmul_(g_c, g_c, value=1 - beta2)
            if wd:
                p_c.mul_(1 - lr * wd)
            # m / (sqrt(v) / c + eps) = c m / (sqrt(v) + eps c), c = sqrt(1 - b2^t): one pass less
            denom = v32.sqrt().add_(eps * sqrt_bc2)
            p_c.addcdiv_(m32, denom, value=-step_size * sqrt_bc2)
            n = p_c.numel()
            for buf, value in ((flat_m, m32), (flat_v, v32)):
                at = int(torch.randint(0, _TABLE - n + 1, (1,), generator=offsets))
                stochastic_round_bf16(value, self._noise[at : at + n], out=buf[rows])


def optimizer_state_dtype(setting: str, params: Sequence[Tensor]) -> tuple[str, str]:
    """("float32" | "bfloat16", why) for `trainer.optim.state_dtype` over `params`.

    auto: bfloat16 when every parameter is a plain float32 CPU tensor (the laptop and CPU
    cluster case, where AdamW's fp32 moments are the largest thing the trainer holds), else
    float32 (CUDA, FSDP2's DTensor shards, bf16 parameters).

    Raises:
        ValueError: "bfloat16" set for parameters that are not plain float32 tensors.
    """
    plain_fp32 = all(type(p.data) is torch.Tensor and p.dtype == torch.float32 for p in params)
    if setting == "float32":
        return "float32", "set"
    if setting == "bfloat16":
        if not plain_fp32:
            raise ValueError(
                'trainer.optim.state_dtype = "bfloat16" needs plain float32 parameters (not '
                'FSDP2 shards or bf16 weights); set it to "float32" or "auto"'
            )
        return "bfloat16", "set"
    if plain_fp32 and params and all(p.device.type == "cpu" for p in params):
        return "bfloat16", "auto: fp32 parameters on a CPU; half the optimizer's memory"
    return "float32", "auto: CUDA, sharded or non-fp32 parameters"
