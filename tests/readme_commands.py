"""The commands and code snippets of README.md, and how the tests cover each (shared by
tests/test_readme_commands.py and tests/distributed/test_readme_snippets.py).

What counts as a command: every line of a ```bash block (comment-only lines and trailing
``# comments`` dropped), and every inline code span that starts with ``python ``, ``torchrun `` or
``scripts/`` (split at ``&&``: the benchmark reproductions). A snippet is a ```python block, named by
its first line that is not an import (trailing comment dropped). Inline spans that start with
``autoshard `` name a command of the bash block with some of its flags: they are checked as
references (the subcommand and every flag exist), not run.

Each command or snippet is classified in exactly one of COMMANDS / SNIPPETS; the unit test fails on
one that is not (a new README command must be classified) and on a classified one the README no
longer has.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEMO = ROOT / "scripts" / "demo.sh"

# How a command or snippet is covered.
RUN = "run as written by tests/test_readme_commands.py"
RUN_DISTRIBUTED = "run as written on 4 gloo ranks by tests/distributed/test_readme_snippets.py"
DEMO_RUNS = "run by scripts/demo.sh (the same command; checked to appear there)"
SETUP = "set-up command: run by CI (scripts/test.sh) / is the demo (scripts/demo.sh); excluded by name"
ARGS = "benchmark too slow for CI: its argparse is checked to accept the exact arguments"

SETUP_COMMANDS = ("scripts/demo.sh", "scripts/test.sh")

COMMANDS: dict[str, str] = {
    "scripts/demo.sh": SETUP,
    "scripts/test.sh": SETUP,
    # the command-line block, run in order in one folder (explain reads the plan written before it)
    "autoshard plan gpt2 --mesh 2x2 --hardware a100-nvlink --budget 3GiB --out plan.json": RUN,
    "autoshard explain plan.json [--full] [--plain]": RUN,       # every combination of the optional flags
    "autoshard plan llama-70b --mesh 4x8 --batch 32 --budget 80GiB --out plan70b.json": RUN,
    "autoshard ops": RUN,
    "autoshard capture llama-7b": RUN,
    "autoshard enumerate gpt2 --mesh 2x4 --hardware h100-nvlink --node linear --json strategies.json": RUN,
    # minutes of measurement on 4 ranks: the demo runs this very command (and plans with its profile)
    "torchrun --nproc_per_node=4 --standalone -m autoshard.profile --mesh 2x2 --name mine --iters 15 "
    "--out mine.yaml": DEMO_RUNS,
    # benchmark reproductions (they write bench/results/: run in a copy of bench/)
    "python bench/op_coverage.py": RUN,              # ~20 s; the README's op table is compared with its output
    "python bench/update_readme.py": RUN,            # on a copy: the README's tables equal bench/results
    # ~20 s: prices the committed GPU measurements; on a copy, the table equals the committed one
    "python bench/gpu_op_compute.py report --profile bench/results/gpu_op_compute-profile.yaml "
    "--measured bench/results/gpu_op_compute-measured.json": RUN,
    "python bench/model_zoo.py": ARGS,               # ~4 min, 4 ranks
    "python bench/capture_llama7b.py": ARGS,         # 3 timed captures of the 7B graph
    "python bench/enumerate_llama7b.py": ARGS,       # 3 timed cold enumerations
    "python bench/plan_depth_scaling.py --reps 3": ARGS,      # minutes: 70B-width captures and budgeted solves
    "python bench/solver_optimality.py": ARGS,       # 8 min with --reference-time-limit 60, hours with the default
    "python bench/solver_budget_sweep.py": ARGS,     # minutes of budgeted solves
    "python bench/runtime_speed.py": ARGS,           # minutes, two torchrun launches
    "python bench/gpu_paths.py": ARGS,               # needs a GPU (one process; --device cpu: a dry run)
    "python bench/runtime_overhead.py": ARGS,        # interleaved timing rounds
    "python bench/compile_speed.py": ARGS,           # minutes: cold inductor compiles on 4 ranks
    "python bench/plan_fidelity.py": ARGS,           # ~15 min (its --quick smoke test measures a profile: minutes)
    "python bench/plan_fidelity.py --reanalyse": ARGS,   # solves a finished run's plans again: ~7 min
    "python bench/plan_fidelity.py --models gpt2-256,llama-192,bert-384,cnn-32,cnnsync-32 --name plan_fidelity_heldout": ARGS,  # ~23 min
    "python bench/plan_fidelity.py --models gpt2-64,llama-384,bert-192,cnn-128,cnnsync-8 --name plan_fidelity_probe": ARGS,  # ~23 min
    "python bench/plan_fidelity.py --models gpt2-192,llama-320,bert-160,cnn-48,cnnsync-24 --name plan_fidelity_unseen": ARGS,  # ~35 min
    "python bench/plan_fidelity.py --models mlp-256,mlp-512,llama-224,cnn-40 --name plan_fidelity_fourth": ARGS,  # ~29 min
    "python bench/plan_fidelity.py --models mlp-256,mlp-512 --name plan_fidelity_mlp": ARGS,  # ~19 min
    "python bench/plan_fidelity.py --models mlp-256,mlp-512 --name plan_fidelity_mlprows": ARGS,  # ~21 min
    "python bench/plan_fidelity.py --models mlp-128,mlp-768 --name plan_fidelity_mlpheldout": ARGS,  # ~20 min
    "python bench/plan_fidelity.py --models cnn-16,cnn-64,cnnsync-16,cnn-40,cnnsync-24 --name plan_fidelity_cnncopy": ARGS,  # ~29 min
    "python bench/plan_fidelity.py --models gpt2-320,llama-160,bert-224,cnn-24,cnnsync-12,mlp-384 --name plan_fidelity_fifth": ARGS,  # ~36 min
    "python bench/plan_fidelity.py --models mlp-640,gpt2-160,bert-288 --name plan_fidelity_sixth": ARGS,  # ~27 min
    "python bench/plan_fidelity.py --models cnn-16,cnn-24,mlp-640 --name plan_fidelity_shipped": ARGS,  # ~16 min
    "python bench/plan_fidelity.py --models cnn-20,gpt2-96,llama-256 --name plan_fidelity_seventh": ARGS,  # ~19 min
    "python bench/plan_fidelity.py --models gpt2-48,bert-64,llama-64 --name plan_fidelity_small": ARGS,  # ~19 min
    "python bench/plan_fidelity.py --models cnn-64,cnn-40,mlp-384 --name plan_fidelity_recheck": ARGS,  # ~16 min
    "python bench/plan_fidelity.py --models gpt2-48,bert-64,llama-64,gpt2-32 --name plan_fidelity_narrow": ARGS,  # ~21 min
    "python bench/plan_fidelity.py --models mlp-256,mlp-512,cnn-32,cnnsync-24 --name plan_fidelity_olderrun": ARGS,  # ~19 min
    "python bench/plan_fidelity.py --models mlp-256,gpt2-128:16x64,llama-96:4x256,bert-160:16x128,cnn-24:16x48,mlp-320:32 --name plan_fidelity_sizes": ARGS,  # ~26 min
    "python bench/plan_fidelity.py --models gpt2-96:32x32,llama-160:8x64,bert-96:4x256,cnnsync-16:16x32,mlp-192:16 --name plan_fidelity_sizes2": ARGS,  # ~24 min
    "python bench/plan_fidelity.py --models mlp-256,mlp-160:8,gpt2-64:8x32,llama-128:8x64,cnn-12:8x32,bert-128:8x64 --name plan_fidelity_replicated": ARGS,  # ~25 min
    "python bench/plan_fidelity.py --models gpt2-80:8x64,llama-80:8x32,bert-112:8x64,cnn-20:8x32,mlp-224:8,cnnsync-12:8x32 --name plan_fidelity_replicated2": ARGS,  # ~25 min
    "python bench/plan_fidelity.py --models gpt2-64:8x32,cnn-12:8x32,llama-96:8x64,bert-80:8x64,cnn-28:8x32,mlp-288:8 --name plan_fidelity_watch": ARGS,  # ~27 min
    "python bench/plan_fidelity.py --models gpt2-64:8x32,cnn-12:8x32,llama-96:8x64,bert-80:8x64,cnn-28:8x32,mlp-288:8 --name plan_fidelity_busy": ARGS,  # ~29 min
    "python bench/plan_fidelity.py --models gpt2-96:8x64,llama-128:8x32,bert-128:8x32,cnn-20:16x32,mlp-224:16,cnnsync-16:8x32 --name plan_fidelity_busy2": ARGS,  # ~30 min
    "python bench/plan_fidelity.py --models cnn-28:8x32,bert-80:8x64 --name plan_fidelity_rerun": ARGS,  # ~21 min
    "python bench/plan_fidelity.py --models cnn-28:8x32 --name plan_fidelity_evening": ARGS,  # ~18 min
    "python bench/plan_fidelity.py --models cnn-28:8x32,cnn-24:8x32,cnn-36:8x32,gpt2-112:8x32,llama-72:8x64,bert-96:8x32 "
    "--name plan_fidelity_margin": ARGS,  # ~33 min
    "python bench/plan_fidelity.py --models bert-80:8x64,gpt2-96:8x64,bert-128:8x32,llama-48:8x64,cnn-20:8x32 "
    "--name plan_fidelity_misses": ARGS,  # ~32 min
    "python bench/plan_fidelity.py --models bert-80:8x64,gpt2-96:8x64,bert-128:8x32,llama-48:8x64,cnn-20:8x32 "
    "--name plan_fidelity_loadcheck": ARGS,  # ~32 min
    "python bench/plan_fidelity.py --models llama-48:8x64,gpt2-64:8x32,bert-64:8x32,llama-96:8x64,cnn-24:8x32 "
    "--name plan_fidelity_views": ARGS,  # ~34 min
    "python bench/plan_fidelity.py --models llama-40:8x64,llama-64:8x32,gpt2-48:8x64,bert-56:8x64,cnn-18:8x32 "
    "--name plan_fidelity_dec07": ARGS,  # ~27 min
    "python bench/plan_retime.py --from-run plan_fidelity_dec07 --models llama-40:8x64": ARGS,  # ~3.5 min on 4 ranks
    "python bench/plan_retime.py --from-run plan_fidelity_dec07 --name plan_fidelity_dec07-retime-all": ARGS,  # ~15 min
    "python bench/plan_fidelity.py --models llama-40:8x64,llama-64:8x32,gpt2-48:8x64,bert-56:8x64,cnn-18:8x32 "
    "--name plan_fidelity_dec07b": ARGS,  # ~26 min
    "python bench/plan_fidelity.py --models llama-56:8x64,gpt2-40:8x64,bert-72:8x32,cnn-22:8x32,llama-176:8x64,"
    "gpt2-144:8x32 --name plan_fidelity_dec08": ARGS,  # ~31 min
    "python bench/plan_fidelity.py --models gpt2-56:8x64,llama-88:8x64,bert-48:8x64,cnn-26:8x32,bert-144:8x32 "
    "--name plan_fidelity_dec08b": ARGS,  # ~27 min
    "python bench/plan_retime.py --from-run plan_fidelity_dec08 --models gpt2-40:8x64,llama-56:8x64": ARGS,  # ~6 min
    "python bench/step_decomposition.py --models llama-40:8x64 --plans data_parallel,megatron --hardware bench/results/plan_fidelity_dec07-profile.yaml --iters 16": ARGS,  # ~1 min
    "python bench/step_decomposition.py --models gpt2-48,llama-64 --plans data_parallel --hardware "
    "bench/results/plan_fidelity_small-profile.yaml": ARGS,      # ~2 min
    "python bench/replicated_plans.py": ARGS,      # ~2 min on 4 ranks
    "python bench/step_lockstep.py": ARGS,         # ~1 min on 4 ranks
    "python bench/step_watch_overhead.py": ARGS,   # ~1 min on 4 ranks
    "python bench/step_decomposition.py --models mlp-512,mlp-256 --plans data_parallel,solved "
    "--hardware bench/results/plan_fidelity_fourth-profile.yaml": ARGS,     # 1.5 min, a diagnosis
    "python bench/step_decomposition.py": ARGS,      # 2.5 min of interleaved phases on 4 ranks
    "python bench/step_decomposition.py --models cnn-16,cnn-64,cnnsync-16,gpt2-128,llama-128,cnn-28:8x32 "
    "--plans data_parallel,megatron,zero3,solved --hardware bench/results/step_decomposition-profile.yaml": ARGS,  # 17 min
    "python bench/step_waits.py": ARGS,              # minutes: traced steps of 4 plans x 3 models on 4 ranks
    "python bench/collective_waits.py --models cnn-28:8x32 --plans data_parallel,bench/results/cnn-28-channel-split-plan.json,"
    "megatron,zero3 --hardware bench/results/plan_fidelity_margin-profile.yaml --rounds 40": ARGS,   # 0.4 min on 4 ranks
    "python bench/autochunk.py": ARGS,               # about a minute of timed runs (7 per configuration)
    "python bench/activation_memory.py": ARGS,       # GPT-2 small blocks, timed steps: minutes
    "python bench/param_offload.py": ARGS,           # timed training steps
}

SNIPPETS: dict[str, str] = {
    'model, args, kwargs = build_model("gpt2", device="meta", batch=8, seq=1024)': RUN,
    'model, args, kwargs = build_model("llama-7b", device="meta", batch=8, seq=2048)': RUN,
    "mesh = autoshard.init_mesh((2, 2))": RUN_DISTRIBUTED,
    "plan = autoshard.plan_once(net, (example_x,), mesh=(2, 2))": RUN_DISTRIBUTED,
}


@dataclass(frozen=True)
class Snippet:
    key: str        # first line that is not an import, comment dropped
    code: str
    line: int       # 1-based line of the README where the block starts


def readme_text() -> str:
    return README.read_text()


def _blocks(text: str, lang: str) -> list[tuple[int, str]]:
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)]


def strip_comment(line: str) -> str:
    """A shell line without its trailing ``# comment`` (no ``#`` inside quotes in the README)."""
    return re.sub(r"(^|\s)#.*$", "", line).strip()


