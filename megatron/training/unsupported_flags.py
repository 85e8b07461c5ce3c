"""Megatron-LM flags this training loop does not take, each with what to pass instead.

A Megatron-LM command line brought here stops at the first of them with one line naming the flag and its
replacement (argparse's own answer was its usage, over a hundred lines per rank, then "unrecognized
arguments").
"""

from __future__ import annotations

from megatron.training.validation import ArgumentError

UNSUPPORTED: dict[str, str] = {
    "--train-samples": "pass --train-iters (samples / --global-batch-size): the run counts iterations",
    "--lr-warmup-samples": "pass --lr-warmup-iters (samples / --global-batch-size)",
    "--lr-decay-samples": "pass --lr-decay-iters (samples / --global-batch-size)",
    "--lr-warmup-fraction": "pass --lr-warmup-iters (the fraction x --lr-decay-iters)",
    "--lr-wsd-decay-samples": "there is no WSD schedule here; pass --lr-decay-style linear or cosine",
    "--lr-wsd-decay-iters": "there is no WSD schedule here; pass --lr-decay-style linear or cosine",
    "--lr-wsd-decay-style": "there is no WSD schedule here; pass --lr-decay-style linear or cosine",
    "--rampup-batch-size": "the global batch size is fixed (the data position of iteration t is t x "
                           "--global-batch-size, which replay and recovery rely on); pass --global-batch-size",
    "--exit-interval": "pass --train-iters N to end the run after iteration N (with --save it saves there)",
    "--exit-duration-in-mins": "bound the run with --train-iters, and keep its progress with --save-interval",
    "--exit-signal-handler": "a signal does not save a checkpoint here; keep the progress with --save-interval",
    "--skip-train": "evaluation runs inside training (--eval-interval, --eval-iters)",
    "--finetune": "it restarts the iteration count at 0; --load CKPT --no-load-optim "
                  "--no-load-rng loads the model alone and continues CKPT's iteration count",
    "--mock-data": "write a small corpus with tools/preprocess_data.py and pass --data-path",
}
"""Megatron-LM flag -> what to do instead (the rest of the line)."""

UNSUPPORTED_VALUES: dict[tuple[str, str], str] = {
    ("--lr-decay-style", "WSD"): "there is no WSD schedule here; pass constant, linear, cosine or "
                                 "inverse-square-root",
}
"""(Megatron-LM flag, value) pairs this loop does not take, and what to do instead."""


def check_unsupported(argv: list[str]) -> None:
    """Raise :class:`ArgumentError` for the first Megatron-LM flag (or flag value) of ``argv`` that is not
    supported here; ``--flag=value`` counts as ``--flag value``."""
    for idx, token in enumerate(argv):
        name, eq, value = token.partition("=")
        if name in UNSUPPORTED:
            raise ArgumentError(f"{name} (Megatron-LM) is not supported here: {UNSUPPORTED[name]}")
        if not eq and idx + 1 < len(argv):
            value = argv[idx + 1]
        if (name, value) in UNSUPPORTED_VALUES:
            raise ArgumentError(f"{name} {value}: {UNSUPPORTED_VALUES[name, value]}")
