import math

from moe_ft.policy.window import find_window_size, window_peak_bytes


def paper_find_window_size(n, s_active, s_frozen, bandwidth, t_iter):
    """MoEvement Alg. 1 lines 7-18 verbatim (uniform sizes), except the lower bound 1 instead of 2."""
    active = n
    while active > 1:
        ckpt = s_active * active + s_frozen * (n - active)
        if ckpt / bandwidth <= t_iter:
            break
        active -= 1
    return math.ceil(n / active), active


def test_uniform_sizes_match_paper():
    for n in (1, 2, 5, 12, 40):
        for budget in (1, 10, 37, 100, 1000, 10_000):
            got = find_window_size([12] * n, [2] * n, bandwidth_bytes_per_s=budget, t_iter_s=1.0)
            want = paper_find_window_size(n, 12, 2, budget, 1.0)
            if got.fits:
                assert (got.window, got.num_active) == want


def test_worked_example():
    # 6 operators, FULL 10 bytes, COMPUTE 1 byte, budget 25 bytes per iteration:
    # a=2: slice 0 = 2*10 + 4*1 = 24 <= 25 -> W = 3.   a=3: 30 + 3 = 33 > 25.
    choice = find_window_size([10] * 6, [1] * 6, bandwidth_bytes_per_s=25, t_iter_s=1.0)
    assert (choice.window, choice.num_active, choice.peak_bytes, choice.fits) == (3, 2, 24, True)


def test_heterogeneous_checks_every_slice():
    # A big operator last in order: slice 1 is the busiest, not slice 0.
    full, comp = [1, 1, 50], [1, 1, 5]
    assert window_peak_bytes(full, comp, 2) == max(1 + 1 + 5, 50)
    choice = find_window_size(full, comp, bandwidth_bytes_per_s=40, t_iter_s=1.0)
    assert not choice.fits and choice.window == 3


def test_everything_fits_gives_window_one():
    choice = find_window_size([5, 6, 7], [1, 1, 1], bandwidth_bytes_per_s=1e9, t_iter_s=1.0)
    assert (choice.window, choice.num_active) == (1, 3)
