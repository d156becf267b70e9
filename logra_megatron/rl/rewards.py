"""Verifiable rewards: a registry of ``reward(prompt_record, completion_text) -> float``.

A reward reads the prompt record (see :mod:`logra_megatron.rl.tasks`: ``prompt``, ``answer``,
``task``, ``metadata``) and the decoded completion, and returns a float, usually in [0, 1].
Rewards are registered by name with :func:`register_reward` and looked up with
:func:`get_reward`, so a config names its reward and new verifiers plug in without touching the
trainer. Registered here:

- ``exact_match``: the completion, stripped of surrounding whitespace, equals the reference
  answer (the embedded arithmetic task: ``"12+7="`` -> ``"19"``). Strict on purpose: the
  policy must also learn to stop after the answer.
- ``basic_arithmetic``, ``chain_sum``, ``gsm_symbolic`` (and ``reasoning_gym``, which
  dispatches on ``record["task"]``): the final answer is extracted from the completion with
  :func:`extract_final_answer` and scored by reasoning-gym's own ``score_answer`` for that
  dataset, so its rules hold (e.g. ``basic_arithmetic`` gives partial credit
  ``len(answer)/len(extracted)`` when the reference is a substring, ``gsm_symbolic`` gives 0.01
  for a wrong number).
- ``math_verify``: symbolic equivalence of the completion's answer and the reference with
  math-verify (``\\boxed{0.5}`` matches ``1/2`` and ``\\frac{2}{4}``). A GSM8K-style ``#### 72``
  (in the completion or the reference) and an ``<answer>...</answer>`` span are cut out first,
  because math-verify would otherwise read the last number anywhere in the text.
- ``format``: 1.0 when the answer is stated in the expected form, else 0.0. The expected form is
  the record's ``answer_pattern`` regex matched against the whole stripped completion when the
  record has one (the arithmetic task: a bare integer), otherwise an explicit final-answer
  marker at the end of the completion (see :func:`ends_with_marked_answer`).
- ``code_tests``: 1.0 when the completion passes the record's unit tests, run in the sandbox
  of :mod:`logra_megatron.rl.sandbox`, else 0.0. The program is the completion (preceded by the
  prompt when ``metadata["include_prompt"]`` is true, as for HumanEval, whose completions
  continue the prompt's function), then ``metadata["test"]``, then ``check(<entry_point>)`` when
  ``metadata["entry_point"]`` is given (see :func:`code_tests_program`).

Rewards that misbehave (raise, hang, kill their process) are contained by
:class:`logra_megatron.rl.reward_runner.RewardRunner`, which the trainer calls them through.

Final-answer extraction (:func:`extract_final_answer`) tries, in order, and takes the LAST
occurrence of the first rule that matches: ``<answer>X</answer>``; ``\\boxed{X}`` (braces
balanced); ``#### X`` (to the end of its line); ``Answer: X`` / ``answer is X``
(case-insensitive, to the end of its line); finally the last number in the text. The result is
stripped of whitespace, surrounding ``$`` and ``*`` (Markdown bold) and a trailing period;
``None`` when nothing is found.
"""

import functools
import re
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from logra_megatron.errors import UserError
from logra_megatron.rl.sandbox import SandboxLimits, SandboxResult, run_program
from logra_megatron.schema import option

RewardFn = Callable[[dict, str], float]
_REWARDS: dict = {}


