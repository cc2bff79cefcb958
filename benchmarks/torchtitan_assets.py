"""A local tokenizer and dataset for TorchTitan runs without a network (compile-only runs).

TorchTitan's configs name a Hugging Face tokenizer (``--hf-assets-path``, e.g.
``./assets/hf/Llama-3.1-8B``) and the C4 dataset (``allenai/c4``, streamed from the Hub). A
compile-only run needs neither's content: its tensors are fake, and only the token ids' shapes
matter. :func:`write_assets` writes a word-level tokenizer (``tokenizer.json`` and
``tokenizer_config.json``, with Llama 3's begin/end-of-text tokens) and a few documents in C4's
format (one JSON object with a ``"text"`` field a line), which TorchTitan reads as its
``c4_test`` dataset from another path::

    python benchmarks/torchtitan_assets.py DIR
    ... -m torchtitan.train ... --hf-assets-path DIR/tokenizer \\
        --dataloader.dataset c4_test --dataloader.dataset-path DIR/c4

Needs the ``tokenizers`` package (a TorchTitan dependency). Run ``HF_HUB_OFFLINE=1
HF_DATASETS_OFFLINE=1`` to be sure nothing is fetched.
"""

from __future__ import annotations

import json
import os
import sys

_WORDS = (
    "beautiful is better than ugly explicit implicit simple complex complicated flat nested "
    "sparse dense readability counts special cases aren't enough to break the rules although "
    "practicality beats purity errors should never pass silently unless explicitly silenced in "
    "face of ambiguity refuse temptation guess there one and preferably only obvious way do it "
    "that may not be at first you are dutch now never often right if implementation hard explain "
    "bad idea easy good namespaces honking great let's more those"
).split()


def write_assets(directory: str, documents: int = 64) -> tuple[str, str]:
    """Write the tokenizer and the dataset under ``directory``; returns their paths
    (``DIR/tokenizer``, ``DIR/c4``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer_dir = os.path.join(directory, "tokenizer")
    data_dir = os.path.join(directory, "c4")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    vocab = {token: i for i, token in enumerate([*specials, *sorted(set(_WORDS))])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": specials[0], "eos_token": specials[1],
                   "add_bos_token": True, "add_eos_token": False}, f)
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for i in range(documents):
            words = [_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(200 + 37 * i)]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return tokenizer_dir, data_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DIR")
    for path in write_assets(sys.argv[1]):
        print(path)
