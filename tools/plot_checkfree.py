"""CheckFree convergence study: one command trains every recovery strategy on an emulated
4-stage pipeline on CPU, plots the loss curves and writes the table of final losses into
``docs/checkfree.md`` (between the ``checkfree-study`` markers).

    python tools/plot_checkfree.py --out docs/                     # ~5 min on one core
    python tools/plot_checkfree.py --out /tmp/cf --iterations 40 --strategies none weighted

What is emulated and why is in ``tools/studies/checkfree_convergence.py`` and ``docs/checkfree.md``. Deterministic:
the corpus is generated from a seed, the model and data order are seeded, the failure schedule is fixed.
Plotting needs matplotlib (``pip install -e .[plot]``); without it the table is still written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    HAVE_MATPLOTLIB = True
except ImportError:  # optional: the [plot] extra
    HAVE_MATPLOTLIB = False

BEGIN, END = "<!-- checkfree-study:begin -->", "<!-- checkfree-study:end -->"
PNG = "checkfree_convergence.png"


def make_data(directory: str, seed: int) -> str:
    from tools.make_corpus import write_corpus
    from tools.preprocess_data import preprocess

    write_corpus(os.path.join(directory, "corpus.jsonl"), num_docs=2000, seed=seed)
    preprocess(os.path.join(directory, "corpus.jsonl"), os.path.join(directory, "corpus"), append_eod=True)
    return os.path.join(directory, "corpus")


def smooth(values: list[float], alpha: float = 0.1) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else (1 - alpha) * acc + alpha * v
        out.append(acc)
    return out


def plot(curves, cfg, path: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for c in curves:
        ax.plot(c.executed, smooth(c.loss), label=f"{c.strategy} (eval {c.eval_loss:.3f})",
                linewidth=2.0 if c.strategy in ("weighted", "checkfree+") else 1.2)
    for x in range(cfg.fail_every, cfg.iterations, cfg.fail_every):
        ax.axvline(x, color="grey", alpha=0.25, linewidth=0.8)
    ax.set_xlabel("executed iterations (compute spent)")
    ax.set_ylabel("training loss (EMA 0.1)")
    ax.set_title(f"Stage lost every {cfg.fail_every} iterations, {cfg.num_stages} stages x {cfg.layers_per_stage} "
                 "layers (MoE GPT, CPU)")
    lo = min(min(smooth(c.loss)[len(c.loss) // 4:]) for c in curves)
    ax.set_ylim(lo - 0.1, lo + 1.6)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(curves, cfg) -> str:
    ref = {c.strategy: c for c in curves}.get("none")
    lines = ["| strategy | failures | data iterations reached | train loss (last 10) | eval loss | vs. no failure |",
             "|---|---:|---:|---:|---:|---:|"]
    for c in curves:
        train = sum(c.loss[-10:]) / len(c.loss[-10:])
        delta = f"{c.eval_loss - ref.eval_loss:+.4f}" if ref is not None else ""
        lines.append(f"| {c.strategy} | {len(c.failures)} | {c.data_iteration[-1] + 1} | {train:.4f} | "
                     f"{c.eval_loss:.4f} | {delta} |")
    return "\n".join(lines)


def write_doc_block(doc: str, block: str) -> bool:
    """Replace the text between the study markers of ``doc``; ``False`` if the file or markers are absent."""
    if not os.path.exists(doc):
        return False
    text = open(doc, encoding="utf-8").read()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        return False
    with open(doc, "w", encoding="utf-8") as f:
        f.write(pattern.sub(lambda _: f"{BEGIN}\n{block}\n{END}", text))
    return True


def main(argv=None) -> int:
    from tools.studies.checkfree_convergence import STRATEGIES, StudyConfig, run_study

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="Directory for the PNG.")
    p.add_argument("--json", default="", help="Also write every curve (losses, failures) to this JSON file.")
    p.add_argument("--doc", default=os.path.join(ROOT, "docs", "checkfree.md"),
                   help="Markdown file whose checkfree-study block receives the table ('' = none).")
    p.add_argument("--iterations", type=int, default=StudyConfig.iterations)
    p.add_argument("--fail-every", type=int, default=StudyConfig.fail_every)
    p.add_argument("--checkpoint-every", type=int, default=StudyConfig.checkpoint_every)
    p.add_argument("--seed", type=int, default=StudyConfig.seed)
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    a = p.parse_args(argv)
    cfg = StudyConfig(iterations=a.iterations, fail_every=a.fail_every, checkpoint_every=a.checkpoint_every,
                      seed=a.seed, strategies=tuple(a.strategies))
    os.makedirs(a.out, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="checkfree-study-") as tmp:
        curves = run_study(cfg, make_data(tmp, seed=0), log=lambda line: print(line, flush=True))
    seconds = time.perf_counter() - start
    if a.json:
        with open(a.json, "w") as f:
            json.dump([c.__dict__ for c in curves], f)
    block = (table(curves, cfg) + f"\n\n{cfg.iterations} executed iterations per strategy, a stage lost every "
             f"{cfg.fail_every}, rollback checkpoints every {cfg.checkpoint_every}; eval loss on "
             f"{cfg.eval_iters} held-out iterations; seed {cfg.seed}; {seconds:.0f} s for the whole study "
             f"(`python tools/plot_checkfree.py --out {a.out}`).\n\nFailures (executed iteration, stage, rebuild): "
             + "; ".join(f"{c.strategy}: " + ", ".join(f"{e}/{s} {n}" for e, s, n in c.failures[:4])
                         for c in curves if c.failures and c.strategy in ("weighted", "checkfree+")))
    print(block)
    if HAVE_MATPLOTLIB:
        plot(curves, cfg, os.path.join(a.out, PNG))
        print(f"wrote {os.path.join(a.out, PNG)}")
    else:
        print("matplotlib is not installed (pip install -e .[plot]): no plot", file=sys.stderr)
    if a.doc and write_doc_block(a.doc, block):
        print(f"updated the study table in {a.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
