"""What the trainer needs from a task source (:class:`TaskSource`), whatever its problems are.

A source yields *prompt records*, plain dicts that the rollout and reward code pass around::

    {"prompt": "12+7=", "answer": "19", "task": "arithmetic", "metadata": {...}}

``prompt`` is the problem text (before any chat formatting: rl/prompt_format.py renders it),
``answer`` the reference the reward compares against (``None`` for a reasoning-gym dataset that
has no single right answer and scores by its metadata), ``task`` the source's name, ``metadata``
whatever the source knows about the problem (reasoning-gym's ``score_answer`` reads it, the
``code_tests`` reward reads ``test`` and ``entry_point`` from it). A record may also carry
``answer_pattern``, a regular expression the whole stripped completion must match to count as
well formatted (the ``format`` reward).

Every source splits its problems with :func:`~logra_megatron.rl.tasks.split.in_held_out_split`
and draws training batches as a function of ``(seed, step)``, so a resumed run sees the prompts
the uninterrupted one would have seen.
"""

from abc import ABC, abstractmethod

BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."
"""The answer-format instruction of short-answer tasks in chat form (the rewards extract the
boxed answer: rl/rewards.py: extract_final_answer)."""

PROVIDES_ANSWER = "answer"
"""A source whose records carry reference answers (what answer-comparing rewards and the
supervised warm-up need)."""
PROVIDES_TESTS = "tests"
"""A source whose records carry unit tests in ``metadata["test"]`` (the ``code_tests`` reward)."""


class TaskSource(ABC):
    """Problems for training and evaluation, split once and for all into train and held-out."""

    name: str
    """The task's name as ``--task`` gives it (``arithmetic``, ``chain_sum``, ``jsonl:data.jsonl``)."""

    @abstractmethod
    def train_prompts(self, count: int, step: int = 0) -> list:
        """``count`` distinct training records (never held out) for step ``step``, a function of
        ``(seed, step)``; a :class:`~logra_megatron.errors.UserError` when there are not that many."""

    @abstractmethod
    def held_out(self, count: int) -> list:
        """The first ``count`` held-out records (the same on every call, in every run)."""

    @abstractmethod
    def is_held_out(self, prompt: str) -> bool:
        """Whether a problem text belongs to the held-out split."""

    @abstractmethod
    def default_reward(self, chat: bool) -> str:
        """The registered reward that scores this task when ``--reward`` is not given; ``chat``:
        whether prompts are shown through a chat template (the answer is then asked for in a
        stated format, e.g. ``\\boxed{}``)."""

    @property
    @abstractmethod
    def provides(self) -> frozenset:
        """What the records hold for rewards to rely on: :data:`PROVIDES_ANSWER`,
        :data:`PROVIDES_TESTS`, ``reasoning_gym`` and ``reasoning_gym:<dataset>``."""

    @property
    def answer_instruction(self) -> str:
        """What the user message asks for after the problem in chat form ('' for nothing)."""
        return BOXED_INSTRUCTION

    def chat_reply(self, record: dict) -> str:
        """A correct assistant reply in the format :attr:`answer_instruction` asks for (the
        supervised warm-up's target in chat form)."""
        return "\\boxed{" + str(record["answer"]) + "}"

    def check_supply(self, needs: list) -> None:
        """``needs``: ``(side, what, count)`` with side ``"held-out"`` or ``"training"`` and
        ``what`` the flag asking; a :class:`UserError` naming it when the source has fewer
        distinct problems on that side (found before any process group starts)."""
        for side, _what, count in needs:
            (self.held_out(count) if side == "held-out" else self.train_prompts(count, step=0))

    def length_probe(self, eval_count: int, batch: int) -> list:
        """Records whose prompts bound the prompt length a run meets (resolve checks that the
        longest plus ``--max-new-tokens`` fits the model): by default the evaluation set and the
        first training batch."""
        return self.held_out(eval_count) + self.train_prompts(batch, step=0)
