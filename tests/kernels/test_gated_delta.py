"""kernels/gated_delta.py (hybrid models' linear-attention layers): the causal convolution over each request's history
and the gated delta rule, against plain per-sequence references (F.conv1d; the rule's matrix form in float64); the
Triton rule against the torch one (interpreter on CPU; compiled on CUDA: bench/gpu_check.sh's GPU_TWINS); and the
design's promise: a sequence cut into steps anywhere, beside other requests, gives the bits of one step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.tolerances import rounding_tol

from replayllm.kernels.dispatch import triton_can_run
from replayllm.kernels.gated_delta import conv_windows, delta_rule_torch, delta_rule_triton

HK, HV, DK, DV, C, K = 2, 4, 16, 8, 24, 4
LENS = (1, 5, 23, 70)  # one token, shorter than the kernel, longer than a chunk of 64


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sequences(seed: int, device: str, per_channel: bool = False) -> list[dict]:
    """per_channel: a log decay per key channel [n, Hv, Dk] (Kimi Delta Attention), else one per head [n, Hv]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENS:
        q = F.normalize(torch.randn(n, HK, DK, generator=g), dim=-1) * DK**-0.5
        k = F.normalize(torch.randn(n, HK, DK, generator=g), dim=-1)
        out.append({name: t.to(device) for name, t in dict(
            x=torch.randn(n, C, generator=g), q=q, k=k, v=torch.randn(n, HV, DV, generator=g),
            g=-torch.rand(n, HV, *((DK,) if per_channel else ()), generator=g) * 2,
            beta=torch.rand(n, HV, generator=g)).items()})
    return out


def _run_steps(seqs: list[dict], cuts: list[list[int]], rule, weight: torch.Tensor) -> tuple[list, list]:
    """Every sequence i (slot i + 1 of 6; slot 0 holds NaN junk no row may read) run in steps: step j holds, for
    each sequence with a piece left, its tokens cuts[i][j] .. cuts[i][j + 1]. Returns per sequence (conv output
    [n, C], rule output [n, Hv, Dv]) and the final states (conv [6, K - 1, C], delta [6, Hv, Dk, Dv])."""
    device = seqs[0]["x"].device
    conv_state = torch.full((6, K - 1, C), float("nan"), device=device)
    delta_state = torch.full((6, HV, DK, DV), float("nan"), device=device)
    outs = [([], []) for _ in seqs]
    for j in range(max(len(c) - 1 for c in cuts)):
        rows = [i for i, c in enumerate(cuts) if j + 1 < len(c)]
        pieces = {name: torch.cat([seqs[i][name][cuts[i][j]:cuts[i][j + 1]] for i in rows])
                  for name in seqs[0]}
        lens = [cuts[i][j + 1] - cuts[i][j] for i in rows]
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
        start = torch.tensor([cuts[i][j] for i in rows], device=device)
        slots = torch.tensor([i + 1 for i in rows], device=device)
        token_row = torch.repeat_interleave(torch.arange(len(rows), device=device), torch.tensor(lens, device=device))
        positions = start[token_row] + torch.arange(int(qsl[-1]), device=device) - qsl[token_row]
        y = conv_windows(pieces["x"], conv_state, slots, token_row, positions, start, qsl, start + qsl.diff(), weight)
        o = rule(pieces["q"], pieces["k"], pieces["v"], pieces["g"], pieces["beta"], delta_state, slots, qsl, start,
                 max(lens))
        for r, i in enumerate(rows):
            outs[i][0].append(y[qsl[r]:qsl[r + 1]])
            outs[i][1].append(o[qsl[r]:qsl[r + 1]])
    return [(torch.cat(a), torch.cat(b)) for a, b in outs], [conv_state, delta_state]


