"""The schema of a run's configuration: one small dataclass per section.

Every field has a docstring under it saying what it does and where it is read; choices are
`Literal` types and number ranges are in the type (`PositiveInt`, `Annotated[float, Range(...)]`,
`config/constraints.py`), all checked when the config is loaded (`config/load.py`). Checks that involve several
fields are in `config/validate.py`; what the run derives from the config is in `config/plan.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from megatron_agent.config.constraints import (
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
)
from megatron_agent.errors import InputError

BUILTIN_TOOLS = ("calculator", "search", "python")
"""The tools `tools.enabled` names without a dotted path (envs/tools/)."""

KILL_PHASES = ("rollout", "update", "save")
"""Where `debug.hold_at` can hold a run (train/kill_points.py)."""

KLEstimator = Literal["k1", "abs", "k2", "k3", "k1+", "k3+"]
"""The KL estimators of rl/kl.py (k3+ is k3's value with k2's gradient)."""


@dataclass
class ModelConfig:
    """The HF model the actor, reference and rollout engine start from."""

    path: str = ""
    """HF folder (config.json + safetensors + tokenizer); empty means a tiny model made on the fly."""
    tiny_family: Literal["llama", "qwen2", "qwen3", "quickstart"] = "qwen2"
    """Tiny model made when `path` is empty: llama, qwen2, qwen3, or quickstart (digit tokenizer)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter and compute dtype of the Megatron models: fp32 or bf16."""
    fp8: Literal["", "delayed", "tensorwise", "mxfp8", "blockwise"] = ""
    """FP8 recipe on GPU with Transformer Engine: '' (off), 'delayed', 'tensorwise', 'mxfp8'."""
    transformer_impl: Literal["auto", "te", "local"] = "auto"
    """Layer spec: 'auto' (Transformer Engine where TE and a GPU are present), 'te' or 'local'."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation in training: 'none', 'selective' (core attention) or 'full' (every layer)."""
    ref_offload: bool = False
    """Keep the frozen reference model's weights on the CPU between uses (GPU memory saving)."""
    logprob_chunk_tokens: PositiveInt = 1024
    """Tokens per chunk of the vocab-parallel log-prob/entropy computation (bounds memory)."""


