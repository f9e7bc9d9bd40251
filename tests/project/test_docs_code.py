"""Every Python block of README.md and docs/ runs, so the docs cannot drift from the code.

A block runs as written, in a namespace holding what its prose takes as given
(``tests/support/docs_given.py``: the imports and a small ``model``, ``optimizer``,
``data``...), in a fresh working directory.  By default it runs in one
process, a rank of a 1-rank gloo group (as ``torchrun --nproc_per_node=1``
starts a script).  An HTML comment on the line before the fence says how,
when that is not enough::

    <!-- docs-test: ranks=2 -->          on 2 gloo ranks (a pool, as every multi-rank test)
    <!-- docs-test: ranks=2 isolated --> on ranks started for it alone (it ends the process group)
    <!-- docs-test: ranks=2 sharded -->  given a model that went through fully_shard (docs_given.py)
    <!-- docs-test: ranks=2 fsdp1 -->    given torch FSDP1's checkpoints and a shardkit FSDP1 model
    <!-- docs-test: torchrun=2 -->       as a script under torchrun, which forms the gloo process group first
                                         unless the block does (DataLoader workers fork there, as for users)
    <!-- docs-test: continues -->        in the namespace of the last block before it that runs, right after it
    <!-- docs-test: s3 -->               with the local S3 server standing in for the bucket it names
    <!-- docs-test: excerpt: REASON -->  not run: it needs a GPU cluster or a cloud account

An excerpt must say why; the summary test counts them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.dist import run_on_ranks, run_torchrun

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DIRECTIVE = re.compile(r"^<!-- docs-test: (?P<terms>.*?) -->$")
EXCERPT_REASONS = ("GPU", "cloud account", "ranks")


@dataclass
class Block:
    page: str
    line: int          # of the first code line, 1-based
    code: str
    terms: str = ""


@dataclass
class Program:
    """Blocks that run one after another in one namespace (a block and the ones that continue it)."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.blocks[0].page}:{self.blocks[0].line}"

    def term(self, name: str) -> str | None:
        match = re.search(rf"\b{name}(?:=(\d+))?\b", self.blocks[0].terms)
        return None if match is None else (match.group(1) or "")


def python_blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            directive = DIRECTIVE.match(lines[i - 1].strip()) if i else None
            found.append(Block(str(page.relative_to(ROOT)), i + 2, "\n".join(lines[i + 1:end]),
                               directive.group("terms") if directive else ""))
            i = end
        i += 1
    return found


ALL_BLOCKS = [block for page in PAGES for block in python_blocks(page)]


def programs() -> list[Program]:
    out: list[Program] = []
    for block in ALL_BLOCKS:
        if block.terms.startswith("excerpt"):
            continue
        if re.search(r"\bcontinues\b", block.terms):
            assert out and out[-1].blocks[-1].page == block.page, f"{block.page}:{block.line} continues nothing"
            out[-1].blocks.append(block)
        else:
            out.append(Program([block]))
    return out


def run_program(sources: list[tuple[str, int, str]], workdir: str, env: dict[str, str], terms: str = "") -> None:
    """Run ``(page, line, code)`` blocks in order in one namespace; module level: ranks call it by name."""
    from tests.support.docs_given import given

    saved_env = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    here = os.getcwd()
    os.chdir(workdir)
    try:
        namespace = given(Path(workdir), terms)
        for page, line, code in sources:
            exec(compile("\n" * (line - 1) + code, f"{ROOT / page}", "exec"), namespace)
    finally:
        os.chdir(here)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


TORCHRUN_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
from tests.project.test_docs_code import run_program
if {forms_group!r} is False:  # a training script's first line, unless the block is that script
    dist.init_process_group("gloo")
run_program({sources!r}, {workdir!r}, {{}}, {terms!r})
"""


def s3_environment(s3_server) -> dict[str, str]:
    """The local S3 server in place of AWS, with a fresh, empty ``bucket``."""
    import s3fs

    endpoint, options = s3_server
    fs = s3fs.S3FileSystem(**options)
    if fs.exists("bucket"):
        fs.rm("bucket", recursive=True)
    fs.mkdir("bucket")
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.mark.parametrize("program", programs(), ids=lambda p: p.id)
def test_the_block_runs(program: Program, tmp_path, request):
    sources = [(b.page, b.line, b.code) for b in program.blocks]
    terms = program.blocks[0].terms
    env = s3_environment(request.getfixturevalue("s3_server")) if program.term("s3") is not None else {}
    if program.term("torchrun"):
        script = tmp_path / "block.py"
        forms_group = any("init_process_group(" in b.code for b in program.blocks)
        script.write_text(TORCHRUN_SCRIPT.format(root=str(ROOT), sources=sources, workdir=str(tmp_path),
                                                 terms=terms, forms_group=forms_group))
        done = run_torchrun(script, int(program.term("torchrun")), env={**env, "PYTHONPATH": str(ROOT)},
                            cwd=tmp_path, timeout=240)
        assert done.returncode == 0, f"{program.id}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    else:  # one process is a rank of a 1-rank group, as under torchrun --nproc_per_node=1
        run_on_ranks(int(program.term("ranks") or 1), run_program, sources, str(tmp_path), env, terms,
                     isolated=program.term("isolated") is not None)


def test_every_block_runs_or_is_an_excerpt_that_says_why():
    excerpts = [b for b in ALL_BLOCKS if b.terms.startswith("excerpt")]
    for block in excerpts:
        reason = block.terms.partition(":")[2].strip()
        assert any(word in reason for word in EXCERPT_REASONS), f"{block.page}:{block.line}: excerpt without a " \
                                                                f"reason: {block.terms!r}"
    unknown = [f"{b.page}:{b.line}: {b.terms!r}" for b in ALL_BLOCKS if b.terms and not b.terms.startswith("excerpt")
               and not re.fullmatch(r"(((ranks|torchrun)=\d+|isolated|sharded|fsdp1|continues|s3) )+", b.terms + " ")]
    assert unknown == []
    run = sum(len(p.blocks) for p in programs())
    assert run + len(excerpts) == len(ALL_BLOCKS) and run >= 3 * len(excerpts), (run, len(excerpts))
