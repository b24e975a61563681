"""kernels/mamba_ssm.py (Granite 4.0-H's Mamba-2 layers; Jamba's Mamba-1, A per state element): the selective state
update against its matrix form in float64, the Triton kernel against the torch reference (interpreter on CPU;
compiled on CUDA in bench/gpu_check.sh's GPU_TESTS), and a sequence cut into steps anywhere, beside another, giving
the bits of one step."""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import rounding_tol

from replayllm.kernels.dispatch import triton_can_run
from replayllm.kernels.mamba_ssm import ssm_update_torch, ssm_update_triton

H, P, N, G = 4, 8, 16, 2  # two heads per group of B / C
LENS = (1, 6, 40)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sequences(seed: int, device: str) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{k: v.to(device) for k, v in dict(
        x=torch.randn(n, H, P, generator=g), dt=torch.rand(n, H, generator=g) * 0.5,
        b=torch.randn(n, G, N, generator=g), c=torch.randn(n, G, N, generator=g)).items()} for n in LENS]


def _params(device: str, per_state: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A [H] (Mamba-2) or [H, N] (Mamba-1: one per state element), D [H]."""
    g = torch.Generator().manual_seed(9)
    a = -torch.rand(H, N if per_state else 1, generator=g).mul(3).add(0.1)
    return (a if per_state else a[:, 0]).to(device), torch.randn(H, generator=g).to(device)


def _run(seqs: list[dict], cuts: list[list[int]], rule, per_state: bool = False
         ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Sequence i in slot i + 1 (slot 0: NaN junk no row reads), step j holding its tokens cuts[i][j] ..
    cuts[i][j + 1]. Returns each sequence's y [n, H, P] and the state tensor [5, H, P, N]."""
    device = seqs[0]["x"].device
    a, d = _params(device, per_state)
    state = torch.full((5, H, P, N), float("nan"), device=device)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for j in range(max(len(c) - 1 for c in cuts)):
        rows = [i for i, c in enumerate(cuts) if j + 1 < len(c)]
        piece = {k: torch.cat([seqs[i][k][cuts[i][j]:cuts[i][j + 1]] for i in rows]) for k in seqs[0]}
        lens = [cuts[i][j + 1] - cuts[i][j] for i in rows]
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
        start = torch.tensor([cuts[i][j] for i in rows], device=device)
        y = rule(piece["x"], piece["dt"], a, piece["b"], piece["c"], d, state,
                 torch.tensor([i + 1 for i in rows], device=device), qsl, start, max(lens))
        for r, i in enumerate(rows):
            outs[i].append(y[qsl[r]:qsl[r + 1]])
    return [torch.cat(o) for o in outs], state


def _reference(s: dict, per_state: bool = False) -> torch.Tensor:
    """S_h = exp(dt A_h) S_h + dt x_h B_g^T (Mamba-1: exp(dt A_h,n) per state column), y_h = S_h C_g + D_h x_h, per
    head, in float64."""
    a, d = (t.double().cpu() for t in _params("cpu", per_state))
    x, dt, b, c = (s[k].double().cpu() for k in ("x", "dt", "b", "c"))
    state = torch.zeros(H, P, N, dtype=torch.float64)
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for h in range(H):
            grp = h // (H // G)
            state[h] = torch.exp(dt[t, h] * a[h]) * state[h] + dt[t, h] * torch.outer(x[t, h], b[t, grp])  # [P, N]
            y[t, h] = state[h] @ c[t, grp] + d[h] * x[t, h]
    return y


ONE_STEP = [[0, n] for n in LENS]
SPLIT = [[0, 1], [0, 4, 5, 6], [0, 1, 17, 39, 40]]


@pytest.mark.parametrize("per_state", [False, True], ids=["mamba2", "mamba1"])
def test_torch_update_matches_its_matrix_form_and_any_split(per_state):
    seqs = _sequences(0, "cpu")
    whole, state = _run(seqs, ONE_STEP, ssm_update_torch, per_state)
    split, split_state = _run(seqs, SPLIT, ssm_update_torch, per_state)
    for s, y, y2, n in zip(seqs, whole, split, LENS):
        ref = _reference(s, per_state)
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=rounding_tol(ref, terms=N, steps=n))
        assert torch.equal(y, y2)
    assert torch.equal(state[1:4], split_state[1:4]) and torch.isnan(state[0]).all() and torch.isnan(state[4]).all()


@pytest.mark.parametrize("per_state", [False, True], ids=["mamba2", "mamba1"])
@pytest.mark.parametrize("cuts", [ONE_STEP, SPLIT], ids=["one_step", "split"])
def test_triton_update_matches_torch(cuts, per_state):
    device = _device()
    if not triton_can_run(torch.device(device)):
        pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)")
    seqs = _sequences(1, device)
    want, want_state = _run(seqs, cuts, ssm_update_torch, per_state)
    got, got_state = _run(seqs, cuts, ssm_update_triton, per_state)
    for y_want, y_got, n in zip(want, got, LENS):
        torch.testing.assert_close(y_got, y_want, rtol=0, atol=rounding_tol(y_want, terms=N, steps=n))
    torch.testing.assert_close(got_state[1:4], want_state[1:4], rtol=0,
                               atol=rounding_tol(want_state[1:4], terms=N, steps=max(LENS)))
    if cuts is SPLIT:
        whole, _ = _run(seqs, ONE_STEP, ssm_update_triton, per_state)
        assert all(torch.equal(a, b) for a, b in zip(whole, got))