@dataclass
class ParallelConfig:
    """Megatron model parallelism: the trainer's world is tp * pp * dp ranks."""

    tp: PositiveInt = 1
    """Tensor-parallel size."""
    dp: PositiveInt = 1
    """Data-parallel size of the trainer (Megatron workers = tp * pp * dp)."""
    pp: PositiveInt = 1
    """Pipeline-parallel size."""
    vpp: PositiveInt = 1
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B); 1 means off."""


@dataclass
class RolloutConfig:
    """The rollout engine and the agent loop."""

    engine: Literal["vllm", "hf"] = "vllm"
    """Rollout engine: 'vllm' (default) or 'hf' (transformers generate; a debugging aid only)."""
    n: PositiveInt = 4
    """Trajectories sampled per prompt (the GRPO group size)."""
    num_engines: PositiveInt = 1
    """Rollout engine actors; each step's prompts are split across them."""
    max_engine_restarts: NonNegativeInt = 3
    """Engine processes that may die per run: each is replaced, synced and its prompts rolled out
    again (`rollout/engine_restarts`); one more death stops the run (docs/faults.md)."""
    colocate: bool = True
    """GPU: engines share the trainer's GPUs (the engine sleeps during the update); else separate GPUs."""
    temperature: NonNegativeFloat = 1.0
    """Sampling temperature."""
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Nucleus sampling threshold."""
    top_k: Annotated[int, Range(ge=-1)] = -1
    """Top-k sampling (-1: off)."""
    max_new_tokens: PositiveInt = 64
    """Tokens generated per assistant turn at most."""
    max_turns: PositiveInt = 4
    """Assistant turns per trajectory at most."""
    max_total_tokens: PositiveInt = 512
    """Prompt plus response tokens per trajectory at most."""
    tp: PositiveInt = 1
    """vLLM tensor-parallel size (GPU)."""
    gpu_memory_utilization: Annotated[float, Range(gt=0, le=1)] = 0.5
    """vLLM's share of GPU memory (GPU)."""
    kv_cache_memory_bytes: NonNegativeInt = 0
    """vLLM KV-cache size on CPU; 0: what one batch's trajectories need at full length
    (`rollout.factory.kv_cache_bytes`)."""
    enable_sleep_mode: bool = False
    """GPU: start vLLM with sleep mode, so that `sleep()` frees its memory while the trainer runs."""
    max_trajectory_seconds: NonNegativeFloat = 0.0
    """Wall-clock budget of one trajectory in seconds (0: none); past it the trajectory ends ('timeout')."""
    stop_at_tool_call: bool = True
    """End an assistant turn at the first `</tool_call>` (else at EOS only, allowing several calls per turn)."""
    max_in_flight: PositiveInt = 256
    """Trajectories generating or running tools at the same time."""
    seed: NonNegativeInt = 0
    """Seed of the rollout engine's sampler."""
    quantization: Literal["", "fp8", "nvfp4_w4a16", "fp8_qdq", "nvfp4_qdq"] = ""
    """Rollout weights quantized by ModelOpt at every sync (docs/quantization.md): '' (the actor's
    dtype); 'fp8' or 'nvfp4_w4a16': vLLM computes with real FP8 / NVFP4 weights (GPU only);
    'fp8_qdq' or 'nvfp4_qdq': the same quantized values dequantized into the engine's dtype
    (anywhere: the same policy gap). algorithm.rollout_is=auto then means 'token'."""
    fp8_scales: Literal["tensor", "block128"] = "tensor"
    """FP8 formats (rollout.quantization, actor.qat): 'tensor' (one scale per weight) or 'block128'
    (per 128x128 tile)."""


