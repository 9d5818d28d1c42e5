"""torchrun worker for the weight-sync tests (run by tests/sync/test_sync_layouts.py and test_sync_failures.py).

`--mode layouts`: rank 0 starts one vLLM engine process per model; for every layout, the actor
is built at that TP x PP (x VPP) over all ranks (the rest is data parallel), synced, trained,
synced again three times; each sync's engine and actor log-probs of test sequences are recorded.
Optionally (`--export`) the last layout's streamed tensors and a checkpoint are written for the
export comparison.

`--mode failures` (one rank): a skipped sync, dropped and corrupted buckets, a stopped engine
and a killed engine; every error message is recorded.
"""

import argparse
import dataclasses
import json
import os
import signal
import time

import torch
import torch.distributed as dist

from tests.helpers.mp_logprobs_worker import parse_layout, sequences


class RecordingEngine:
    """An 'engine' process that writes every bucket it loads to out_dir (for the export comparison)."""

    def __init__(self, model_path, out_dir):
        self.weight_version = 0
        self.out_dir = out_dir
        self.num_updates = 0

    def update_weights(self, named_tensors):
        from safetensors.torch import save_file

        save_file(
            {n: t.clone() for n, t in named_tensors},
            os.path.join(self.out_dir, f"bucket{self.num_updates}.safetensors"),
        )
        self.num_updates += 1
        self.weight_version += 1
        return self.weight_version


class DropBucket:
    """Forwards to an endpoint but loses bucket `index` (and, with `hide`, its manifest entry)."""

    local = False

    def __init__(self, inner, index, hide):
        self.inner, self.index, self.hide = inner, index, hide

    def call(self, method, *args, **kwargs):
        from megatron_agent.sync.endpoints import EngineCall, _done

        if method == "load_bucket" and args[0].index == self.index:
            return EngineCall(_done({"checksum_s": 0.0, "load_s": 0.0}), lambda: "dropper", method)
        if method == "finish" and self.hide:
            sync_id, manifest, version = args
            manifest = {k: v for k, v in manifest.items() if k[1] != self.index}
            return self.inner.call(method, sync_id, manifest, version)
        return self.inner.call(method, *args, **kwargs)


