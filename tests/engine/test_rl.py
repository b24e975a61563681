"""replayllm.rl (issue 29, the RL loop): mismatch statistics by hand, GRPO's advantages and loss by hand, the loop on a
tiny model (the engine holds the trainer's weights after every step; batch-invariant mode reports exactly zero
mismatch, fp32 otherwise within rounding), rollouts saved as a trace file `replayllm diff` takes as side A, and
`replayllm rl-demo`. CPU, tiny models."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from helpers.hf_reference import load_hf, tiny_configs
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM
from replayllm.entrypoints.cli.main import main as cli_main
from replayllm.entrypoints.diff import read_trace_file
from replayllm.rl import group_advantages, grpo_loss, grpo_step, mismatch_stats, save_rollouts

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]
N, MAX_TOKENS = 4, 6


def _even(prompt: list[int], completion: list[int]) -> float:
    return sum(t % 2 == 0 for t in completion) / len(completion)


def _llm(path: str, **kw) -> LLM:
    return LLM(path, enable_trace_replay=True, device="cpu", dtype="float32", max_model_len=64,
               skip_tokenizer_init=True, **kw)


def _trainer_and_optimizer(path: str):
    trainer = load_hf(path)  # fp32
    return trainer, torch.optim.Adam(trainer.parameters(), lr=1e-2)


def _engine_differs(llm: LLM, trainer) -> list[str]:
    """HF names whose tensor in the engine (its row range of a fused qkv / gate_up parameter, or the whole
    parameter) is not bit-equal to the trainer's, cast to the engine's dtype."""
    model = llm.llm_engine.runner.model
    params, shards = dict(model.named_parameters()), model._fused_shards()
    differ = []
    for name, tensor in trainer.state_dict().items():
        found = model.weight_target(name, params, shards)
        if found is None:  # rotary buffers; a tied model's lm_head (the embedding)
            continue
        target, offset, rows = found
        mine = params[target][offset : offset + rows]
        if not torch.equal(mine, tensor.to(mine.device, mine.dtype)):
            differ.append(name)
    return differ


# -- mismatch_stats, advantages, loss: by hand ---------------------------------------------------------------
def test_mismatch_stats_against_a_hand_computation():
    sampler = [[-1.0, -2.0], [-0.5]]
    trainer = [torch.tensor([-1.0, -1.5], requires_grad=True), torch.tensor([-0.75])]
    stats = mismatch_stats(sampler, trainer)  # Δ = trainer - sampler = [0, 0.5, -0.25]
    k3 = [math.exp(d) - 1 - d for d in (0.0, 0.5, -0.25)]
    assert stats.num_tokens == 3
    assert stats.mean_abs == pytest.approx(0.25, abs=1e-15) and stats.max_abs == 0.5
    assert stats.kl == pytest.approx(sum(k3) / 3, rel=1e-12)  # 0.0591737...
    assert stats.share_above == pytest.approx(2 / 3) and stats.threshold == 0.1
    assert mismatch_stats(sampler, trainer, threshold=0.3).share_above == pytest.approx(1 / 3)
    # k3 is the KL(sampler || trainer) estimator: exp(r) - 1 - r with r = trainer - sampler (not the reverse).
    assert mismatch_stats([[0.0]], [[-1.0]]).kl == pytest.approx(math.exp(-1) - 1 + 1)
    # float64 throughout: a float32 difference of 1e-9 survives (it would round to 0 in float32 around -1).
    tiny = mismatch_stats([torch.tensor([-1.0], dtype=torch.float64)], [[-1.0 + 1e-9]])
    assert tiny.max_abs == pytest.approx(1e-9, rel=1e-6)
    same = mismatch_stats(sampler, sampler)
    assert (same.mean_abs, same.max_abs, same.kl, same.share_above) == (0.0, 0.0, 0.0, 0.0)


def test_mismatch_stats_rejects_what_does_not_line_up():
    with pytest.raises(ValueError, match=r"rollout 1 has 1 sampler logprobs but 2 trainer logprobs"):
        mismatch_stats([[-1.0], [-1.0]], [[-1.0], [-1.0, -2.0]])
    with pytest.raises(ValueError, match="2 sampler rollouts but 1 trainer rollouts"):
        mismatch_stats([[-1.0], [-1.0]], [[-1.0]])
    with pytest.raises(ValueError, match="rollout 0's trainer logprobs must be 1-D"):
        mismatch_stats([[-1.0]], [torch.zeros(1, 1)])
    with pytest.raises(ValueError, match="NaN"):
        mismatch_stats([[float("nan")]], [[-1.0]])
    with pytest.raises(ValueError, match="no tokens"):
        mismatch_stats([[]], [[]])
    with pytest.raises(ValueError, match="threshold"):
        mismatch_stats([[-1.0]], [[-1.0]], threshold=-1)


def test_advantages_and_loss_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.5, 0.5], n=2)
    s = math.sqrt(0.5)  # sample std of (1, 0) and of (0, 1)
    expected = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="groups of n=4"):
        group_advantages([1.0, 0.0], n=4)
    with pytest.raises(ValueError, match="n must be an integer >= 2"):  # checked before the engine is touched
        grpo_step(None, None, None, PROMPTS, _even, n=1)
    # Two rollouts (2 and 1 tokens), advantages +1 / -1: loss = -mean_t(exp(lp_t - old_t) * A).
    lp = [torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-0.5], requires_grad=True)]
    old = [[-1.0, -2.5], [-0.5]]
    loss = grpo_loss(lp, old, torch.tensor([1.0, -1.0]))
    assert float(loss.detach()) == pytest.approx(-(1 + math.exp(0.5) - 1) / 3, rel=1e-6)
    loss.backward()  # d loss / d lp_t = -ratio_t * A / tokens; nothing flows to the sampler's numbers
    assert lp[0].grad.tolist() == pytest.approx([-1 / 3, -math.exp(0.5) / 3], rel=1e-6)
    assert lp[1].grad.tolist() == pytest.approx([1 / 3], rel=1e-6)


# -- the loop --------------------------------------------------------------------------------------------------
def test_two_steps_keep_the_engine_on_the_trainers_weights(tiny_models):
    path = tiny_models["qwen3"]
    llm = _llm(path)
    trainer, opt = _trainer_and_optimizer(path)
    start = {k: v.clone() for k, v in trainer.state_dict().items()}
    llm.load_weights(trainer)  # already equal (same checkpoint); the loop's starting point either way
    for step in range(2):
        rec = grpo_step(llm, trainer, opt, PROMPTS, _even, n=N, max_tokens=MAX_TOKENS, step=step)
        assert _engine_differs(llm, trainer) == []  # the engine follows the trainer after every step
        assert rec.step == step and len(rec.rollouts) == len(PROMPTS) * N
        assert [r.group for r in rec.rollouts] == [g for g in range(len(PROMPTS)) for _ in range(N)]
        assert all(r.prompt_token_ids == PROMPTS[r.group] and 1 <= len(r.completion_token_ids) <= MAX_TOKENS
                   and len(r.sampler_logprobs) == len(r.completion_token_ids)
                   and r.reward == _even(r.prompt_token_ids, r.completion_token_ids) for r in rec.rollouts)
        assert rec.mean_reward == pytest.approx(sum(r.reward for r in rec.rollouts) / len(rec.rollouts))
        m = rec.mismatch
        assert m.num_tokens == sum(len(r.completion_token_ids) for r in rec.rollouts)
        # The engine vs transformers on the same fp32 weights: two computations of each logprob, within
        # rounding (tolerances.LOGPROB_TOL); a misaligned token or a stale weight is off by far more.
        assert m.max_abs <= LOGPROB_TOL and m.share_above == 0.0
        assert 0.0 <= m.kl <= LOGPROB_TOL**2  # exp(Δ) - 1 - Δ <= Δ² for |Δ| <= 1
        assert math.isfinite(rec.loss)
    moved = [k for k, v in trainer.state_dict().items() if not torch.equal(v, start[k])]
    assert moved, "the optimizer steps changed no weight: the engine-equals-trainer check above was vacuous"
    # A NaN reward is refused before any backward (QA: it made every trainer weight and the engine NaN)
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    with pytest.raises(ValueError, match="rewards must be finite"):
        grpo_step(llm, trainer, opt, PROMPTS, lambda p, c: float("nan"), n=N, max_tokens=MAX_TOKENS)
    assert all(torch.equal(v, before[k]) for k, v in trainer.state_dict().items())
    assert _engine_differs(llm, trainer) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_mismatch_is_exactly_zero(tiny_models, dtype):
    """score() gives the trainer the engine's own bits, which batch-invariant mode makes equal to the sampling-time
    ones: zero mismatch, also for a bf16 sampler and an fp32 trainer (the RL case)."""
    path = tiny_models["qwen3"]
    llm = LLM(path, enable_trace_replay=True, batch_invariant=True, device="cpu", dtype=dtype, max_model_len=64,
              skip_tokenizer_init=True)
    trainer, opt = _trainer_and_optimizer(path)
    llm.load_weights(trainer)
    for step in range(2):
        rec = grpo_step(llm, trainer, opt, PROMPTS, _even, n=N, max_tokens=MAX_TOKENS, step=step)
        m = rec.mismatch
        assert m.num_tokens > 0 and (m.mean_abs, m.max_abs, m.kl, m.share_above) == (0.0, 0.0, 0.0, 0.0)
        assert _engine_differs(llm, trainer) == []
    assert all(p.grad is None for p in trainer.parameters())  # zero_grad after the optimizer step


def test_bf16_sampler_without_batch_invariance_shows_a_mismatch(tiny_models):
    """The same bf16 sampler outside batch-invariant mode: the trainer's fp32 numbers differ (the metric is not
    zero by construction)."""
    path = tiny_models["qwen3"]
    llm = LLM(path, enable_trace_replay=True, device="cpu", dtype="bfloat16", max_model_len=64,
              skip_tokenizer_init=True)
    trainer, opt = _trainer_and_optimizer(path)
    rec = grpo_step(llm, trainer, opt, PROMPTS, _even, n=N, max_tokens=MAX_TOKENS)
    assert rec.mismatch.max_abs > LOGPROB_TOL  # bf16 rounding of logits ~20: far above fp32's bound
    assert _engine_differs(llm, trainer) == []  # cast to bf16: equal to the engine's copy


def test_saved_rollouts_are_side_a_of_a_diff(tiny_models, tmp_path, capsys):
    path = tiny_models["qwen3"]
    llm = _llm(path)
    trainer, opt = _trainer_and_optimizer(path)
    rec = grpo_step(llm, trainer, opt, PROMPTS, _even, n=N, max_tokens=MAX_TOKENS)
    out = tmp_path / "rollouts.jsonl"
    assert save_rollouts(out, [rec], llm) == len(rec.rollouts)
    saved = read_trace_file(out)
    assert saved.provenance["tool"] == "replayllm rl" and saved.provenance["engine"]["dtype"] == "float32"
    assert [(r.prompt_token_ids, r.trace_token_ids, r.logprobs) for r in saved.records] == \
        [(r.prompt_token_ids, r.completion_token_ids, r.sampler_logprobs) for r in rec.rollouts]
    assert saved.records[0].id == "s0-p0-0" and saved.records[0].meta["reward"] == rec.rollouts[0].reward

    # The diff command: A = the sampler's stored logprobs, B = a replay on the checkpoint, whose weights are the
    # ones step 0 sampled with (the loop moved only the engine above).
    report_dir = tmp_path / "report"
    rc = cli_main(["diff", path, "--traces", str(out), "--a", "file",
                   "--b", "dtype=float32,device=cpu,max_model_len=64", "--out", str(report_dir)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((report_dir / "diff.json").read_text())
    tokens = sum(len(r.completion_token_ids) for r in rec.rollouts)
    assert report["a"]["kind"] == "file" and report["b"]["kind"] == "engine"
    assert report["num_requests"] == len(rec.rollouts) and report["num_tokens"] == tokens == len(report["tokens"])
    assert [t["logprob_a"] for t in report["tokens"]] == [x for r in rec.rollouts for x in r.sampler_logprobs]
    # A replay of the sampler's own tokens on its weights: the same numbers up to another batch's rounding.
    assert report["overall"]["max_abs_delta"] <= LOGPROB_TOL


# -- replayllm rl-demo ----------------------------------------------------------------------------------------
STEP_LINE = re.compile(r"step +(\d+)  reward (\S+)  loss (\S+)  mean\|Δ\| (\S+)  max\|Δ\| (\S+)  KL (\S+)  "
                       r"share>0\.1 (\S+)  \((\d+) tokens")


def _demo(args: list[str], capsys) -> tuple[int, list[tuple[float, ...]], str]:
    rc = cli_main(["rl-demo", *args])
    out = capsys.readouterr()
    rows = [tuple(float(x) for x in m.groups()) for m in STEP_LINE.finditer(out.out)]
    return rc, rows, out.out + out.err


def test_rl_demo_on_the_embedded_model(tmp_path, capsys):
    save = tmp_path / "rollouts.jsonl"
    rc, rows, text = _demo(["--steps", "2", "--num-prompts", "2", "--n", "2", "--max-tokens", "4",
                            "--dtype", "float32", "--save-rollouts", str(save)], capsys)
    assert rc == 0, text
    assert "replayllm/tiny-qwen3" in text and "transformers teacher forcing" in text
    assert [r[0] for r in rows] == [0.0, 1.0]
    for _, reward, loss, mean_abs, max_abs, kl, share, tokens in rows:
        assert 0.0 <= reward <= 1.0 and math.isfinite(loss) and 0 < tokens <= 2 * 2 * 4
        # fp32 engine vs fp32 transformers on the embedded model (hidden 64, 2 layers, like tolerances' models)
        assert 0.0 <= mean_abs <= max_abs <= LOGPROB_TOL and 0.0 <= kl and share == 0.0
    saved = read_trace_file(save)
    assert len(saved.records) == 2 * 2 * 2 and {r.meta["step"] for r in saved.records} == {0, 1}


def test_rl_demo_on_a_config_only_folder(tmp_path, capsys):
    """The 0.6B "dummy" shape's path (a folder with only config.json), on a tiny config: the trainer's seeded
    initialisation is copied into the engine, which starts from load_format=dummy."""
    folder = tmp_path / "config-only"
    config = tiny_configs()["qwen3"]
    config.architectures = ["Qwen3ForCausalLM"]  # what a checkpoint's config.json names (the engine reads it)
    config.save_pretrained(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    rc, rows, text = _demo(["--model", str(folder), "--steps", "1", "--num-prompts", "2", "--n", "2",
                            "--max-tokens", "3", "--batch-invariant", "--dtype", "float32"], capsys)
    assert rc == 0, text
    assert "random weights" in text and "replayllm.score" in text
    assert len(rows) == 1 and rows[0][3:7] == (0.0, 0.0, 0.0, 0.0)  # batch-invariant: exactly zero


def test_rl_demo_rejects_bad_settings(capsys):
    rc, _, text = _demo(["--n", "1"], capsys)
    assert rc == 2 and "--n must be >= 2" in text