@dataclass
class AlgorithmConfig:
    """Advantage estimation, KL and the policy loss."""

    adv_estimator: Literal[
        "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"
    ] = "grpo"
    """Advantage estimator; 'gae' trains a critic (the `critic` section) and is PPO's."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm."""
    clip_ratio_low: Annotated[
        float, Range(ge=0, lt=1, why="the ratio must stay above 1 - clip_ratio_low > 0")
    ] = 0.2
    """PPO lower clip (ratio >= 1 - clip_ratio_low)."""
    clip_ratio_high: NonNegativeFloat = 0.2
    """PPO upper clip (ratio <= 1 + clip_ratio_high)."""
    clip_ratio_c: Annotated[float, Range(gt=1, why="the dual clip bounds the ratio from above at c > 1")] = (
        3.0
    )
    """Dual-clip bound applied where the advantage is negative."""
    kl_loss_coef: NonNegativeFloat = 0.0
    """Weight of the KL loss term (0 disables it)."""
    kl_loss_estimator: KLEstimator = "k3+"
    """KL estimator for the loss term: k1, abs, k2, k3, k1+, k3+ (k3's value with k2's gradient)."""
    kl_reward_coef: NonNegativeFloat = 0.0
    """Weight of the per-token k1 KL subtracted from rewards (REINFORCE++ style)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    policy_loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    """Policy loss: 'vanilla' (PPO clip with dual clip) or 'gspo' (sequence-level ratio)."""
    log_ratio_clamp: PositiveFloat = 20.0
    """The policy log-ratio is clamped to [-x, x] before the exp (masked positions removed first)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False gives Dr.GRPO)."""
    gamma: Fraction = 1.0
    """Discount of reinforce_plus_plus and gae."""
    lam: Fraction = 1.0
    """GAE's lambda (the actor's advantages)."""
    lam_critic: Fraction | None = None
    """GAE's lambda for the critic's returns (None: `lam`)."""
    loss_agg_horizon: NonNegativeInt = 0
    """Constant horizon of seq-mean-token-sum-norm (Dr.GRPO); 0 means the maximum response length."""
    kl_reward_estimator: KLEstimator = "k1"
    """KL estimator for the KL-in-reward term (REINFORCE++ uses k1)."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """KL coefficient controller for the KL-in-reward coefficient: 'fixed' or 'adaptive'."""
    kl_target: PositiveFloat = 0.1
    """Adaptive KL controller: target mean per-token KL."""
    kl_horizon: PositiveInt = 10000
    """Adaptive KL controller: horizon (in samples) of the proportional update."""
    rollout_is: Literal["auto", "none", "token", "sequence"] = "auto"
    """Rollout-vs-trainer importance weights in the policy loss: 'none', 'token' or 'sequence';
    'auto': 'token' with an off-policy loss or quantized rollout weights (rollout.quantization),
    else 'none' (`RunPlan.rollout_is`)."""
    rollout_is_cap: Annotated[
        float, Range(ge=1, why="a cap below 1 would cut on-policy tokens, whose weight is 1")
    ] = 2.0
    """Cap of the rollout importance weights."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """Weights above the cap: 'truncate' (cap them) or 'mask' (drop the token or sequence)."""
    off_policy_loss: Literal["", "decoupled", "tis"] = ""
    """Off-policy correction (required with trainer.mode=async; docs/async.md): proximal log-probs
    from the trainer before the update (the PPO clip is on pi/pi_prox) and the behaviour weight
    pi_prox/pi_engine at `rollout_is`'s level ('auto': token), 'decoupled' dropping weights above
    `rollout_is_cap` (AReaL), 'tis' capping them (truncated IS). '': none (then `rollout_is_mode`)."""
    mismatch_thresholds: list[PositiveFloat] = field(default_factory=lambda: [0.1, 1.0])
    """|old - rollout| log-prob thresholds reported as mismatch/frac_abs_diff_gt_{t}."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards all tie and generate more until the batch is full."""
    max_num_gen_batches: PositiveInt = 4
    """Dynamic sampling: generation rounds per step at most (then train on what was kept)."""
    overlong_buffer_len: NonNegativeInt = 0
    """Overlong penalty: responses within this many tokens of the limit lose reward linearly (0: off)."""
    overlong_penalty_factor: NonNegativeFloat = 1.0
    """Overlong penalty at the limit itself (reward minus this factor)."""
    guard_enabled: bool = True
    """Check loss, gradients and per-token log-ratios before each optimizer step; skip on a breach."""
    guard_max_abs_log_ratio: PositiveFloat | None = 20.0
    """Guard: largest |logprob - old_logprob| allowed on a loss token (None: off)."""
    guard_max_ratio: Annotated[float, Range(gt=1, why="an on-policy token has ratio 1")] | None = None
    """Guard: largest exp(logprob - old_logprob) allowed on a loss token (None: off)."""
    guard_max_rollout_abs_log_ratio: PositiveFloat | None = 20.0
    """Guard: largest |old_logprob - rollout_logprob| allowed on a loss token (None: off)."""
    guard_max_abs_kl: PositiveFloat | None = None
    """Guard: largest |logprob - ref_logprob| allowed on a loss token (None: off)."""
    guard_max_grad_norm: PositiveFloat | None = None
    """Guard: largest total gradient norm before clipping (None: off; non-finite always breaches)."""
    guard_top_k: PositiveInt = 5
    """Guard: tokens listed per ranking in the culprit report."""
    guard_max_consecutive_skips: NonNegativeInt = 3
    """Guard: steps in a row that may be skipped; one more breach stops the run with GuardError."""