def register_reward(name: str):
    """Decorator: register ``fn(prompt_record, completion_text) -> float`` under ``name``.

    The registered function is wrapped so that a ``None`` completion counts as empty text and
    the result is always a Python float.
    """

    def decorate(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is already registered")

        @functools.wraps(fn)
        def reward(prompt_record: dict, completion_text: Optional[str]) -> float:
            return float(fn(prompt_record, completion_text if isinstance(completion_text, str) else ""))

        _REWARDS[name] = reward
        return reward

    return decorate


def available_rewards() -> list:
    """Names of the registered rewards, sorted."""
    return sorted(_REWARDS)


def get_reward(name: str) -> RewardFn:
    """The reward registered under ``name``; a :class:`UserError` listing the known names if none."""
    if name not in _REWARDS:
        raise UserError(f"unknown reward {name!r}; known rewards: {', '.join(available_rewards())}")
    return _REWARDS[name]


@dataclass(frozen=True)
class RewardConfig:
    """Which registered reward scores completions (training and evaluation)."""

    name: str = option("exact_match", flag="--reward",
                       help="a registered reward: exact_match, math_verify, format, a reasoning-gym task name, ...")
    timeout_s: float = option(30.0, flag="--reward-timeout",
                              help="seconds one completion's reward may take; past it the reward scores 0 "
                                   "and is counted (reward_timeouts)")
    workers: int = option(1, flag="--reward-workers", help="processes that compute rewards in parallel")

    def __post_init__(self):
        get_reward(self.name)
        if not self.timeout_s > 0:
            raise UserError(f"--reward-timeout must be > 0, got {self.timeout_s}")
        if self.workers < 1:
            raise UserError(f"--reward-workers must be >= 1, got {self.workers}")


def weighted_reward(weights: dict) -> RewardFn:
    """A reward that is the weighted sum of registered rewards, e.g.
    ``weighted_reward({"exact_match": 1.0, "format": 0.1})``."""
    parts = [(get_reward(name), float(weight)) for name, weight in weights.items()]

    def reward(prompt_record: dict, completion_text: str) -> float:
        return sum(weight * fn(prompt_record, completion_text) for fn, weight in parts)

    return reward


# --- final-answer extraction -------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_LINE = re.compile(r"\banswer(?:\s+is\s*:?|\s*:)[ \t]*([^\n]*)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None  # unbalanced: the completion was cut off inside the box


def _clean(answer: str) -> Optional[str]:
    decoration = " \t\r\n$*"  # whitespace, LaTeX dollars, Markdown bold
    answer = answer.strip(decoration)
    if answer.endswith("."):
        answer = answer[:-1].strip(decoration)
    return answer or None


def _marked_answer(text: str) -> Optional[str]:
    """The answer given with an explicit marker (rules 1-4), or None."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return _clean(tags[-1])
    boxed = _last_boxed(text)
    if boxed is not None:
        return _clean(boxed)
    for pattern in (_HASHES, _ANSWER_LINE):
        found = pattern.findall(text)
        if found:
            return _clean(found[-1])
    return None


def extract_final_answer(text: str) -> Optional[str]:
    """The final answer stated in ``text`` (rules in the module docstring), or ``None``."""
    if not text:
        return None
    marked = _marked_answer(text)
    if marked is not None:
        return marked
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def ends_with_marked_answer(text: str) -> bool:
    """True when ``text`` ends with an explicitly marked, non-empty final answer:
    ``<answer>X</answer>``, ``\\boxed{X}`` (optionally followed by ``$``, ``.`` or ``]``), or a
    last line holding ``#### X`` or ``Answer: X`` (e.g. ``Final answer: X``)."""
    tail = text.rstrip()
    if re.search(r"<answer>\s*\S.*?</answer>$", tail, re.DOTALL | re.IGNORECASE):
        return True
    box = max(tail.rfind("\\boxed{"), tail.rfind("\\fbox{"))
    if box >= 0:
        content = _last_boxed(tail)
        if content and content.strip():
            closing = box + tail[box:].index("{") + 1 + len(content)
            if re.fullmatch(r"[}\s$.\\\]]*", tail[closing:]):
                return True
    last_line = tail.rsplit("\n", 1)[-1]
    return bool(re.search(r"(?:####|\banswer\s*:)[\s*]*[^\s*]", last_line, re.IGNORECASE))


# --- rewards -----------------------------------------------------------------------------------

@register_reward("exact_match")
def exact_match_reward(prompt_record: dict, completion_text: str) -> float:
    """1.0 when the stripped completion equals the stripped reference answer."""
    return 1.0 if completion_text.strip() == str(prompt_record["answer"]).strip() else 0.0


@register_reward("arithmetic_partial")
def arithmetic_partial_reward(prompt_record: dict, completion_text: str) -> float:
    """Exact answer: 1.0. A number with the right length: half credit per matching digit
    (right-aligned) -- a denser signal than exact match for a policy that is often nearly right.
    Anything else: 0.0. Accuracy is still measured by exact match."""
    answer, text = str(prompt_record["answer"]).strip(), completion_text.strip()
    if text == answer:
        return 1.0
    if not re.fullmatch(r"-?\d+", text) or len(text) != len(answer):
        return 0.0
    matches = sum(a == b for a, b in zip(text, answer))
    return 0.5 * matches / len(answer)


@register_reward("format")
def format_reward(prompt_record: dict, completion_text: str) -> float:
    """1.0 when the completion states its answer in the expected form (module docstring)."""
    pattern = prompt_record.get("answer_pattern")
    if pattern is not None:
        return 1.0 if re.fullmatch(pattern, completion_text.strip()) else 0.0
    return 1.0 if ends_with_marked_answer(completion_text) else 0.0


