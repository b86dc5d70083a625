"""Every ```python block of README.md and docs/*.md runs, as a user would run it.

Each block runs in a fresh namespace, with a temporary folder as its working directory. An HTML
comment on the line before a block says how it runs:

    (no comment)                              a complete script, in this process
    <!-- run: given causal-lm -->             in this process, with a fixture set's names defined
    <!-- run: 2 ranks, given classifier -->    on 2 gloo ranks, the process group up as torchrun and
                                              init_process_group leave it (RANK, WORLD_SIZE, ... set)

The fixture sets stand for what the text around a block calls "your model", "your data":
    classifier  model (an MLP, 32 features -> 4 classes), loader (batches of (inputs, labels)),
                path (a file the block may write)
    lightning   module (a LightningModule of that MLP), loader
    causal-lm   model (a tiny random Llama over bytes), tokenizer (bytes -> ids), text, more_text, data
                (a few {"input_ids", "labels"} examples)

Every relative link of these pages must name a file that exists.
"""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path

import pytest
import torch

from distributed import run

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
RUN = re.compile(r"<!-- run: (?:(?P<ranks>\d+) ranks)?(?:, )?(?:given (?P<fixture>[\w-]+))? -->")
FENCE = re.compile(r"^```(\w*)\s*$")


def python_blocks(page: Path) -> list[tuple[str, int, str, int, str | None]]:
    """(page name, first line of code, code, ranks, fixture set) for every ```python block of the page."""
    lines, blocks, index = page.read_text().splitlines(), [], 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        if fence.group(1) == "python":
            marker = RUN.fullmatch(lines[index - 1].strip()) if index else None
            ranks = int(marker["ranks"]) if marker and marker["ranks"] else 1
            fixture = marker["fixture"] if marker else None
            blocks.append((page.name, index + 2, "\n".join(lines[index + 1 : end]) + "\n", ranks, fixture))
        index = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]


# ---- fixture sets -----------------------------------------------------------------------------
def classifier(rank: int, folder: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    generator = torch.Generator().manual_seed(1 + rank)
    inputs = torch.randn(64, 32, generator=generator)
    labels = inputs[:, :4].argmax(1)  # a learnable rule
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=16)
    return {"model": model, "loader": loader, "path": os.path.join(folder, "checkpoint.pt")}


def lightning(rank: int, folder: str) -> dict:
    import lightning

    names = classifier(rank, folder)

    class Classifier(lightning.LightningModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def training_step(self, batch, _):
            inputs, labels = batch
            return torch.nn.functional.cross_entropy(self.net(inputs), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return {"module": Classifier(names["model"]), "loader": names["loader"]}


class ByteTokenizer:
    """Text to UTF-8 byte ids, the call and save_pretrained that netgain.align uses of a tokenizer."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": list(text.encode())}

    def save_pretrained(self, folder: str) -> None:
        Path(folder, "tokenizer.txt").write_text("bytes\n")


def causal_lm(rank: int, folder: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                         max_position_embeddings=256))
    source = Path(torch.__file__).read_text() + Path(os.__file__).read_text()  # some real text
    ids = torch.tensor(list(source[:4096].encode())[:16 * 32]).view(32, 16)
    return {"model": model, "tokenizer": ByteTokenizer(), "text": source[: len(source) // 2],
            "more_text": source[len(source) // 2 :], "data": [{"input_ids": x, "labels": x} for x in ids]}


FIXTURES = {"classifier": classifier, "lightning": lightning, "causal-lm": causal_lm}


def execute(code: str, page: str, line: int, fixture: str | None, rank: int, folder: str) -> None:
    """Run the block as __main__; its tracebacks give the page's own line numbers."""
    namespace = {"__name__": "__main__"}
    if fixture is not None:
        namespace.update(FIXTURES[fixture](rank, folder))
    exec(compile("\n" * (line - 1) + code, page, "exec"), namespace)


def on_rank(rank: int, world_size: int, code: str, page: str, line: int, fixture: str | None, folder: str) -> None:
    """One rank of a block: the environment torchrun sets (Lightning, Accelerate and the Trainer read it)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                      TORCHELASTIC_RUN_ID="docs", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    os.chdir(folder)
    try:
        execute(code, page, line, fixture, rank, folder)
    except Exception:  # the test gets the whole traceback, with the page's line numbers
        raise RuntimeError(traceback.format_exc()) from None


def test_the_pages_have_python_blocks():
    assert {page for page, *_ in BLOCKS} >= {"README.md", "codecs.md", "fsdp.md", "integrations.md", "align.md"}
    assert all(fixture in FIXTURES for *_, fixture in BLOCKS if fixture is not None)


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_the_pages_link_to_files_that_exist(page):
    targets = [target for target in LINK.findall(page.read_text()) if "://" not in target]
    assert [target for target in targets if not (page.parent / target).exists()] == []


@pytest.mark.parametrize("page, line, code, ranks, fixture", BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in BLOCKS])
def test_python_block_runs(page, line, code, ranks, fixture, tmp_path, monkeypatch):
    if ranks == 1:
        monkeypatch.chdir(tmp_path)
        execute(code, page, line, fixture, 0, str(tmp_path))
        return
    results = run(on_rank, ranks, code, page, line, fixture, str(tmp_path))
    assert all(status == "ok" for status, _ in results), "\n".join(str(message) for _, message in results)
