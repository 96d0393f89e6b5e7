"""The long-context reference model's training data, its smoke run, and what o3edge makes of the result."""

import importlib
import inspect
import re
import json
import os
import subprocess
import sys
import sysconfig

import pytest
from tokenizers import Tokenizer

from o3edge import O3Config, O3Model
from o3edge.model_path import SHIPPED_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

import doc_qa  # noqa: E402
import eval_long_reference  # noqa: E402
import passkey  # noqa: E402
import reference_corpus  # noqa: E402
from long_mix import Mix  # noqa: E402

MODULES = ["json", "os.path", "textwrap", "shutil", "base64", "string", "glob", "fnmatch", "shlex", "random",
           "statistics", "bisect", "heapq", "copy", "difflib", "html", "keyword", "calendar", "gzip", "zlib",
           "reprlib", "gettext"]  # the last two pages fall in the corpus's held-out split


def doc_page(module: str) -> str:
    """A documentation page in the reST layout of the Python docs, from the module's own docstrings."""
    mod = importlib.import_module(module)
    lines = [f":mod:`{module}` --- {module}", "=" * 20, "", f".. module:: {module}", ""]
    for name, obj in sorted(vars(mod).items()):
        doc = inspect.getdoc(obj) if callable(obj) and not name.startswith("_") else None
        if doc and getattr(obj, "__module__", None) == mod.__name__:
            kind = "class" if inspect.isclass(obj) else "function"
            lines += [f".. {kind}:: {name}(*args)", "", "   " + doc.split("\n\n")[0].replace("\n", "\n   "), ""]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def docs():
    return {f"docs/library/{m}.rst": doc_page(m) for m in MODULES}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(os.path.join(SHIPPED_MODEL, "tokenizer.json"))


def test_passkey_example_puts_the_key_where_it_says(tok, docs):
    encode = lambda text: tok.encode(text).ids  # noqa: E731
    filler = encode(" ".join(docs.values()))
    needle_len = len(encode(passkey.NEEDLE.format(k="12345")))
    question_len = len(encode(passkey.QUESTION))
    for length, depth in [(300, 0.0), (512, 0.37), (1024, 1.0)]:
        ex = passkey.example(encode, filler, length, depth, "12345")
        assert len(ex.prompt) == length
        assert ex.needle_at == int((length - needle_len - question_len) * depth)
        needle = tok.decode(ex.prompt[ex.needle_at:ex.needle_at + needle_len])
        assert needle == "The pass key is 12345. Remember it. The pass key is 12345.\n"
        assert tok.decode(ex.prompt).endswith("What is the pass key? The pass key is")
        assert tok.decode(ex.answer) == " 12345."
    assert passkey.found("12345", " 12345. Remember") and not passkey.found("12345", " 123456.")


def test_passkey_rows_score_the_key_and_not_the_needles_random_digits(tok, docs):
    stream = __import__("torch").tensor(tok.encode(" ".join(docs.values()) * 3).ids)
    b = Mix(tok, stream, [], seq_len=512, seed=3).batch(6, ["passkey"] * 6)
    again = Mix(tok, stream, [], seq_len=512, seed=3).batch(6, ["passkey"] * 6)
    assert b.ids.equal(again.ids) and b.answer_mask.equal(again.answer_mask)  # the seed decides
    assert b.ids.shape == (6, 513) and b.answer_mask.shape == (6, 512)
    for ids, lm, ans in zip(b.ids, b.lm_mask, b.answer_mask):
        targets = ids[1:]
        answer = tok.decode(targets[ans].tolist())
        key = answer.strip(" .")
        assert answer == f" {key}." and len(key) == 5
        text = tok.decode(ids.tolist(), skip_special_tokens=False)
        assert text.count(f"The pass key is {key}.") == 3  # twice in the needle, once answered
        assert not (lm & ans).any()
        # the needle's first key (random digits) is never a target; its second (a copy) is, once
        assert tok.decode(targets[lm].tolist()).count(key) == 1