def bash_commands(text: str | None = None) -> list[str]:
    """Every command line of the README's ```bash blocks, in order."""
    out = []
    for _, block in _blocks(text or readme_text(), "bash"):
        out += [c for c in (strip_comment(line) for line in block.splitlines()) if c]
    return out


def inline_commands(text: str | None = None) -> list[str]:
    """Inline code spans that are commands (``python ...``, ``torchrun ...``, ``scripts/...``)."""
    text = _outside_blocks(text or readme_text())
    out = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for part in span.split("&&"):
            part = part.strip()
            if re.match(r"(python|torchrun) |scripts/", part):
                out.append(part)
    return out


def inline_references(text: str | None = None) -> list[str]:
    """Inline spans naming an ``autoshard`` command (``autoshard plan --outputs local``)."""
    return [s.strip() for s in re.findall(r"`(autoshard [a-z][^`\n]*)`", _outside_blocks(text or readme_text()))]


def _outside_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def all_commands(text: str | None = None) -> list[str]:
    """Every command of the README, each once, in order."""
    return list(dict.fromkeys(bash_commands(text) + inline_commands(text)))


def snippets(text: str | None = None) -> list[Snippet]:
    out = []
    for line, code in _blocks(text or readme_text(), "python"):
        first = next(strip_comment(s) for s in code.splitlines()
                     if strip_comment(s) and not re.match(r"(import|from) ", s.strip()))
        out.append(Snippet(first, code, line))
    return out


