"""Prompts from files: the shipped benchmark prompts (nanospec/data/prompts.jsonl: a prompt and its
category per line) and a user's prompts file (JSON lines with a "prompt" field)."""
from __future__ import annotations

import itertools
import json
from importlib import resources

from nanospec.errors import NanospecError


def shipped_prompts(categories: list[str] | None = None) -> list[dict]:
    text = resources.files("nanospec").joinpath("data/prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if not categories or r["category"] in categories]


def by_category_in_turn(rows: list[dict]) -> list[dict]:
    """The rows a category at a time in turn (the first of each category, then the second of
    each...): any first N of them mix the kinds of text as the whole set does."""
    by_category = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    return [row for turn in itertools.zip_longest(*by_category.values()) for row in turn if row is not None]


def read_prompts_file(path: str) -> list[str]:
    """The 'prompt' field of each JSON line; a file that is not such lines is one error naming the
    line at fault."""
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise NanospecError(f"{path}:{n} is not a JSON object ({e.msg}); write one "
                                        '{"prompt": "..."} per line') from None
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                    raise NanospecError(f"{path}:{n} has no string 'prompt' field; write one "
                                        '{"prompt": "..."} per line')
                prompts.append(row["prompt"])
    except FileNotFoundError:
        raise NanospecError(f"prompts file {path} not found") from None
    except IsADirectoryError:
        raise NanospecError(f"prompts file {path} is a folder; give a .jsonl file") from None
    except UnicodeDecodeError:
        raise NanospecError(f"prompts file {path} is not UTF-8 text; give JSON lines with a 'prompt' "
                            "field") from None
    except OSError as e:
        raise NanospecError(f"cannot read prompts file {path} ({e.strerror})") from None
    if not prompts:
        raise NanospecError(f"prompts file {path} holds no prompt; write one {{\"prompt\": \"...\"}} "
                            "per line")
    return prompts
