"""A transformers-`generate` engine with the `VLLMEngine` interface: a debugging aid, never the default.

It is slow (one request at a time, no KV-cache sharing) and exists to cross-check the vLLM path
on a machine where vLLM misbehaves. Log-probs are the model's raw log-softmax at each step
(before temperature/top-p/top-k), the same quantity `VLLMEngine` returns.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable, Sequence

import torch

from megatron_agent.rollout.engine import GenerationOutput, SamplingConfig


class HFEngine:
    """transformers model + `generate`, with `generate`, `add_request`/`step` and `update_weights`."""

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "float32", seed: int = 0):
        """Load the HF folder `model_path` on the CPU (or the current GPU)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = (
            AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype).to(self.device).eval()
        )
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.weight_version = 0
        self._queue: collections.deque = collections.deque()
        self._counter = 0
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    @property
    def eos_token_id(self) -> int:
        """End-of-turn token id."""
        return int(self.tokenizer.eos_token_id)

    @torch.no_grad()
    def _generate_one(self, prompt: Sequence[int], sampling: SamplingConfig) -> GenerationOutput:
        ids = torch.tensor([list(prompt)], device=self.device)
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else {self.eos_token_id})
        out_ids, logprobs, past, finish, stop_reason = [], [], None, "length", None
        step_input = ids
        for _ in range(sampling.max_tokens):
            res = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            token = self._sample(logits, sampling)
            out_ids.append(token)
            logprobs.append(float(logp[token]))
            step_input = torch.tensor([[token]], device=self.device)
            if token in stops:
                finish = "stop"
                stop_reason = None if token == self.eos_token_id else token
                break
            if sampling.stop:
                text = self.tokenizer.decode(out_ids, skip_special_tokens=False)
                hit = next((s for s in sampling.stop if s in text), None)
                if hit is not None:
                    finish, stop_reason = "stop", hit
                    break
        return GenerationOutput(out_ids, logprobs, finish, stop_reason, self.weight_version)

    def _sample(self, logits: torch.Tensor, sampling: SamplingConfig) -> int:
        if sampling.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / sampling.temperature
        if sampling.top_k > 0:
            kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
            logits = torch.where(logits < kth, float("-inf"), logits)
        probs = torch.softmax(logits, dim=-1)
        if sampling.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(sorted_p, 0) - sorted_p > sampling.top_p
            probs[order[drop]] = 0.0
            probs = probs / probs.sum()
        return int(torch.multinomial(probs.cpu(), 1, generator=self._generator))

    def generate(
        self, prompts_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[list[GenerationOutput]]:
        """`sampling.n` samples per prompt, in prompt order."""
        return [[self._generate_one(p, sampling) for _ in range(sampling.n)] for p in prompts_token_ids]

    def add_request(self, prompt_token_ids: Sequence[int], sampling: SamplingConfig) -> str:
        """Queue one request; `step()` runs it to completion."""
        self._counter += 1
        request_id = f"hf-{self._counter}"
        self._queue.append((request_id, list(prompt_token_ids), sampling))
        return request_id

    def step(self) -> list[tuple[str, GenerationOutput]]:
        """Run the oldest queued request fully."""
        if not self._queue:
            return []
        request_id, prompt, sampling = self._queue.popleft()
        return [(request_id, self._generate_one(prompt, sampling))]

    def abort(self, request_ids: list[str]) -> None:
        """Drop queued requests."""
        drop = set(request_ids)
        self._queue = collections.deque(r for r in self._queue if r[0] not in drop)

    def has_unfinished_requests(self) -> bool:
        """Whether requests are queued."""
        return bool(self._queue)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model in place; returns the new weight version."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise ValueError(f"unknown weight name {name!r} for {type(self.model).__name__}")
            params[name].copy_(tensor.to(params[name].dtype))
        self.weight_version += 1
        return self.weight_version

    def sleep(self, level: int = 1) -> None:
        """No-op (kept for interface parity)."""

    def wake_up(self) -> None:
        """No-op (kept for interface parity)."""