class CorruptBucket:
    """Forwards to an endpoint after flipping one byte of tensor `entry` in shared-memory bucket 0."""

    local = False

    def __init__(self, inner, entry):
        self.inner, self.entry, self.corrupted = inner, entry, None

    def call(self, method, *args, **kwargs):
        if method == "load_bucket" and args[0].index == 0:
            header, payload = args[0], args[1]
            e = header.entries[self.entry]
            with open(payload["path"], "r+b") as f:
                f.seek(e.offset + e.nbytes // 2)
                b = f.read(1)
                f.seek(e.offset + e.nbytes // 2)
                f.write(bytes([b[0] ^ 0x10]))
            self.corrupted = e.name
        return self.inner.call(method, *args, **kwargs)


def engine_kwargs(cache_dir):
    return {"dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "seed": 0, "cache_dir": cache_dir}


def train(model, steps=2, seed=0):
    """A few optimizer steps of next-token NLL on random sequences (weights change visibly)."""
    g = torch.Generator().manual_seed(seed)
    # Four micro-batches of one sequence each: the interleaved (VPP) schedule needs a multiple
    # of the pipeline size (with one micro-batch it waits forever in its p2p exchange).
    seqs = [torch.randint(0, 330, (24,), generator=g).tolist() for _ in range(4)]

    def loss_fn(mb, logp_BT, entropy_BT):
        mask = mb.valid_BT
        return -(torch.where(mask > 0, logp_BT, 0.0)).sum() / 92.0, {}

    for _ in range(steps):
        model.train_step(seqs, loss_fn, max_tokens=32)


def start_engines(models, cache_dir):
    """Rank 0: one engine process per model, started together; everyone gets their handles."""
    from megatron_agent.sync import SubprocessEndpoint

    owned = {}
    if dist.get_rank() == 0:
        env = {"OMP_NUM_THREADS": "1"}
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(len(models)) as pool:
            futs = {
                m: pool.submit(
                    SubprocessEndpoint, m, engine_kwargs(cache_dir), env=env, name=os.path.basename(m)
                )
                for m in models
            }
            owned = {m: f.result() for m, f in futs.items()}
    box = [{m: ep.handle for m, ep in owned.items()}]
    dist.broadcast_object_list(box, src=0)
    return owned, box[0]


def run_layouts(args):
    from megatron.core import parallel_state as ps

    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.config import SyncConfig
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.platform.parallel import destroy_model_parallel, init_model_parallel
    from megatron_agent.platform.setup import init_distributed
    from megatron_agent.sync import SubprocessEndpoint, WeightSender

    init_distributed()
    pairs = [x.split("=") for x in args.layouts]  # layout=model_path
    owned, handles = start_engines(sorted({m for _, m in pairs}), args.cache)
    clients = {}
    results = {}
    test_seqs = sequences()
    for layout, model_path in pairs:
        tp, pp, vpp = parse_layout(layout)
        init_model_parallel(tp, pp, vpp)
        model = policy_from_hf(
            model_path, BuildOptions(tp=tp, pp=pp, vpp=vpp), trainable=True, optim=OptimConfig(lr=2e-3)
        )
        sender_rank = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
        if sender_rank and model_path not in clients:
            clients[model_path] = owned.get(model_path) or SubprocessEndpoint.connect(handles[model_path])
        endpoints = [clients[model_path]] if sender_rank else []
        sender = WeightSender(model, SyncConfig(bucket_mb=1, timeout_s=120), endpoints)
        if layout in args.small_buckets:
            sender.bucket_bytes = 64 << 10  # smaller than a gate/up unit: oversize buckets travel alone
        record = {"metrics": [], "engine": [], "actor": []}
        for k in range(4):
            if k:
                train(model, seed=k)
            record["metrics"].append(sender.sync())
            actor = model.logprobs(test_seqs, max_tokens=128)
            engine = None
            if sender.role.is_leader:
                engine = endpoints[0].call("probe", test_seqs).result(60)
            mine = {
                "engine": engine,
                "actor": [x.tolist() for x in actor] if sender.role.holds_probe else None,
            }
            got = [None] * dist.get_world_size()
            dist.all_gather_object(got, mine)
            record["engine"].append(next(g["engine"] for g in got if g["engine"] is not None))
            record["actor"].append(next(g["actor"] for g in got if g["actor"] is not None))
        if layout == args.export_layout:
            export(model, model_path, sender, args.out_dir)
        results[layout] = record
        destroy_model_parallel()
    for ep in owned.values():
        ep.close()
    if dist.get_rank() == 0:
        with open(os.path.join(args.out_dir, "layouts.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()


def export(model, model_path, sender, out_dir):
    """Stream once more into a recording engine process, and save a checkpoint of the same state."""
    from megatron_agent.checkpoint.model_io import save_checkpoint
    from megatron_agent.sync import SubprocessEndpoint, WeightSender

    streamed = os.path.join(out_dir, "streamed")
    recorder = None
    if dist.get_rank() == 0:
        os.makedirs(streamed)
        recorder = SubprocessEndpoint(
            model_path,
            {"out_dir": streamed},
            name="recorder",
            engine_class="tests.sync.sync_worker:RecordingEngine",
        )
    box = [recorder.handle if recorder else None]
    dist.broadcast_object_list(box, src=0)
    endpoints = []
    if sender.role.is_sender:
        endpoints = [recorder or SubprocessEndpoint.connect(box[0])]
    rec_sender = WeightSender(model, dataclasses.replace(sender.cfg, verify=False), endpoints)
    rec_sender.bucket_bytes = sender.bucket_bytes
    rec_sender.sync()
    if recorder is not None:
        recorder.close()
    save_checkpoint(os.path.join(out_dir, "ckpt"), model.chunks, model.arch, hf_dir=model_path)


def run_failures(args):
    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.config import SyncConfig
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.platform.parallel import init_model_parallel
    from megatron_agent.sync import SubprocessEndpoint, SyncError, WeightSender

    init_model_parallel(1, 1)
    ep = SubprocessEndpoint(
        args.model, engine_kwargs(args.cache), env={"OMP_NUM_THREADS": "1"}, name="victim"
    )
    model = policy_from_hf(args.model, BuildOptions(), trainable=True, optim=OptimConfig(lr=2e-3))
    cfg = SyncConfig(bucket_mb=1, timeout_s=60)
    out = {"pid": ep.pid}

    def attempt(key, endpoints, action="sync", timeout_s=None):
        sender = WeightSender(
            model, dataclasses.replace(cfg, timeout_s=timeout_s or cfg.timeout_s), endpoints
        )
        sender.num_syncs = 100 * len(out)  # distinct sync ids per attempt, as one long-lived sender has
        t0 = time.perf_counter()
        try:
            out[key] = {"ok": getattr(sender, action)()}
        except SyncError as e:
            out[key] = {"error": str(e)}
        out[key]["seconds"] = time.perf_counter() - t0

    attempt("first", [ep])
    train(model, seed=1)
    attempt("skipped", [ep], action="probe")
    attempt("dropped", [DropBucket(ep, 1, hide=False)])
    attempt("dropped_hidden", [DropBucket(ep, 1, hide=True)])
    corrupt = CorruptBucket(ep, entry=1)
    attempt("corrupted", [corrupt])
    out["corrupted"]["tensor"] = corrupt.corrupted
    attempt("recovered", [ep])
    os.kill(ep.pid, signal.SIGSTOP)
    train(model, seed=2)
    attempt("stopped", [ep], timeout_s=3)
    os.kill(ep.pid, signal.SIGKILL)
    attempt("killed", [ep], timeout_s=30)
    ep.close()
    with open(os.path.join(args.out_dir, "failures.json"), "w") as f:
        json.dump(out, f)


def run_gpu(args):
    """One rank on GPU: sync into a vLLM engine process over `--transport`, train, sync again."""
    from megatron_agent.build_policy import policy_from_hf
    from megatron_agent.config import SyncConfig
    from megatron_agent.models.build import BuildOptions
    from megatron_agent.models.policy import OptimConfig
    from megatron_agent.platform.parallel import init_model_parallel
    from megatron_agent.sync import SubprocessEndpoint, WeightSender

    init_model_parallel(1, 1)
    # NCCL cannot join two ranks on one GPU: the engine gets the second GPU there.
    env = {"CUDA_VISIBLE_DEVICES": "1"} if args.transport == "nccl" else {}
    kwargs = {"dtype": "float32", "gpu_memory_utilization": 0.2, "kv_cache_memory_bytes": None, "seed": 0}
    ep = SubprocessEndpoint(args.model, kwargs, env=env, name=f"gpu-{args.transport}")
    model = policy_from_hf(args.model, BuildOptions(), trainable=True, optim=OptimConfig(lr=2e-3))
    # GPU attention kernels differ from Megatron's more than the CPU ones: 2e-3 in fp32.
    cfg = SyncConfig(bucket_mb=1, transport=args.transport, probe_tol_fp32=2e-3, timeout_s=300)
    sender = WeightSender(model, cfg, [ep])
    out = {"metrics": [sender.sync()]}
    train(model, seed=1)
    out["metrics"].append(sender.sync())
    ep.close()
    with open(os.path.join(args.out_dir, f"gpu_{args.transport}.json"), "w") as f:
        json.dump(out, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["layouts", "failures", "gpu"], required=True)
    p.add_argument("--transport", default="auto")
    p.add_argument("--layouts", nargs="*", default=[], help="LAYOUT=MODEL_DIR ...")
    p.add_argument("--small-buckets", nargs="*", default=[])
    p.add_argument("--export-layout", default="")
    p.add_argument("--model", default="")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--cache", required=True)
    args = p.parse_args()
    {"layouts": run_layouts, "failures": run_failures, "gpu": run_gpu}[args.mode](args)


if __name__ == "__main__":
    main()