@dataclass
class ActorConfig:
    """The actor's optimisation: PPO epochs, mini- and micro-batches, optimizer, schedule."""

    ppo_mini_batch_size: NonNegativeInt = 0
    """Prompts per optimizer step (each with its rollout.n samples); 0 means data.train_batch_size."""
    ppo_epochs: PositiveInt = 1
    """Passes over each step's rollouts."""
    micro_batch_tokens: PositiveInt = 4096
    """Token budget per micro-batch (sequences are packed up to it)."""
    qat: Literal["", "fp8", "nvfp4_w4a16"] = ""
    """Quantization-aware training: the actor's forward fake-quantizes its decoder linear weights
    with ModelOpt as the rollout's weights are (the family of rollout.quantization; FP8 scales of
    rollout.fp8_scales), gradients passing straight through; '' : off (quant/qat.py)."""
    old_logprobs: Literal["auto", "recompute"] = "auto"
    """Where the old (proximal) log-probs come from: 'recompute' (a forward-only pass of the actor
    before the update) or 'auto' (from the update's own forward when the step is on-policy: one
    PPO epoch, one mini-batch and no KL in the reward, so that old == current and the ratio is
    exactly 1; rollout IS weights are then computed in the loss; otherwise recomputed)."""
    lr: NonNegativeFloat = 1e-5
    """Peak learning rate."""
    lr_warmup_steps: NonNegativeInt = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: 'constant', 'linear' or 'cosine' decay to `min_lr` at the last optimizer step."""
    min_lr: NonNegativeFloat = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    grad_clip: NonNegativeFloat = 1.0
    """Global gradient-norm clip (0: off)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (optimizer state sharded over data-parallel ranks)."""


@dataclass
class CriticConfig:
    """The PPO critic (`algorithm.adv_estimator=gae`): a value model built like the actor, from the
    actor's starting weights with a new value head, on the actor's ranks (`placement=colocated`)
    or on ranks of its own with their own layout (`placement=separate`)."""

    placement: Literal["colocated", "separate"] = "colocated"
    """'colocated': the critic lives on the actor's Megatron ranks, at their layout (no extra
    processes or GPUs); 'separate': a Ray worker group of its own (tp * pp * dp more ranks, one
    GPU each on GPU) whose value pass and update run while the actor's run."""
    tp: NonNegativeInt = 0
    """Tensor-parallel size of a separate critic (0: parallel.tp)."""
    pp: NonNegativeInt = 0
    """Pipeline-parallel size of a separate critic (0: parallel.pp)."""
    vpp: NonNegativeInt = 0
    """Virtual pipeline stages of a separate critic (0: parallel.vpp when the pipeline size is the
    actor's, else 1)."""
    dp: NonNegativeInt = 0
    """Data-parallel size of a separate critic (0: parallel.dp)."""
    lr: NonNegativeFloat = 1e-5
    """Peak learning rate."""
    lr_warmup_steps: NonNegativeInt = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: 'constant', 'linear' or 'cosine' decay to `min_lr` at the last optimizer step."""
    min_lr: NonNegativeFloat = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    grad_clip: NonNegativeFloat = 1.0
    """Global gradient-norm clip (0: off)."""
    ppo_epochs: PositiveInt = 1
    """Passes of the critic over each step's rollouts (the actor's mini-batches)."""
    values: Literal["auto", "pass"] = "auto"
    """Where the values before the update come from. 'auto': from the critic update's own forward
    when that forward sees the weights the values are of (a colocated critic, one epoch, one
    mini-batch: `RunPlan.values_from_update`), the step's returns computed there, sequence by
    sequence; otherwise, and with 'pass', from a forward-only value pass before the update."""
    cliprange_value: PositiveFloat = 0.5
    """A value may move this far from the rollout's value before the clip stops its gradient."""
    init_from: str = ""
    """A whole-run checkpoint of a gae run whose critic (critic/model, its head included) the
    critic starts from, instead of the actor's weights and a new head (to skip the warm-up)."""


