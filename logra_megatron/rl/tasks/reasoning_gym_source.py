"""reasoning-gym's procedural datasets as task sources, generated offline from a seed.

reasoning-gym (pinned to 0.1.25 in setup.py's ``rl`` extra) registers 106 datasets; all but
``composite`` (a mixture that must be configured with other datasets) generate offline, and are
listed in :data:`REASONING_GYM_TASKS` so that ``--task`` is checked, with close matches on a
typo, without importing reasoning-gym (which takes seconds). tests/rl/test_tasks.py checks the
list against the installed reasoning-gym.

How problems are drawn:

- **A fixed pool.** Problem ``i`` is item ``i`` of the dataset created with ``size`` =
  :data:`POOL_SIZE` and ``seed`` = the split seed (not the run's ``--seed``): most generators
  seed item ``i`` from ``seed + i``, a few precompute from ``size``, so both are fixed and the
  pool is the same in every run.
- **Held-out by the question's hash** (tasks/split.py): the evaluation set is the first
  ``count`` held-out questions in pool order; training draws pool indices from a generator seeded
  by ``(seed, step)`` and rejects held-out questions, so a question that two indices generate
  can never cross the split.
- ``--task-options`` (a JSON object) becomes the dataset's config, e.g. ``{"min_terms": 2,
  "max_terms": 3}`` for ``chain_sum``; a wrong option is one error line.

:data:`WITHOUT_REFERENCE_ANSWERS` are datasets whose items carry ``answer: None`` (several answers
are right; their ``score_answer`` checks a proposed one against the metadata): they train with
their own reward, but the supervised warm-up and answer-comparing rewards do not apply.
"""

import json
import random

from logra_megatron.errors import UserError
from logra_megatron.rl.tasks.base import PROVIDES_ANSWER, TaskSource
from logra_megatron.rl.tasks.split import in_held_out_split

REASONING_GYM_TASKS = (
    "ab", "acre", "advanced_geometry", "aiw", "arc_1d", "arc_agi", "base_conversion",
    "basic_arithmetic", "bf", "binary_alternation", "binary_matrix", "bitwise_arithmetic", "boxnet",
    "caesar_cipher", "calendar_arithmetic", "chain_sum", "circuit_logic", "codeio", "coin_flip",
    "color_cube_rotation", "complex_arithmetic", "count_bits", "count_primes", "countdown",
    "course_schedule", "cryptarithm", "decimal_arithmetic", "decimal_chain_sum", "dice",
    "emoji_mystery", "family_relationships", "figlet_font", "fraction_simplification", "futoshiki",
    "game_of_life", "game_of_life_halting", "gcd", "graph_color", "group_anagrams", "gsm_symbolic",
    "intermediate_integration", "isomorphic_strings", "jugs", "kakurasu", "knight_swap",
    "knights_knaves", "largest_island", "lcm", "leg_counting", "letter_counting", "letter_jumble",
    "list_functions", "mahjong_puzzle", "manipulate_matrix", "maze", "mini_sudoku", "modulo_grid",
    "n_queens", "needle_haystack", "number_filtering", "number_format", "number_sequence",
    "number_sorting", "palindrome_generation", "palindrome_partitioning", "path_star",
    "polynomial_equations", "polynomial_multiplication", "pool_matrix", "power_function",
    "prime_factorization", "products", "propositional_logic", "puzzle24", "quantum_lock", "ransom_note",
    "rearc", "rectangle_count", "rotate_matrix", "rotten_oranges", "rubiks_cube", "rush_hour",
    "self_reference", "sentence_reordering", "shortest_path", "simple_equations", "simple_geometry",
    "simple_integration", "sokoban", "spell_backward", "spiral_matrix", "string_insertion",
    "string_manipulation", "string_splitting", "string_synthesis", "sudoku", "survo", "syllogism",
    "time_intervals", "tower_of_hanoi", "tsumego", "word_ladder", "word_sequence_reversal",
    "word_sorting", "zebra_puzzles",
)
"""Every reasoning-gym 0.1.25 dataset that generates offline without further configuration."""
WITHOUT_REFERENCE_ANSWERS = frozenset({"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour"})
"""Datasets whose items have no single reference answer (``answer`` is None)."""
POOL_SIZE = 10_000
"""Problems per pool. Large enough for a few thousand training steps without running short; small
enough that the generators which precompute from their size (``acre``: ~7 s) stay quick."""
REASONING_GYM = "reasoning_gym"
"""What the records of any reasoning-gym source provide (the ``reasoning_gym`` reward)."""


