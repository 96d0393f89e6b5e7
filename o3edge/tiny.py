"""Small Hugging Face checkpoints with random weights and a real byte-level BPE tokenizer.

Made offline (no download), without transformers: tests, CI and the built-in default use them.
The tokenizer is trained on this interpreter's standard-library sources.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig
import tempfile

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")

TINY = dict(family="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=704,
            vocab_size=2048, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0)

FAMILIES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


def corpus(max_files: int = 200) -> list[str]:
    """Texts of the first standard-library modules (sorted, so the tokenizer is reproducible)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(stdlib, "*.py")))[:max_files]
    texts = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as fh:
                texts.append(fh.read())
        except (OSError, UnicodeDecodeError):
            continue
    return texts


def train_tokenizer(vocab_size: int, texts: list[str], add_bos: bool = False,
                    split_digits: bool = False) -> Tokenizer:
    """A GPT-2 style byte-level BPE with exactly vocab_size entries (specials first); with split_digits
    every digit is a token of its own (as Llama's tokenizer does), so a number reads the same wherever
    it stands and copying it is one token per digit."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    if add_bos:
        bos = SPECIALS[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def hf_config(spec: dict) -> dict:
    """config.json as transformers writes it for the spec's family."""
    arch, model_type = FAMILIES[spec["family"]]
    head_dim = spec.get("head_dim", spec["hidden_size"] // spec["num_heads"])
    cfg = {
        "architectures": [arch], "model_type": model_type, "hidden_act": "silu",
        "hidden_size": spec["hidden_size"], "intermediate_size": spec["intermediate_size"],
        "num_attention_heads": spec["num_heads"], "num_key_value_heads": spec["num_kv_heads"],
        "num_hidden_layers": spec["num_layers"], "vocab_size": spec["vocab_size"], "head_dim": head_dim,
        "max_position_embeddings": spec["max_position_embeddings"], "rms_norm_eps": spec.get("rms_norm_eps", 1e-6),
        "rope_theta": spec["rope_theta"], "tie_word_embeddings": spec["tie_word_embeddings"],
        "bos_token_id": 0, "eos_token_id": spec.get("eos_token_id", 2), "torch_dtype": "float32",
        "attention_bias": spec["family"] == "qwen2", "initializer_range": 0.02,
    }
    if spec.get("rope_scaling"):
        cfg["rope_scaling"] = spec["rope_scaling"]
    if spec["family"] != "llama":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec["num_layers"])
    return cfg


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors; norms near one and biases random so every term matters."""
    g = torch.Generator().manual_seed(seed)
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, H, KV = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + w(n, std=0.1)

    t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": norm(D)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(V, D)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(D)
        t[p + "post_attention_layernorm.weight"] = norm(D)
        for name, rows in (("q", H * hd), ("k", KV * hd), ("v", KV * hd)):
            t[p + f"self_attn.{name}_proj.weight"] = w(rows, D)
            if cfg["attention_bias"]:
                t[p + f"self_attn.{name}_proj.bias"] = w(rows, std=0.1)
        t[p + "self_attn.o_proj.weight"] = w(D, H * hd)
        if cfg["model_type"] == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
        t[p + "mlp.gate_proj.weight"] = w(F, D)
        t[p + "mlp.up_proj.weight"] = w(F, D)
        t[p + "mlp.down_proj.weight"] = w(D, F)
    return t


def save_weights(tensors: dict, out_dir: str, num_shards: int = 1) -> None:
    """model.safetensors, or N shards with the index transformers reads."""
    if num_shards == 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for k in range(num_shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::num_shards]}
        save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)


def make_checkpoint(out_dir: str, seed: int = 0, num_shards: int = 1, texts: list[str] | None = None,
                    add_bos: bool = False, **overrides) -> str:
    """Write a random checkpoint (config, weights, tokenizer, chat template) into out_dir."""
    spec = dict(TINY, **overrides)
    os.makedirs(out_dir, exist_ok=True)
    cfg = hf_config(spec)
    tok = train_tokenizer(spec["vocab_size"], texts if texts is not None else corpus(), add_bos)
    cfg["eos_token_id"] = tok.token_to_id("<|im_end|>") if spec.get("chat_eos", True) else 0
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": 0, "eos_token_id": cfg["eos_token_id"]}, fh)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
                   "eos_token": SPECIALS[2], "pad_token": SPECIALS[0], "chat_template": CHATML,
                   "model_max_length": spec["max_position_embeddings"]}, fh, indent=1)
    save_weights(random_weights(cfg, seed), out_dir, num_shards)
    return out_dir


def default_tiny_path() -> str:
    """The built-in tiny model, made once into the user's cache directory."""
    cache = os.environ.get("O3EDGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "o3edge")
    path = os.path.join(cache, "models", "tiny-random-v1")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(path))
        make_checkpoint(tmp)
        try:
            os.rename(tmp, path)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return path