@dataclass
class DataConfig:
    """Prompt datasets."""

    train_path: str = ""
    """Parquet or jsonl task file; empty means synthetic tasks generated on the fly."""
    val_path: str = ""
    """Held-out task file for validation; empty means synthetic tasks with another seed."""
    train_batch_size: PositiveInt = 4
    """Prompts per RL step (each sampled rollout.n times)."""
    val_batch_size: NonNegativeInt = 0
    """Validation tasks used per validation (0: all of the validation set)."""
    shuffle: bool = True
    """Shuffle the training tasks every epoch."""
    seed: NonNegativeInt = 1234
    """Shuffling seed."""
    max_prompt_length: PositiveInt = 1024
    """Prompt tokens at most; longer prompts are skipped and counted (data/skipped_rows)."""
    synthetic: Literal["arithmetic", "multihop"] = "arithmetic"
    """Synthetic tasks used when the task path is empty: arithmetic (calculator) or multihop (search)."""
    num_synthetic_tasks: PositiveInt = 16
    """How many synthetic tasks to generate."""
    arithmetic_max_depth: PositiveInt = 2
    """Nesting depth of synthetic arithmetic questions (1: `a op b`)."""
    num_synthetic_val_tasks: PositiveInt = 32
    """How many synthetic validation tasks to generate (when val_path is empty)."""


@dataclass
class PythonToolConfig:
    """The `python` tool's sandbox and limits."""

    sandbox: Literal["strict", "auto", "off"] = "auto"
    """'auto' and 'strict': bubblewrap, and the run refuses to start where it cannot hold a call; 'off': no sandbox, on purpose."""
    memory_mb: Annotated[
        int, Range(ge=48, why="the interpreter and the /dev/shm of a call need about 32 MiB")
    ] = 512
    """Memory budget of one call in MiB: every process, its working folder and /dev/shm together."""
    max_processes: PositiveInt = 8
    """Processes (and threads) one call may have at once."""
    tmp_mb: Annotated[int, Range(ge=1, why="the snippet's file is written there")] = 64
    """Size of a call's working folder (a tmpfs) in MiB, inside memory_mb."""


@dataclass
class ToolsConfig:
    """Tools available to the agent."""

    enabled: list[str] = field(default_factory=lambda: ["calculator"])
    """Tool names (built-ins) or dotted paths of user tools."""
    timeout_s: PositiveFloat = 10.0
    """Per-call timeout in seconds of every tool (the python tool's process tree is killed at it)."""
    max_tool_response_tokens: PositiveInt = 256
    """Tool output longer than this is truncated."""
    truncate_side: Literal["left", "middle", "right"] = "middle"
    """Part of a too-long tool output that is dropped: left, middle or right."""
    search_index_dir: str = ""
    """Folder of the prebuilt BM25 index of the `search` tool (see envs/tools/search.py)."""
    search_top_k: PositiveInt = 3
    """Passages returned by one `search` call."""
    max_concurrent: NonNegativeInt = 0
    """python tool calls running at once per engine (the rest wait); 0: one per core, within half the free memory."""
    python: PythonToolConfig = field(default_factory=PythonToolConfig)
    """The python tool."""


@dataclass
class SFTConfig:
    """Supervised warm start on chat data (`sft` command, or before RL in `train` when steps > 0)."""

    steps: NonNegativeInt = 0
    """Optimizer steps of SFT (0: none)."""
    data_path: str = ""
    """jsonl or parquet of {"messages": [...], "tools": [...]}; empty means synthetic calculator demos."""
    num_synthetic: PositiveInt = 2000
    """Synthetic demonstrations generated when data_path is empty."""
    tool_use_rate: Fraction = 0.3
    """Share of synthetic demonstrations that call the calculator (the rest answer with a guess)."""
    batch_size: PositiveInt = 32
    """Conversations per SFT step."""
    lr: NonNegativeFloat = 2e-3
    """SFT peak learning rate (linear warmup, then cosine decay to min_lr_ratio * lr)."""
    warmup_steps: NonNegativeInt = 20
    """Linear warmup steps of the SFT learning rate."""
    min_lr_ratio: Fraction = 0.1
    """SFT learning rate at the last step, as a share of `lr`."""
    seed: NonNegativeInt = 7
    """Seed of the synthetic demonstrations and their order."""


