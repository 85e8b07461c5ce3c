"""How often, and by how much, MRO falls short of the best plan on random eq.-1 instances.

    python -m tools.studies.mro_shortfall --instances 300 --seed 0

Instances: ``N`` in [3, 7] nodes, ``c`` in [2, 4] slots, ``E`` in [2, 8] experts (``E <= N*c``), ``f`` in
{1, 2}, loads drawn from a log-normal (sigma 1, so loads are skewed as routed loads are); the allocation is
eq. 1. For every instance and every ``k`` in ``1..N-1`` failed nodes, the best plan for ``k`` is found
with ``optimal_plan(..., target_failures=k)``; when the symmetry-reduced exact search fits its budget the
best is proven, otherwise the instance is counted under "local" (a lower bound on the best). Reported:
the share of instances where MRO is below the best for at least one ``k``, the share of (instance, k)
pairs, and the mean/max absolute shortfall over the pairs that fall short.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from moe_ft.placement.allocation import allocate_replicas
from moe_ft.placement.plans import mro_plan
from moe_ft.placement.reliability import recovery_vector
from moe_ft.placement.search import SearchConfig, optimal_plan


@dataclass
class ShortfallStats:
    instances: int = 0
    exact_instances: int = 0
    instances_short: int = 0
    pairs: int = 0
    pairs_short: int = 0
    sum_gap: float = 0.0
    max_gap: float = 0.0
    worst: tuple = ()

    def report(self) -> str:
        mean = self.sum_gap / self.pairs_short if self.pairs_short else 0.0
        return (
            f"instances: {self.instances} (best proven by exact search: {self.exact_instances})\n"
            f"MRO below the best for some k: {self.instances_short} ({100 * self.instances_short / self.instances:.1f} %)\n"
            f"(instance, k) pairs short: {self.pairs_short} of {self.pairs} ({100 * self.pairs_short / self.pairs:.1f} %)\n"
            f"shortfall where short: mean {mean:.4f}, max {self.max_gap:.4f} (absolute probability)\n"
            f"worst: replicas={self.worst[0] if self.worst else None} N={self.worst[1] if self.worst else None} "
            f"c={self.worst[2] if self.worst else None} k={self.worst[3] if self.worst else None}"
        )


def run_study(num_instances: int, seed: int, max_exact_plans: int = 5000) -> ShortfallStats:
    rng = random.Random(seed)
    stats = ShortfallStats()
    while stats.instances < num_instances:
        n, c, e, f = rng.randint(3, 7), rng.randint(2, 4), rng.randint(2, 8), rng.choice([1, 2])
        if e * f > n * c:
            continue
        loads = [rng.lognormvariate(0.0, 1.0) for _ in range(e)]
        r = allocate_replicas(loads, num_nodes=n, slots_per_node=c, min_replicas=f)
        mro = recovery_vector(mro_plan(r, n, c), e)
        all_exact, short = True, False
        for k in range(1, n):
            result = optimal_plan(r, n, c, SearchConfig(target_failures=k, max_exact_plans=max_exact_plans))
            all_exact &= result.method == "exact"
            best = recovery_vector(result.plan, e)[k]
            assert best >= mro[k]
            stats.pairs += 1
            gap = float(best - mro[k])
            if gap > 0:
                short = True
                stats.pairs_short += 1
                stats.sum_gap += gap
                if gap > stats.max_gap:
                    stats.max_gap, stats.worst = gap, (r, n, c, k)
        stats.instances += 1
        stats.exact_instances += all_exact
        stats.instances_short += short
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-exact-plans", type=int, default=5000)
    args = parser.parse_args(argv)
    print(run_study(args.instances, args.seed, args.max_exact_plans).report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