def test_doc_pairs_hold_out_what_they_claim(tok, docs):
    pairs = {p.name: p for p in doc_qa.pairs(docs)}
    assert pairs["json.dumps"].answer.startswith("Serialize obj to a JSON formatted str")
    assert pairs["json.dumps"].question() == "What does json.dumps do?"
    train, valid, held = doc_qa.split(list(pairs.values()))
    assert held and valid and len(train) > len(held)
    assert {p.name for p in held} == {n for n in pairs if doc_qa.bucket(n) < doc_qa.HELD_OUT_PER_MILLE}
    mix = Mix(tok, __import__("torch").tensor(tok.encode(" ".join(docs.values())).ids), train, 256, seed=0)
    rows = [tok.decode(row.tolist(), skip_special_tokens=False) for _ in range(10)
            for row in mix.batch(4, ["chat"] * 4).ids]
    forms = [re.compile(re.escape(t).replace(re.escape("{}"), r"(\S+)") + "$")
             for ts in doc_qa.TEMPLATES.values() for t in ts]
    asked = {m.group(1) for row in rows for q in re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", row)
             for m in [next(filter(None, (f.match(q) for f in forms)))]}
    assert len(asked) > 20 and asked <= {p.name for p in train}
    chats = "".join(rows)
    assert not any(f" {p.name} " in chats or f" {p.name}?" in chats for p in held + valid)


def test_tiny_long_run_writes_a_checkpoint_o3edge_loads_and_chats_with(tmp_path, docs):
    corpus = dict(docs)
    root = sysconfig.get_paths()["stdlib"]
    for name in sorted(os.listdir(root))[:120]:
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as fh:
                text = reference_corpus.module_docstrings(fh.read(), name[:-3])
            if text:
                corpus[f"stdlib/{name}"] = text
    pack = tmp_path / "corpus.jsonl.xz"
    reference_corpus.write_pack(corpus, str(pack))
    out, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    cmd = [sys.executable, os.path.join(REPO, "tools", "train_reference.py"), "--tiny", "--shape", "long",
           "--device", "cpu", "--steps", "8", "--data", str(pack), "--eval-every", "4", "--chat-eval", "4",
           "--passkey-per-cell", "1", "--out", str(out), "--metrics", str(metrics)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    m = json.loads(metrics.read_text())
    assert m["passkey"]["tried"] == 2 * len(m["passkey"]["by_depth"])  # two lengths x the depths
    assert m["chat"]["n"] == 4 and all(n > 0 for n in m["qa_pairs"]) and m["held_out_ppl"] > 1
    assert "valid_answer_loss" in m["evals"][-1] and m["best_step"] > 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["max_position_embeddings"], cfg["rope_theta"]) == (256, 100000.0)

    model = O3Model.from_config(O3Config(model_path=str(out), device="cpu", dtype="float32"))
    question = [{"role": "user", "content": "What does json.dumps do?"}]
    assert model.engine.tokenizer.render_chat(question) == doc_qa.chat_prompt("What does json.dumps do?")
    reply = model.generate(messages=question, max_new_tokens=8)
    assert reply.finish_reason in ("stop", "length") and reply.completion_tokens >= 1
    ids = model.engine.encode(" ".join(docs.values()))[:255]
    assert model.engine.score(ids).shape == (255, 512)

    # the evaluator runs it on o3edge's engine: perplexity, pass keys up to its window, held-out chat
    table = tmp_path / "bench.md"
    (row,) = eval_long_reference.main(["--model", str(out), "--data", str(pack), "--lengths", "128,256,512",
                                       "--passkey-per-cell", "1", "--chat-pairs", "2", "--ppl-tokens", "600",
                                       "--ppl-window", "128", "--threads", "1", "--write", str(table)])
    assert row["window"] == 256 and row["ppl"] > 1 and row["chat"]["n"] == 2
    assert row["load_s"] > 0 and row["first_ttft_ms"] > 0  # how fast it starts, beside the old default
    assert row["passkey"]["by_length"][512] is None and row["passkey"]["tried"] == 2 * len(row["passkey"]["by_depth"])
    assert re.search(r"\| 256 \| .* \| n/a \| \d+% of 2 \|", table.read_text())  # 512 past its window


def test_the_long_models_tokenizer_reads_every_digit_as_a_token(docs):
    from o3edge.tiny import train_tokenizer

    texts = list(docs.values()) + ["port 8080, 65125 and 1999 again: 8080 65125 1999"] * 50
    split = train_tokenizer(600, texts, split_digits=True)
    assert split.encode(" 65125.").tokens == ["Ġ", "6", "5", "1", "2", "5", "."]
    assert split.decode(split.encode("The pass key is 65125.").ids) == "The pass key is 65125."
    assert len(train_tokenizer(600, texts).encode(" 65125.").tokens) < 7  # plain BPE merges digits
