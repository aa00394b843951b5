"""The recipe's offline data: a generated English-like corpus and a character-level tokenizer built locally."""

from __future__ import annotations

import random
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the teacher", "a small bird", "the farmer",
             "our neighbour", "the child", "a sailor", "the baker", "the doctor"]
_VERBS = ["sees", "likes", "carries", "paints", "finds", "builds", "watches", "feeds", "follows", "cleans"]
_OBJECTS = ["the red ball", "a wooden boat", "the garden", "a loaf of bread", "the blue door", "an apple",
            "the river", "a warm coat", "the little house", "a green hat", "the tall tree", "a letter"]
_ENDINGS = ["every morning", "after lunch", "in the rain", "near the sea", "with great care", "at night",
            "before dinner", "on sunday", "without a word", "in the park"]


def builtin_corpus(num_sentences: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
        lines.append(s[0].upper() + s[1:])
    return "\n".join(lines) + "\n"


def load_corpus(corpus: str, num_sentences: int, seed: int) -> str:
    if corpus == "builtin":
        return builtin_corpus(num_sentences, seed)
    path = Path(corpus)
    if not path.is_file():
        raise FileNotFoundError(f"data.corpus: {corpus} is not a file (or use 'builtin')")
    return path.read_text(encoding="utf-8")


def build_tokenizer(text: str, vocab_size: int):
    """A character-level tokenizer whose vocabulary is exactly ``vocab_size`` (padded with unused tokens).

    Matching the model's vocabulary size matters: with a smaller tokenizer vocabulary, generation can
    produce ids the tokenizer cannot decode and print nothing.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(text))
    tokens = SPECIALS + chars
    if len(tokens) > vocab_size:
        raise ValueError(f"the corpus has {len(chars)} distinct characters; model.vocab_size must be at least "
                         f"{len(tokens)} (it is {vocab_size})")
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def make_splits(text: str, tokenizer, seq_len: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token blocks of ``seq_len``: the last ``val_fraction`` of the text is validation."""
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    blocks = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    n_val = max(1, int(len(blocks) * val_fraction))
    if len(blocks) - n_val < 1:
        raise ValueError(f"the corpus gives only {len(blocks)} blocks of {seq_len} tokens; use more text")
    return blocks[:-n_val], blocks[-n_val:]