@dataclass
class SyncConfig:
    """Megatron -> rollout engine weight sync after every update."""

    bucket_mb: PositiveInt = 256
    """Size of one flat transfer buffer in MiB (a larger tensor travels alone)."""
    verify: bool = True
    """Check a checksum per bucket and probe log-probs (engine vs actor) after every sync."""
    probe_tol_fp32: PositiveFloat = 1e-4
    """Largest |engine - actor| probe log-prob allowed in fp32."""
    probe_tol_bf16: PositiveFloat = 0.1
    """Largest |engine - actor| probe log-prob allowed in bf16."""
    probe_tol_fp8: PositiveFloat = 0.5
    """Largest |engine - actor| probe log-prob allowed for an FP8 engine (rollout.quantization=fp8 or
    fp8_qdq) unless the actor's forward is quantized alike (actor.qat): the rollout dtype's then."""
    probe_tol_nvfp4: PositiveFloat = 1.0
    """Largest |engine - actor| probe log-prob allowed for an NVFP4 engine (nvfp4_w4a16, nvfp4_qdq)
    unless the actor's forward is quantized alike (actor.qat)."""
    timeout_s: PositiveFloat = 300.0
    """An engine that does not answer a sync call within this many seconds is an error."""
    transport: Literal["auto", "direct", "shm", "cuda_ipc", "nccl"] = "auto"
    """'auto' (from where the engine lives), 'direct', 'shm', 'cuda_ipc' or 'nccl'."""


@dataclass
class TrainerConfig:
    """The run: steps, validation, run folder, resume, seeds."""

    total_steps: NonNegativeInt = 10
    """RL steps to run."""
    run_dir: str = "runs/default"
    """Run folder: metrics.jsonl, rollout dumps, guard reports, checkpoints, plot."""
    test_freq: NonNegativeInt = 0
    """Validate every N steps (and before the first step); 0: only before the first and after the last."""
    dump_rollouts: bool = True
    """Write rollouts/step_{N:06d}.jsonl each step."""
    resume: str = "auto"
    """'auto' (newest complete checkpoint in the run folder), 'never', or a checkpoint folder."""
    critic_warmup: NonNegativeInt = 0
    """First RL steps in which only the critic trains (the actor waits; algorithm.adv_estimator=gae)."""
    deterministic: bool = False
    """Bitwise-repeatable rollouts and updates on CPU for the same seed: per-request sampling seeds
    from (step, trajectory uid, turn), a lockstep engine schedule and an empty prefix cache at
    each rollout, so a killed and resumed run repeats an uninterrupted one (docs/resume.md)."""
    seed: NonNegativeInt = 42
    """Seed of every RNG (torch, numpy, python, Megatron's TP RNG tracker)."""
    init_from: str = ""
    """Checkpoint (e.g. written by `sft`) whose weights the actor starts from instead of model.path."""
    worker_timeout_s: PositiveFloat = 600.0
    """A worker call that does not return within this many seconds is an error naming the worker."""
    mode: Literal["sync", "async"] = "sync"
    """'sync': generate, then train, each step; 'async': the engines generate the next steps' groups
    while the actor trains, under the staleness bound `async.max_staleness` (docs/async.md)."""


