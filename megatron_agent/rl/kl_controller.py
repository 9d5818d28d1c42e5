"""KL coefficient controllers: fixed, and adaptive (Ziegler et al. 2019, as in PPO-RLHF).

The trainer reads `controller.value` as the KL coefficient (in the reward or the loss) and calls
`controller.update(current_kl, num_steps)` once per RL step with the measured mean KL.
Both have `state_dict` / `load_state_dict` so that a resumed run continues with the same value.
"""

from __future__ import annotations

KL_CONTROLLERS = ("fixed", "adaptive")


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, num_steps: int) -> None:
        """No-op (the coefficient is fixed)."""

    def state_dict(self) -> dict:
        """The controller's state (its value)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller driving the measured KL towards `target_kl`.

    value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * num_steps / horizon
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ValueError(f"adaptive KL controller needs target_kl > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, num_steps: int) -> None:
        """Move the coefficient after `num_steps` samples (or steps) measured `current_kl`."""
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_steps / self.horizon

    def state_dict(self) -> dict:
        """The controller's state (its value)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict`."""
        self.value = float(state["value"])


def make_kl_controller(
    kind: str, kl_coef: float, *, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named `kind` ('fixed' or 'adaptive') starting at `kl_coef`."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; expected one of {', '.join(KL_CONTROLLERS)}")
