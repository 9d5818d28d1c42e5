"""Engine side, vLLM on CPU: load a bucket's full HF tensors straight into the model, one pass each.

vLLM's generic in-place `reload_weights` restores every layer on fresh memory, loads it, re-runs
the CPU weight processing and copies the result back: three passes and a fresh allocation per
layer (0.40 s for the 99.6M-parameter benchmark model, 0.74 GB/s). For an unquantized TP1 engine
on CPU the end state is simple and this module reaches it directly:

- linear layers (fused q/k/v and gate/up included, rows in vLLM's [q; k; v] and [gate; up] order)
  keep only a oneDNN handle with their own packed copy of the weight: the handle is rebuilt from
  the full weight read in place from the bucket (one reorder pass; a fused weight whose parts are
  adjacent in the bucket is a view, otherwise it is concatenated first). Biases are copied in place.
- embeddings, the untied output layer and norms are copied in place into their parameters; the
  output layer's handle is rebuilt after its copy (the tied head: `refresh_tied_lm_head`).

`DirectLoader.for_model` returns None where these assumptions do not hold (GPU, an engine TP > 1,
quantized layers, an unknown module): the receiver then uses `reload_weights`. The probe after
every sync checks the result either way.
"""

from __future__ import annotations

import torch

from megatron_agent.sync.buckets import iter_views


def _linear_method_names() -> tuple[type, type]:
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    return LinearBase, UnquantizedLinearMethod


class DirectLoader:
    """Maps HF tensor names to vLLM modules of one CPU model and loads buckets into them."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        # sub-module name -> (fused module name, shard index), e.g. q_proj -> (qkv_proj, 0)
        self.part_of = {p: (fused, i) for fused, parts in self.packed.items() for i, p in enumerate(parts)}

    @classmethod
    def for_model(cls, model: torch.nn.Module, world_size: int) -> DirectLoader | None:
        """A loader for `model` if every module is one it handles, else None (use reload_weights)."""
        if torch.cuda.is_available() or world_size != 1:
            return None
        linear_base, unquantized = _linear_method_names()
        for module in model.modules():
            if isinstance(module, linear_base):
                if not isinstance(module.quant_method, unquantized) or not hasattr(module, "cpu_linear"):
                    return None
        return cls(model)

    def _target(self, hf_name: str) -> tuple[str, str, int | None]:
        """(module name, parameter name, shard index or None) of one HF tensor."""
        module_path, _, param = hf_name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if leaf in self.part_of:
            fused, index = self.part_of[leaf]
            return f"{parent}.{fused}", param, index
        return module_path, param, None

    @torch.no_grad()
    def load(self, u8: torch.Tensor, header) -> None:
        """Load every tensor of one bucket (a bucket never splits a fused module's parts)."""
        groups: dict[tuple[str, str], list[tuple[int | None, torch.Tensor]]] = {}
        for name, view in iter_views(u8, header):
            module_name, param, index = self._target(name)
            groups.setdefault((module_name, param), []).append((index, view))
        linear_base, _ = _linear_method_names()
        for (module_name, param), parts in groups.items():
            module = self.model.get_submodule(module_name)
            full = _joined([t for _, t in sorted(parts, key=lambda p: p[0] or 0)])
            if isinstance(module, linear_base) and param == "weight":
                if full.shape[1] != module.input_size_per_partition or full.shape[0] != sum(
                    module.output_partition_sizes
                ):
                    raise ValueError(
                        f"{module_name}: synced weight has shape {tuple(full.shape)}, the engine expects "
                        f"({sum(module.output_partition_sizes)}, {module.input_size_per_partition})"
                    )
                # The handle packs its own copy of the weight; the view into the bucket is only read.
                module.weight = torch.nn.Parameter(full, requires_grad=False)
                module.quant_method.process_weights_after_loading(module)
                continue
            target = getattr(module, param)
            rows = full.shape[0]
            if target.shape[1:] != full.shape[1:] or target.shape[0] < rows:
                raise ValueError(
                    f"{module_name}.{param}: synced tensor has shape {tuple(full.shape)}, the engine's is "
                    f"{tuple(target.shape)}"
                )
            target.data[:rows].copy_(full)  # an embedding may have padded rows past the vocabulary
            if module is getattr(self.model, "lm_head", None) and hasattr(module, "quant_method"):
                module.quant_method.process_weights_after_loading(module)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts concatenated along dim 0: a view when they are adjacent in memory, else a copy."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    pos = first.data_ptr()
    adjacent = all(p.is_contiguous() and p.dtype == first.dtype for p in parts)
    for p in parts:
        adjacent = adjacent and p.data_ptr() == pos
        pos += p.numel() * p.element_size()
    if adjacent:
        rows = sum(p.shape[0] for p in parts)
        return first.as_strided((rows, *first.shape[1:]), first.stride())
    return torch.cat(parts, dim=0)