@dataclass
class AsyncConfig:
    """Asynchronous RL (`trainer.mode=async`; the YAML and override key is `async`)."""

    max_staleness: NonNegativeInt = 1
    """eta: a group is admitted (its generation starts) only while fewer than (eta + 1) x
    data.train_batch_size groups are ahead of the trainer's weight version, so no trained token
    was sampled more than eta versions before the update that trains it. 0: the synchronous run."""
    keep_kv: bool = False
    """Requests that a weight sync interrupts keep their KV cache (computed with the old weights),
    and the prefix cache stays; false (the default) recomputes it under the new weights."""
    interrupt_after_engine_steps: PositiveInt = 16
    """Deterministic mode: a batch that a sync will interrupt pauses after this many engine steps
    of its rollout and takes the new weights there (or at its end, if shorter), so the schedule
    is a function of the config. Otherwise a sync interrupts the engines when it arrives."""
    share_cores: bool = True
    """CPU runs that are not deterministic: while a rollout engine of its machine generates, a
    Megatron rank runs on half its threads (all of them otherwise), so that the two do not hold
    each other up on the same cores (`platform/core_sharing.py`). No effect on GPU."""


@dataclass
class RayConfig:
    """Where the Ray cluster comes from."""

    address: str = ""
    """'' starts a local cluster sized to the machine; 'auto' or HOST:PORT joins an existing one."""
    num_cpus: NonNegativeInt = 0
    """CPUs of the local cluster (0: all of this machine's)."""


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save_dir: str = ""
    """Where checkpoints go; empty means <run_dir>/checkpoints."""
    save_freq: NonNegativeInt = 0
    """Save every N steps (0: only at the end)."""
    keep_last: PositiveInt = 2
    """Complete checkpoints kept (older ones removed only after a new one is complete)."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """A save that fails (e.g. a full disk): 'stop' (exit 1 naming the path; the previous checkpoint
    stays) or 'continue' (a warning and `checkpoint/save_errors`; the run goes on). docs/faults.md."""


@dataclass
class DebugConfig:
    """Fault drills (docs/faults.md); all off by default."""

    nan_logits_step: NonNegativeInt = 0
    """RL step whose update gets a NaN in the actor's logits (0: off)."""
    nan_logits_sample: NonNegativeInt = 0
    """Which trajectory of that step: its index in the step's batch (line of rollouts/step_N.jsonl)."""
    nan_logits_token: NonNegativeInt = 0
    """Which token of it: index into its response_ids (0: the first response token)."""
    forced_first_turn: str = ""
    """Text the engines must emit as every trajectory's first assistant turn (makes a random model
    call tools; '' off)."""
    kill_engine_at_step: NonNegativeInt = 0
    """RL step at whose rollout engine 0's process kills itself (SIGKILL) after a few engine steps;
    once per run folder, the replacement does not (0: off)."""
    hold_at: str = ""
    """'PHASE:STEP' (rollout, update or save): hold the run there until it is killed, for resume
    drills (megatron_agent/train/kill_points.py); '' off."""


@dataclass
class LoggingConfig:
    """Metrics outputs besides metrics.jsonl and the console table."""

    tensorboard: bool = False
    """Also write tensorboard event files to <run_dir>/tensorboard."""
    wandb_project: str = ""
    """Also log to this wandb project (empty: off; WANDB_MODE=offline works without a network)."""
    plot: bool = True
    """Redraw <run_dir>/metrics.png every step."""
    progress_bars: bool = True
    """Progress bars for the rollout and update phases (only when stderr is a terminal)."""


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallelism."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engine and agent loop."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL algorithm."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Actor optimisation."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The PPO critic (algorithm.adv_estimator=gae)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """Tools."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Weight sync to the rollout engines."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The run."""
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    """Asynchronous RL (key `async` in YAML and overrides: `async` is a Python keyword)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Ray cluster."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Logging."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Fault injection for drills and tests."""


class ConfigError(InputError):
    """A configuration key or value is wrong; the message names it."""

    @classmethod
    def of(cls, problems: list[str]) -> ConfigError:
        """One error reporting every problem (one per line when there are several)."""
        if len(problems) == 1:
            return cls(problems[0])
        return cls(f"{len(problems)} problems in the config:\n  " + "\n  ".join(problems))