def provides_key(task_name: str) -> str:
    """What the records of one dataset provide: its own ``score_answer`` applies."""
    return f"{REASONING_GYM}:{task_name}"


def parse_task_options(text: str) -> dict:
    """``--task-options``' canonical JSON text -> keyword arguments ('' -> none)."""
    return json.loads(text) if text else {}


class ReasoningGymTasks(TaskSource):
    """One reasoning-gym dataset, pooled and split (module docstring)."""

    def __init__(self, task_name: str, options: dict, held_out_fraction: float, split_seed: int = 0,
                 seed: int = 0, pool_size: int = POOL_SIZE):
        if task_name not in REASONING_GYM_TASKS:
            raise UserError(f"{task_name!r} is not an offline reasoning-gym dataset")
        self.name = task_name
        self.held_out_fraction, self.split_seed, self.seed = held_out_fraction, split_seed, seed
        self.pool_size = pool_size
        self._dataset = _create_dataset(task_name, pool_size, split_seed, options)
        self._items: dict = {}

    def record(self, index: int) -> dict:
        """Pool item ``index`` as a prompt record (generated once, then cached)."""
        if index not in self._items:
            entry = self._dataset[index]
            answer = entry.get("answer")
            self._items[index] = {
                "prompt": entry["question"],
                "answer": None if answer is None else str(answer),
                "task": self.name,
                "metadata": entry.get("metadata", {}),
            }
        return self._items[index]

    def is_held_out(self, prompt: str) -> bool:
        return in_held_out_split(prompt, self.held_out_fraction, self.split_seed)

    def default_reward(self, chat: bool) -> str:
        return REASONING_GYM  # reasoning-gym's score_answer of the dataset the record names

    @property
    def provides(self) -> frozenset:
        found = {REASONING_GYM, provides_key(self.name)}
        if self.name not in WITHOUT_REFERENCE_ANSWERS:
            found.add(PROVIDES_ANSWER)
        return frozenset(found)

    def _held_out_upto(self, count: int) -> list:
        """Up to ``count`` distinct held-out records, in pool order."""
        chosen, seen = [], set()
        for index in range(self.pool_size):
            if len(chosen) == count:
                break
            record = self.record(index)
            if record["prompt"] not in seen and self.is_held_out(record["prompt"]):
                seen.add(record["prompt"])
                chosen.append(record)
        return chosen

    def _train_upto(self, count: int, step: int) -> list:
        """Up to ``count`` distinct training records drawn for ``step`` (rejection sampling)."""
        rng = random.Random(f"train|{self.seed}|{step}")
        chosen, seen = [], set()
        attempts_left = 20 * count + 1000
        while len(chosen) < count and attempts_left > 0:
            attempts_left -= 1
            record = self.record(rng.randrange(self.pool_size))
            if record["prompt"] in seen or self.is_held_out(record["prompt"]):
                continue
            seen.add(record["prompt"])
            chosen.append(record)
        return chosen

    def _too_few(self, what: str, count: int, side: str, found: int) -> UserError:
        return UserError(f"{what} asks for {count} distinct {side} problems, but only {found} were found in the "
                         f"reasoning-gym task {self.name}'s pool of {self.pool_size} (--held-out-fraction "
                         f"{self.held_out_fraction}); ask for fewer or widen the task with --task-options")

    def held_out(self, count: int) -> list:
        chosen = self._held_out_upto(count)
        if len(chosen) < count:
            raise self._too_few("--eval-prompts", count, "held-out", len(chosen))
        return chosen

    def train_prompts(self, count: int, step: int = 0) -> list:
        chosen = self._train_upto(count, step)
        if len(chosen) < count:
            raise self._too_few("--prompts-per-step", count, "training", len(chosen))
        return chosen

    def check_supply(self, needs: list) -> None:
        for side, what, count in needs:
            found = len(self._held_out_upto(count) if side == "held-out" else self._train_upto(count, step=0))
            if found < count:
                raise self._too_few(what, count, side, found)


def _create_dataset(task_name: str, size: int, seed: int, options: dict):
    import reasoning_gym  # deferred: importing it takes seconds

    try:
        return reasoning_gym.create_dataset(task_name, size=size, seed=seed, **options)
    except (TypeError, ValueError, AssertionError, KeyError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"--task-options {json.dumps(options)} are not valid for the reasoning-gym task "
                        f"{task_name}: {reason}") from None
