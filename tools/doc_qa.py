"""Question/answer pairs drawn from the documentation: "What does json.dumps do?" -> its first sentence.

Every `.. function::`, `.. class::` and `.. method::` of a documentation page (reST as
tools/reference_corpus.py cleans it) gives one pair: the object's qualified name (module from
`.. module::` / `.. currentmodule::`, class from the enclosing `.. class::`) and the first sentence
of its description, inline markup removed. A hash of the name holds ~10% of the names out: the
trainer never sees their pairs, the evaluator asks only them; another 5% are validation (the
trainer's checkpoint choice). Their pages may still be in the training text: what is measured is
whether the model learned to answer from what it read.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

HELD_OUT_PER_MILLE = 100  # buckets [0, 100) of 1000, by name hash: held out (reported)
VALID_PER_MILLE = 50  # buckets [100, 150): validation
TEMPLATES = {"function": ("What does {} do?", "What is {} for?", "Explain {}."),
             "class": ("What is {}?", "What is {} for?", "Explain {}.")}
_DIRECTIVE = re.compile(r"^( *)\.\. (function|class|exception|method|classmethod|staticmethod):: *([\w.]+)")
_MODULE = re.compile(r"^\.\. (?:module|currentmodule):: *([\w.]+)")
_SENTENCE = re.compile(r"^(.+?[.!?])(?=\s+[A-Z(`*]|$)")


@dataclass(frozen=True)
class Pair:
    name: str  # json.dumps
    kind: str  # "function" or "class"
    answer: str  # the first sentence of its documentation
    page: str  # the document it came from

    def question(self, variant: int = 0) -> str:
        return TEMPLATES[self.kind][variant % len(TEMPLATES[self.kind])].format(self.name)


def plain(text: str) -> str:
    """One line, reST inline markup (``code``, *emphasis*, `title`) reduced to its text."""
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"``(.+?)``", r"\1", text)
    text = re.sub(r"\*\*(.+?)\*\*|\*(\S(?:.*?\S)?)\*", lambda m: m.group(1) or m.group(2), text)
    return re.sub(r"`([^`]+)`", r"\1", text).replace("\\", "")


def first_sentence(paragraph: str) -> str | None:
    m = _SENTENCE.match(plain(paragraph))
    return m.group(1) if m and 12 <= len(m.group(1)) <= 240 else None


def page_pairs(page: str, text: str) -> list[Pair]:
    """The pairs of one cleaned reST page, in page order."""
    lines, module, classes, out = text.split("\n"), None, [], []
    for i, line in enumerate(lines):
        m = _MODULE.match(line)
        if m:
            module, classes = m.group(1), []
            continue
        m = _DIRECTIVE.match(line)
        if not m:
            continue
        indent, kind, name = len(m.group(1)), m.group(2), m.group(3)
        classes = [(ind, q) for ind, q in classes if ind < indent]
        if classes and "." not in name:
            qual = f"{classes[-1][1]}.{name}"
        elif "." in name or not module:
            qual = name
        else:
            qual = f"{module}.{name}"
        if kind in ("class", "exception"):
            classes.append((indent, qual))
        body = _first_paragraph(lines, i + 1, indent)
        sentence = first_sentence(body) if body else None
        if sentence:
            out.append(Pair(qual, "class" if kind in ("class", "exception") else "function", sentence, page))
    return out


def _first_paragraph(lines: list[str], start: int, indent: int) -> str | None:
    """The directive's first body paragraph: after its signature/option lines and a blank line."""
    i = start
    while i < len(lines) and lines[i].strip():  # continuation signatures, :options:
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    para = []
    while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > indent:
        para.append(lines[i])
        i += 1
    text = " ".join(para).strip()
    return None if not text or text.startswith(("..", ":", ">>>")) else text


def pairs(docs: dict[str, str]) -> list[Pair]:
    """Every documentation page's pairs, one per name (the first found, pages in path order)."""
    seen: dict[str, Pair] = {}
    for page, text in sorted(docs.items()):
        if page.startswith("docs/"):
            for p in page_pairs(page, text):
                seen.setdefault(p.name, p)
    return list(seen.values())


def bucket(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 1000


def split(all_pairs: list[Pair]) -> tuple[list[Pair], list[Pair], list[Pair]]:
    """(train, validation, held out) by a hash of the name, each in hash order (so its first N are a
    fair sample of every page, not the first pages)."""
    parts = ([], [], [])
    for p in sorted(all_pairs, key=lambda p: hashlib.sha256(p.name.encode()).hexdigest()):
        b = bucket(p.name)
        parts[2 if b < HELD_OUT_PER_MILLE else 1 if b < HELD_OUT_PER_MILLE + VALID_PER_MILLE else 0].append(p)
    return parts


def chat_prompt(question: str) -> str:
    """The ChatML text up to the answer, as o3edge's chat template renders one user turn."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


CHAT_END = "<|im_end|>\n"


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def score(expected: str, got: str) -> tuple[bool, float]:
    """(exact match of the words, word-level F1) of an answer against the documented sentence."""
    e, g = words(expected), words(got)
    common = sum(min(e.count(w), g.count(w)) for w in set(e))
    f1 = 0.0 if not common else 2 * common / (len(e) + len(g))
    return e == g, f1
