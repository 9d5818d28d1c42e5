"""torchrun worker of tests/quant/test_qat_sync.py: quantized weights at TP1PP1 and TP2PP2.

For each layout and format ('fp8', 'nvfp4'): the actor is built, synced once into a recording
engine process that asks for `<format>_qdq` weights (what it is given to load is written to
disk), its HF tensors are gathered for the reference, then QAT is switched on: the log-probs of
fixed sequences (to compare with the HF model with ModelOpt-quantized weights) and one optimizer
step (the straight-through gradient must move the weights). Rank 0 writes JSON and safetensors.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from tests.helpers.mp_logprobs_worker import parse_layout, sequences


class QuantizedRecorder:
    """An 'engine' that asks for dequantized quantized weights and records what it is given."""

    def __init__(self, model_path, out_dir, quantization, fmt):
        self.out_dir, self.weight_version, self.num_updates = out_dir, 0, 0
        self.quantization = {"quantization": quantization, "format": fmt}

    def update_weights(self, named_tensors):
        from safetensors.torch import save_file

        path = os.path.join(self.out_dir, f"bucket{self.num_updates}.safetensors")
        save_file({n: t.clone() for n, t in named_tensors}, path)
        self.num_updates += 1
        self.weight_version += 1
        return self.weight_version


def record_sync(model, model_path, out_dir, fmt_name):
    """Sync `model` once into a recorder asking for `<fmt>_qdq` (fp32 wire), into `out_dir`."""
    from megatron_agent.config import SyncConfig
    from megatron_agent.sync import SubprocessEndpoint, WeightSender
    from megatron_agent.sync.producer import SyncRole

    recorder = None
    if dist.get_rank() == 0:
        os.makedirs(out_dir)
        kwargs = {"out_dir": out_dir, "quantization": f"{fmt_name}_qdq", "fmt": fmt_name}
        recorder = SubprocessEndpoint(
            model_path, kwargs, name="recorder", engine_class="tests.quant.qat_sync_worker:QuantizedRecorder"
        )
    box = [recorder.handle if recorder else None]
    dist.broadcast_object_list(box, src=0)
    endpoints = [recorder or SubprocessEndpoint.connect(box[0])] if SyncRole.current().is_sender else []
    WeightSender(model, SyncConfig(bucket_mb=1, timeout_s=120, verify=False), endpoints).sync()
    if recorder is not None:
        recorder.close()


def hf_state(model):
    """Collective: the actor's HF tensors (rank 0 of each stage's sender gathers; all to rank 0)."""
    from megatron_agent.weights.export import iter_hf_tensors

    local = {n: t.detach().clone() for n, t in iter_hf_tensors(model.chunks, model.arch)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    state = {}
    for part in gathered:
        state.update(part)
    return state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", nargs="+", required=True)  # layout=model_path
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel
    from megatron_agent.platform.setup import init_distributed
    from megatron_agent.quant.formats import FORMATS
    from megatron_agent.quant.qat import enable_qat

    init_distributed()
    results, seqs = {}, sequences()
    for spec in args.layouts:
        layout, model_path = spec.split("=")
        tp, pp, vpp = parse_layout(layout)
        init_model_parallel(tp, pp, vpp)
        for fmt_name in ("fp8", "nvfp4"):
            key = f"{layout}/{fmt_name}"
            model = policy_from_hf(
                model_path, BuildOptions(tp=tp, pp=pp, vpp=vpp), trainable=True, optim=OptimConfig(lr=1e-2)
            )
            record_sync(model, model_path, os.path.join(args.out_dir, key.replace("/", "_")), fmt_name)
            state = hf_state(model)
            wrapped = enable_qat(model.chunks, model.arch, FORMATS[fmt_name], tp)
            logp = model.logprobs(seqs, max_tokens=64)
            mine = (
                [x.tolist() for x in logp]
                if logp is not None and ps.get_tensor_model_parallel_rank() == 0
                else None
            )
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)

            def loss_fn(mb, logp_BT, entropy_BT):
                return -(torch.where(mb.valid_BT > 0, logp_BT, 0.0)).sum() / 80.0, {}

            model.train_step(seqs[:4], loss_fn, max_tokens=64)
            after = hf_state(model)
            if dist.get_rank() == 0:
                from safetensors.torch import save_file

                save_file(state, os.path.join(args.out_dir, f"{key.replace('/', '_')}_actor.safetensors"))
                moved = [n for n in state if not torch.equal(state[n], after[n])]
                results[key] = {
                    "logprobs": next(g for g in gathered if g is not None),
                    "wrapped": wrapped,
                    "moved": moved,
                }
            del model
        destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(os.path.join(args.out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()


if __name__ == "__main__":
    main()