def _delta_reference(s: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's matrix form per value head, in float64: S = (I - beta k k^T) exp(g) S + beta k v^T, o = S^T q."""
    r = HV // HK
    q, k, v, g, beta = (s[n].double().cpu() for n in ("q", "k", "v", "g", "beta"))
    state = torch.zeros(HV, DK, DV, dtype=torch.float64)
    out = torch.zeros(q.shape[0], HV, DV, dtype=torch.float64)
    for t in range(q.shape[0]):
        for h in range(HV):
            kt, qt = k[t, h // r], q[t, h // r]
            a = torch.eye(DK, dtype=torch.float64) - beta[t, h] * torch.outer(kt, kt)
            decay = g[t, h].exp()[:, None] if g.dim() == 3 else g[t, h].exp()  # per key channel: per state row
            state[h] = a @ (decay * state[h]) + beta[t, h] * torch.outer(kt, v[t, h])
            out[t, h] = state[h].T @ qt
    return out, state


ONE_STEP = [[0, n] for n in LENS]
SPLIT = [[0, 1], [0, 2, 3, 5], [0, 7, 8, 9, 23], [0, 1, 64, 65, 70]]  # prefill chunks, then one-token steps


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay_per_head", "decay_per_key_channel"])
def test_torch_forms_match_their_references_and_any_split(per_channel):
    seqs = _sequences(0, "cpu", per_channel)
    weight = torch.randn(C, K, generator=torch.Generator().manual_seed(5))
    whole, (conv_state, delta_state) = _run_steps(seqs, ONE_STEP, delta_rule_torch, weight)
    split, split_states = _run_steps(seqs, SPLIT, delta_rule_torch, weight)
    for s, (y, o), (y2, o2), n in zip(seqs, whole, split, LENS):
        ref = F.conv1d(s["x"].T[None], weight[:, None], padding=K - 1, groups=C)[0, :, :n].T
        torch.testing.assert_close(y, ref, rtol=0, atol=rounding_tol(ref, terms=K))
        ref_o, ref_state = _delta_reference(s)
        torch.testing.assert_close(o.double(), ref_o, rtol=0, atol=rounding_tol(ref_o, terms=DK, steps=n))
        assert torch.equal(y, y2) and torch.equal(o, o2)  # cut anywhere, beside others: the same bits
    for i, s in enumerate(seqs):
        last = F.pad(s["x"], (0, 0, K - 1, 0))[-(K - 1):]  # the last K - 1 inputs, zeros before position 0
        assert torch.equal(conv_state[i + 1], last) and torch.equal(split_states[0][i + 1], last)
        assert torch.equal(delta_state[i + 1], split_states[1][i + 1])
    assert torch.isnan(delta_state[0]).all()  # slot 0 belongs to no row: untouched


@pytest.mark.parametrize("per_channel", [False, True], ids=["decay_per_head", "decay_per_key_channel"])
@pytest.mark.parametrize("cuts", [ONE_STEP, SPLIT], ids=["one_step", "split"])
def test_triton_rule_matches_torch(cuts, per_channel):
    device = _device()
    if not triton_can_run(torch.device(device)):
        pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)")
    seqs = _sequences(1, device, per_channel)
    weight = torch.randn(C, K, generator=torch.Generator().manual_seed(6)).to(device)
    want, want_states = _run_steps(seqs, cuts, delta_rule_torch, weight)
    got, got_states = _run_steps(seqs, cuts, delta_rule_triton, weight)
    for (_, o_want), (_, o_got), n in zip(want, got, LENS):
        torch.testing.assert_close(o_got, o_want, rtol=0, atol=rounding_tol(o_want, terms=DK, steps=n))
    torch.testing.assert_close(got_states[1][1:5], want_states[1][1:5], rtol=0,
                               atol=rounding_tol(want_states[1][1:5], terms=DK, steps=max(LENS)))
    if cuts is SPLIT:  # and the kernel's own promise: any split gives its one-step bits
        whole, _ = _run_steps(seqs, ONE_STEP, delta_rule_triton, weight)
        assert all(torch.equal(a[1], b[1]) for a, b in zip(whole, got))


def test_triton_rule_padding_rows_share_a_slot():
    """CUDA-graph padding rows all name the pad slot: the real rows' outputs and states are those of a step
    without them."""
    device = _device()
    if not triton_can_run(torch.device(device)):
        pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)")
    s = _sequences(2, device)[2]
    one = {n: t[:1] for n, t in s.items()}
    pad = {n: torch.cat([t[:1], t[1:4]]) for n, t in s.items()}  # 1 real row + 3 padding rows (one token each)
    state = torch.zeros(3, HV, DK, DV, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    want = delta_rule_triton(one["q"], one["k"], one["v"], one["g"], one["beta"], state.clone(),
                             torch.tensor([1], **i64), torch.tensor([0, 1], **i64), torch.tensor([0], **i64))
    padded_state = state.clone()
    got = delta_rule_triton(pad["q"], pad["k"], pad["v"], pad["g"], pad["beta"], padded_state,
                            torch.tensor([1, 2, 2, 2], **i64), torch.arange(5, **i64), torch.zeros(4, **i64))
    ref_state = state.clone()
    delta_rule_triton(one["q"], one["k"], one["v"], one["g"], one["beta"], ref_state, torch.tensor([1], **i64),
                      torch.tensor([0, 1], **i64), torch.tensor([0], **i64))
    assert torch.equal(got[0], want[0]) and torch.equal(padded_state[1], ref_state[1])
