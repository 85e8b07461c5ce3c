"""Generate the default training corpus deterministically (no download): short English-like documents
from a small grammar, so a byte-level model's loss visibly falls within a hundred iterations.

    python tools/make_corpus.py --output data/corpus.jsonl [--num-docs 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random

SUBJECTS = ["the expert", "a router", "the model", "every token", "the pipeline", "a node", "the optimizer",
            "each layer", "the gate", "a replica", "the snapshot", "the cluster"]
VERBS = ["sends", "routes", "saves", "restores", "learns", "replays", "checks", "holds", "moves", "computes"]
OBJECTS = ["the gradients", "its weights", "a checkpoint", "the tokens", "the loss", "a window",
           "the master copy", "the state", "every expert", "the batch"]
ENDINGS = ["after each step", "before the failure", "on the host", "without a stall", "in order",
           "twice", "again", "at once", "for the next iteration", "exactly"]


def make_document(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(3, 8)):
        words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
        if rng.random() < 0.6:
            words.append(rng.choice(ENDINGS))
        sentence = " ".join(words)
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
    return " ".join(sentences)


def write_corpus(path: str, num_docs: int = 2000, seed: int = 0) -> None:
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num_docs):
            f.write(json.dumps({"text": make_document(rng)}) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True)
    parser.add_argument("--num-docs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_corpus(args.output, args.num_docs, args.seed)
    print(f"wrote {args.num_docs} documents to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
