import json
import math

import pytest
import torch

from megatron_agent.rl import (
    GuardBatch,
    GuardError,
    GuardLimits,
    StepGuard,
    agree_to_skip,
    compute_policy_loss,
)

B, T = 3, 5


def _seed_batch(mask_culprit: bool):
    """The seed scenario: token (1, 2) was injected, logp -30 under the policy, old -0.01."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(B, T, generator=g) * 2
    logp = old + torch.randn(B, T, generator=g) * 0.05
    old[1, 2], logp[1, 2] = -0.01, -30.0
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 3:] = False  # padding
    if mask_culprit:
        mask[1, 2] = False
    source = [["sampled"] * T for _ in range(B)]
    source[1][2] = "injected"
    return GuardBatch(
        logprob=logp.requires_grad_(),
        old_logprob=old,
        advantages=torch.randn(B, T, generator=g),
        loss_mask=mask,
        rollout_logprob=torch.where(mask, old + 0.01, float("nan")),
        ref_logprob=old - 0.1,
        token_ids=torch.arange(B * T).reshape(B, T) + 100,
        sample_ids=["uid-a", "uid-b", "uid-c"],
        turn_index=torch.tensor([[0, 0, 1, 1, 1]] * B),
        token_source=source,
        decode=lambda i: f"<tok{i}>",
    )


def test_seed_scenario_skips_and_names_exactly_the_injected_token(tmp_path, capsys):
    batch = _seed_batch(mask_culprit=False)
    loss, _ = compute_policy_loss(batch.logprob, batch.old_logprob, batch.advantages, batch.loss_mask)
    loss.backward()
    guard = StepGuard(tmp_path, GuardLimits(max_abs_log_ratio=10.0), top_k=3)
    guard.observe(batch)
    decision = guard.check(7, loss=loss, parameters=[batch.logprob])
    assert decision.skip and decision.reasons == ["abs_log_ratio"]
    assert decision.metrics["guard/skipped_steps"] == 1.0
    assert decision.report_path == tmp_path / "guard" / "step_000007.json"
    report = json.loads(decision.report_path.read_text())
    (culprit,) = report["breaching_tokens"]
    assert culprit["sample_id"] == "uid-b" and culprit["position"] == 2 and culprit["turn"] == 1
    assert culprit["token_id"] == 107 and culprit["text"] == "<tok107>" and culprit["source"] == "injected"
    assert culprit["logprob"] == -30.0 and culprit["old_logprob"] == pytest.approx(-0.01)
    assert culprit["ref_logprob"] == pytest.approx(-0.11) and culprit["loss_mask"] is True
    assert culprit["breaches"] == ["abs_log_ratio"]
    assert culprit["log_ratio"] == pytest.approx(-29.99)
    assert report["top_by_abs_log_ratio"][0]["token_id"] == 107
    assert len(report["top_by_abs_log_ratio"]) == 3 and len(report["top_by_loss_contribution"]) == 3
    assert report["num_breaching_tokens"]["abs_log_ratio"] == 1
    out = capsys.readouterr().out
    assert "[guard] step 7 skipped: abs_log_ratio" in out and "uid-b" in out and "injected" in out


def test_seed_scenario_masked_gives_finite_loss_and_no_skip(tmp_path):
    batch = _seed_batch(mask_culprit=True)
    loss, _ = compute_policy_loss(batch.logprob, batch.old_logprob, batch.advantages, batch.loss_mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(batch.logprob.grad).all()
    guard = StepGuard(tmp_path, GuardLimits(max_abs_log_ratio=10.0))
    guard.observe(batch)
    decision = guard.check(7, loss=loss, parameters=[batch.logprob])
    assert not decision.skip and decision.reasons == [] and decision.report_path is None
    assert decision.metrics["guard/num_masked_tokens"] == 3.0  # two padding + the injected token
    assert not (tmp_path / "guard").exists()


class _Tiny(torch.nn.Module):
    def __init__(self, vocab=11, hidden=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, ids_BT):
        logits = self.out(self.emb(ids_BT))
        return torch.log_softmax(logits, -1).gather(-1, ids_BT[..., None])[..., 0]


def _step(model, opt, guard, step, ids, inject):
    opt.zero_grad()
    logp = model(ids)
    old = logp.detach().clone()
    if inject:
        old[0, 1] = logp[0, 1].detach() + 29.99
    mask = torch.ones_like(ids, dtype=torch.bool)
    adv = torch.linspace(-1, 1, ids.numel()).reshape(ids.shape)
    loss, _ = compute_policy_loss(logp, old, adv, mask)
    loss.backward()
    guard.observe(GuardBatch(logprob=logp, old_logprob=old, advantages=adv, loss_mask=mask, token_ids=ids))
    decision = guard.check(step, loss=loss, parameters=model.parameters())
    if not decision.skip:
        opt.step()
    return decision


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()]
    return params, state


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    return all(torch.equal(x, y) for x, y in zip(pa, pb)) and all(
        s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1) for s1, s2 in zip(sa, sb)
    )


def test_skipped_step_leaves_weights_and_adamw_state_bitwise_unchanged(tmp_path):
    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    guard = StepGuard(tmp_path, console=False)
    ids = torch.randint(0, 11, (2, 6))
    assert not _step(model, opt, guard, 0, ids, inject=False).skip  # creates the optimizer state
    before = _snapshot(model, opt)
    decision = _step(model, opt, guard, 1, ids, inject=True)
    assert decision.skip and decision.reasons == ["abs_log_ratio"]
    assert _same(before, _snapshot(model, opt))
    assert guard.skipped_steps == 1
    opt.step()  # the same gradients, applied: the comparison above can fail
    assert not _same(before, _snapshot(model, opt))


def test_consecutive_breaches_stop_the_run(tmp_path):
    guard = StepGuard(tmp_path, max_consecutive_skips=2, console=False)
    bad = _seed_batch(mask_culprit=False)
    good = _seed_batch(mask_culprit=True)
    for step, batch in enumerate([bad, bad, good, bad, bad]):
        guard.observe(batch)
        assert guard.check(step).skip == (batch is bad)
    assert guard.consecutive_skips == 2 and guard.skipped_steps == 4
    guard.observe(bad)
    with pytest.raises(GuardError, match="breached 3 optimizer steps in a row"):
        guard.check(5)
    assert (tmp_path / "guard" / "step_000005.json").exists()
    restored = StepGuard(tmp_path)
    restored.load_state_dict(guard.state_dict())
    assert restored.skipped_steps == 5


def test_nonfinite_loss_grads_and_tokens_breach(tmp_path):
    guard = StepGuard(tmp_path, GuardLimits(max_grad_norm=5.0), max_consecutive_skips=10, console=False)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([0.0, float("nan"), 1.0])
    assert guard.check(0, parameters=[p]).reasons == ["nonfinite_grad"]
    assert guard.check(1, loss=[torch.tensor(1.0), torch.tensor(float("inf"))]).reasons == ["nonfinite_loss"]
    assert guard.check(2, grad_norm=6.0).reasons == ["grad_norm"]
    assert guard.check(2, grads=[torch.tensor([3.0, 4.0]), torch.tensor([0.0])]).reasons == []  # norm 5
    assert guard.check(2, grads=[torch.tensor([3.0, 4.1])]).reasons == ["grad_norm"]
    assert guard.check(2, grads=[torch.tensor([float("-inf")])]).reasons == ["nonfinite_grad"]
    batch = _seed_batch(mask_culprit=True)
    batch.logprob.data[0, 0] = float("nan")  # a loss token
    batch.logprob.data[2, 4] = float("nan")  # masked: ignored
    guard.observe(batch)
    d = guard.check(3)
    assert d.reasons == ["nonfinite_tokens"] and d.metrics["guard/num_nonfinite_tokens"] == 1.0
    report = json.loads(d.report_path.read_text())
    (tok,) = report["breaching_tokens"]
    assert tok["sample_id"] == "uid-a" and tok["position"] == 0 and tok["logprob"] == "nan"


def test_rollout_ratio_and_kl_limits(tmp_path):
    batch = _seed_batch(mask_culprit=True)
    batch.rollout_logprob[0, 3] = batch.old_logprob[0, 3] - 8.0
    batch.ref_logprob[2, 1] = batch.logprob.detach()[2, 1] + 6.0
    limits = GuardLimits(max_rollout_abs_log_ratio=5.0, max_abs_kl=5.0, max_ratio=1.01)
    guard = StepGuard(tmp_path, limits, max_consecutive_skips=10, console=False)
    guard.observe(batch)
    d = guard.check(0)
    assert set(d.reasons) == {"rollout_abs_log_ratio", "abs_kl", "ratio"}
    report = json.loads(d.report_path.read_text())
    assert report["top_by_rollout_abs_log_ratio"][0]["position"] == 3
    assert report["top_by_abs_kl"][0]["sample_id"] == "uid-c"
    assert d.metrics["guard/max_rollout_abs_log_ratio"] == pytest.approx(8.0)


def test_topk_is_exact_over_micro_batches(tmp_path):
    guard = StepGuard(tmp_path, top_k=2, console=False)
    gaps = [[0.1, 25.0, 0.2], [30.0, 0.3, 21.0]]
    for i, row in enumerate(gaps):
        old = torch.zeros(1, 3)
        guard.observe(
            GuardBatch(
                logprob=old - torch.tensor([row]),
                old_logprob=old,
                advantages=torch.ones(1, 3),
                loss_mask=torch.ones(1, 3, dtype=torch.bool),
                sample_ids=[f"s{i}"] if i == 0 else torch.tensor([1]),
            )
        )
    d = guard.check(0)
    report = json.loads(d.report_path.read_text())
    top = [(r["sample_id"], r["position"], r["micro_batch"]) for r in report["top_by_abs_log_ratio"]]
    assert top == [(1, 0, 1), ("s0", 1, 0)]
    assert report["top_by_abs_log_ratio"][0]["rollout_logprob"] is None
    assert [r["scores"]["abs_log_ratio"] for r in report["breaching_tokens"]] == [30.0, 25.0, 21.0]
    assert d.metrics["guard/max_abs_log_ratio"] == 30.0 and math.isfinite(d.metrics["guard/num_loss_tokens"])


def test_agree_to_skip_without_distributed():
    assert agree_to_skip(True) and not agree_to_skip(False)


def test_from_config(tmp_path):
    from megatron_agent.config import load_config

    cfg = load_config(
        None, ["algorithm.guard_max_abs_log_ratio=5", "algorithm.guard_max_consecutive_skips=0"]
    )
    guard = StepGuard.from_config(cfg.algorithm, tmp_path)
    assert guard.limits.max_abs_log_ratio == 5.0 and guard.limits.max_rollout_abs_log_ratio == 20.0
    guard.console = False
    guard.observe(_seed_batch(mask_culprit=False))
    with pytest.raises(GuardError):
        guard.check(0)


def test_guard_disabled_by_config_checks_nothing(tmp_path):
    from megatron_agent.config import load_config

    cfg = load_config(None, ["algorithm.guard_enabled=false", "algorithm.guard_max_consecutive_skips=0"])
    guard = StepGuard.from_config(cfg.algorithm, tmp_path)
    guard.console = False
    guard.observe(_seed_batch(mask_culprit=False))  # would breach: see test_from_config
    d = guard.check(0, loss=torch.tensor(float("nan")))
    assert not d.skip and d.reasons == [] and d.metrics == {"guard/skipped": 0.0}
    assert not (tmp_path / "guard").exists()  # no culprit report either
