"""How a prompt record is shown to the policy, and what a correct reply looks like.

Bare (the embedded character-level default, and any tokenizer without a chat template): the
policy continues the problem text itself (``"12+7="`` -> ``"19"``), and the supervised
warm-up's target is the reference answer.

Chat (a pretrained chat model whose tokenizer has a template, ``--chat-template auto|on``): the
conversation ``[system: --system-prompt,] user: problem + "\\n\\n" + answer instruction`` is
rendered through the tokenizer's template with ``add_generation_prompt=True``
(rl/chat_template.py), so the policy writes the assistant's turn, which ends with the
tokenizer's end-of-sequence token. The answer instruction is the task's (``Put the final answer
in \\boxed{}.`` for short answers, a Python code block for HumanEval) unless
``--answer-instruction`` replaces it, and the warm-up's target is the task's reply in that
format (``\\boxed{19}``).
"""

from typing import Optional

from logra_megatron.errors import UserError
from logra_megatron.rl.chat_template import ChatTemplate, chat_template_of


class PromptFormat:
    """Record -> the text the policy continues, and -> a correct reply (module docstring)."""

    def __init__(self, source, template: Optional[ChatTemplate] = None, system_prompt: Optional[str] = None,
                 instruction: Optional[str] = None):
        """``source``: the run's :class:`~logra_megatron.rl.tasks.TaskSource`; ``template``:
        None for bare prompts; ``instruction``: None for the task's own."""
        self.source = source
        self.template = template
        self.system_prompt = system_prompt
        self.instruction = source.answer_instruction if instruction is None else instruction

    @property
    def chat(self) -> bool:
        return self.template is not None

    def messages(self, record: dict) -> list:
        """The conversation a chat prompt renders."""
        user = record["prompt"] + ("\n\n" + self.instruction if self.instruction else "")
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": user}]

    def prompt(self, record: dict) -> str:
        """The text the policy continues."""
        if self.template is None:
            return record["prompt"]
        return self.template.render(self.messages(record), add_generation_prompt=True)

    def reply(self, record: dict) -> str:
        """A correct completion (the supervised warm-up's target, before the EOS token)."""
        if self.template is None:
            return str(record["answer"])
        return self.source.chat_reply(record)


def build_prompt_format(task_config, source, tokenizer) -> PromptFormat:
    """The run's format: ``task_config`` is the :class:`~logra_megatron.rl.tasks.TaskConfig`
    (``--chat-template``, ``--system-prompt``, ``--answer-instruction``), ``tokenizer`` the
    run's. A system prompt or an answer instruction without a chat template is an error (they
    would be silently dropped)."""
    mode = task_config.chat_template
    template = None if mode == "none" else chat_template_of(tokenizer)
    if mode == "on" and template is None:
        raise UserError("--chat-template on: the run's tokenizer has no chat template (a Hugging Face tokenizer "
                        "folder with chat_template.jinja or a chat_template in tokenizer_config.json)")
    if template is None:
        for flag, value in (("--system-prompt", task_config.system_prompt),
                            ("--answer-instruction", task_config.answer_instruction)):
            if value is not None:
                why = "--chat-template none" if mode == "none" else "the run's tokenizer has none"
                raise UserError(f"{flag} goes into a chat template's messages, and there is no chat template ({why})")
    return PromptFormat(source, template, task_config.system_prompt, task_config.answer_instruction)
