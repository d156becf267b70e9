"""``--task jsonl:PATH``: the user's own problems, one JSON object per line.

``--prompt-field`` (default ``prompt``) names the problem text, ``--answer-field`` (default
``answer``) the reference answer (a string or a number); every other field of the object goes into
the record's ``metadata`` (so a file of code problems with ``test`` and ``entry_point`` fields
trains with ``--reward code_tests``). Blank lines are skipped. A file that cannot be read, a line
that is not a JSON object, and a missing or mistyped field are each one error line naming the
file and the line, raised when the config is resolved (before any process group starts).
"""

import json
import os

from logra_megatron.errors import UserError
from logra_megatron.rl.tasks.base import PROVIDES_ANSWER, PROVIDES_TESTS
from logra_megatron.rl.tasks.finite import FiniteTasks

JSONL_PREFIX = "jsonl:"


def read_jsonl_records(path: str, prompt_field: str, answer_field: str, task_name: str) -> list:
    """The records of a JSONL file (module docstring); UserError naming the line on bad input."""
    where = f"--task {task_name}"
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as error:
        raise UserError(f"{where}: cannot read {path}: {error.strerror or error}") from None
    records = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{where}: {path} line {number} is not UTF-8 text") from None
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as error:  # JSONDecodeError, and numbers too long to read
            raise UserError(f"{where}: {path} line {number} is not valid JSON ({str(error).splitlines()[0]})") from None
        except RecursionError:
            raise UserError(f"{where}: {path} line {number} is nested too deeply") from None
        if not isinstance(value, dict):
            raise UserError(f"{where}: {path} line {number} must be a JSON object, not {type(value).__name__}")
        for flag, field, kinds in (("--prompt-field", prompt_field, (str,)),
                                   ("--answer-field", answer_field, (str, int, float))):
            if field not in value:
                raise UserError(f"{where}: {path} line {number} has no field {field!r} ({flag}); "
                                f"its fields: {', '.join(map(repr, value)) or 'none'}")
            if not isinstance(value[field], kinds) or isinstance(value[field], bool):
                kind = "a string" if kinds == (str,) else "a string or a number"
                raise UserError(f"{where}: {path} line {number}: field {field!r} must be {kind}, "
                                f"got {json.dumps(value[field])[:40]}")
        if not value[prompt_field].strip():
            raise UserError(f"{where}: {path} line {number}: field {prompt_field!r} is empty")
        metadata = {key: item for key, item in value.items() if key not in (prompt_field, answer_field)}
        records.append({"prompt": value[prompt_field], "answer": str(value[answer_field]), "task": task_name,
                        "metadata": metadata})
    if not records:
        raise UserError(f"{where}: {path} holds no records (one JSON object per line)")
    return records


def check_jsonl_path(task_name: str) -> None:
    """The cheap check at flag time: the path names a file (its content is read at resolve)."""
    path = task_name[len(JSONL_PREFIX):]
    if not path:
        raise UserError("--task jsonl:PATH needs the path of a JSONL file after 'jsonl:'")
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise UserError(f"--task {task_name}: {path} {what}; give a JSONL file")


class JsonlTasks(FiniteTasks):
    """The records of one JSONL file, split by the hash of the prompt."""

    def __init__(self, task_name: str, prompt_field: str, answer_field: str, held_out_fraction: float,
                 split_seed: int = 0, seed: int = 0):
        self.name = task_name
        self.path = task_name[len(JSONL_PREFIX):]
        records = read_jsonl_records(self.path, prompt_field, answer_field, task_name)
        self._tests = all(isinstance(r["metadata"].get("test"), str) for r in records)
        super().__init__(records, held_out_fraction, split_seed, seed)

    def default_reward(self, chat: bool) -> str:
        return "final_answer"  # the stated (boxed, tagged or last) answer equals the reference

    @property
    def provides(self) -> frozenset:
        return frozenset({PROVIDES_ANSWER} | ({PROVIDES_TESTS} if self._tests else set()))