def snippet(key: str) -> Snippet:
    found = [s for s in snippets() if s.key == key]
    assert len(found) == 1, f"README has {len(found)} python snippets starting {key!r}"
    return found[0]


def expansions(command: str) -> list[str]:
    """A command with optional ``[--flag]`` placeholders as every combination of them, in order
    (none, each one, ..., all), the way the test runs it."""
    optional = re.findall(r"\s*\[([^\]]+)\]", command)
    base = re.sub(r"\s*\[[^\]]+\]", "", command)
    out = []
    for n in range(len(optional) + 1):
        for chosen in itertools.combinations(optional, n):
            out.append(" ".join([base, *chosen]))
    return out


def demo_lines() -> list[str]:
    """The logical lines of scripts/demo.sh (backslash continuations joined, spaces collapsed)."""
    text = DEMO.read_text().replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def demo_runs(command: str) -> bool:
    """Whether scripts/demo.sh runs ``command`` as written (its program from the repo's .venv/bin,
    environment assignments before it allowed)."""
    program, _, rest = command.partition(" ")
    pattern = rf"(^|[\s(])([A-Z_]+=\S+\s+)*(\S*/)?\.venv/bin/{re.escape(program)} {re.escape(rest)}(\s*\)|\s*$|\s*[|;&])"
    return any(re.search(pattern, line) for line in demo_lines())
