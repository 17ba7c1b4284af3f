"""Prompts from files: the shipped benchmark prompts (nanospec/data/prompts.jsonl: a prompt and its
category per line) and a user's prompts file (JSON lines with a "prompt" field)."""
from __future__ import annotations

import json
from importlib import resources

from nanospec.errors import NanospecError


def shipped_prompts(categories: list[str] | None = None) -> list[dict]:
    text = resources.files("nanospec").joinpath("data/prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if not categories or r["category"] in categories]


def read_prompts_file(path: str) -> list[str]:
    """The 'prompt' field of each JSON line."""
    prompts = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                        raise NanospecError(f"{path}:{n} has no string 'prompt' field")
                    prompts.append(row["prompt"])
    except FileNotFoundError:
        raise NanospecError(f"prompts file {path} not found")
    except json.JSONDecodeError as e:
        raise NanospecError(f"{path} is not JSON lines ({e})")
    return prompts
