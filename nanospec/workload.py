"""The multi-turn workload: sessions of several turns in which later requests revisit what earlier
ones produced, as agents and chats do (the same code edited again, the same data in another shape,
a conversation continued), built from the shipped prompts and the target's own answers, so it
needs no download. A session's first turn is a shipped prompt; each later turn is the whole
conversation so far (in the checkpoint's chat template) and a follow-up of the prompt's category.
Sessions of one category share their follow-ups, as an agent's tasks share their scaffolding.

Every proposer decodes greedily to the same answers, so every one of them runs the same requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

FOLLOW_UPS = {
    "chat": ["Say that again more simply, keeping the same structure.",
             "Thanks. Write your first answer again as a numbered list."],
    "code": ["Add a docstring and type hints to your function and show the complete code again.",
             "Now add a short usage example at the end and show the complete code again."],
    "code_edit": ["Now rename the function to `compute` and return the full code again.",
                  "Add a comment above each line of the function and return the full code again."],
    "math": ["Check your answer: go through the same steps again and confirm the result.",
             "Now solve the same problem with every number doubled, step by step, the same way."],
    "creative": ["Write it again, changing only the last line.",
                 "Now give it a title and write the whole piece out again."],
    "summarize": ["Make the summary shorter: one sentence.",
                  "Now write the summary as three bullet points."],
    "extract": ["Now give the same sentences as a JSON list of strings.",
                "Now number them, one per line, as before."],
    "structured": ["Add one more entry in exactly the same format and show the whole thing again.",
                   "Now give the same data as CSV with a header row."],
}


@dataclass
class Session:
    category: str
    turns: list[str]                                   # the user's messages, in order
    answers: list[str] = field(default_factory=list)   # the target's answers so far

    @property
    def done(self) -> bool:
        return len(self.answers) == len(self.turns)

    def messages(self) -> list[dict]:
        """The conversation up to the next turn's user message."""
        messages = []
        for user, answer in zip(self.turns, self.answers + [None]):
            messages.append({"role": "user", "content": user})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        return messages


def multiturn_sessions(rows: list[dict], turns: int = 3) -> list[Session]:
    """A session per shipped prompt row ({"prompt", "category"}): the prompt, then turns - 1 follow-ups."""
    return [Session(row["category"], [row["prompt"]] + FOLLOW_UPS[row["category"]][:turns - 1]) for row in rows]