@functools.lru_cache(maxsize=None)
def _reasoning_gym_scorer(task_name: str):
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task_name not in DATASETS:
        raise UserError(f"prompt record names task {task_name!r}, which reasoning-gym does not know")
    return reasoning_gym.get_score_answer_fn(task_name)


def score_with_reasoning_gym(task_name: str, prompt_record: dict, completion_text: str) -> float:
    """Extract the final answer and score it with reasoning-gym's ``score_answer`` for the task."""
    answer = extract_final_answer(completion_text)
    if answer is None:
        return 0.0
    entry = {
        "question": prompt_record.get("prompt", ""),
        "answer": str(prompt_record["answer"]),
        "metadata": prompt_record.get("metadata", {}),
    }
    return float(_reasoning_gym_scorer(task_name)(answer, entry))


def _register_reasoning_gym_reward(task_name: str) -> None:
    @register_reward(task_name)
    def reward(prompt_record: dict, completion_text: str) -> float:
        return score_with_reasoning_gym(task_name, prompt_record, completion_text)

    reward.__doc__ = f"reasoning-gym's {task_name} score of the extracted final answer."


for _task in ("basic_arithmetic", "chain_sum", "gsm_symbolic"):
    _register_reasoning_gym_reward(_task)


@register_reward("reasoning_gym")
def reasoning_gym_reward(prompt_record: dict, completion_text: str) -> float:
    """reasoning-gym score for the dataset named by ``prompt_record["task"]`` (mixed task sets)."""
    return score_with_reasoning_gym(prompt_record["task"], prompt_record, completion_text)


def _strip_for_math_verify(text: str) -> str:
    """Cut out an ``<answer>`` span or a GSM8K ``#### X`` before math-verify reads the text."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    return text


@register_reward("math_verify")
def math_verify_reward(prompt_record: dict, completion_text: str) -> float:
    """1.0 when math-verify finds the completion's answer equivalent to the reference.

    math-verify bounds its parse and compare with ``signal.alarm``, which only works in the
    main thread; elsewhere the bound is dropped rather than failing.
    """
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    predicted_text = _strip_for_math_verify(completion_text)
    if not predicted_text.strip():
        return 0.0
    reference_text = _strip_for_math_verify(str(prompt_record["answer"]))
    gold = parse(reference_text, parsing_timeout=timeout)
    if not gold:
        gold = parse(f"${reference_text}$", parsing_timeout=timeout)
    predicted = parse(predicted_text, parsing_timeout=timeout)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0


# --- code execution ----------------------------------------------------------------------------

CODE_TEST_LIMITS = SandboxLimits()
"""Limits of one ``code_tests`` run (10 s wall, 5 s CPU, 512 MiB: module sandbox)."""


def code_tests_program(prompt_record: dict, completion_text: str) -> str:
    """The program ``code_tests`` runs: ``[prompt +] completion``, the record's tests, the check call.

    A HumanEval record: ``prompt`` is the function's signature and docstring, the completion its
    body, and ``metadata`` holds ``test`` (``def check(candidate): assert candidate(2, 3) == 5
    ...``), ``entry_point`` (``"add"``) and ``include_prompt=True``. An optional
    ``metadata["stdin"]`` is the program's standard input.
    """
    metadata = prompt_record.get("metadata") or {}
    test = metadata.get("test")
    if not isinstance(test, str) or not test.strip():
        raise UserError("code_tests reward: the prompt record has no metadata['test'] (the unit tests to run)")
    entry_point = metadata.get("entry_point")
    if entry_point is not None and not (isinstance(entry_point, str) and entry_point.isidentifier()):
        raise UserError(f"code_tests reward: metadata['entry_point'] must be a function name, got {entry_point!r}")
    program = (str(prompt_record.get("prompt", "")) if metadata.get("include_prompt") else "") + completion_text
    program += "\n\n" + test + "\n"
    if entry_point:
        program += f"\n\ncheck({entry_point})\n"
    return program


def run_code_tests(prompt_record: dict, completion_text: str,
                   limits: SandboxLimits = CODE_TEST_LIMITS) -> SandboxResult:
    """Run :func:`code_tests_program` in the sandbox; the result says why it failed, if it did."""
    stdin = (prompt_record.get("metadata") or {}).get("stdin", "")
    return run_program(code_tests_program(prompt_record, completion_text), stdin=stdin, limits=limits)


@register_reward("code_tests")
def code_tests_reward(prompt_record: dict, completion_text: str) -> float:
    """1.0 when the completion passes the record's unit tests in the sandbox, else 0.0."""
    return 1.0 if run_code_tests(prompt_record, completion_text).passed else 0.0


# --- rewards that misbehave --------------------------------------------------------------------
