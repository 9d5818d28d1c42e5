"""Reward functions on the final answer: exact match, F1, numeric match, format; weighted sums.

A reward function has the signature `fn(response: str, ground_truth, trajectory) -> float`
where `response` is the decoded text of the trajectory's sampled tokens of the last turn (the
answer turn) and `trajectory` the full `Trajectory` (tool calls, finish reason). A task's
`reward` spec is `{"ground_truth": ..., "fn": NAME}` or `{"ground_truth": ..., "fns": {NAME: weight}}`
where NAME is a built-in (`exact_match`, `f1`, `numeric`, `format`) or a dotted path.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable
from typing import Any

from megatron_agent.envs.registry import load_object

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str | None:
    """Content of the last `<answer>...</answer>` in `text`, stripped; None if there is none."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def normalize_answer(text: str) -> str:
    """HotpotQA/SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _candidates(ground_truth: Any) -> list[str]:
    return [str(g) for g in ground_truth] if isinstance(ground_truth, (list, tuple)) else [str(ground_truth)]


def exact_match(response: str, ground_truth: Any, trajectory: Any = None) -> float:
    """1.0 when the extracted answer equals a ground truth after normalisation."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return float(any(normalize_answer(answer) == normalize_answer(g) for g in _candidates(ground_truth)))


def f1_score(prediction: str, truth: str) -> float:
    """Token F1 between two strings after normalisation (0 when either is empty)."""
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = Counter(pred) & Counter(gold)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision, recall = num_same / len(pred), num_same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1(response: str, ground_truth: Any, trajectory: Any = None) -> float:
    """Best token F1 of the extracted answer against the ground truths."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return max(f1_score(answer, g) for g in _candidates(ground_truth))


def _number(text: str) -> float | None:
    match = re.search(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?", text)
    if not match:
        return None
    try:
        return float(match.group(0).replace(",", ""))
    except ValueError:
        return None


def numeric(response: str, ground_truth: Any, trajectory: Any = None, rel_tol: float = 1e-6) -> float:
    """1.0 when the first number of the extracted answer equals the ground-truth number."""
    answer = extract_answer(response)
    value = None if answer is None else _number(answer)
    if value is None:
        return 0.0
    for g in _candidates(ground_truth):
        target = _number(g)
        if target is not None and math.isclose(value, target, rel_tol=rel_tol, abs_tol=1e-9):
            return 1.0
    return 0.0


def format_reward(response: str, ground_truth: Any = None, trajectory: Any = None) -> float:
    """1.0 for exactly one answer block and only well-formed tool calls; -1.0 otherwise.

    Use it with a small weight as a format bonus/penalty.
    """
    ok = len(_ANSWER.findall(response)) == 1
    if trajectory is not None:
        ok = ok and all(
            c.status not in ("malformed", "unknown_tool", "bad_arguments") for c in trajectory.tool_calls
        )
    return 1.0 if ok else -1.0


BUILTIN_REWARDS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "em": exact_match,
    "f1": f1,
    "numeric": numeric,
    "format": format_reward,
}


def get_reward_fn(name: str) -> Callable[..., float]:
    """A built-in reward function or one named by dotted path."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if "." not in name and ":" not in name:
        raise ValueError(f"unknown reward {name!r}: use one of {sorted(BUILTIN_REWARDS)} or a dotted path")
    fn = load_object(name)
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn


def reward_weights(spec: dict) -> dict[str, float]:
    """{function name: weight} of a reward spec; ValueError naming what is wrong."""
    if not isinstance(spec, dict):
        raise ValueError(f"a reward spec must be a mapping, got {type(spec).__name__}")
    if "fns" in spec:
        fns = spec["fns"]
        if not isinstance(fns, dict) or not fns:
            raise ValueError("reward 'fns' must be a non-empty mapping of name -> weight")
        return {str(k): float(v) for k, v in fns.items()}
    if "fn" in spec:
        return {str(spec["fn"]): 1.0}
    raise ValueError("a reward spec needs 'fn' (a name) or 'fns' (name -> weight)")


def compute_reward(spec: dict, response: str, trajectory: Any = None) -> tuple[float, dict[str, float]]:
    """Weighted sum of the spec's reward functions, and each component's value.

    A non-finite component counts as 0 (and is reported as NaN in the components).
    """
    total, parts = 0.0, {}
    for name, weight in reward_weights(spec).items():
        value = float(get_reward_fn(name)(response, spec.get("ground_truth"), trajectory))
        parts[name] = value
        if math.isfinite(value):
            total += weight * value
    return total, parts
