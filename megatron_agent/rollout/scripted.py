"""A scripted policy for tests and debugging: force the engine to emit given token ids.

`ForcedTokensLogitsProcessor` is a vLLM V1 logits processor. A request whose
`SamplingParams.extra_args` holds `{"forced_token_ids": [...]}` can only sample those ids, one
per step, in order (after the script it samples freely). Because the engine runs with
`logprobs_mode="raw_logprobs"`, the log-probs it returns for forced tokens are still the model's
own log p(token | prefix): the trajectories are real engine outputs, only the choice is scripted.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

FORCED_KEY = "forced_token_ids"


class ForcedTokensLogitsProcessor(AdapterLogitsProcessor):
    """Restrict each step of a request to the next id of `extra_args['forced_token_ids']`."""

    def is_argmax_invariant(self) -> bool:
        """It changes the argmax, so it must also run under greedy sampling."""
        return False

    def new_req_logits_processor(self, params):
        """Per-request processor, or None when the request has no script."""
        script = (params.extra_args or {}).get(FORCED_KEY)
        if not script:
            return None
        script = [int(t) for t in script]

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            pos = len(output_ids)
            if pos >= len(script):
                return logits
            forced = torch.full_like(logits, float("-inf"))
            forced[script[pos]] = 0.0
            return forced

        return force
